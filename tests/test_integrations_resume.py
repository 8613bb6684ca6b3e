"""The one-call trainer integration against real torch: resume_optimizer, resume_model, load_dcp."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import Snapshot
from helpers import Grown, dcp_save
from optimizers import ShampooLike
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

import dsdmerge as dm
from dsdmerge.demo import TinyModel, make_optimizer
from dsdmerge.integrations import load_dcp, resume_model, resume_optimizer

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
NESTED = StateDictOptions()


def train(model: nn.Module, optims, schedules=(), steps: int = 3) -> None:
    optims = optims if isinstance(optims, (list, tuple)) else [optims]
    for _ in range(steps):
        model(torch.randint(0, 16, (4, 6))).logsumexp(-1).mean().backward()
        for o in optims:
            o.step()
            o.zero_grad()
        for s in schedules:
            s.step()


def assert_state_equal(saved: dict, resumed: dict, *, only: str = "", new=()) -> None:
    """Every key of ``saved`` (that starts with ``only``) is in ``resumed`` with the same
    value, and ``resumed`` holds no other such key than those of ``new``: every key compared."""
    s_keys = {k for k in saved if k.startswith(only)}
    r_keys = {k for k in resumed if k.startswith(only)}
    assert s_keys <= r_keys, sorted(s_keys - r_keys)
    assert r_keys - s_keys == set(new), sorted((r_keys - s_keys) ^ set(new))
    for key in s_keys:
        value = saved[key]
        if isinstance(value, torch.Tensor):
            assert torch.equal(resumed[key], value), key
            assert resumed[key].dtype == value.dtype, key
        else:
            assert resumed[key] == value, key


@pytest.fixture(scope="module")
def trained_state():
    """A trained TinyModel's model state and flattened + nested DSD optimizer state."""
    torch.manual_seed(0)
    model = TinyModel()
    optim, schedule = make_optimizer(model)
    train(model, optim, [schedule])
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "flat": copy.deepcopy(get_optimizer_state_dict(model, optim, options=FLAT)),
        "nested": copy.deepcopy(get_optimizer_state_dict(model, optim)),
        "int": copy.deepcopy(optim.state_dict()),
        "lr": optim.param_groups[0]["lr"],
    }


@pytest.fixture
def saved(trained_state):
    # a resumed optimizer takes the loaded tensors as its state (as Optimizer.load_state_dict
    # does) and later steps update them in place: every test gets its own copy
    return copy.deepcopy(trained_state)


# --------------------------------------------------------------------------------------
# the indexer crash and the one call


@pytest.mark.parametrize("layout", ["flat", "nested"])
def test_one_call_resumes_what_torch_alone_cannot(saved, layout):
    options = FLAT if layout == "flat" else NESTED
    model = TinyModel()
    model.load_state_dict(saved["model"])
    optim, _ = make_optimizer(model)
    with pytest.raises((TypeError, RuntimeError)):  # flat: Adam's float(); nested: strict DSD
        set_optimizer_state_dict(model, optim, saved[layout], options=options)

    loaded = saved[layout]
    snap = Snapshot(loaded)
    model = TinyModel()
    model.load_state_dict(saved["model"])
    optim, _ = make_optimizer(model)
    diff = resume_optimizer(
        model, optim, loaded, options=options, policy="strict", allow_missing="state.indexer.*"
    )
    assert snap.unchanged()
    assert sorted(diff.missing) == sorted(
        f"state.indexer.proj.{p}.{s}"
        for p in ("weight", "bias")
        for s in ("step", "exp_avg", "exp_avg_sq")
    )
    resumed = get_optimizer_state_dict(model, optim, options=FLAT)
    assert_state_equal(saved["flat"], resumed)  # trained state bit-identical, lr of every group
    assert [g["lr"] for g in optim.param_groups] == [saved["lr"]] * 2
    assert [g["weight_decay"] for g in optim.param_groups] == [0.1, 0.0]
    train(model, optim)  # and training goes on


def test_policy_rejection_loads_nothing(saved):
    model = TinyModel()
    optim, _ = make_optimizer(model)
    with pytest.raises(dm.MergeError, match=r"'state\.indexer\.proj\.\{bias,weight\}\.\{exp_avg"):
        resume_optimizer(model, optim, saved["flat"], options=FLAT, policy="strict")
    assert [g["lr"] for g in optim.param_groups] == [1e-3, 1e-3]  # not the checkpoint's


def test_warnings_point_at_the_caller(saved):
    model = TinyModel()
    optim, _ = make_optimizer(model)
    with pytest.warns(dm.DSDMergeWarning, match="indexer") as record:
        resume_optimizer(model, optim, saved["flat"], options=FLAT, policy="warn")
    assert {w.filename for w in record} == {__file__}
    with pytest.warns(
        dm.DSDMergeWarning, match=r"'state\.\{1,4\}\.\{exp_avg,exp_avg_sq,step\}'"
    ) as record:
        resume_optimizer(model, optim, saved["int"], policy="warn")
    assert {w.filename for w in record} == {__file__}
    with pytest.warns(dm.DSDMergeWarning, match="extra") as record:
        resume_model(model, {**saved["model"], "extra": torch.zeros(1)}, policy="warn")
    assert {w.filename for w in record} == {__file__}


def test_bad_arguments():
    model = TinyModel()
    optim, _ = make_optimizer(model)
    with pytest.raises(dm.InvalidPolicyError, match="fresh"):
        resume_optimizer(model, optim, {}, fresh="new")  # type: ignore[arg-type]
    with pytest.raises(dm.StateDictTypeError, match="optimizers"):
        resume_optimizer(model, [], {})
    with pytest.raises(dm.StateDictTypeError, match="mapping"):
        resume_optimizer(model, optim, [1])  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------
# model growth and the learning rate


@pytest.mark.parametrize("fresh", ["reference", "as_fresh"])
def test_model_growth_new_head_first_in_its_group(saved, fresh):
    model = Grown()
    assert next(iter(model.named_parameters()))[0] == "new_head.weight"
    model_diff = resume_model(model, saved["model"], policy="strict", allow_missing="new_head.*")
    assert model_diff.missing == ("new_head.weight", "new_head.bias")
    assert torch.equal(model.embed.weight, saved["model"]["embed.weight"])
    optim, _ = make_optimizer(model)
    diff = resume_optimizer(
        model,
        optim,
        saved["flat"],
        options=FLAT,
        policy="strict",
        allow_missing=["state.indexer.*", "*.new_head.*"],
        fresh=fresh,
    )
    assert "param_groups.new_head.weight.lr" in diff.missing
    # the new head leads both groups, yet every group keeps the checkpoint's scheduled lr
    assert [g["lr"] for g in optim.param_groups] == [saved["lr"]] * 2
    assert [g["initial_lr"] for g in optim.param_groups] == [1e-3] * 2
    head = model.new_head.weight
    if fresh == "reference":  # DSD's zero-gradient step: step 1, zero moments
        assert optim.state[head]["step"].item() == 1.0
        assert torch.equal(optim.state[head]["exp_avg"], torch.zeros_like(head))
    else:
        assert head not in optim.state
    resumed = get_optimizer_state_dict(model, optim, options=FLAT)
    # with DSD's reference state the never-checkpointed parameters get its state, else none
    fresh_state = [k for k in resumed if k.startswith(("state.new_head.", "state.indexer."))]
    assert bool(fresh_state) == (fresh == "reference")
    assert_state_equal(saved["flat"], resumed, only="state.", new=fresh_state)
    train(model, optim)


def test_resume_model_rejects_unexpected_under_strict_and_drops_it_otherwise(saved):
    model = TinyModel()
    loaded = {**saved["model"], "old_head.weight": torch.zeros(2)}
    with pytest.raises(dm.MergeError, match=r"old_head\.weight"):
        resume_model(model, loaded, policy="strict")
    diff = resume_model(model, loaded)  # strict load: the unexpected key was left out
    assert diff.unexpected == ("old_head.weight",)


def test_resume_model_shape_change_can_keep_the_models_tensor(saved):
    model = TinyModel(vocab=20)  # head and embedding grew
    with pytest.raises(dm.MergeError, match="shape"):
        resume_model(model, saved["model"])
    before = model.head.weight.detach().clone()
    with pytest.warns(dm.DSDMergeWarning, match="reference's were taken"):
        diff = resume_model(model, saved["model"], on_shape_mismatch="take_reference")
    assert "head.weight" in diff.mismatched_keys
    assert torch.equal(model.head.weight, before)
    assert torch.equal(model.proj.weight, saved["model"]["proj.weight"])


# --------------------------------------------------------------------------------------
# fresh-state semantics


def manual_steps(model: nn.Module, optim, names: list[str], steps: int, seed: int) -> None:
    """Steps with the same seeded gradients on ``names`` only (other params get none)."""
    gen = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    for _ in range(steps):
        optim.zero_grad(set_to_none=True)
        for name in names:
            params[name].grad = torch.randn(params[name].shape, generator=gen)
        optim.step()


@pytest.mark.parametrize(
    "make",
    [
        lambda m: make_optimizer(m)[0],
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
        lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, amsgrad=True),
    ],
    ids=["adamw", "sgd-momentum", "adam-amsgrad"],
)
def test_as_fresh_is_bit_identical_to_a_never_checkpointed_optimizer(make):
    torch.manual_seed(0)
    old = TinyModel()
    old_optim = make(old)
    train(old, old_optim)
    ckpt_model = old.state_dict()
    ckpt_optim = get_optimizer_state_dict(old, old_optim, options=FLAT)
    fresh_names = ["new_head.weight", "new_head.bias", "indexer.proj.weight"]

    results = {}
    for fresh in ("as_fresh", "reference"):
        torch.manual_seed(1)
        model = Grown()
        resume_model(model, ckpt_model, allow_missing="new_head.*")
        optim = make(model)
        resume_optimizer(model, optim, ckpt_optim, options=FLAT, fresh=fresh)
        manual_steps(model, optim, fresh_names, steps=3, seed=7)
        results[fresh] = dict(model.named_parameters())

    torch.manual_seed(1)
    never = Grown()
    resume_model(never, ckpt_model, allow_missing="new_head.*")
    never_optim = make(never)
    for group, ckpt_lr in zip(
        never_optim.param_groups, [g["lr"] for g in old_optim.param_groups], strict=True
    ):
        group["lr"] = ckpt_lr  # same hyperparameters; only the state differs
    manual_steps(never, never_optim, fresh_names, steps=3, seed=7)
    expected = dict(never.named_parameters())

    for name in fresh_names:
        assert torch.equal(results["as_fresh"][name], expected[name]), name
    if not isinstance(never_optim, torch.optim.SGD):  # SGD's first momentum step is the same
        assert not all(torch.equal(results["reference"][n], expected[n]) for n in fresh_names)


# --------------------------------------------------------------------------------------
# optimizers beyond Adam


def two_optimizers(model: nn.Module):
    """A Muon-style split: AdamW on matrices, SGD with momentum on vectors, each scheduled."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    adamw = torch.optim.AdamW(matrices, lr=1e-3, weight_decay=0.1)
    sgd = torch.optim.SGD(vectors, lr=0.1, momentum=0.9)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.5**s) for o in (adamw, sgd)]
    return [adamw, sgd], schedules


@pytest.mark.parametrize("fresh", ["reference", "as_fresh"])
def test_several_optimizers_on_one_model(fresh):
    torch.manual_seed(0)
    model = TinyModel()
    optims, schedules = two_optimizers(model)
    train(model, optims, schedules)
    saved = copy.deepcopy(get_optimizer_state_dict(model, optims, options=FLAT))
    lrs = [o.param_groups[0]["lr"] for o in optims]
    assert lrs[0] < 1e-3

    model2 = TinyModel()
    model2.load_state_dict(model.state_dict())
    optims2, _ = two_optimizers(model2)
    diff = resume_optimizer(
        model2,
        optims2,
        saved,
        options=FLAT,
        policy="strict",
        allow_missing="state.indexer.*",
        fresh=fresh,
    )
    assert {k.rsplit(".", 1)[1] for k in diff.missing} == {
        "step",
        "exp_avg",
        "exp_avg_sq",
        "momentum_buffer",
    }
    assert [o.param_groups[0]["lr"] for o in optims2] == lrs
    resumed = get_optimizer_state_dict(model2, optims2, options=FLAT)
    indexer_state = [k for k in resumed if k.startswith("state.indexer.")]
    assert_state_equal(
        saved, resumed, only="state.", new=indexer_state if fresh == "reference" else ()
    )
    assert "momentum_buffer" in optims2[1].state[model2.proj.bias]
    assert (model2.indexer.proj.bias in optims2[1].state) == (fresh == "reference")
    train(model2, optims2)


def test_sgd_without_momentum_has_no_state_and_resumes():
    torch.manual_seed(0)
    model = TinyModel()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.StepLR(optim, 1, gamma=0.5)
    train(model, optim, [schedule])
    saved = get_optimizer_state_dict(model, optim, options=FLAT)
    assert not any(k.startswith("state.") for k in saved)
    model2 = TinyModel()
    optim2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(optim2, 1, gamma=0.5)  # adds initial_lr, as when saved
    assert not resume_optimizer(model2, optim2, saved, options=FLAT, policy="strict")
    assert optim2.param_groups[0]["lr"] == optim.param_groups[0]["lr"]


def test_shampoo_like_nested_state():
    torch.manual_seed(0)
    model = TinyModel()
    optim = ShampooLike(model.parameters(), lr=0.05)
    train(model, optim)
    saved = copy.deepcopy(get_optimizer_state_dict(model, optim, options=FLAT))
    assert "state.proj.weight.precond.left" in saved
    assert not any(k.startswith("state.indexer.") for k in saved)

    model2 = TinyModel()
    model2.load_state_dict(model.state_dict())
    optim2 = ShampooLike(model2.parameters(), lr=0.05)
    diff = resume_optimizer(
        model2, optim2, saved, options=FLAT, policy="strict", allow_missing="state.indexer.*"
    )
    assert "state.indexer.proj.weight.precond.right" in diff.missing
    resumed = get_optimizer_state_dict(model2, optim2, options=FLAT)
    assert_state_equal(saved, resumed)
    assert isinstance(optim2.state[model2.proj.weight]["precond"], dict)
    train(model2, optim2)


def test_int_keyed_optimizer_state_dict(saved):
    model = TinyModel()
    model.load_state_dict(saved["model"])
    optim, _ = make_optimizer(model)
    loaded = saved["int"]
    snap = Snapshot(loaded)
    diff = resume_optimizer(model, optim, loaded, fresh="as_fresh")
    assert snap.unchanged()
    # int ids are positions: indexer.proj.weight and .bias are params 1 and 4
    assert {k.split(".")[1] for k in diff.missing} == {"1", "4"}
    assert optim.param_groups[0]["lr"] == saved["lr"]
    indexer = model.indexer.proj.weight
    assert indexer not in optim.state  # as fresh: initialised on its first step
    resumed = get_optimizer_state_dict(model, optim, options=FLAT)
    assert_state_equal(saved["flat"], resumed)
    # with DSD's reference state the indexer is backfilled with step 1
    optim2, _ = make_optimizer(model)
    diff = resume_optimizer(model, optim2, loaded, fresh="reference")
    assert "state.1.exp_avg" in diff.missing
    assert optim2.state[indexer]["step"].item() == 1.0
    params = list(model.parameters())
    halves = [torch.optim.SGD(params[:2]), torch.optim.SGD(params[2:])]
    with pytest.raises(dm.LayoutError, match="int param ids"):
        resume_optimizer(model, halves, loaded)
    with pytest.raises(dm.LayoutError, match="in two of the given optimizers"):
        resume_optimizer(model, [optim, optim2], loaded)


def test_int_keyed_model_growth_is_refused_naming_the_group(saved):
    model = Grown()
    optim, _ = make_optimizer(model)
    with pytest.raises(dm.MergeError, match=r"sizes \[4, 3\] but the optimizer has 2 of sizes"):
        resume_optimizer(model, optim, saved["int"])


# --------------------------------------------------------------------------------------
# DCP: policy first, scoped partial load


@pytest.fixture
def dcp_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = TinyModel()
    optim, schedule = make_optimizer(model)
    train(model, optim, [schedule])
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optim, options=FLAT),
        "step": 3,
    }
    dcp_save(state, tmp_path / "step-3")
    return tmp_path / "step-3", copy.deepcopy(state), optim.param_groups[0]["lr"]


def test_load_dcp_then_resume(dcp_checkpoint):
    path, saved, lr = dcp_checkpoint
    model = Grown()
    optim, _ = make_optimizer(model)
    target = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optim, options=FLAT),
        "step": 0,
    }
    containers = Snapshot({k: v for k, v in target.items() if k != "model"})
    loaded, diff = load_dcp(
        path,
        target,
        policy="strict",
        allow_missing=["model.new_head.*", "optim.state.indexer.*", "optim.*.new_head.*"],
    )
    assert "optim.param_groups.new_head.bias.lr" in diff.missing
    assert loaded["step"] == 3
    assert target["step"] == 0  # containers are not modified
    assert "new_head.weight" not in loaded["model"]  # not in the checkpoint: not in the result
    assert not any(k.startswith("state.indexer.") for k in loaded["optim"])
    # tensors were loaded in place, straight into the model
    assert torch.equal(model.proj.weight, saved["model"]["proj.weight"])
    del containers
    resume_model(model, loaded["model"], policy="strict", allow_missing="new_head.*")
    resume_optimizer(
        model,
        optim,
        loaded["optim"],
        options=FLAT,
        policy="strict",
        allow_missing=["state.indexer.*", "*.new_head.*"],
    )
    assert [g["lr"] for g in optim.param_groups] == [lr, lr]
    resumed = get_optimizer_state_dict(model, optim, options=FLAT)
    assert_state_equal(saved["optim"], resumed, only="state.")
    train(model, optim)


def test_load_dcp_refuses_before_reading_any_tensor(dcp_checkpoint):
    path, _, _ = dcp_checkpoint
    for data in path.glob("*.distcp"):
        data.unlink()  # reading any data would now fail with CheckpointReadError
    model = Grown()
    optim, _ = make_optimizer(model)
    target = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optim, options=FLAT),
    }
    before = model.new_head.weight.detach().clone()
    # "the indexer may be missing" does not mean "anything may be missing"
    with pytest.raises(dm.MergeError, match=r"'model\.new_head\.\{bias,weight\}'") as info:
        load_dcp(path, target, policy="strict", allow_missing="optim.state.indexer.*")
    assert "indexer" not in str(info.value)  # keys are named as compressed patterns
    assert torch.equal(model.new_head.weight, before)
    with pytest.raises(dm.CheckpointReadError, match="DCP load failed"):
        load_dcp(path, target, policy="default")


def test_load_dcp_warnings_point_at_the_caller(dcp_checkpoint):
    path, _, _ = dcp_checkpoint
    model = TinyModel()
    with pytest.warns(dm.DSDMergeWarning, match="optim") as record:
        load_dcp(path, {"model": get_model_state_dict(model)}, policy="warn")
    assert {w.filename for w in record} == {__file__}


def test_load_dcp_shape_mismatch_let_through_is_not_read(dcp_checkpoint):
    path, saved, _ = dcp_checkpoint
    model = TinyModel(vocab=20)
    target = {"model": get_model_state_dict(model)}
    before = model.head.weight.detach().clone()
    with pytest.raises(dm.MergeError, match="shape"):
        load_dcp(path, target, allow_unexpected="*")
    with pytest.warns(dm.DSDMergeWarning, match="reference's were taken"):
        loaded, diff = load_dcp(
            path, target, on_shape_mismatch="take_reference", allow_unexpected="*"
        )
    assert "model.head.weight" in diff.mismatched_keys
    assert "head.weight" not in loaded["model"]
    assert torch.equal(model.head.weight, before)
    assert torch.equal(model.proj.weight, saved["model"]["proj.weight"])
