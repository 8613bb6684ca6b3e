"""Shared pieces of the tests against real trainers (tests/test_frameworks_*.py).

Oracles here are pure torch: optimizer state compared by parameter name (every state
key of every parameter, every hyperparameter of its group), model state bit for bit.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Any

import torch

NAMES = "param_names"


def by_name(osd: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """``(state by fqn, hyperparameters by fqn)`` of an int-keyed state dict with param_names."""
    state: dict[str, Any] = {}
    hyper: dict[str, dict[str, Any]] = {}
    for group in osd["param_groups"]:
        names = group[NAMES]
        assert len(names) == len(group["params"]), group
        for pid, name in zip(group["params"], names, strict=True):
            hyper[name] = {k: v for k, v in group.items() if k not in ("params", NAMES)}
            if pid in osd["state"]:
                state[name] = osd["state"][pid]
    return state, hyper


def equal(a: Any, b: Any) -> bool:
    """Bit for bit: tensors by ``torch.equal`` (and dtype), containers recursively."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def assert_same_optimizer(got: Mapping[str, Any], want: Mapping[str, Any]) -> None:
    """Every parameter's every state key, and its group's every hyperparameter, by name."""
    g_state, g_hyper = by_name(got)
    w_state, w_hyper = by_name(want)
    assert g_hyper.keys() == w_hyper.keys()
    assert g_state.keys() == w_state.keys(), sorted(g_state.keys() ^ w_state.keys())
    for name in w_state:
        assert equal(g_state[name], w_state[name]), name
    for name in w_hyper:
        assert equal(g_hyper[name], w_hyper[name]), (name, g_hyper[name], w_hyper[name])


def assert_same_model(got: Mapping[str, Any], want: Mapping[str, Any]) -> None:
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())
    differ = [k for k in want if not equal(got[k], want[k])]
    assert not differ, differ


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
