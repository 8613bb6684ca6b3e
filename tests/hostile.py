"""Hostile inputs for the "bad input never escapes" suite, and a cycle-safe purity check.

``hostile_state_dicts()`` draws arbitrary nested structures with hostile content:
non-str keys (None, bytes, floats and NaN, bools, tuples), empty and dotted
segments (``"state..x"``, ``"."``, ``"param_groups."``), lists where mappings are
expected, optimizer-shaped dicts with broken parts, cycles (mappings and lists
that contain themselves), deep nesting (dict chains, tuple and list chains up to
10,000 levels), odd leaves (NaN, meta, sparse and empty tensors, TensorMeta).
``mutated()`` breaks one or a few spots of a valid state dict from
``dsdmerge.strategies`` instead, so the hostile part sits deep inside structure
the library otherwise accepts. Both shrink: edits are drawn as indices into the
valid structure, content from small sampled pools.
"""

from __future__ import annotations

import copy
import functools
import math
import reprlib
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
from hypothesis import strategies as st

import dsdmerge as dm
from dsdmerge.strategies import checkpoint_pairs, flat_state_dicts, nested_state_dicts

# -- keys and leaves -------------------------------------------------------------------

SEGMENTS = (
    "",
    ".",
    "..",
    "state",
    "param_groups",
    "params",
    "state.",
    "param_groups.",
    "state..x",
    "state.w",
    "state.w.step",
    "param_groups.w",
    "param_groups.w.lr",
    "param_groups..lr",
    "a",
    "a.b",
    "a.",
    ".a",
    "w",
    "lr",
    "step",
    "exp_avg",
    "0",
    "1",
    "model",
)

hostile_keys: st.SearchStrategy[Any] = st.one_of(
    st.sampled_from(SEGMENTS),
    st.text(alphabet="ab.01", max_size=5),
    st.integers(-2, 3),
    st.sampled_from([None, True, False, b"", b"state", math.nan, -math.inf, 0.0, 1.0, 2**70]),
    st.sampled_from([(), ("a",), (1, "b"), frozenset({"x"})]),
)


@functools.cache
def _deep_tuple(depth: int) -> Any:
    out: Any = ()
    for _ in range(depth):
        out = (out,)
    return out


def _deep_list(depth: int) -> Any:
    out: Any = []
    for _ in range(depth):
        out = [out]
    return out


def _cyclic_list() -> list[Any]:
    out: list[Any] = [1]
    out.append(out)
    return out


def _tensor(kind: str) -> Any:
    if kind == "scalar":
        return torch.tensor(1.5)
    if kind == "vector":
        return torch.zeros(3)
    if kind == "empty":
        return torch.zeros(0)
    if kind == "bf16":
        return torch.ones(2, 2, dtype=torch.bfloat16)
    if kind == "int":
        return torch.arange(4)
    if kind == "bool":
        return torch.tensor([True, False])
    if kind == "nan":
        return torch.tensor([math.nan, 1.0])
    if kind == "meta":
        return torch.empty(4096, 4096, device="meta")
    if kind == "sparse":
        return torch.zeros(3).to_sparse()
    if kind == "param":
        return torch.nn.Parameter(torch.zeros(2))
    if kind == "tensormeta":
        return dm.TensorMeta((2, 3), torch.float32)
    if kind == "numpy":
        try:
            import numpy as np
        except ImportError:  # numpy is optional for torch
            return dm.TensorMeta((2, 3), "float32")
        return np.zeros((2, 3), dtype=np.float32)
    if kind == "fake-none-shape":
        return _FakeNoneShape()
    if kind == "fake-str-shape":
        return _FakeStrShape()
    raise AssertionError(kind)


class _FakeNoneShape:
    """Looks tensor-like to a type check (the class has shape and dtype), but is not."""

    shape = None
    dtype = "float"


class _FakeStrShape:
    shape = "2x3"
    dtype = torch.float32


TENSOR_KINDS = (
    "scalar",
    "vector",
    "empty",
    "bf16",
    "int",
    "bool",
    "nan",
    "meta",
    "sparse",
    "param",
    "tensormeta",
    "numpy",
    "fake-none-shape",
    "fake-str-shape",
)

hostile_leaves: st.SearchStrategy[Any] = st.one_of(
    st.sampled_from([None, True, 0, -1, 1e-3, math.nan, math.inf, "x", "", b"bytes", 10**30]),
    st.sampled_from(TENSOR_KINDS).map(_tensor),
    st.sampled_from([(), (0.9, 0.999), ("a", None), [], [1, 2]]).map(copy.deepcopy),
    st.sampled_from([3, 1200]).map(_deep_tuple),  # past the recursion limit; 10,000 below
    st.sampled_from([3, 1200]).map(_deep_list),
    st.builds(_cyclic_list),
)


# -- containers ------------------------------------------------------------------------


def _dicts(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.dictionaries(hostile_keys, children, max_size=4)


def _group(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    params = st.one_of(
        st.lists(hostile_keys, max_size=3),
        st.lists(hostile_keys, max_size=3).map(tuple),
        st.sampled_from([[["w"]], [{}], "w", None, {"w": 1}, [[]]]).map(copy.deepcopy),
    )
    hyper = st.dictionaries(
        st.one_of(st.sampled_from(["lr", "betas", "eps"]), hostile_keys), children, max_size=3
    )
    return st.one_of(
        st.builds(lambda h, p: {**h, "params": p}, hyper, params),
        hyper,
        children,
    )


def _optimizers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    state = st.one_of(
        st.dictionaries(hostile_keys, st.one_of(_dicts(children), children), max_size=3),
        children,
    )
    groups = st.one_of(st.lists(_group(children), max_size=3), children)
    extra = st.dictionaries(hostile_keys, children, max_size=2)
    return st.builds(lambda s, g, e: {**e, "state": s, "param_groups": g}, state, groups, extra)


def _deep_dicts(depth: int) -> Any:
    out: Any = {"leaf": 1}
    for i in range(depth):
        out = {f"d{i % 3}": out}
    return out


def _wrap(node: Any, how: str) -> Any:
    if how == "proxy" and isinstance(node, dict):
        return MappingProxyType(node)
    if how == "list" and isinstance(node, Mapping):
        return list(node.items())
    return node


hostile_trees: st.SearchStrategy[Any] = st.recursive(
    hostile_leaves,
    lambda children: st.one_of(
        _dicts(children),
        _optimizers(children),
        st.lists(children, max_size=3),
        st.builds(_wrap, _dicts(children), st.sampled_from(["proxy", "list", "none"])),
    ),
    max_leaves=12,
)

hostile_mappings: st.SearchStrategy[Any] = st.one_of(
    _dicts(hostile_trees),
    _optimizers(hostile_trees),
    st.dictionaries(hostile_keys, hostile_leaves, max_size=5),  # flat-looking
    st.dictionaries(st.sampled_from(SEGMENTS), hostile_leaves, max_size=6),
    st.sampled_from([3, 1200]).map(_deep_dicts),
)

non_mappings: st.SearchStrategy[Any] = st.sampled_from(
    [None, 0, "state", b"x", [("a", 1)], (), torch.zeros(1), math.nan]
).map(copy.deepcopy)  # fresh: mutated() edits what it draws


# -- breaking valid state dicts ----------------------------------------------------------


def _slots(root: Any) -> list[tuple[Any, Any]]:
    """Every (container, key-or-index) slot of a state dict (each container once)."""
    out: list[tuple[Any, Any]] = []
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, dict):
            for k, v in node.items():
                out.append((node, k))
                stack.append(v)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                out.append((node, i))
                stack.append(v)
    return out


EDITS = ("replace", "add_key", "delete", "as_list", "cycle", "self_cycle", "deep", "rename")


@st.composite
def mutated(draw: st.DrawFn, base: st.SearchStrategy[Any]) -> Any:
    """A valid state dict from ``base`` with one to three hostile edits (in place: it is fresh)."""
    root = draw(base)
    for _ in range(draw(st.integers(1, 3))):
        slots = _slots(root)
        if not slots:
            root[draw(hostile_keys)] = draw(hostile_trees)
            continue
        node, key = slots[draw(st.integers(0, len(slots) - 1))]
        edit = draw(st.sampled_from(EDITS))
        if edit == "replace":
            node[key] = draw(hostile_trees)
        elif edit == "add_key" and isinstance(node, dict):
            node[draw(hostile_keys)] = draw(hostile_trees)
        elif edit == "delete":
            del node[key]
        elif edit == "as_list" and isinstance(node[key], dict):
            node[key] = list(node[key].values())
        elif edit == "cycle":
            node[key] = root
        elif edit == "self_cycle":
            node[key] = node
        elif edit == "deep":
            depth = draw(st.sampled_from([1200, 10_000]))
            deep = draw(st.sampled_from(["dicts", "tuple"]))
            node[key] = _deep_dicts(depth) if deep == "dicts" else _deep_tuple(depth)
        elif edit == "rename" and isinstance(node, dict):
            node[draw(hostile_keys)] = node.pop(key)
        else:
            node[key] = draw(hostile_leaves)
    return root


# what real optimizers keep besides: heavyball's top-level key, MADGRAD's state['k']
_LEVELS = {"allow_extra_keys": True, "allow_optimizer_entries": True}
valid_state_dicts: st.SearchStrategy[Any] = st.one_of(
    flat_state_dicts(max_params=3),
    nested_state_dicts(max_params=3),
    nested_state_dicts(keyed="id", max_params=3),
    nested_state_dicts(kind="checkpoint", max_params=3),
    nested_state_dicts(keyed="id", max_params=3, **_LEVELS),
    nested_state_dicts(kind="checkpoint", max_params=3, **_LEVELS),
)

hostile_state_dicts: st.SearchStrategy[Any] = st.one_of(
    mutated(valid_state_dicts), hostile_mappings, non_mappings
)


class Case:
    """Drawn hostile values, with a bounded repr: hypothesis prints failing examples with
    ``repr``, and the builtin one recurses without bound on 10,000-deep or cyclic values."""

    def __init__(self, *values: Any) -> None:
        self.values = values

    def __repr__(self) -> str:
        return f"Case({', '.join(map(_short.repr, self.values))})"


# valid pairs, some with what real optimizers and trainers do (a reference lacking state
# fields, heavyball's key, MADGRAD's state['k'], moved parameters), to break
_valid_pairs = {
    layout: st.one_of(
        checkpoint_pairs(layout=layout, max_params=3),
        checkpoint_pairs(
            layout=layout,
            max_params=3,
            allow_missing_fields=True,
            max_moved=2,
            **_LEVELS,
        ),
    )
    for layout in ("flat", "nested")
}


@st.composite
def hostile_pairs(draw: st.DrawFn) -> Case:
    """Case(checkpoint, reference): a valid pair with one side broken, or two hostile values."""
    how = draw(st.sampled_from(["break_checkpoint", "break_reference", "both_hostile", "one"]))
    if how == "both_hostile":
        return Case(draw(hostile_state_dicts), draw(hostile_state_dicts))
    layout = draw(st.sampled_from(["flat", "nested"]))
    ckpt, ref = draw(_valid_pairs[layout])
    if how == "break_checkpoint":
        return Case(draw(mutated(st.just(ckpt))), ref)
    if how == "break_reference":
        return Case(ckpt, draw(mutated(st.just(ref))))
    other = draw(hostile_state_dicts)
    return Case(other, ref) if draw(st.booleans()) else Case(ckpt, other)


hostile_cases: st.SearchStrategy[Case] = hostile_state_dicts.map(Case)


# -- purity ------------------------------------------------------------------------------

_short = reprlib.Repr()
_short.maxlevel = 3


# -- an independent oracle for flatten -----------------------------------------------------


def expected_flat_leaves(sd: Mapping[Any, Any]) -> list[Any]:
    """The leaves ``dm.flatten(sd)`` must hold, one per flat key (for an ``sd`` it accepts).

    Written independently of the library, from torch's format: every non-mapping
    value of a nested mapping, except that an optimizer state dict contributes
    its state values (nested state flattening further; a leaf entry is an
    optimizer-level value), one copy of each group hyperparameter per member of
    the group, and the leaves of the keys it has beside ``state`` and ``param_groups``.
    """
    out: list[Any] = []
    # (mapping, whether an optimizer-shaped mapping in it is an optimizer state dict)
    stack: list[tuple[Mapping[Any, Any], bool]] = [(sd, True)]
    while stack:
        node, optimizers = stack.pop()
        if optimizers and dm.is_optimizer_state_dict(node):
            for entry in node["state"].values():
                if isinstance(entry, Mapping):
                    stack.append((entry, False))
                else:
                    out.append(entry)
            for group in node["param_groups"]:
                values = [v for name, v in group.items() if name != "params"]
                out.extend(values * len(group["params"]))
            for name, value in node.items():
                if name in ("state", "param_groups"):
                    continue
                if isinstance(value, Mapping):
                    stack.append((value, False))
                else:
                    out.append(value)
            continue
        for value in node.values():
            if isinstance(value, Mapping):
                stack.append((value, optimizers))
            else:
                out.append(value)
    return out
