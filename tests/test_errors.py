"""Bad input gets a DSDMergeError, never a stray KeyError or AttributeError."""

from __future__ import annotations

import pytest
import torch

import dsdmerge as dm

BAD_OPTIMIZERS = [
    {"state": {"w": 3}, "param_groups": [{"lr": 1, "params": ["w"]}]},
    {"state": {}, "param_groups": [{"lr": 1}]},
    {"state": {}, "param_groups": [{"lr": 1, "params": "w"}]},
    {"state": {}, "param_groups": [5]},
    {"state": {}, "param_groups": [{"lr": {"x": 1}, "params": ["w"]}]},
    {"state": {}, "param_groups": [{1: 2, "params": ["w"]}]},
    {"state": {None: {"step": 1}}, "param_groups": []},
]


GOOD = {"state": {}, "param_groups": [{"lr": 1, "params": ["w"]}]}
CALLS = {
    "flatten": lambda bad: dm.flatten(bad),
    "merge(bad, good)": lambda bad: dm.merge(bad, GOOD),
    "merge(good, bad)": lambda bad: dm.merge(GOOD, bad),
    "diff": lambda bad: dm.diff(bad, GOOD),
    "unflatten(like=bad)": lambda bad: dm.unflatten(dm.flatten(GOOD), like=bad),
}


@pytest.mark.parametrize("bad", BAD_OPTIMIZERS)
@pytest.mark.parametrize("call", sorted(CALLS))
def test_malformed_optimizer_state_dicts_raise_dsdmerge_errors(call, bad):
    with pytest.raises(dm.DSDMergeError):
        CALLS[call](bad)


@pytest.mark.parametrize("bad", [None, 1, "x", [("a", 1)], torch.zeros(1)])
@pytest.mark.parametrize("fn", [dm.flatten, dm.unflatten, dm.classify])
def test_non_mappings_raise_state_dict_type_error(fn, bad):
    with pytest.raises(dm.StateDictTypeError):
        fn(bad)


@pytest.mark.parametrize("fn", [dm.merge, dm.diff, dm.check])
def test_non_mapping_arguments_to_two_argument_functions(fn):
    with pytest.raises(dm.StateDictTypeError, match="checkpoint"):
        fn([1], {})
    with pytest.raises(dm.StateDictTypeError, match="reference"):
        fn({}, None)


def test_flat_keys_must_be_strings():
    with pytest.raises(dm.StateDictTypeError):
        dm.merge({1: torch.zeros(1)}, {"a": torch.zeros(1)})


def test_cycles_in_merge_inputs_raise_layout_error():
    c: dict = {"m": {}}
    c["m"]["self"] = c["m"]
    r: dict = {"m": {}}
    r["m"]["self"] = r["m"]
    with pytest.raises(dm.LayoutError, match="cycle"):
        dm.merge(c, r)


def test_every_error_class_is_in_the_hierarchy():
    for cls, builtin in [
        (dm.LayoutError, ValueError),
        (dm.StateDictTypeError, TypeError),
        (dm.MergeError, ValueError),
        (dm.InvalidPolicyError, ValueError),
    ]:
        assert issubclass(cls, dm.DSDMergeError)
        assert issubclass(cls, builtin)
    assert issubclass(dm.DSDMergeWarning, UserWarning)


def test_merge_error_says_what_to_do_next():
    with pytest.raises(dm.MergeError, match="allow_missing"):
        dm.merge({}, {"a": 1}, policy="strict")


def test_tensors_whose_shape_raises_get_a_dsdmerge_error_naming_the_key():
    # was: the C-level shape/dtype pass let the RuntimeError of a nested tensor's .shape escape
    class NoShape(torch.Tensor):
        @property
        def shape(self):  # type: ignore[override]
            raise RuntimeError("no shape")

    with pytest.warns(UserWarning, match="nested"):
        nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    for bad in (nested, torch.zeros(2).as_subclass(NoShape)):
        for call in (dm.diff, dm.merge, dm.check):
            with pytest.raises(dm.StateDictTypeError, match="'w'"):
                call({"w": bad, "v": torch.zeros(1)}, {"w": torch.zeros(2), "v": torch.zeros(1)})
