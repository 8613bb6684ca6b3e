"""The laws of merge, diff and flatten, on state dicts from dsdmerge.strategies."""

from __future__ import annotations

import contextlib
import warnings

import pytest
from conftest import Snapshot, leaves, same_tree
from hypothesis import given
from hypothesis import strategies as st

import dsdmerge as dm
from dsdmerge.strategies import checkpoint_pairs, flat_state_dicts, nested_state_dicts

# Shape mismatches raise under every built-in policy; the laws are about what merges.
MERGING = dm.DEFAULT.replace(shape="ignore")

pairs = st.one_of(
    checkpoint_pairs(layout="flat"),
    checkpoint_pairs(layout="nested"),
    checkpoint_pairs(layout="nested", keyed="id"),
    checkpoint_pairs(layout="flat", kind="model"),
    checkpoint_pairs(layout="nested", kind="model"),
)
no_mismatch_pairs = st.one_of(
    checkpoint_pairs(layout="flat", max_mismatched=0),
    checkpoint_pairs(layout="nested", max_mismatched=0),
    checkpoint_pairs(layout="nested", keyed="id", max_mismatched=0),
)


@given(no_mismatch_pairs)
def test_idempotence(pair):
    c, r = pair
    once = dm.merge(c, r)
    assert same_tree(dm.merge(once, r), once)


@given(no_mismatch_pairs)
def test_checkpoint_precedence_every_checkpoint_leaf_is_kept_by_identity(pair):
    c, r = pair
    out = dm.merge(c, r)
    kept = {id(x) for x in leaves(out)}
    assert all(id(x) in kept for x in leaves(c))
    flat_c, flat_out = dm.flatten(c), dm.flatten(out)
    backfilled_groups = {k for k in flat_out if k not in flat_c and k.startswith("param_groups.")}
    assert all(flat_out[k] is v for k, v in flat_c.items())
    assert backfilled_groups <= set(dm.diff(c, r).missing)


@given(pairs)
def test_completeness_result_keys_are_the_union(pair):
    c, r = pair
    out = dm.merge(c, r, policy=MERGING)
    assert set(dm.flatten(out)) == set(dm.flatten(c)) | set(dm.flatten(r))


@given(pairs, st.sampled_from(["default", "warn", MERGING]))
def test_purity_inputs_are_unchanged_deeply(pair, policy):
    c, r = pair
    snaps = Snapshot(c), Snapshot(r)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with contextlib.suppress(dm.MergeError):
            dm.merge(c, r, policy=policy)
        dm.diff(c, r)
        dm.flatten(c)
    assert all(s.unchanged() for s in snaps)


@given(pairs)
def test_layout_preservation(pair):
    c, r = pair
    assert dm.classify(dm.merge(c, r, policy=MERGING)) is dm.classify(c)


@given(
    st.one_of(
        nested_state_dicts(), nested_state_dicts(keyed="id"), nested_state_dicts(kind="checkpoint")
    )
)
def test_flatten_round_trip_with_like(x):
    assert same_tree(dm.unflatten(dm.flatten(x), like=x), x)


@given(flat_state_dicts())
def test_unflatten_round_trip_without_like_on_dsd_flat_dicts(flat):
    back = dm.flatten(dm.unflatten(flat))
    assert back.keys() == flat.keys()
    assert all(back[k] is v for k, v in flat.items())


@given(pairs)
def test_merge_commutes_with_flatten(pair):
    c, r = pair
    via_nested = dm.flatten(dm.merge(c, r, policy=MERGING))
    via_flat = dm.merge(dm.flatten(c), dm.flatten(r), policy=MERGING)
    assert via_nested.keys() == via_flat.keys()
    assert all(via_nested[k] is via_flat[k] for k in via_flat)


@given(pairs)
def test_diff_is_the_same_whatever_the_layout(pair):
    c, r = pair
    assert dm.diff(c, r) == dm.diff(dm.flatten(c), dm.flatten(r))
    assert dm.merge_with_diff(c, r, policy=MERGING).diff == dm.diff(c, r)


@given(pairs)
def test_diff_symmetry(pair):
    c, r = pair
    forward, backward = dm.diff(c, r), dm.diff(r, c)
    assert set(forward.missing) == set(backward.unexpected)
    assert set(forward.unexpected) == set(backward.missing)
    assert set(forward.mismatched_keys) == set(backward.mismatched_keys)


@given(
    pairs,
    st.lists(
        st.sampled_from(["state.*", "param_groups.*", "*.indexer.*", "*.weight*", "model.*"]),
        max_size=2,
    ),
)
def test_strict_raises_iff_a_not_allowed_difference_exists(pair, globs):
    c, r = pair
    d = dm.diff(c, r)
    policy = dm.STRICT.replace(allow_missing=globs, allow_unexpected=globs, conflict="ignore")
    bad = (
        any(not policy.allows_missing(k) for k in d.missing)
        or any(not policy.allows_unexpected(k) for k in d.unexpected)
        or bool(d.mismatched)
    )
    if bad:
        with pytest.raises(dm.MergeError):
            dm.merge(c, r, policy=policy)
    else:
        dm.merge(c, r, policy=policy)


@given(checkpoint_pairs(layout="flat", max_mismatched=0, max_unexpected=0))
def test_backfilled_hyperparameters_are_group_consistent(pair):
    c, r = pair
    out = dm.merge(c, r)
    nested = dm.unflatten(out)  # raises if members of a group disagree
    by_fqn = {p: g for g in nested["param_groups"] for p in g["params"]}
    for key in dm.diff(c, r).missing:
        if key.startswith("param_groups."):
            fqn, _, name = key[len("param_groups.") :].rpartition(".")
            assert by_fqn[fqn][name] == out[key]
