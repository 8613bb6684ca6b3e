"""Nested merges: per parameter and per state field, param_groups from the checkpoint."""

from __future__ import annotations

import pytest
import torch
from conftest import Snapshot
from torch import nn

import dsdmerge as dm


def adam_state(step: float, n: int = 2):
    return {
        "step": torch.tensor(step),
        "exp_avg": torch.full((n,), step),
        "exp_avg_sq": torch.full((n,), step),
    }


def test_param_missing_only_exp_avg_sq_gets_only_that():
    ckpt = {
        "state": {"w": {"step": torch.tensor(9.0), "exp_avg": torch.ones(2)}},
        "param_groups": [{"lr": 5e-5, "params": ["w"]}],
    }
    ref = {"state": {"w": adam_state(1.0)}, "param_groups": [{"lr": 1e-3, "params": ["w"]}]}
    out, diff, _ = dm.merge_with_diff(ckpt, ref)
    assert out["state"]["w"]["step"] is ckpt["state"]["w"]["step"]
    assert out["state"]["w"]["exp_avg"] is ckpt["state"]["w"]["exp_avg"]
    assert out["state"]["w"]["exp_avg_sq"] is ref["state"]["w"]["exp_avg_sq"]
    assert diff.missing == ("state.w.exp_avg_sq",)
    assert out["param_groups"] == [{"lr": 5e-5, "params": ["w"]}]


def test_new_param_joins_its_group_with_checkpoint_hyperparameters():
    ckpt = {
        "state": {"a": adam_state(5.0)},
        "param_groups": [{"lr": 5e-5, "wd": 0.1, "params": ["a"]}],
    }
    ref = {
        "state": {"new": adam_state(1.0), "a": adam_state(1.0)},
        "param_groups": [{"lr": 1e-3, "wd": 0.1, "params": ["new", "a"]}],
    }
    out, diff, _ = dm.merge_with_diff(ckpt, ref)
    assert out["param_groups"] == [{"lr": 5e-5, "wd": 0.1, "params": ["new", "a"]}]
    assert out["state"]["new"]["step"] is ref["state"]["new"]["step"]
    assert set(diff.missing) == {
        "state.new.step",
        "state.new.exp_avg",
        "state.new.exp_avg_sq",
        "param_groups.new.lr",
        "param_groups.new.wd",
    }


def test_hyperparameter_added_by_newer_torch_is_backfilled_per_group():
    ckpt = {
        "state": {},
        "param_groups": [{"lr": 0.1, "params": ["a"]}, {"lr": 0.2, "params": ["b"]}],
    }
    ref = {
        "state": {},
        "param_groups": [
            {"lr": 1.0, "decoupled_weight_decay": True, "params": ["a"]},
            {"lr": 1.0, "decoupled_weight_decay": False, "params": ["b"]},
        ],
    }
    out = dm.merge(ckpt, ref)
    assert out["param_groups"] == [
        {"lr": 0.1, "decoupled_weight_decay": True, "params": ["a"]},
        {"lr": 0.2, "decoupled_weight_decay": False, "params": ["b"]},
    ]


def test_whole_new_group_comes_from_the_reference():
    ckpt = {"state": {}, "param_groups": [{"lr": 0.1, "params": ["a"]}]}
    ref = {
        "state": {},
        "param_groups": [{"lr": 1.0, "params": ["a"]}, {"lr": 2.0, "params": ["lora"]}],
    }
    out = dm.merge(ckpt, ref)
    assert out["param_groups"] == [{"lr": 0.1, "params": ["a"]}, {"lr": 2.0, "params": ["lora"]}]
    assert out["param_groups"][1] is not ref["param_groups"][1]


def test_unexpected_params_keep_their_state_but_groups_list_the_reference_params():
    # torch maps params by position: a dead name in a group would change its size, which
    # Optimizer.load_state_dict rejects; the dead param's state is kept (and reported)
    ckpt = {
        "state": {"a": adam_state(3.0), "gone": adam_state(3.0)},
        "param_groups": [{"lr": 0.1, "params": ["a", "gone"]}],
    }
    ref = {"state": {"a": adam_state(1.0)}, "param_groups": [{"lr": 1.0, "params": ["a"]}]}
    out, diff, _ = dm.merge_with_diff(ckpt, ref)
    assert out["param_groups"][0]["params"] == ["a"]
    assert out["state"]["gone"]["exp_avg"] is ckpt["state"]["gone"]["exp_avg"]
    assert diff.unexpected == (
        "state.gone.step",
        "state.gone.exp_avg",
        "state.gone.exp_avg_sq",
        "param_groups.gone.lr",
    )


def test_int_keyed_group_size_change_is_an_error_naming_the_group():
    ckpt = {
        "state": {},
        "param_groups": [{"lr": 0.1, "params": [0, 1]}, {"lr": 0.1, "params": [2]}],
    }
    ref = {
        "state": {},
        "param_groups": [{"lr": 0.1, "params": [0, 1]}, {"lr": 0.1, "params": [2, 3]}],
    }
    with pytest.raises(dm.MergeError, match=r"param_groups\[1\]: 1 params in the checkpoint but 2"):
        dm.merge(ckpt, ref)


def test_int_keyed_merge_loads_into_torch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    model[1](torch.randn(2, 3)).sum().backward()  # only the second layer trains
    optim.step()
    ckpt = optim.state_dict()
    assert sorted(ckpt["state"]) == [2, 3]
    fresh = torch.optim.Adam(model.parameters(), lr=0.01)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    fresh.step()  # every param has state now, as in DSD's _init_optim_state
    merged = dm.merge(ckpt, fresh.state_dict())
    assert sorted(merged["state"]) == [0, 1, 2, 3]
    assert merged["state"][2]["exp_avg"] is ckpt["state"][2]["exp_avg"]
    target = torch.optim.Adam(model.parameters(), lr=0.01)
    target.load_state_dict(merged)
    assert torch.equal(
        target.state[list(model.parameters())[2]]["exp_avg"], ckpt["state"][2]["exp_avg"]
    )


def test_int_and_fqn_keyed_optimizers_do_not_merge():
    ckpt = {"state": {0: {"step": 1}}, "param_groups": [{"lr": 1, "params": [0]}]}
    ref = {"state": {"w": {"step": 1}}, "param_groups": [{"lr": 1, "params": ["w"]}]}
    with pytest.raises(dm.LayoutError, match="int param ids"):
        dm.merge(ckpt, ref)


def test_whole_checkpoint_dicts_merge_recursively():
    ckpt = {
        "model": {"w": torch.ones(2)},
        "optim": {"state": {}, "param_groups": [{"lr": 0.1, "params": ["w"]}]},
        "step": 7,
    }
    ref = {
        "model": {"w": torch.zeros(2), "head": torch.zeros(3)},
        "optim": {
            "state": {"head": adam_state(1.0)},
            "param_groups": [{"lr": 1.0, "params": ["w", "head"]}],
        },
        "step": 0,
    }
    out, diff, _ = dm.merge_with_diff(ckpt, ref)
    assert out["step"] == 7
    assert out["model"]["w"] is ckpt["model"]["w"]
    assert out["model"]["head"] is ref["model"]["head"]
    assert out["optim"]["param_groups"] == [{"lr": 0.1, "params": ["w", "head"]}]
    assert "model.head" in diff.missing
    assert "optim.param_groups.head.lr" in diff.missing


def test_structure_conflict_is_a_layout_error():
    with pytest.raises(dm.LayoutError, match="'model'"):
        dm.merge({"model": torch.zeros(1), "extra": {}}, {"model": {"w": torch.zeros(1)}})


def test_flat_checkpoint_with_nested_reference_uses_exact_groups():
    # two groups with equal reference hyperparameters: only the nested reference tells them apart
    ref = {
        "state": {},
        "param_groups": [
            {"lr": 1e-3, "params": ["a", "new_a"]},
            {"lr": 1e-3, "params": ["b", "new_b"]},
        ],
    }
    ckpt = {"param_groups.a.lr": 5e-5, "param_groups.b.lr": 7e-5}
    out = dm.merge(ckpt, ref)
    assert out["param_groups.new_a.lr"] == 5e-5
    assert out["param_groups.new_b.lr"] == 7e-5


def test_nested_checkpoint_with_flat_reference_is_refused_with_advice():
    with pytest.raises(dm.LayoutError, match="flatten"):
        dm.merge({"state": {}, "param_groups": []}, {"param_groups.w.lr": 1.0})


def test_nested_merge_makes_new_containers_and_does_not_mutate():
    ckpt = {"state": {"a": adam_state(3.0)}, "param_groups": [{"lr": 0.1, "params": ["a"]}]}
    ref = {
        "state": {"a": adam_state(1.0), "b": adam_state(1.0)},
        "param_groups": [{"lr": 1.0, "params": ["a", "b"]}],
    }
    snaps = Snapshot(ckpt), Snapshot(ref)
    out = dm.merge(ckpt, ref)
    assert all(s.unchanged() for s in snaps)
    assert out["state"] is not ckpt["state"]
    assert out["state"]["a"] is not ckpt["state"]["a"]
    assert out["state"]["b"] is not ref["state"]["b"]
    assert out["param_groups"][0] is not ckpt["param_groups"][0]
    assert out["param_groups"][0]["params"] is not ref["param_groups"][0]["params"]


def test_flattened_optimizer_inside_a_whole_checkpoint_keeps_the_group_lr():
    # {"model": ..., "optim": <flattened DSD>} is how trainers torch.save a checkpoint
    ckpt = {"optim": {"state.a.step": 5, "param_groups.a.lr": 5e-5}, "step": 3}
    ref = {
        "optim": {
            "state.new.step": 1,
            "state.a.step": 1,
            "param_groups.new.lr": 1e-3,
            "param_groups.a.lr": 1e-3,
        },
        "step": 0,
    }
    nested, diff, _ = dm.merge_with_diff(ckpt, ref)
    assert nested["optim"]["param_groups.new.lr"] == 5e-5
    assert nested["optim"]["state.a.step"] is ckpt["optim"]["state.a.step"]
    assert diff.missing == ("optim.state.new.step", "optim.param_groups.new.lr")
    flat = dm.merge(dm.flatten(ckpt), dm.flatten(ref))
    assert flat == dm.flatten(nested)
    assert flat["optim.param_groups.new.lr"] == 5e-5


def test_conflicts_of_a_prefixed_flat_optimizer_are_reported_in_both_layouts():
    ckpt = {"optim": {"param_groups.a.lr": 1e-4, "param_groups.b.lr": 2e-4}}
    ref = {"optim": {"param_groups.a.lr": 1e-3, "param_groups.b.lr": 1e-3}}
    for c, r in ((ckpt, ref), (dm.flatten(ckpt), dm.flatten(ref))):
        with pytest.raises(dm.MergeError, match=r"'optim': param group 0 \(inferred\).*'lr'"):
            dm.merge(c, r, policy="strict")
