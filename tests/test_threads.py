"""Concurrent calls from threads give identical results (no shared mutable state)."""

from __future__ import annotations

import contextlib
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hostile import hostile_pairs
from hypothesis import given, settings
from hypothesis import strategies as st

import dsdmerge as dm
from dsdmerge.strategies import checkpoint_pairs

LOOSE = dm.Policy(missing="warn", conflict="warn")
SHAPES = {"on_shape_mismatch": "take_reference"}
CALLS = {
    "merge": lambda c, r: dm.merge(c, r),
    "merge-strict": lambda c, r: dm.merge(c, r, policy="strict", allow_missing="*.indexer.*"),
    "merge_with_diff": lambda c, r: dm.merge_with_diff(c, r, policy=LOOSE, **SHAPES),
    "diff": dm.diff,
    "check": lambda c, r: dm.check(c, r, policy="strict"),
    "flatten": lambda c, r: dm.flatten(c),
    "unflatten": lambda c, r: dm.unflatten(dm.flatten(c), like=c),
    "classify": lambda c, r: dm.classify(c),
    "rename": lambda c, r: dm.rename(c, {r"^": "module.", r"\.attn\.": ".attention."}),
    "merge-rename": lambda c, r: dm.merge_with_diff(
        dm.rename(c, {r"^": "module."}), r, policy=LOOSE, rename="ddp", **SHAPES
    ),
}


def outcome(call: Any, c: Any, r: Any) -> Any:
    try:
        return ("ok", call(c, r))
    except dm.DSDMergeError as err:
        return ("error", type(err), str(err))


def same_tree(a: Any, b: Any) -> bool:
    """Same containers (dicts, lists) holding the very same leaves; iterative, for any depth."""
    stack = [(a, b)]
    while stack:
        x, y = stack.pop()
        if x is y or (type(x) is str and x == y):  # a renamed fqn is a new, equal string
            continue
        if type(x) is not type(y) or not isinstance(x, (dict, list)):
            return False
        if isinstance(x, dict):
            if list(x) != list(y):
                return False
            stack.extend((x[k], y[k]) for k in x)
        else:
            if len(x) != len(y):
                return False
            stack.extend(zip(x, y, strict=True))
    return True


def same_outcome(a: Any, b: Any) -> bool:
    if a[0] != b[0]:
        return False
    if a[0] == "error":
        return a == b
    x, y = a[1], b[1]
    if isinstance(x, dm.Merged):
        return same_tree(x.state_dict, y.state_dict) and (x.diff, x.conflicts) == (
            y.diff,
            y.conflicts,
        )
    return same_tree(x, y) if isinstance(x, dict) else x == y


@contextlib.contextmanager
def tiny_switch_interval():
    """Make the interpreter switch threads as often as it can, to interleave the calls."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


@settings(max_examples=max(8, settings().max_examples // 100))  # 100 under the fuzz profile
@given(
    st.lists(
        st.one_of(
            checkpoint_pairs(layout="flat", max_params=40, max_missing=5, max_unexpected=5),
            checkpoint_pairs(layout="nested", max_params=40, max_missing=5, max_unexpected=5),
            checkpoint_pairs(layout="nested", keyed="id", max_params=40),
            hostile_pairs().map(lambda case: case.values),
        ),
        min_size=3,
        max_size=3,
    )
)
def test_concurrent_calls_give_identical_results(batch):
    with warnings.catch_warnings(), tiny_switch_interval():
        warnings.simplefilter("ignore")  # warnings machinery is process-wide; not under test
        jobs = [(name, i) for name in CALLS for i in range(len(batch))] * 4
        serial = {(name, i): outcome(CALLS[name], *batch[i]) for name, i in set(jobs)}
        with ThreadPoolExecutor(max_workers=8) as pool:
            results = list(pool.map(lambda job: outcome(CALLS[job[0]], *batch[job[1]]), jobs))
    for job, result in zip(jobs, results, strict=True):
        assert same_outcome(result, serial[job]), job
