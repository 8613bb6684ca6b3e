"""dsdmerge.rekey: int ids to fqns (by names or torch's param_names) and back."""

from __future__ import annotations

import pytest
import torch
from conftest import Snapshot, leaves
from hypothesis import given
from hypothesis import strategies as st

import dsdmerge as dm
from dsdmerge.strategies import nested_state_dicts, optimizer_state_dicts


def names_of(osd):
    """Invented fqns, one per listed param id, in param-group order."""
    ids = [pid for g in osd["param_groups"] for pid in g["params"]]
    return [f"layers.{i}.w{pid}" for i, pid in enumerate(ids)]


@given(st.one_of(optimizer_state_dicts(keyed="id"), nested_state_dicts(keyed="id")))
def test_ids_to_fqns_and_back_is_the_identity(osd):
    snap = Snapshot(osd)
    names = names_of(osd)
    fqn = dm.rekey(osd, names)
    assert snap.unchanged()
    assert [p for g in fqn["param_groups"] for p in g["params"]] == names
    assert set(fqn["state"]) <= set(names)
    assert dm.rekey(fqn, names) == osd
    assert dm.rekey(fqn) == osd
    ids = {id(x) for x in leaves(osd)}
    assert all(id(x) in ids for x in leaves(fqn) if not isinstance(x, str))


@given(optimizer_state_dicts(keyed="id", min_params=1))
def test_a_rekeyed_optimizer_equals_the_fqn_keyed_one(osd):
    # the strategies key one parameter set by ids or by fqns: same state under both keys
    names = names_of(osd)
    fqn = dm.rekey(osd, names)
    for i, name in zip(
        [pid for g in osd["param_groups"] for pid in g["params"]], names, strict=True
    ):
        if i in osd["state"]:
            assert fqn["state"][name].keys() == osd["state"][i].keys()


def test_names_from_named_parameters_and_from_param_names():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    optim = torch.optim.SGD(model.named_parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    optim.step()
    saved = optim.state_dict()
    assert saved["param_groups"][0]["param_names"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    by_param_names = dm.rekey(saved)
    assert dm.rekey(saved, model.named_parameters()) == by_param_names
    assert list(by_param_names["state"]) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert by_param_names["param_groups"][0]["param_names"] == [
        "0.weight",
        "0.bias",
        "1.weight",
        "1.bias",
    ]


def test_too_few_or_too_many_names():
    osd = {"state": {}, "param_groups": [{"lr": 1, "params": [0, 1]}, {"lr": 2, "params": [2]}]}
    with pytest.raises(dm.DSDMergeError, match=r"2 name\(s\) for the 3 params .*2, 1 per group"):
        dm.rekey(osd, ["a", "b"])
    with pytest.raises(dm.DSDMergeError, match=r"4 name\(s\) for the 3 params"):
        dm.rekey(osd, ["a", "b", "c", "d"])
    with pytest.raises(dm.DSDMergeError, match="no 'param_names'"):
        dm.rekey(osd)
    with pytest.raises(dm.DSDMergeError, match="listed twice"):
        dm.rekey(osd, ["a", "b", "a"])
    with pytest.raises(dm.StateDictTypeError, match="not a str"):
        dm.rekey(osd, ["a", "b", 3])
    with pytest.raises(dm.LayoutError, match="nested optimizer state dict"):
        dm.rekey({"state.0.step": 1}, ["a"])
    fqn = dm.rekey(osd, ["a", "b", "c"])
    with pytest.raises(dm.DSDMergeError, match="same order"):
        dm.rekey(fqn, ["b", "a", "c"])


def test_state_that_belongs_to_no_parameter_is_kept_and_dcp_string_ids_map():
    osd = {
        "state": {"0": {"step": 1}, "k": torch.tensor(3)},
        "param_groups": [{"lr": 1, "params": [0]}],
    }
    out = dm.rekey(osd, ["w"])
    assert list(out["state"]) == ["w", "k"]
    assert out["state"]["k"] is osd["state"]["k"]
