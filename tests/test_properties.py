"""The laws of merge, diff and flatten, on state dicts from the public dsdmerge.strategies.

Profiles (tests/conftest.py): ``dev`` (default) runs each law on 60 examples,
``HYPOTHESIS_PROFILE=fuzz`` on 10,000.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
from conftest import Snapshot, leaves, same_tree
from hypothesis import given
from hypothesis import strategies as st

import dsdmerge as dm
from dsdmerge.merge import reshaped
from dsdmerge.report import format_keys
from dsdmerge.strategies import (
    checkpoint_pairs,
    flat_state_dicts,
    model_state_dicts,
    nested_state_dicts,
    optimizer_state_dicts,
)

# Shape mismatches raise under every built-in policy; most laws are about what merges.
MERGING = dm.DEFAULT.replace(shape="ignore", unrelated="ignore")


def _pairs(**kw):
    return st.one_of(
        checkpoint_pairs(layout="flat", **kw),
        checkpoint_pairs(layout="nested", **kw),
        checkpoint_pairs(layout="nested", keyed="id", **kw, max_unexpected=0),
        checkpoint_pairs(layout="flat", kind="model", **kw),
        checkpoint_pairs(layout="nested", kind="model", **kw),
        checkpoint_pairs(layout="nested", allow_meta=True, allow_new_hyperparameters=True, **kw),
        checkpoint_pairs(layout="flat", allow_meta=True, allow_new_hyperparameters=True, **kw),
    )


pairs = _pairs()
nested = st.one_of(
    nested_state_dicts(),
    nested_state_dicts(keyed="id"),
    nested_state_dicts(kind="checkpoint", allow_meta=True),
    nested_state_dicts(kind="model"),
)
globs = st.lists(
    st.sampled_from(["state.*", "param_groups.*", "*.indexer.*", "*.weight*", "model.*", "*.lr"]),
    max_size=2,
)


def flat(sd):
    return dm.flatten(sd)


def _shape_taken(merged):
    return {m.key for m in merged.diff.mismatched if reshaped(m)}


# -- merge -----------------------------------------------------------------------------


@given(pairs, st.booleans())
def test_idempotence(pair, drop):
    c, r = pair
    policy = MERGING.replace(drop_unexpected=drop)
    once = dm.merge(c, r, policy=policy)
    assert same_tree(dm.merge(once, r, policy=policy), once)


@given(pairs)
def test_merging_a_state_dict_over_itself_gives_it_back(pair):
    for sd in pair:
        out = dm.merge(sd, sd, policy="strict")
        assert same_tree(out, sd)
        assert out is not sd


def _pg_split(key):
    """``(optimizer prefix, param id, hyperparameter)`` of a ``param_groups.*`` key, or None."""
    at = 0 if key.startswith("param_groups.") else key.find(".param_groups.") + 1
    if at == 0 and not key.startswith("param_groups."):
        return None
    head = key[: at + len("param_groups.")]
    pid, _, name = key[len(head) :].rpartition(".")
    return head, pid, name


def _dead_params(c, r):
    """Param ids listed in ``c``'s nested param groups that no group of ``r`` lists."""

    def ids(sd):
        found = []
        stack = [sd]
        while stack:
            node = stack.pop()
            if dm.is_optimizer_state_dict(node):
                found.extend(p for g in node["param_groups"] for p in g["params"])
            elif isinstance(node, dict):
                stack.extend(v for v in node.values() if isinstance(v, dict))
        return found

    have = set(ids(r))
    return [p for p in ids(c) if p not in have]


def _regrouped(out, fc, fr):
    """Checkpoint hyperparameter keys a nested merge regroups: a parameter the reference no
    longer has is in no group (its key is gone), and a parameter the reference moved to
    another group takes that group's value (one a checkpoint member holds for the name)."""
    r_pids = {(p[0], p[1]) for p in map(_pg_split, fr) if p}
    by_name = {}
    for key, value in fc.items():
        parts = _pg_split(key)
        if parts:
            by_name.setdefault((parts[0], parts[2]), set()).add(id(value))
    found = set()
    for key, value in fc.items():
        parts = _pg_split(key)
        if not parts:
            continue
        if key not in out:
            if (parts[0], parts[1]) not in r_pids:
                found.add(key)
        elif out[key] is not value and id(out[key]) in by_name[parts[0], parts[2]]:
            found.add(key)
    return found


@given(pairs)
def test_checkpoint_precedence_by_identity(pair):
    c, r = pair
    merged = dm.merge_with_diff(c, r, policy=MERGING)
    out, fc, fr = flat(merged.state_dict), flat(c), flat(r)
    taken = _shape_taken(merged)
    regrouped = _regrouped(out, fc, fr) if dm.classify(c) == "nested" else set()
    # every checkpoint value is kept, the very object, unless torch would reject its shape
    # (or, nested, the reference regrouped its parameter)
    assert all(out[k] is v for k, v in fc.items() if k not in taken | regrouped)
    assert all(out[k] is fr[k] for k in taken)
    # everything else comes from the reference, the very object (hyperparameters: see below)
    assert all(out[k] is fr[k] for k in fr.keys() - fc.keys() if not k.startswith("param_groups."))
    # and every checkpoint leaf is somewhere in the result (but the name of a parameter the
    # reference no longer has, in a params list, and what a regrouped one held)
    kept = {id(x) for x in leaves(merged.state_dict)}
    gone = {id(fc[k]) for k in taken | regrouped} | {id(p) for p in _dead_params(c, r)}
    assert all(id(x) in kept for x in leaves(c) if id(x) not in gone)


def _group_filled(out, fc, fr):
    """Keys of ``out`` in neither input: hyperparameters a kept unexpected parameter takes
    from its nested group (one value per group), which the reference added to the group."""
    extra = out.keys() - fc.keys() - fr.keys()
    unexpected = _hyperparameters(fc).keys() - _hyperparameters(fr).keys()
    for key in extra:
        assert key.startswith("param_groups."), key
        assert key[len("param_groups.") :].rpartition(".")[0] in unexpected, key
    return extra


@given(pairs, st.booleans())
def test_completeness(pair, drop):
    c, r = pair
    out = dm.merge(c, r, policy=MERGING.replace(drop_unexpected=drop))
    fo, fc, fr = flat(out), flat(c), flat(r)
    expected = set(fr) if drop else set(fc) | set(fr)
    extra = _group_filled(fo, fc, fr)
    regrouped = _regrouped(fo, fc, fr) if dm.classify(c) == "nested" else set()
    assert set(fo) - extra == expected - {k for k in regrouped if k not in fo}
    assert not extra or dm.classify(out) == "nested"


@given(pairs, st.sampled_from(["default", "warn", "strict", MERGING]))
def test_deep_purity(pair, policy):
    c, r = pair
    snaps = Snapshot(c), Snapshot(r)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with contextlib.suppress(dm.MergeError):
            dm.merge(c, r, policy=policy)
        with contextlib.suppress(dm.MergeError):
            dm.merge_with_diff(c, r, policy=policy)
        with contextlib.suppress(dm.MergeError):
            dm.check(c, r, policy=policy)
        dm.diff(c, r)
        dm.classify(c)
        fc = dm.flatten(c)
        with contextlib.suppress(dm.LayoutError):  # c may have params r has no place for
            dm.unflatten(fc, like=r if dm.classify(r) == "nested" else None)
        if dm.classify(c) == "nested":
            dm.unflatten(fc, like=c)
    assert all(s.unchanged() for s in snaps)


@given(pairs)
def test_results_share_no_container_with_the_inputs(pair):
    c, r = pair
    out = dm.merge(c, r, policy=MERGING)
    ids_in = {id(node) for sd in pair for node in _containers(sd)}
    assert not ids_in & {id(node) for node in _containers(out)}


def _containers(tree):
    stack, out = [tree], []
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            out.append(node)
            stack.extend(node.values())
        elif isinstance(node, list):
            out.append(node)
            stack.extend(node)
    return out


@given(pairs)
def test_layout_preservation(pair):
    c, r = pair
    assert dm.classify(dm.merge(c, r, policy=MERGING)) is dm.classify(c)


@given(
    st.one_of(checkpoint_pairs(layout="flat"), checkpoint_pairs(layout="flat", kind="model")),
    st.booleans(),
)
def test_a_flat_merge_keeps_the_checkpoints_key_order_then_appends_backfills(pair, drop):
    c, r = pair
    out = dm.merge(c, r, policy=MERGING.replace(drop_unexpected=drop))
    kept = [k for k in c if k in r or not drop]
    assert list(out) == kept + [k for k in r if k not in c]


@given(pairs)
def test_merge_commutes_with_flatten(pair):
    c, r = pair
    via_nested = flat(dm.merge(c, r, policy=MERGING))
    via_flat = dm.merge(flat(c), flat(r), policy=MERGING)
    # a nested merge knows true group membership: it regroups what the reference moved or
    # dropped (a flat one cannot tell and keeps the checkpoint's values)
    regrouped = _regrouped(via_nested, flat(c), flat(r)) if dm.classify(c) == "nested" else set()
    assert via_nested.keys() - _group_filled(via_nested, flat(c), flat(r)) == via_flat.keys() - {
        k for k in regrouped if k not in via_nested
    }
    assert all(via_nested[k] is via_flat[k] for k in via_flat if k not in regrouped)


@given(pairs)
def test_a_flat_checkpoint_merges_over_a_nested_reference_like_over_its_flat_form(pair):
    c, r = pair
    assert dm.merge(flat(c), r, policy=MERGING) == dm.merge(flat(c), flat(r), policy=MERGING)


def _hyperparameters(f):
    """{param id: {name: value}} from the param_groups.* keys of a flat dict, in key order."""
    out = {}
    for key, value in f.items():
        if key.startswith("param_groups."):
            pid, _, name = key[len("param_groups.") :].rpartition(".")
            out.setdefault(pid, {})[name] = value
    return out


@given(pairs)
def test_backfilled_hyperparameters_are_the_checkpoints_for_that_group(pair):
    """A new parameter takes the checkpoint's (scheduled) hyperparameters of its group.

    That is, the value the checkpoint has for the first member of the parameter's
    reference group that the checkpoint has; the reference's value only when the
    checkpoint has no member of the group. The oracle is independent of
    dsdmerge: the strategies give each group its own weight decay, on both sides,
    so a parameter's group is its weight decay.
    """
    c, r = pair
    out, fc = flat(dm.merge(c, r, policy=MERGING)), flat(c)
    ref = _hyperparameters(flat(r))
    for pid, values in ref.items():
        group = [m for m, v in ref.items() if v["weight_decay"] == values["weight_decay"]]
        for name, ref_value in values.items():
            from_group = (fc.get(f"param_groups.{m}.{name}", dm) for m in group)
            expected = next((v for v in from_group if v is not dm), ref_value)
            key = f"param_groups.{pid}.{name}"
            assert out[key] is fc.get(key, expected), key


# -- diff ------------------------------------------------------------------------------


@given(pairs)
def test_diff_symmetry(pair):
    c, r = pair
    forward, backward = dm.diff(c, r), dm.diff(r, c)
    assert forward.missing == backward.unexpected
    assert forward.unexpected == backward.missing
    assert forward.mismatched_keys == backward.mismatched_keys
    for m, n in zip(forward.mismatched, backward.mismatched, strict=True):
        assert (m.checkpoint, m.reference) == (n.reference, n.checkpoint)


@given(pairs)
def test_diff_is_the_same_whatever_the_layout_and_whichever_function(pair):
    c, r = pair
    d = dm.diff(c, r)
    assert d == dm.diff(flat(c), flat(r))
    assert d == dm.diff(flat(c), r)
    assert dm.merge_with_diff(c, r, policy=MERGING).diff == d
    assert dm.check(c, r, policy=MERGING) == d


@given(pairs)
def test_diff_names_exactly_the_keys_that_differ(pair):
    c, r = pair
    d, fc, fr = dm.diff(c, r), flat(c), flat(r)
    assert set(d.missing) == fr.keys() - fc.keys()
    assert set(d.unexpected) == fc.keys() - fr.keys()
    tensors = {k for k in fc.keys() & fr.keys() if hasattr(fc[k], "shape")}
    differ = {k for k in tensors if (fc[k].shape, fc[k].dtype) != (fr[k].shape, fr[k].dtype)}
    assert set(d.mismatched_keys) == differ
    assert len(d.missing) == len(set(d.missing))  # and each once


# -- policies ----------------------------------------------------------------------------


def _not_allowed(d, policy):
    return (
        [k for k in d.missing if not policy.allows_missing(k)],
        [k for k in d.unexpected if not policy.allows_unexpected(k)],
    )


@given(pairs, globs)
def test_strict_raises_iff_a_not_allowed_difference_exists(pair, allow):
    c, r = pair
    d = dm.diff(c, r)
    policy = dm.STRICT.replace(allow_missing=allow, allow_unexpected=allow)
    missing, unexpected = _not_allowed(d, policy)
    if missing or unexpected or d.mismatched:
        for call in (dm.merge, dm.check):
            with pytest.raises(dm.MergeError) as info:
                call(c, r, policy=policy)
            assert info.value.diff == d
            text = str(info.value)
            # the not-allowed keys, compressed into exact patterns, and nothing allowed
            assert all(format_keys(keys) in text for keys in (missing, unexpected) if keys)
    else:
        assert same_tree(dm.merge(c, r, policy=policy), dm.merge(c, r))
        assert dm.check(c, r, policy=policy) == d


@given(_pairs(max_mismatched=0), globs)
def test_warn_warns_iff_default_would_backfill_or_keep_something_not_allowed(pair, allow):
    c, r = pair
    d = dm.diff(c, r)
    policy = dm.WARN.replace(allow_missing=allow, allow_unexpected=allow)
    missing, unexpected = _not_allowed(d, policy)
    dtype = [m for m in d.mismatched if m.dtype_differs]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = dm.merge(c, r, policy=policy)
    texts = [str(w.message) for w in caught if issubclass(w.category, dm.DSDMergeWarning)]
    assert len(texts) == len(caught)
    assert any("missing from the checkpoint" in t for t in texts) == bool(missing)
    assert any("unexpected in the checkpoint" in t for t in texts) == bool(unexpected)
    assert any("dtype differs" in t for t in texts) == bool(dtype)
    assert len(texts) == bool(missing) + bool(unexpected) + bool(dtype)  # one per kind
    assert same_tree(out, dm.merge(c, r))  # and it merges exactly as the default does


@given(pairs)
def test_no_hyperparameter_conflicts_in_consistent_checkpoints(pair):
    c, r = pair
    assert dm.merge_with_diff(c, r, policy=MERGING.replace(conflict="raise")).conflicts == ()


# -- flatten / unflatten -------------------------------------------------------------------


@given(nested)
def test_flatten_round_trip_with_like(sd):
    assert same_tree(dm.unflatten(dm.flatten(sd), like=sd), sd)


@given(st.one_of(flat_state_dicts(), flat_state_dicts(allow_meta=True)))
def test_unflatten_round_trip_without_like_on_dsd_flat_dicts(f):
    back = dm.flatten(dm.unflatten(f))
    assert back.keys() == f.keys()
    assert all(back[k] is v for k, v in f.items())


@given(st.one_of(optimizer_state_dicts(keyed="id"), optimizer_state_dicts()))
def test_unflatten_of_a_flat_optimizer_dict_loads_where_the_nested_one_would(osd):
    # like= restores int ids and group membership exactly
    assert same_tree(dm.unflatten(dm.flatten(osd), like=osd), osd)
    assert dm.classify(dm.flatten(osd)) is dm.Layout.FLAT


@given(st.one_of(flat_state_dicts(kind="model"), model_state_dicts(allow_meta=True)))
def test_flat_state_dicts_flatten_to_themselves(f):
    out = dm.flatten(f)
    assert out == f
    assert out is not f
    assert all(out[k] is v for k, v in f.items())
