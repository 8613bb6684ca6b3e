from __future__ import annotations

import pytest
import torch
from torch import nn

import dsdmerge as dm


def test_layout_is_a_str_enum():
    assert dm.Layout.NESTED == "nested"
    assert dm.Layout.FLAT == "flat"
    assert str(dm.Layout.FLAT) == "flat"
    assert f"{dm.Layout.NESTED}" == "nested"


def test_empty_mapping_is_flat():
    assert dm.classify({}) is dm.Layout.FLAT


def test_model_state_dict_is_flat():
    assert dm.classify(nn.Linear(2, 2).state_dict()) is dm.Layout.FLAT


def test_safetensors_like_dict_is_flat():
    assert dm.classify({"a.weight": torch.zeros(1), "b.bias": torch.zeros(2)}) is dm.Layout.FLAT


def test_flat_optimizer_dict_with_scalars_and_tuples_is_flat():
    flat = {"state.w.step": torch.tensor(1.0), "param_groups.w.betas": (0.9, 0.99)}
    assert dm.classify(flat) is dm.Layout.FLAT


def test_torch_optimizer_state_dict_is_nested():
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([p])
    p.grad = torch.ones(2)
    opt.step()
    assert dm.classify(opt.state_dict()) is dm.Layout.NESTED


def test_untrained_optimizer_state_dict_is_nested():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    assert dm.classify(opt.state_dict()) is dm.Layout.NESTED


def test_fqn_keyed_and_whole_checkpoint_dicts_are_nested():
    fqn = {"state": {"a.w": {"step": 1}}, "param_groups": [{"lr": 1.0, "params": ["a.w"]}]}
    assert dm.classify(fqn) is dm.Layout.NESTED
    assert (
        dm.classify({"model": {"w": torch.zeros(1)}, "optim": fqn, "step": 3}) is dm.Layout.NESTED
    )


def test_mixed_optimizer_layouts_raise_layout_error_naming_a_key():
    mixed = {"state": {"w": {"step": 1}}, "param_groups": [], "state.x.step": 2}
    with pytest.raises(dm.LayoutError, match=r"state\.x\.step"):
        dm.classify(mixed)


def test_layout_error_is_a_value_error_and_dsdmerge_error():
    assert issubclass(dm.LayoutError, ValueError)
    assert issubclass(dm.LayoutError, dm.DSDMergeError)


@pytest.mark.parametrize("bad", [None, [1, 2], "state", 3, torch.zeros(2)])
def test_non_mapping_raises_dsdmerge_error(bad):
    with pytest.raises(dm.DSDMergeError):
        dm.classify(bad)
    with pytest.raises(TypeError):
        dm.classify(bad)


def test_is_optimizer_state_dict():
    assert dm.is_optimizer_state_dict({"state": {}, "param_groups": []})
    assert not dm.is_optimizer_state_dict({"state": {}})
    assert not dm.is_optimizer_state_dict([])
