"""Real resumes through torch's own checkpoint code: build, train, save, load, resume."""

from __future__ import annotations

import pytest
import torch
from helpers import Grown
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

import dsdmerge as dm
from dsdmerge.demo import TinyModel, make_optimizer

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def train(model: nn.Module, optim, schedule=None, steps: int = 3) -> None:
    for _ in range(steps):
        model(torch.randint(0, 16, (4, 6))).logsumexp(-1).mean().backward()
        optim.step()
        optim.zero_grad()
        if schedule is not None:
            schedule.step()


@pytest.fixture
def checkpoint(tmp_path):
    torch.manual_seed(0)
    model = TinyModel()
    optim, schedule = make_optimizer(model)
    train(model, optim, schedule)
    path = tmp_path / "ckpt.pt"
    torch.save(
        {
            "model": model.state_dict(),
            "optim": get_optimizer_state_dict(model, optim, options=FLAT),
        },
        path,
    )
    return torch.load(path, weights_only=True), optim.param_groups[0]["lr"]


def test_torch_alone_crashes_on_the_indexer(checkpoint):
    loaded, _ = checkpoint
    assert not any(k.startswith("state.indexer.") for k in loaded["optim"])
    model = TinyModel()
    optim, _ = make_optimizer(model)
    with pytest.raises(TypeError, match="float\\(\\) argument must be"):
        set_optimizer_state_dict(model, optim, loaded["optim"], options=FLAT)


def test_dsdmerge_makes_it_load_with_trained_state_bit_identical(checkpoint):
    loaded, scheduled_lr = checkpoint
    ckpt = loaded["optim"]
    model = TinyModel()
    model.load_state_dict(loaded["model"])
    optim, _ = make_optimizer(model)
    reference = get_optimizer_state_dict(model, optim, options=FLAT)
    merged = dm.merge(ckpt, reference, policy="strict", allow_missing=["state.indexer.*"])
    set_optimizer_state_dict(model, optim, merged, options=FLAT)
    resumed = get_optimizer_state_dict(model, optim, options=FLAT)
    for key, value in ckpt.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(resumed[key], value), key
            assert resumed[key].dtype == value.dtype
        else:
            assert resumed[key] == value, key
    assert [g["lr"] for g in optim.param_groups] == [scheduled_lr, scheduled_lr]
    # training goes on
    train(model, optim)


def test_strict_without_the_allow_list_names_the_indexer(checkpoint):
    loaded, _ = checkpoint
    model = TinyModel()
    optim, _ = make_optimizer(model)
    reference = get_optimizer_state_dict(model, optim, options=FLAT)
    with pytest.raises(
        dm.MergeError,
        match=r"'state\.indexer\.proj\.\{bias,weight\}\.\{exp_avg,exp_avg_sq,step\}' \(6 keys\)",
    ):
        dm.merge(loaded["optim"], reference, policy="strict")


def test_new_param_first_in_its_group_keeps_the_scheduled_lr(checkpoint):
    loaded, scheduled_lr = checkpoint
    assert scheduled_lr < 1e-3
    model = Grown()
    assert next(iter(model.named_parameters()))[0] == "new_head.weight"
    model.load_state_dict(loaded["model"], strict=False)
    ckpt = loaded["optim"]

    naive_optim, _ = make_optimizer(model)
    fresh = get_optimizer_state_dict(model, naive_optim, options=FLAT)
    set_optimizer_state_dict(model, naive_optim, {**fresh, **ckpt}, options=FLAT)
    assert naive_optim.param_groups[0]["lr"] == 1e-3  # the bug: fresh lr silently wins

    optim, _ = make_optimizer(model)
    reference = get_optimizer_state_dict(model, optim, options=FLAT)
    merged, diff, _ = dm.merge_with_diff(ckpt, reference)
    assert "param_groups.new_head.weight.lr" in diff.missing
    assert merged["param_groups.new_head.weight.lr"] == scheduled_lr
    set_optimizer_state_dict(model, optim, merged, options=FLAT)
    assert [g["lr"] for g in optim.param_groups] == [scheduled_lr, scheduled_lr]
    assert [g["weight_decay"] for g in optim.param_groups] == [0.1, 0.0]
    assert [g["initial_lr"] for g in optim.param_groups] == [1e-3, 1e-3]


def test_warn_reports_disagreeing_group_members():
    ckpt = {"param_groups.a.lr": 1e-4, "param_groups.b.lr": 2e-4, "param_groups.c.lr": 1e-4}
    ref = {"param_groups.a.lr": 1e-3, "param_groups.b.lr": 1e-3, "param_groups.c.lr": 1e-3}
    with pytest.warns(dm.DSDMergeWarning, match="disagree on 'lr'"):
        dm.merge(ckpt, ref, policy="warn")
    with pytest.raises(dm.MergeError, match="disagree on 'lr'"):
        dm.merge(ckpt, ref, policy="strict")
    assert (
        dm.merge_with_diff(ckpt, ref, policy=dm.DEFAULT.replace(conflict="ignore")).conflicts == ()
    )


def test_model_growth_model_and_optimizer_both_load_strict(checkpoint):
    loaded, scheduled_lr = checkpoint
    model = Grown()
    merged_model = dm.merge(
        loaded["model"], model.state_dict(), policy="strict", allow_missing="new_head.*"
    )
    model.load_state_dict(merged_model, strict=True)
    optim, _ = make_optimizer(model)
    reference = get_optimizer_state_dict(model, optim, options=FLAT)
    merged = dm.merge(
        loaded["optim"],
        reference,
        policy="strict",
        allow_missing=["state.indexer.*", "*.new_head.*"],
    )
    set_optimizer_state_dict(model, optim, merged, options=FLAT)
    head = model.new_head.weight
    assert optim.state[head]["step"].item() == 1.0  # DSD's fresh state: one zero-grad step
    assert torch.equal(optim.state[head]["exp_avg"], torch.zeros_like(head))
    assert optim.param_groups[0]["lr"] == scheduled_lr
