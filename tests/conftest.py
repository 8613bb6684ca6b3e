"""Shared test helpers and hypothesis profiles.

Profiles: ``dev`` (default, fast, a fresh random sample each run), ``ci`` (the same
examples as ``dev`` would draw, but derandomized, so a commit passes or fails CI
the same way every time; ``.ci/run`` selects it), ``fuzz`` (10k+ examples per
property; ``HYPOTHESIS_PROFILE=fuzz python -m pytest tests``).
"""

from __future__ import annotations

import os
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
    """A deep record of a state dict: containers, their contents, leaf identity, tensor data."""

    def __init__(self, tree: Any) -> None:
        self.tree = tree
        self.record = self._take(tree)

    @staticmethod
    def _take(tree: Any) -> list[Any]:
        out: list[Any] = []
        stack = [tree]
        while stack:
            node = stack.pop()
            if isinstance(node, Mapping):
                out.append((id(node), tuple(node.keys()), tuple(id(v) for v in node.values())))
                stack.extend(node.values())
            elif isinstance(node, list):
                out.append((id(node), len(node), tuple(id(v) for v in node)))
                stack.extend(node)
            elif isinstance(node, torch.Tensor):
                if node.device.type == "meta":
                    out.append((id(node), tuple(node.shape), node.dtype))
                else:
                    out.append((id(node), node.detach().clone(), node.data_ptr(), node._version))
            else:
                out.append((id(node), repr(node)))
        return out

    def unchanged(self) -> bool:
        now = self._take(self.tree)
        if len(now) != len(self.record):
            return False
        for old, new in zip(self.record, now, strict=True):
            if len(old) != len(new):
                return False
            for x, y in zip(old, new, strict=True):
                if isinstance(x, torch.Tensor):
                    if not torch.equal(x, y):
                        return False
                elif x != y:
                    return False
        return True
