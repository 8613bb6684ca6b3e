"""dsdmerge.integrations.hooks with torch alone: record_param_names, install_load_hook,
install_model_load_hook (the trainers themselves: tests/test_frameworks_*.py)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from conftest import Snapshot
from frameworks import Net, adamw, equal, torch_steps

import dsdmerge as dm
from dsdmerge.integrations import (
    install_load_hook,
    install_model_load_hook,
    record_param_names,
)


def trained(**options):
    model = Net(**options)
    optimizer = adamw(model)
    record_param_names(optimizer, model)
    torch_steps(model, optimizer, 0, 2)
    return model, optimizer


# -- record_param_names -------------------------------------------------------------------


def test_record_param_names_writes_dsd_fqns_without_changing_the_optimizer():
    model = Net(frozen=("a",))
    compiled = torch.compile(model)  # _orig_mod. in named_parameters(), not in DSD's fqns
    optimizer = adamw(model)
    handle = record_param_names(optimizer, compiled)
    (group,) = optimizer.state_dict()["param_groups"]
    assert group["param_names"] == [n for n, p in model.named_parameters() if p.requires_grad]
    assert "param_names" not in optimizer.param_groups[0]  # only what state_dict() returns
    assert record_param_names(optimizer, model) is handle  # idempotent
    handle.remove()
    assert "param_names" not in optimizer.state_dict()["param_groups"][0]
    again = record_param_names(optimizer, model)  # a removed hook registers anew
    assert again is not handle
    assert "param_names" in optimizer.state_dict()["param_groups"][0]


def test_record_param_names_keeps_the_names_torch_wrote():
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD([("mine.w", model.weight), ("mine.b", model.bias)], lr=0.1)
    record_param_names(optimizer, model)
    assert optimizer.state_dict()["param_groups"][0]["param_names"] == ["mine.w", "mine.b"]


def test_record_param_names_refuses_a_parameter_of_another_model():
    optimizer = adamw(Net())
    with pytest.raises(dm.LayoutError, match="not a parameter of the model"):
        record_param_names(optimizer, Net())


def test_record_param_names_unwraps_an_optimizer_wrapper():
    class Wrapper(torch.optim.Optimizer):  # accelerate's AcceleratedOptimizer's shape
        def __init__(self, optimizer):
            self.optimizer = optimizer

        def state_dict(self):
            return self.optimizer.state_dict()

    model = Net()
    optimizer = adamw(model)
    record_param_names(Wrapper(optimizer), model)
    assert optimizer.state_dict()["param_groups"][0]["param_names"]


# -- install_load_hook --------------------------------------------------------------------


def test_the_optimizers_own_empty_state_passes_through(caplog):
    model = Net()
    optimizer = adamw(model)
    hook = install_load_hook(optimizer, model, policy="strict")
    with caplog.at_level(logging.INFO, logger="dsdmerge"):
        optimizer.load_state_dict(optimizer.state_dict())  # accelerate's prepare() does this
    assert hook.diff is None
    assert hook.loads == 0
    assert not caplog.records


def test_a_load_is_merged_by_name_and_logged_once(caplog):
    old, old_optimizer = trained(order=("a", "b"))
    saved = copy.deepcopy(old_optimizer.state_dict())
    model = Net(order=("b", "a"))  # the same modules, registered in another order
    optimizer = adamw(model)
    hook = install_load_hook(optimizer, model, policy="strict")
    with caplog.at_level(logging.INFO, logger="dsdmerge"):
        optimizer.load_state_dict(saved)
    assert len(caplog.records) == 1
    assert "install_load_hook" in caplog.records[0].getMessage()
    assert not hook.diff
    for name in ("a.weight", "b.bias"):
        got = optimizer.state[dict(model.named_parameters())[name]]
        want = old_optimizer.state[dict(old.named_parameters())[name]]
        assert equal(got, want)
    hook.remove()
    optimizer.load_state_dict(saved)  # torch's own again: by position, a gets b's state
    got = optimizer.state[model.a.weight]["exp_avg"]
    assert equal(got, old_optimizer.state[old.b.weight]["exp_avg"])


def test_without_names_a_load_is_refused_and_changes_nothing():
    _, old_optimizer = trained()
    saved = copy.deepcopy(old_optimizer.state_dict())
    for g in saved["param_groups"]:
        del g["param_names"]
    model = Net(order=("b", "a"))
    optimizer = adamw(model)
    torch_steps(model, optimizer, 0, 1)
    snap = Snapshot({"state": optimizer.state, "groups": optimizer.param_groups})
    install_load_hook(optimizer, model)
    with pytest.raises(dm.LayoutError, match=r"names=.*by_position=True"):
        optimizer.load_state_dict(saved)
    assert snap.unchanged()


def test_names_or_by_position_say_how_to_map_a_nameless_checkpoint():
    old, old_optimizer = trained()
    saved = copy.deepcopy(old_optimizer.state_dict())
    for g in saved["param_groups"]:
        del g["param_names"]
    names = [n for n, _ in old.named_parameters()]
    model = Net(order=("b", "a"))
    optimizer = adamw(model)
    install_load_hook(optimizer, model, names=names)
    optimizer.load_state_dict(saved)
    assert equal(optimizer.state[model.a.weight], old_optimizer.state[old.a.weight])
    same = Net()
    optimizer = adamw(same)
    install_load_hook(optimizer, same, by_position=True)
    optimizer.load_state_dict(saved)
    assert equal(optimizer.state[same.b.weight], old_optimizer.state[old.b.weight])


def test_state_of_a_parameter_the_optimizer_no_longer_holds_is_not_kept():
    """Reported as unexpected, and left out: torch would keep it under its fqn, forever."""
    _, old_optimizer = trained(frozen=("a",))
    model = Net(frozen=("b",))
    optimizer = adamw(model)
    hook = install_load_hook(optimizer, model, allow_missing="*a.*", allow_unexpected="*b.*")
    optimizer.load_state_dict(copy.deepcopy(old_optimizer.state_dict()))
    assert {k.split(".")[1] for k in hook.diff.unexpected} == {"b"}
    assert all(isinstance(k, torch.Tensor) for k in optimizer.state)
    assert all(type(k) is int for k in optimizer.state_dict()["state"])


def test_a_hook_installs_only_for_the_models_parameters():
    with pytest.raises(dm.LayoutError, match="not a parameter of the model"):
        install_load_hook(adamw(Net()), Net())
    with pytest.raises(dm.InvalidPolicyError):
        install_load_hook(adamw(model := Net()), model, fresh="stale")  # type: ignore[arg-type]


def test_a_deepspeed_zero_state_is_refused_saying_what_to_do():
    model = Net()
    optimizer = adamw(model)
    install_load_hook(optimizer, model)
    zero = {"base_optimizer_state": {}, "single_partition_of_fp32_groups": [], "zero_stage": 1}
    with pytest.raises(dm.LayoutError, match="universal"):
        optimizer.load_state_dict({"optimizer_state_dict": zero})


# -- install_model_load_hook --------------------------------------------------------------


def test_model_hook_merges_what_a_strict_or_non_strict_load_gets():
    old, _ = trained()
    saved = {k: v.clone() for k, v in old.state_dict().items()}
    model = Net(head=True, vocab=24, mid="mid", seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    hook = install_model_load_hook(
        model,
        policy="strict",
        allow_missing="value.*",
        rename={r"^b\.": "mid."},
        on_shape_mismatch="resize",
    )
    with pytest.warns(dm.DSDMergeWarning, match="resized"):  # "strict" says so
        assert model.load_state_dict(saved).missing_keys == []  # strict, complete
    assert hook.diff.missing == ("value.weight", "value.bias")
    assert [r.key for r in hook.diff.resized] == ["embed.weight"]
    assert equal(model.embed.weight.detach()[:16], saved["embed.weight"])
    assert equal(model.embed.weight.detach()[16:], before["embed.weight"][16:])
    assert equal(model.mid.weight.detach(), saved["b.weight"])
    assert equal(model.value.weight.detach(), before["value.weight"])


def test_a_refused_model_load_changes_nothing():
    old, _ = trained()
    saved = old.state_dict()
    model = Net(head=True, seed=1)
    snap = Snapshot(dict(model.named_parameters()))
    install_model_load_hook(model, policy="strict")
    with pytest.raises(dm.MergeError, match="value"):
        model.load_state_dict(saved, strict=False)
    assert snap.unchanged()


def test_model_hook_on_a_submodule_loaded_through_its_parent():
    old, _ = trained()
    parent = torch.nn.Module()
    parent.net = Net(head=True, seed=1)
    hook = install_model_load_hook(parent.net, allow_missing="value.*")
    parent.load_state_dict({f"net.{k}": v for k, v in old.state_dict().items()})
    assert hook.diff.missing == ("value.weight", "value.bias")
    assert equal(parent.net.a.weight.detach(), old.a.weight.detach())
    hook.remove()
    with pytest.raises(RuntimeError, match="Missing key"):
        parent.load_state_dict({f"net.{k}": v for k, v in old.state_dict().items()})


def test_an_optimizers_own_top_level_keys_survive_the_rekey():
    """heavyball keeps its own key next to state and param_groups, and reads it on load."""
    _, old_optimizer = trained()
    saved = {**copy.deepcopy(old_optimizer.state_dict()), "mine": {"k": 3}}
    model = Net()
    optimizer = adamw(model)
    install_load_hook(optimizer, model, policy="strict")
    got = []  # what torch loads: a pre-hook registered after dsdmerge's sees its result
    optimizer.register_load_state_dict_pre_hook(lambda o, sd: got.append(dict(sd)))
    optimizer.load_state_dict(saved)
    assert got[0]["mine"] == {"k": 3}
