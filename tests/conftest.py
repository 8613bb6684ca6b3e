"""Shared test helpers and hypothesis profiles.

Profiles: ``dev`` (default, fast, a fresh random sample each run), ``ci`` (the same
examples as ``dev`` would draw, but derandomized, so a commit passes or fails CI
the same way every time; ``.ci/run`` selects it), ``fuzz`` (10k+ examples per
property; ``HYPOTHESIS_PROFILE=fuzz python -m pytest tests``).
"""

from __future__ import annotations

import os
import reprlib
from collections.abc import Mapping
from typing import Any

import optree
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "dev", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "fuzz",
    max_examples=10_000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def _is_leaf(x: Any) -> bool:
    return not isinstance(x, (dict, list))


def leaves(tree: Any) -> list[Any]:
    """Leaves of a state dict: everything that is not a dict or a list (tuples are leaves)."""
    return optree.tree_leaves(tree, is_leaf=_is_leaf, none_is_leaf=True)


def same_tree(a: Any, b: Any) -> bool:
    """Same containers (types, keys, order-insensitive for dicts) and identical leaves."""
    sa = optree.tree_structure(a, is_leaf=_is_leaf, none_is_leaf=True)
    sb = optree.tree_structure(b, is_leaf=_is_leaf, none_is_leaf=True)
    if sa != sb:
        return False
    return all(x is y for x, y in zip(leaves(a), leaves(b), strict=True))


class Snapshot:
    """A deep record of a state dict, so that any mutation makes :meth:`unchanged` false.

    Every container reachable from ``tree`` (cycles and any depth allowed): its
    identity, type, and the identities of its keys and values in order. Every tensor:
    version counter, storage pointer, dtype, shape and contents (meta tensors: shape
    and dtype). Mutable leaves (``bytearray``, ``set``): their contents. So a key
    added or removed, a value replaced, a list appended to, or tensor data written
    (in place or by swapping its storage) is seen.
    """

    def __init__(self, tree: Any) -> None:
        self.tree = tree
        self.record = self._take(tree)

    @staticmethod
    def _take(tree: Any) -> list[Any]:
        out: list[Any] = []
        seen: set[int] = set()
        stack = [tree]
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            if isinstance(node, Mapping):
                items = list(node.items())
                out.append((id(node), type(node), [(id(k), id(v)) for k, v in items]))
                for k, v in items:
                    stack.append(k)
                    stack.append(v)
            elif isinstance(node, (list, tuple)):
                out.append((id(node), type(node), [id(v) for v in node]))
                stack.extend(node)
            else:
                out.append((id(node), _leaf_record(node)))
        return out

    def unchanged(self) -> bool:
        return self._take(self.tree) == self.record


_SHORT = reprlib.Repr()
_SHORT.maxlevel = 3


def _leaf_record(node: Any) -> Any:
    if isinstance(node, torch.Tensor):
        if node.device.type == "meta":
            return ("meta", tuple(node.shape), node.dtype, node._version)
        dense = node.detach().to_dense() if node.layout != torch.strided else node.detach()
        # repr of the values: NaN compares equal to itself, unlike torch.equal
        return (
            "tensor",
            node._version,
            _data_ptr(node),
            node.dtype,
            tuple(node.shape),
            repr(dense.tolist()),
        )
    if isinstance(node, (bytearray, set)):  # bounded repr: a set may hold a 1,000-deep tuple
        return ("mutable", _SHORT.repr(node), len(node))
    return ("leaf", type(node))


def _data_ptr(t: torch.Tensor) -> int | None:
    try:
        return int(t.data_ptr())
    except RuntimeError:  # sparse and other layouts without one storage
        return None
