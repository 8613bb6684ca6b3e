"""The laws of convert, on checkpoints from the public dsdmerge.strategies.

Each example draws a whole checkpoint (model and optimizer over the same parameters,
every optimizer kind the strategies know, Shampoo-like nested state included) and
derives rules that apply to it: a transpose for each matrix, and fuses of neighbours in
a param group that can be concatenated. The laws: converting commutes with flatten and
with rename, never mutates its input, shares every leaf it does not convert, and a
fuse followed by the split back (a transpose twice, an unstack then the stack back) is
the identity.
"""

from __future__ import annotations

import warnings
from itertools import pairwise
from typing import Any

import story
import torch
from conftest import Snapshot
from hypothesis import assume, given
from hypothesis import strategies as st

import dsdmerge as dm
from dsdmerge.strategies import nested_state_dicts

checkpoints = nested_state_dicts(kind="checkpoint", min_params=1, allow_optimizer_entries=True)


def rules_for(ckpt: dict[str, Any], choose: Any) -> tuple[list[Any], list[Any], set[str]]:
    """Rules that apply to ``ckpt``, the rules back, and the fqns they touch."""
    model, osd = ckpt["model"], ckpt["optim"]
    group_of = {f: i for i, g in enumerate(osd["param_groups"]) for f in g["params"]}
    there: list[Any] = []
    back: list[Any] = []
    touched: set[str] = set()
    for g in osd["param_groups"]:
        members = g["params"]
        for a, b in pairwise(members):
            ta, tb = model[a], model[b]
            if (
                a in touched
                or b in touched
                or ta.dim() == 0
                or ta.shape[1:] != tb.shape[1:]
                or tb.dim() != ta.dim()
                or ta.dtype != tb.dtype
                or (a in osd["state"]) != (b in osd["state"])
                or group_of[a] != group_of[b]
                or not choose()
            ):
                continue
            target = f"fused{len(there)}.weight"
            there.append(dm.Fuse([a, b], target))
            back.append(dm.Split(target, [a, b], sizes=[ta.shape[0], tb.shape[0]]))
            touched.update((a, b))
    for fqn, value in model.items():
        if fqn not in touched and value.dim() == 2 and choose():
            there.append(dm.Transpose(fqn, dims=(0, 1)))
            back.append(dm.Transpose(fqn, dims=(1, 0)))
            touched.add(fqn)
        elif fqn not in touched and value.dim() >= 2 and choose():  # parts of 1-D or more
            parts = f"{fqn}.parts.{{E}}"
            there.append(dm.Unstack(fqn, parts, over="E"))
            back.append(dm.Stack(parts, fqn, over="E"))
            touched.add(fqn)
    return there, back[::-1], touched


def convert(sd: Any, rules: list[Any]) -> tuple[Any, list[str]]:
    """``dm.convert`` with ``nonelementwise="reset"`` (Shampoo-like state), its warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = dm.convert(sd, rules, nonelementwise="reset")
    return out, [str(w.message) for w in caught]


def drawn(data: Any) -> tuple[dict[str, Any], list[Any], list[Any], set[str]]:
    ckpt = data.draw(checkpoints)
    there, back, touched = rules_for(ckpt, lambda: data.draw(st.booleans()))
    assume(there)
    return ckpt, there, back, touched


@given(st.data())
def test_convert_commutes_with_flatten(data):
    ckpt, there, _, _ = drawn(data)
    nested, warned = convert(ckpt, there)
    flat, warned_flat = convert(dm.flatten(ckpt), there)
    assert story.tree_differences(dm.flatten(nested), flat) == []
    assert len(warned) == len(warned_flat)


@given(st.data())
def test_convert_commutes_with_rename(data):
    ckpt, there, _, _ = drawn(data)
    rules = {r"^model\.": "net."}

    def renamed(rule: Any) -> Any:
        return eval(repr(rule).replace("'model.", "'net."), {k: getattr(dm, k) for k in dm.__all__})

    first, _ = convert(dm.rename(ckpt, rules, unmatched="ignore"), [renamed(r) for r in there])
    second = dm.rename(convert(ckpt, there)[0], rules, unmatched="ignore")
    assert story.tree_differences(second, first) == []


@given(st.data())
def test_convert_is_pure_and_shares_every_leaf_it_does_not_convert(data):
    ckpt, there, _, touched = drawn(data)
    snap = Snapshot(ckpt)
    out, _ = convert(ckpt, there)
    assert snap.unchanged()
    before, after = dm.flatten(ckpt), dm.flatten(out)
    for key, value in after.items():
        fqn = (
            key.removeprefix("model.")
            .removeprefix("optim.state.")
            .removeprefix("optim.param_groups.")
        )
        if key in before and not any(fqn.startswith(f + ".") or fqn == f for f in touched):
            assert value is before[key], key
    # converted tensors are new: no storage of the result is one of the input's (scalars such
    # as step are taken over as they are: they are the same value)
    inputs = {
        v.untyped_storage().data_ptr()
        for v in before.values()
        if isinstance(v, torch.Tensor) and v.numel()
    }
    for key, value in after.items():
        if key not in before and isinstance(value, torch.Tensor) and value.dim():
            assert value.is_contiguous(), key
            assert value.untyped_storage().data_ptr() not in inputs, key


@given(st.data())
def test_converting_there_and_back_is_the_identity(data):
    ckpt, there, back, _ = drawn(data)
    again, _ = convert(convert(ckpt, there)[0], back)

    # group membership may come back in another order (a fused pair comes back side by side)
    def unordered(sd: dict[str, Any]) -> dict[str, Any]:
        osd = sd["optim"]
        groups = [{**g, "params": sorted(g["params"])} for g in osd["param_groups"]]
        return {**sd, "optim": {**osd, "param_groups": groups}}

    expected = ckpt
    if any("fresh optimizer state" in w for w in convert(ckpt, there)[1]):
        # state that could not be converted was reset: only the model comes back
        expected = {**ckpt, "optim": again["optim"]}
    assert story.tree_differences(unordered(expected), unordered(again)) == []
