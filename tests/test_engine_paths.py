"""The fast paths of the engine against a plain, obviously correct model of diff and merge.

The engine finds key differences from the union ``{**reference, **checkpoint}`` and value
identity, compares tensors in C-level passes, and takes shortcuts for common value types;
these tests feed it what breaks shortcuts: shared objects on both sides, reordered keys,
singleton values, tensor-likes of other types, tensors where the other side has a scalar.
"""

from __future__ import annotations

import numpy as np
import torch
from conftest import Snapshot
from hypothesis import given
from hypothesis import strategies as st

import dsdmerge as dm

MERGING = dm.DEFAULT.replace(shape="ignore")

SHARED = [torch.zeros(2), torch.zeros(3), torch.zeros(2, dtype=torch.float16), True, None, 0.5]


def _tensor_like(value: object) -> bool:
    tp = type(value)
    return hasattr(tp, "shape") and hasattr(tp, "dtype")


def _differs(c: object, r: object) -> bool:
    try:
        return bool(c.shape != r.shape or c.dtype != r.dtype)  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001
        return True


def model(c: dict, r: dict) -> tuple[list[str], list[str], list[str]]:
    """missing (reference order), unexpected (checkpoint order), mismatched (reference order)."""
    missing = [k for k in r if k not in c]
    unexpected = [k for k in c if k not in r]
    mismatched = [
        k
        for k, rv in r.items()
        if k in c
        and c[k] is not rv
        and _tensor_like(c[k])
        and _tensor_like(rv)
        and _differs(c[k], rv)
    ]
    return missing, unexpected, mismatched


values = st.one_of(
    st.sampled_from(SHARED),  # the same object may land on both sides
    st.builds(torch.zeros, st.sampled_from([(), (2,), (3,), (2, 2)])),
    st.builds(
        lambda n: torch.zeros(n, dtype=torch.bfloat16), st.integers(min_value=1, max_value=3)
    ),
    st.builds(lambda n: dm.TensorMeta((n,), torch.float32), st.integers(min_value=1, max_value=3)),
    st.builds(lambda n: np.zeros(n, dtype=np.float32), st.integers(min_value=1, max_value=3)),
    st.builds(lambda n: torch.nn.Parameter(torch.zeros(n)), st.integers(min_value=1, max_value=3)),
    st.floats(allow_nan=False),
    st.booleans(),
    st.none(),
    st.tuples(st.floats(allow_nan=False)),
)
keys = st.sampled_from(
    [f"state.p{i}.{n}" for i in range(6) for n in ("step", "exp_avg")]
    + [f"param_groups.p{i}.{n}" for i in range(6) for n in ("lr", "amsgrad")]
)


@st.composite
def flat_pairs(draw: st.DrawFn) -> tuple[dict, dict]:
    r = draw(st.dictionaries(keys, values, max_size=24))
    c: dict = {}
    for k in draw(st.permutations(list(r))) if draw(st.booleans()) else list(r):
        choice = draw(st.sampled_from(["new-value", "drop", "share"]))
        if choice == "new-value":
            c[k] = draw(values)
        elif choice == "share":
            c[k] = r[k]
    for k in draw(st.lists(keys, max_size=4)):
        c.setdefault(k, draw(values))
    return c, r


@given(flat_pairs())
def test_diff_matches_the_model(pair):
    c, r = pair
    missing, unexpected, mismatched = model(c, r)
    d = dm.diff(c, r)
    assert list(d.missing) == missing
    assert list(d.unexpected) == unexpected
    assert list(d.mismatched_keys) == mismatched


@given(flat_pairs(), st.booleans())
def test_merge_matches_the_model(pair, drop):
    c, r = pair
    snaps = Snapshot(c), Snapshot(r)
    policy = MERGING.replace(drop_unexpected=drop, missing="ignore", unexpected="ignore")
    out, d, _ = dm.merge_with_diff(c, r, policy=policy)
    missing, unexpected, mismatched = model(c, r)
    assert (list(d.missing), list(d.unexpected), list(d.mismatched_keys)) == (
        missing,
        unexpected,
        mismatched,
    )
    expected = {**r, **c}
    for k in unexpected if drop else ():
        del expected[k]
    for k in mismatched:
        if d.mismatched[mismatched.index(k)].shape_differs:
            expected[k] = r[k]
    assert list(out) == list(expected)
    assert all(out[k] is v for k, v in expected.items() if not k.startswith("param_groups."))
    assert all(s.unchanged() for s in snaps)


def test_missing_hyperparameters_with_shared_singleton_values_are_found():
    # every value is a shared singleton, so identity says nothing: the lookups decide
    r = {"state.a.step": torch.zeros(()), "param_groups.a.amsgrad": False, "param_groups.b.x": None}
    c = {"state.a.step": torch.zeros(()), "param_groups.a.amsgrad": False}
    assert dm.diff(c, r).missing == ("param_groups.b.x",)
    assert dm.merge(c, r)["param_groups.b.x"] is None


def test_the_same_tensor_on_both_sides_is_not_missing():
    t = torch.zeros(2)
    r = {"a": t, "b": torch.zeros(3)}
    d = dm.diff({"a": t}, r)
    assert d.missing == ("b",)
    assert dm.diff(r, r) == dm.KeyDiff()


def test_a_scalar_where_the_reference_has_a_tensor_is_not_a_mismatch():
    d = dm.diff({"state.w.step": 3.0}, {"state.w.step": torch.zeros(())})
    assert d == dm.KeyDiff()
