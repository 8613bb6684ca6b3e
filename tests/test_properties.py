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
from dsdmerge._verdict import reshaped
from dsdmerge.report import format_keys
from dsdmerge.strategies import (
    checkpoint_pairs,
    flat_state_dicts,
    model_state_dicts,
    nested_state_dicts,
    optimizer_state_dicts,
)

# Shape mismatches raise under every built-in policy; most laws are about what merges (and
# what merges does not depend on the conflict action: it only says whether to warn or raise).
MERGING = dm.DEFAULT.replace(shape="ignore", unrelated="ignore", conflict="ignore")


# What real optimizers and trainers do: a reference lacking state fields, heavyball's
# top-level key, MADGRAD's state['k'], parameters moved to another group.
FEATURES = {"allow_missing_fields": True, "allow_extra_keys": True, "allow_optimizer_entries": True}


def _featured(**kw):
    """Pairs with every opt-in feature, moved parameters among them (flat too: a flat merge
    settles the groups they make disagree, test_a_flat_merge_settles_groups_...)."""
    return st.one_of(
        checkpoint_pairs(layout="nested", **FEATURES, max_moved=2, **kw),
        checkpoint_pairs(layout="nested", keyed="id", **FEATURES, **kw, max_unexpected=0),
        checkpoint_pairs(layout="flat", **FEATURES, **kw),
        checkpoint_pairs(layout="flat", **FEATURES, max_moved=2, **kw),
        checkpoint_pairs(
            layout="nested",
            allow_meta=True,
            allow_new_hyperparameters=True,
            **FEATURES,
            max_moved=2,
            **kw,
        ),
    )


def _pairs(**kw):
    return st.one_of(
        checkpoint_pairs(layout="flat", **kw),
        checkpoint_pairs(layout="nested", **kw),
        checkpoint_pairs(layout="nested", keyed="id", **kw, max_unexpected=0),
        checkpoint_pairs(layout="flat", kind="model", **kw),
        checkpoint_pairs(layout="nested", kind="model", **kw),
        checkpoint_pairs(layout="nested", allow_meta=True, allow_new_hyperparameters=True, **kw),
        checkpoint_pairs(layout="flat", allow_meta=True, allow_new_hyperparameters=True, **kw),
        _featured(**kw),
    )


pairs = _pairs()
LEVELS = {"allow_extra_keys": True, "allow_optimizer_entries": True}
nested = st.one_of(
    nested_state_dicts(),
    nested_state_dicts(keyed="id"),
    nested_state_dicts(kind="checkpoint", allow_meta=True),
    nested_state_dicts(kind="model"),
    nested_state_dicts(**LEVELS),
    nested_state_dicts(keyed="id", **LEVELS),
    nested_state_dicts(kind="checkpoint", **LEVELS),
)
globs = st.lists(
    st.sampled_from(["state.*", "param_groups.*", "*.indexer.*", "*.weight*", "model.*", "*.lr"]),
    max_size=2,
)


def flat(sd):
    return dm.flatten(sd)


def _shape_taken(merged):
    return {m.key for m in merged.diff.mismatched if reshaped(m)}


# -- an oracle for param groups, independent of dsdmerge -------------------------------------
# The strategies give every param group its own weight decay, the same on both sides, so a
# parameter's weight decay names its group in either state dict, flat or nested; a moved
# parameter has one weight decay in the checkpoint and another in the reference.


def _hyperparameters(f):
    """{param id: {name: value}} from the param_groups.* keys of a flat dict, in key order."""
    out = {}
    for key, value in f.items():
        if key.startswith("param_groups."):
            pid, _, name = key[len("param_groups.") :].rpartition(".")
            out.setdefault(pid, {})[name] = value
    return out


def _groups(hyper):
    """{weight decay: member ids in order} (the members of one group are written together)."""
    out = {}
    for pid, values in hyper.items():
        out.setdefault(values["weight_decay"], []).append(pid)
    return out


def _home(members, chk, decay=None):
    """The weight decay of the checkpoint group of ``members`` (a reference group, in order,
    whose own weight decay is ``decay``): the checkpoint group with the same weight decay (at
    the same position: the strategies give both sides the same group order) when some member
    is in it, else the one most of them are in (the first on a tie); None when the checkpoint
    has none of them."""
    if decay is not None and any(chk.get(p, {}).get("weight_decay") == decay for p in members):
        return decay
    counts = {}
    for pid in members:
        if pid in chk:
            decay = chk[pid]["weight_decay"]
            counts[decay] = counts.get(decay, 0) + 1
    return max(counts, key=counts.get, default=None)  # max keeps the first of equal counts


def _mixed(fc, fr):
    """Reference groups whose checkpoint members come from more than one checkpoint group."""
    chk = _hyperparameters(fc)
    return [
        decay
        for decay, members in _groups(_hyperparameters(fr)).items()
        if len({chk[m]["weight_decay"] for m in members if m in chk}) > 1
    ]


def _moved(fc, fr):
    """Parameters whose group (weight decay) differs between checkpoint and reference."""
    chk, ref = _hyperparameters(fc), _hyperparameters(fr)
    return [p for p in ref if p in chk and chk[p]["weight_decay"] != ref[p]["weight_decay"]]


_NONE = object()  # no value (the oracle's own sentinel)


def _same(a, b):
    """Equal values of one type (the strategies' hyperparameters are plain: floats, tuples, ...)."""
    return type(a) is type(b) and a == b


def _first_of_most(values):
    """The value most of ``values`` hold (the first of them on a tie), ``_NONE`` if none."""
    kinds = []  # [value, count], in order of first appearance
    for v in values:
        for kind in kinds:
            if _same(kind[0], v):
                kind[1] += 1
                break
        else:
            kinds.append([v, 1])
    best = max((n for _, n in kinds), default=0)
    return next((v for v, n in kinds if n == best), _NONE)


def _flat_groups(fc, fr, *, inferred):
    """What a flat merge gives each reference hyperparameter key, and the disagreeing groups.

    The rule of dsdmerge._groups restated on the strategies' data (a group is named by its
    weight decay in the reference, flat or nested): for each group and hyperparameter, the
    checkpoint values of its members (in the reference's order). When they agree, members
    without one take it. When they disagree, rounds until nothing changes, each on the values
    the rounds before wrote: a member "moved in" if every value it holds is another group's
    usual value (the one its members agree on, else the one most of them hold); the group
    takes the value most members hold, leaving out values only moved members hold, the first
    on a tie; members without a value take it, and so does every member holding another one
    (with inferred groups, only moved ones). Returns ({key: expected value}, [(weight decay,
    name) that disagree]).
    """
    chk, ref = _hyperparameters(fc), _hyperparameters(fr)
    groups = _groups(ref)
    names = {d: list(ref[members[0]]) for d, members in groups.items()}
    held = {
        (d, n): [chk.get(m, {}).get(n, _NONE) for m in members]
        for d, members in groups.items()
        for n in names[d]
    }

    def agreement(values):
        present = [v for v in values if v is not _NONE]
        if not present:
            return _NONE
        return present[0] if all(_same(present[0], v) for v in present) else "disagree"

    def torn(v):
        return isinstance(v, str) and v == "disagree"

    agreed = {place: agreement(values) for place, values in held.items()}
    disagree = [place for place, v in agreed.items() if torn(v)]
    work = {place: list(values) for place, values in held.items()}
    for place, v in agreed.items():  # backfilled as the merge does
        if not torn(v) and v is not _NONE:
            work[place] = [v if x is _NONE else x for x in work[place]]
    for _ in range(2 * len(groups) + 2):
        usual = {d: {} for d in groups}
        for (d, n), values in work.items():
            now = agreement(values)
            if torn(now):
                usual[d][n] = _first_of_most([v for v in values if v is not _NONE])
            elif now is not _NONE:
                usual[d][n] = now
        writes = []
        for d, n in disagree:
            values = work[d, n]
            if not torn(agreement(values)):
                value = agreement(values)
                writes.append(((d, n), [at for at, v in enumerate(values) if v is _NONE], value))
                continue

            def moved(at, d=d, usual=usual):
                row = [(x, work[d, x][at]) for x in names[d] if work[d, x][at] is not _NONE]
                return bool(row) and any(
                    all(x in usual[e] and _same(usual[e][x], v) for x, v in row)
                    for e in groups
                    if e != d
                )

            kinds = []  # [value, holders]
            for at, v in enumerate(values):
                if v is not _NONE:
                    kind = next((k for k in kinds if _same(k[0], v)), None)
                    if kind is None:
                        kinds.append(kind := [v, []])
                    kind[1].append(at)
            pool = [k for k in kinds if not all(map(moved, k[1]))] or kinds
            best = max(len(k[1]) for k in pool)
            value = next(k[0] for k in pool if len(k[1]) == best)
            ats = [at for at, v in enumerate(values) if v is _NONE]
            ats += [
                at for k in kinds if k[0] is not value for at in k[1] if not inferred or moved(at)
            ]
            writes.append(((d, n), ats, value))
        changed = False
        for place, ats, value in writes:
            for at in ats:
                if work[place][at] is not value:
                    work[place][at] = value
                    changed = True
        if not changed:
            break
    expected = {}
    for d, n in held:
        for m, now in zip(groups[d], work[d, n], strict=True):
            key = f"param_groups.{m}.{n}"
            expected[key] = fr[key] if now is _NONE else now
    return expected, disagree


# -- merge -----------------------------------------------------------------------------


@given(pairs, st.booleans())
def test_idempotence(pair, drop):
    c, r = pair
    policy = MERGING.replace(drop_unexpected=drop)
    once = dm.merge(c, r, policy=policy)
    assert same_tree(dm.merge(once, r, policy=policy), once)


@given(pairs, st.sampled_from(["ignore", "warn"]), st.booleans())
def test_what_a_merge_returns_does_not_depend_on_the_conflict_action(pair, action, strict):
    """The conflict action says whether to go on quietly, warn or raise; the groups are
    settled the same way whatever it says (and strict, when it accepts, merges the same)."""
    c, r = pair
    quiet = dm.merge(c, r, policy=MERGING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = dm.merge(c, r, policy=MERGING.replace(conflict=action))
        assert same_tree(out, quiet)
        if strict:
            everything = dm.STRICT.replace(allow_missing="*", allow_unexpected="*", shape="ignore")
            with contextlib.suppress(dm.MergeError):  # (refused: members disagree)
                assert same_tree(dm.merge(c, r, policy=everything.replace(dtype="ignore")), quiet)


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
    if dm.classify(c) == "nested":
        regrouped = _regrouped(out, fc, fr)
    else:  # a flat merge settles groups whose members disagree (a moved parameter among them)
        expected, _ = _flat_groups(fc, fr, inferred=dm.classify(r) == "flat")
        regrouped = {k for k in fc if k in expected and expected[k] is not fc[k]}
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
    # dropped; a flat one settles groups whose members disagree by their values (see
    # _flat_groups): the two may differ there, and only there
    regrouped = _regrouped(via_nested, flat(c), flat(r)) if dm.classify(c) == "nested" else set()
    _, disagree = _flat_groups(flat(c), flat(r), inferred=True)
    groups = _groups(_hyperparameters(flat(r)))
    regrouped |= {f"param_groups.{m}.{n}" for d, n in disagree for m in groups[d]}
    assert via_nested.keys() - _group_filled(via_nested, flat(c), flat(r)) == via_flat.keys() - {
        k for k in regrouped if k not in via_nested
    }
    assert all(via_nested[k] is via_flat[k] for k in via_flat if k not in regrouped)


@given(pairs)
def test_a_flat_checkpoint_merges_over_a_nested_reference_like_over_its_flat_form(pair):
    c, r = pair
    over_nested = dm.merge(flat(c), r, policy=MERGING)
    over_flat = dm.merge(flat(c), flat(r), policy=MERGING)
    # the true groups settle members that disagree, where inferred ones keep them (but moved
    # ones): the two differ there, and only there
    given, _ = _flat_groups(flat(c), flat(r), inferred=dm.classify(r) == "flat")
    inferred, _ = _flat_groups(flat(c), flat(r), inferred=True)
    differ = {k for k in given if given[k] is not inferred[k]}
    assert over_nested.keys() == over_flat.keys()
    assert all(over_nested[k] is over_flat[k] for k in over_flat if k not in differ)
    assert all(over_nested[k] is given[k] and over_flat[k] is inferred[k] for k in differ)


@given(
    checkpoint_pairs(
        layout="nested", **FEATURES, min_moved=1, max_moved=2, min_missing=1, max_mismatched=0
    ),
    st.sampled_from(["default", "warn", "strict"]),
    st.booleans(),
)
def test_a_flat_merge_settles_groups_that_disagree_and_says_so(pair, policy, nested_reference):
    """Flat over flat (groups inferred from equal reference values) or over a nested reference
    (the true groups), with moved and new parameters: every group whose checkpoint members
    disagree is settled (see _flat_groups) and reported, one line per group and
    hyperparameter naming every value held: a warning under default and warn, an error under
    strict (where everything else is allowed), whose merge then changes nothing."""
    c, r = pair
    fc, fr = flat(c), flat(r)
    ref = r if nested_reference else fr
    expected, disagree = _flat_groups(fc, fr, inferred=not nested_reference)
    if policy == "strict":  # everything else allowed: only the disagreement is left to refuse
        policy = dm.STRICT.replace(allow_missing="*", allow_unexpected="*")
        if disagree:
            with pytest.raises(dm.MergeError, match="disagree on") as info:
                dm.merge(fc, ref, policy=policy)
            assert len(info.value.problems) == 1
            return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        merged = dm.merge_with_diff(fc, ref, policy=policy)
    lines = merged.conflicts
    assert len(lines) == len(disagree)
    for line, (_, name) in zip(lines, disagree, strict=True):
        assert f"disagree on {name!r}" in line
        held = {repr(v) for k, v in fc.items() if k.endswith(f".{name}")}
        assert any(h in line for h in held)
    assert any("disagree on" in str(w.message) for w in caught) == bool(disagree)
    out = merged.state_dict
    assert all(out[k] is v for k, v in expected.items()), [
        k for k, v in expected.items() if out[k] is not v
    ]


@given(pairs)
def test_backfilled_hyperparameters_are_the_checkpoints_for_that_group(pair):
    """A new parameter takes the checkpoint's (scheduled) hyperparameters of its group.

    Flat: the value the checkpoint has for the first member of the parameter's
    reference group that the checkpoint has; the reference's value only when the
    checkpoint has no member of the group. Nested, where the true groups are
    known: every member of a reference group, new, moved or not, takes the values
    of its checkpoint group (the one at its position when some member comes from it,
    else the one most members come from); the reference's where that group lacks one.
    The oracle is independent of dsdmerge (see _groups).
    """
    c, r = pair
    out, fc = flat(dm.merge(c, r, policy=MERGING)), flat(c)
    ref, chk = _hyperparameters(flat(r)), _hyperparameters(fc)
    nested = dm.classify(c) == "nested"
    if not nested:  # groups settled by their values (see _flat_groups)
        expected, _ = _flat_groups(fc, flat(r), inferred=dm.classify(r) == "flat")
        assert all(out[k] is v for k, v in expected.items())
        return
    checkpoint_groups = _groups(chk)
    for decay, members in _groups(ref).items():
        home = _home(members, chk, decay) if nested else None
        source = checkpoint_groups[home] if home is not None else members
        for pid in members:
            for name, ref_value in ref[pid].items():
                from_group = (chk[m][name] for m in source if name in chk.get(m, ()))
                expected = next(from_group, ref_value)
                key = f"param_groups.{pid}.{name}"
                assert out[key] is (expected if nested else fc.get(key, expected)), key


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
    if missing or unexpected or d.mismatched or _mixed(flat(c), flat(r)):
        for call in (dm.merge, dm.check):
            with pytest.raises(dm.MergeError) as info:
                call(c, r, policy=policy)
            assert info.value.diff == d
            text = str(info.value)
            # the not-allowed keys, compressed into exact patterns, and nothing allowed
            assert all(format_keys(keys) in text for keys in (missing, unexpected) if keys)
    else:
        assert same_tree(dm.merge(c, r, policy=policy), dm.merge(c, r, policy=MERGING))
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
    mixed = bool(_mixed(flat(c), flat(r)))  # moved parameters: a conflict of hyperparameters
    assert any(" moved: " in t or "disagree" in t for t in texts) == mixed
    assert len(texts) == bool(missing) + bool(unexpected) + bool(dtype) + mixed  # one per kind
    assert same_tree(out, dm.merge(c, r, policy=MERGING))  # and merges exactly as default does


@given(pairs)
def test_hyperparameter_conflicts_iff_a_reference_group_mixes_checkpoint_groups(pair):
    """A consistent checkpoint has no conflicts, until parameters moved: then a reference group
    whose checkpoint members come from several checkpoint groups is reported (a flat merge
    sees them disagree, a nested one names the moved parameters)."""
    c, r = pair
    policy = MERGING.replace(conflict="warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        conflicts = dm.merge_with_diff(c, r, policy=policy).conflicts
    mixed = _mixed(flat(c), flat(r))
    assert bool(conflicts) == bool(mixed)
    assert len(caught) == bool(conflicts)  # all of them in one warning
    if conflicts and dm.classify(c) == "nested":
        # each line names a member of a mixed group that takes another checkpoint group's
        # hyperparameters ("moved" from the group its reference group takes after: on a tie,
        # that may be the member that stayed, see test_lose_nothing.py)
        groups = _groups(_hyperparameters(flat(r)))
        members = {m for decay in mixed for m in groups[decay]}
        assert all(any(f"{m} moved: " in line for m in members) for line in conflicts)


# -- what real optimizers and trainers do -------------------------------------------------


def _owned(f, pids):
    """The keys of a flat dict that belong to one of ``pids`` (``state.<pid>.*``,
    ``param_groups.<pid>.*``): the others are optimizer-level (``state.k``, ``heavyball.*``)."""
    prefixes = tuple(f"{head}.{p}." for p in pids for head in ("state", "param_groups"))
    return {k for k in f if k.startswith(prefixes)}


def _pids(*flats):
    return set().union(*(_hyperparameters(f).keys() for f in flats))


@given(_featured(max_mismatched=0), st.sampled_from([dm.DEFAULT, dm.WARN, MERGING]), st.booleans())
def test_optimizer_level_parts_are_kept_by_identity_and_round_trip(pair, policy, drop):
    """Keys beside state and param_groups (heavyball's) and optimizer-level state entries
    (MADGRAD's state['k']): the checkpoint's kept by identity (dropped only by drop_unexpected,
    where the reference lacks them), the reference's backfilled by identity; and every state
    dict, merged or not, comes back from flatten/unflatten with the same tree and leaves."""
    c, r = pair
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = dm.merge(c, r, policy=policy.replace(drop_unexpected=drop))
    fo, fc, fr = flat(out), flat(c), flat(r)
    pids = _pids(fc, fr)
    level_c, level_r = fc.keys() - _owned(fc, pids), fr.keys() - _owned(fr, pids)
    for key in level_c:
        assert fo[key] is fc[key] if key in fr or not drop else key not in fo
    assert all(fo[key] is fr[key] for key in level_r - level_c)
    assert fo.keys() - _owned(fo, pids) == (level_r if drop else level_c | level_r)
    for sd in (c, r, out):
        if dm.classify(sd) == "nested":
            assert same_tree(dm.unflatten(dm.flatten(sd), like=sd), sd)
        else:  # (with heavyball's keys, no DSD optimizer dict: split on dots)
            back = dm.flatten(dm.unflatten(sd))
            assert back.keys() == sd.keys()
            assert all(back[k] is v for k, v in sd.items())


@given(
    st.one_of(
        checkpoint_pairs(layout="nested", **FEATURES, max_unexpected=0),
        checkpoint_pairs(layout="nested", keyed="id", **FEATURES, max_unexpected=0),
    )
)
def test_a_flat_merge_unflattens_like_the_reference_losing_nothing(pair):
    """A flat merge (flatten_optimizer_state_dict=True) put back into the reference's nested
    structure (int ids, true groups) keeps every key and value, the checkpoint's optimizer-level
    ones the reference lacks too: placed under the optimizer (heavyball's key) or its state
    (MADGRAD's state['k']), as unflatten without like reads them."""
    c, r = pair
    merged = dm.merge(flat(c), flat(r), policy=MERGING)
    back = dm.flatten(dm.unflatten(merged, like=r))
    assert back.keys() == merged.keys()
    assert all(back[k] is v for k, v in merged.items())


@given(
    st.one_of(
        checkpoint_pairs(layout="nested", allow_missing_fields=True, max_mismatched=0),
        checkpoint_pairs(layout="flat", allow_missing_fields=True, max_mismatched=0),
        checkpoint_pairs(layout="nested", keyed="id", allow_missing_fields=True, max_mismatched=0),
        _featured(max_mismatched=0),
    ),
    st.sampled_from([dm.DEFAULT, dm.WARN, MERGING]),
    st.sampled_from(["reference", "as_fresh"]),
)
def test_a_reference_lacking_state_fields_never_drops_the_checkpoints(pair, policy, fresh):
    """Every state field the checkpoint has for a parameter that still exists is in the result,
    the very object, whatever the reference lacks (a changed config: max_exp_avg_sq without
    amsgrad; schedulefree's empty entries; no entry at all), as Optimizer.load_state_dict keeps
    them. (Policy(drop_unexpected=True) drops the ones the reference lacks: it says so.)"""
    c, r = pair
    fc, fr = flat(c), flat(r)
    fields = {k for k in _owned(fc, _pids(fr)) if k.startswith("state.")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = flat(dm.merge(c, r, policy=policy, fresh=fresh))
    assert all(out[k] is fc[k] for k in fields)


@given(checkpoint_pairs(layout="nested", **FEATURES, min_moved=1, max_moved=2), st.booleans())
def test_a_moved_parameter_takes_its_new_groups_hyperparameters_and_keeps_its_state(pair, drop):
    """A parameter in another group in the reference than in the checkpoint (a bias moved to
    the no-decay group) is listed once, in its reference group, and has that group's
    hyperparameters: the checkpoint's values of its new group (see _home). Its state is
    kept by identity."""
    c, r = pair
    out = dm.merge(c, r, policy=MERGING.replace(drop_unexpected=drop))
    fo, fc, fr = flat(out), flat(c), flat(r)
    ref, chk = _hyperparameters(fr), _hyperparameters(fc)
    moved = _moved(fc, fr)
    assert moved
    # membership: the reference's groups, each parameter once; a checkpoint group no reference
    # group took is kept (unless dropping) for the members the reference no longer has
    n = len(r["param_groups"])
    assert [g["params"] for g in out["param_groups"][:n]] == [
        g["params"] for g in r["param_groups"]
    ]
    listed = [p for g in out["param_groups"] for p in g["params"]]
    assert len(listed) == len(set(listed))
    assert not drop or len(out["param_groups"]) == n
    # hyperparameters and state
    checkpoint_groups = _groups(chk)
    for p in moved:
        decay = ref[p]["weight_decay"]
        home = checkpoint_groups[_home(_groups(ref)[decay], chk, decay)]
        for name, value in ref[p].items():
            expected = next((chk[m][name] for m in home if name in chk[m]), value)
            assert fo[f"param_groups.{p}.{name}"] is expected, (p, name)
        state = [k for k in _owned(fc, [p]) if k.startswith("state.")]
        assert all(fo[k] is fc[k] for k in state if k in fr or not drop)


@given(
    st.one_of(
        checkpoint_pairs(layout="flat"),
        checkpoint_pairs(layout="nested"),
        checkpoint_pairs(layout="nested", keyed="id", max_unexpected=0),
        _featured(),
    ),
    st.booleans(),
)
def test_as_fresh_leaves_exactly_the_parameters_without_checkpointed_state_stateless(pair, drop):
    """fresh="as_fresh": a parameter the checkpoint has no state for (new, or never got a
    gradient) has no state in the result; nothing else differs from fresh="reference", down to
    the very objects (optimizer-level entries, heavyball's keys, groups)."""
    c, r = pair
    policy = MERGING.replace(drop_unexpected=drop)
    as_reference = dm.merge(c, r, policy=policy)
    as_fresh = dm.merge(c, r, policy=policy, fresh="as_fresh")
    fc, fr = flat(c), flat(r)
    stateless = {p for p in _pids(fr) if not any(k.startswith(f"state.{p}.") for k in fc)}
    if dm.classify(c) == "nested":
        kept = {p: e for p, e in as_reference["state"].items() if str(p) not in stateless}
        assert same_tree(as_fresh, {**as_reference, "state": kept})
        assert not {str(p) for p in as_fresh["state"]} & stateless
    else:
        gone = {k for k in _owned(as_reference, stateless) if k.startswith("state.")}
        assert list(as_fresh) == [k for k in as_reference if k not in gone]
        assert all(as_fresh[k] is v for k, v in as_reference.items() if k not in gone)


# -- flatten / unflatten -------------------------------------------------------------------


@given(nested)
def test_flatten_round_trip_with_like(sd):
    assert same_tree(dm.unflatten(dm.flatten(sd), like=sd), sd)


@given(
    st.one_of(
        flat_state_dicts(),
        flat_state_dicts(allow_meta=True),
        optimizer_state_dicts(layout="flat", allow_optimizer_entries=True),  # state.k
        optimizer_state_dicts(layout="flat", **LEVELS),  # heavyball.*: split on dots
    )
)
def test_unflatten_round_trip_without_like_on_dsd_flat_dicts(f):
    back = dm.flatten(dm.unflatten(f))
    assert back.keys() == f.keys()
    assert all(back[k] is v for k, v in f.items())


@given(
    st.one_of(
        optimizer_state_dicts(keyed="id"),
        optimizer_state_dicts(),
        optimizer_state_dicts(keyed="id", **LEVELS),
    )
)
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
