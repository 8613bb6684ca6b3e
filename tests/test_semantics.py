"""Every fast path of the engine equals the plain semantics of dsdmerge._spec.

The engine (dsdmerge._engine.run) takes shortcuts: the flat pass walks the two key sequences
side by side or falls back to a union, reads torch's param-group keys as a table or key by
key, compares tensors in C-level passes; the nested walk batches the per-parameter state of
all parameters and skips the unexpected-key walk when nothing can be unexpected. Here the
whole Outcome (merged state dict with its key order and leaves by identity, missing,
unexpected, mismatches, conflicts, problems, the slots a policy uses) is compared with the
plain, key-by-key definition, on the shipped strategies (every opt-in feature included),
in every layout, with the keys in torch's order and shuffled.
"""

from __future__ import annotations

import random

import pytest
from helpers import rows_reordered, taking_reference
from hypothesis import given
from hypothesis import strategies as st
from semantics_check import assert_same_outcome
from test_properties import FEATURES, pairs

import dsdmerge as dm
from dsdmerge import _spec
from dsdmerge.strategies import checkpoint_pairs

OPTIONS = st.fixed_dictionaries(
    {"merge": st.booleans(), "keep_unexpected": st.booleans(), "conflicts": st.booleans()}
)

# what the strategies draw, and what breaks the engine's shortcuts: a flat reference's
# param-group keys in another order than torch's (no table: key by key), or the whole
# key order shuffled (no side-by-side walk: the union)
with_moves = st.one_of(
    checkpoint_pairs(layout="nested", **FEATURES, min_moved=1, max_moved=2),
    checkpoint_pairs(layout="flat", **FEATURES, min_moved=1, max_moved=2),
    checkpoint_pairs(layout="nested", **FEATURES, min_moved=1, max_moved=2, min_missing=1),
)
all_pairs = st.one_of(pairs, with_moves)


def _shuffled(sd, seed):
    keys = list(sd)
    random.Random(seed).shuffle(keys)
    return {k: sd[k] for k in keys}


def _groups_last(sd):
    """A flat dict with one parameter's hyperparameters moved to the end (no longer a table)."""
    pg = [k for k in sd if k.startswith("param_groups.")]
    if not pg:
        return sd
    fqn = pg[0][len("param_groups.") :].rpartition(".")[0]
    moved = [k for k in pg if k.startswith(f"param_groups.{fqn}.")][1:]
    return {**{k: v for k, v in sd.items() if k not in moved}, **{k: sd[k] for k in moved}}


@given(all_pairs, OPTIONS)
def test_the_engine_equals_the_semantics(pair, options):
    assert_same_outcome(*pair, **options)


@given(all_pairs, OPTIONS)
def test_the_flat_pass_equals_the_semantics_on_the_flattened_pair(pair, options):
    c, r = pair
    assert_same_outcome(dm.flatten(c), dm.flatten(r), **options)


@given(all_pairs, OPTIONS)
def test_a_flat_checkpoint_over_a_nested_reference_equals_the_semantics(pair, options):
    c, r = pair
    assert_same_outcome(dm.flatten(c), r, **options)


@given(all_pairs, st.booleans())
def test_a_nested_checkpoint_compared_with_a_flat_reference_equals_the_semantics(pair, conflicts):
    c, r = pair
    assert_same_outcome(c, dm.flatten(r), merge=False, conflicts=conflicts)


@given(all_pairs, OPTIONS, st.integers(0, 2**32 - 1), st.sampled_from(["shuffled", "no table"]))
def test_the_fallbacks_equal_the_semantics(pair, options, seed, how):
    c, r = (dm.flatten(sd) for sd in pair)
    if how == "shuffled":
        c, r = _shuffled(c, seed), _shuffled(r, seed + 1)
    else:
        r = _groups_last(r)
    assert_same_outcome(c, r, **options)


@pytest.mark.parametrize("keep", [True, False])
def test_semantics_of_a_hand_made_case(keep):
    """The module docstring's rules, on a case small enough to check by eye."""
    c = {"state.w.step": 7, "param_groups.w.lr": 5e-5, "old": 1}
    r = {"state.w.step": 1, "state.new.step": 1, "param_groups.w.lr": 1e-3}
    r["param_groups.new.lr"] = r["param_groups.w.lr"]  # one group: equal hyperparameters
    out = _spec.outcome(c, r, merge=True, keep_unexpected=keep)
    assert out.missing == ["state.new.step", "param_groups.new.lr"]
    assert out.unexpected == ["old"]
    expected = {"state.w.step": 7, "param_groups.w.lr": 5e-5, "old": 1}
    if not keep:
        del expected["old"]
    expected |= {"state.new.step": 1, "param_groups.new.lr": 5e-5}  # the group's value
    assert out.merged == expected
    assert list(out.merged) == list(expected)


def _perturbed(sd, seed, how):
    """A flat checkpoint with some hyperparameter values changed (``"conflict"``: members of
    one group may now disagree) or replaced by equal values that are new objects."""
    pg = [k for k in sd if k.startswith("param_groups.")]
    if not pg:
        return sd
    rng = random.Random(seed)
    out = dict(sd)
    for key in rng.sample(pg, rng.randint(1, min(3, len(pg)))):
        v = out[key]
        if how == "conflict":
            out[key] = v + 1 if type(v) in (int, float) else ("other", v)
        elif type(v) is float:
            out[key] = float(repr(v))  # equal, not the same object
    return out


@given(
    all_pairs,
    st.integers(0, 2**32 - 1),
    st.sampled_from(["conflict", "equal copies"]),
    st.booleans(),
)
def test_group_conflicts_equal_the_semantics(pair, seed, how, shuffled):
    """The strict check's quick proof of consistency (dsdmerge._groups.proven_consistent)
    never hides a conflict: checkpoints whose group members disagree, or agree through
    equal values that are different objects, get exactly the semantics' conflicts."""
    c, r = (dm.flatten(sd) for sd in pair)
    c = _perturbed(c, seed, how)
    if shuffled:
        c = _shuffled(c, seed)
    assert_same_outcome(c, r, merge=True, keep_unexpected=True, conflicts=True)


@given(
    st.lists(st.tuples(st.sampled_from([0.1, 0.2, 1, "a"]), st.sampled_from([0.1, 0.2, 1, "a"]))),
    st.integers(1, 4),
)
def test_proven_consistent_is_a_proof(cells, period):
    """When the quick proof says "consistent", positions with equal reference values hold
    equal checkpoint values (the condition the group check's skip relies on)."""
    from dsdmerge._groups import proven_consistent
    from dsdmerge._values import same_value

    r_values = [r for r, _ in cells]
    c_values = [c for _, c in cells]
    if proven_consistent(r_values, c_values, period):
        for i in range(len(cells)):
            for j in range(len(cells)):
                if same_value(r_values[i], r_values[j]):
                    assert same_value(c_values[i], c_values[j])


_CELLS = [0.1, 0.2, 1, 1.0, True, float("nan"), (0.9, 0.99), (1, 2), (1.0, 2.0), "a", None]


@given(
    st.integers(1, 4),
    st.lists(st.tuples(st.integers(1, 6), st.integers(0, 3)), min_size=1, max_size=5),
    st.data(),
)
def test_the_block_proof_is_a_proof(k, shape, data):
    """Rows in blocks of shared reference objects (torch's layout, where the block proof
    runs), checkpoint values drawn to agree or not, with holes (positions the checkpoint
    lacks): when the proof says "consistent", any two positions (but holes) whose reference
    values are same_value hold same_value checkpoint values."""
    from dsdmerge._groups import proven_consistent
    from dsdmerge._values import same_value

    cells = st.sampled_from(_CELLS)
    r_values: list = []
    c_values: list = []
    templates = [data.draw(st.lists(cells, min_size=k, max_size=k)) for _ in range(4)]
    for rows, which in shape:
        r_row = templates[which]
        c_row = data.draw(st.lists(cells, min_size=k, max_size=k))
        for _ in range(rows):
            r_values += r_row
            if data.draw(st.booleans()):  # the same checkpoint objects, or copies, or others
                c_values += c_row
            else:
                c_values += [copy_of(v) for v in data.draw(st.lists(cells, min_size=k, max_size=k))]
    n = len(r_values)
    holes = sorted(data.draw(st.sets(st.integers(0, n - 1), max_size=3)))
    if proven_consistent(r_values, c_values, k, holes=holes):
        kept = [p for p in range(n) if p not in holes]
        for p in kept:
            for q in kept:
                if same_value(r_values[p], r_values[q]):
                    assert same_value(c_values[p], c_values[q]), (p, q)


def test_the_block_proof_tells_tuples_apart_by_their_items_types():
    """(1, 2) == (1.0, 2.0), but they are not same_value: reference rows holding them are
    not one group, so a later (1.0, 2.0) row whose checkpoint value differs from the
    earlier (1.0, 2.0) row's is a disagreement the proof must not hide."""
    from dsdmerge._groups import proven_consistent

    r_values = [(1, 2), (1.0, 2.0), 0.1, (1.0, 2.0)]
    assert not proven_consistent(r_values, ["x", "x", "z", "y"], 1)
    assert not proven_consistent([(1.0, 2.0), (1, 2)], ["x", "y"], 1)  # (one block, not one value)


def test_a_conflict_hidden_behind_equal_tuples_is_found():
    """The same at the engine: the reference's two params whose hyperparameter is (1.0, 2.0)
    are one inferred group whose checkpoint members disagree: strict refuses, naming it,
    as the semantics say."""
    fqns = ["a", "b", "c", "d"]
    pg = [(1, 2), (1.0, 2.0), 0.1, (1.0, 2.0)]
    r = {f"state.{f}.step": 0 for f in fqns}
    r |= {f"param_groups.{f}.x": v for f, v in zip(fqns, pg, strict=True)}
    c = dict(r)
    c |= {f"param_groups.{f}.x": v for f, v in zip(fqns, ["x", "x", "z", "y"], strict=True)}
    assert_same_outcome(c, r, merge=True, keep_unexpected=False, conflicts=True)
    assert _spec.outcome(c, r, merge=True, conflicts=True).conflicts
    with pytest.raises(dm.MergeError, match=r"'x'"):
        dm.merge(c, r, policy="strict")


def test_the_block_proof_reads_rows_in_chunks():
    """Blocks that span chunks of the lazy block proof (dsdmerge._groups._CHUNK values),
    holes at chunk edges, a block whose first row lacks a key: the proof equals its
    definition on each side of a chunk boundary."""
    from dsdmerge import _groups
    from dsdmerge._values import MISSING, same_value

    k = 3
    rows = 3 * _groups._CHUNK // k + 5
    a_row, b_row = [1e-3, (0.9, 0.99), 0.1], [1e-3, (0.9, 0.99), 0.0]
    split = _groups._CHUNK // k - 1  # the second block starts one row before a chunk ends
    r_values = a_row * split + b_row * (rows - split)
    c_row_a, c_row_b = [2e-3, (0.8, 0.9), 0.1], [2e-3, (0.8, 0.9), 0.0]
    good = c_row_a * split + c_row_b * (rows - split)
    edge = _groups._CHUNK // k * k
    holes = sorted({split * k, split * k + 2, edge - 1, edge, edge + 1, len(good) - 1})
    with_holes = list(good)
    for p in holes:
        with_holes[p] = MISSING
    assert _groups.proven_consistent(r_values, good, k)
    assert _groups.proven_consistent(r_values, with_holes, k, holes=holes)
    for at in (split * k - 1, split * k + 1, edge + 2, edge + 3, len(good) - 2):
        assert at not in holes
        bad = list(with_holes)
        bad[at] = 5e-3 if type(bad[at]) is float else (0.8, 0.91)
        assert not _groups.proven_consistent(r_values, bad, k, holes=holes), at
    copies = [float(repr(v)) if type(v) is float else tuple(v) for v in good]  # equal objects
    assert _groups.proven_consistent(r_values, copies, k)
    ints = list(good)
    ints[edge + 1] = (0, 1)  # == nothing there, and (0, 1) == (0.0, 1.0) only by value
    assert not _groups.proven_consistent(r_values, ints, k)
    assert not same_value((0, 1), (0.0, 1.0))


def copy_of(v):
    """An equal value that is another object (as torch.load gives every parameter its own)."""
    if type(v) is float:
        return float(repr(v))
    if type(v) is tuple:
        return tuple(copy_of(x) for x in v)
    return v


def test_a_conflict_in_torch_layout_at_scale_is_found():
    """A DeepSeek-like flat optimizer in torch's layout, one member's lr changed: strict
    refuses, naming it (the quick proof fails, the exact check runs)."""
    fqns = [f"layers.{i}.w" for i in range(200)]
    lr, wd = 1e-3, 0.1
    r = {f"state.{f}.step": 0 for f in fqns}
    for f in fqns:
        r |= {f"param_groups.{f}.lr": lr, f"param_groups.{f}.weight_decay": wd}
    c = dict(r)
    c["param_groups.layers.150.w.lr"] = 2e-3
    with pytest.raises(dm.MergeError, match=r"layers\.150\.w"):
        dm.merge(c, r, policy="strict")
    c["param_groups.layers.150.w.lr"] = float(repr(lr))  # equal, another object
    assert dm.merge(c, r, policy="strict") == c


@given(all_pairs, OPTIONS, st.sampled_from([0.0, 0.5, 1.0]), st.booleans())
def test_groups_in_their_own_orders_equal_the_semantics(pair, options, start, both):
    """Param groups whose hyperparameters stand in different orders (the table read in
    blocks, dsdmerge._table.PgTable.blocks) give the semantics' outcome."""
    c, r = (dm.flatten(sd) for sd in pair)
    r = rows_reordered(r, start)
    if both:
        c = rows_reordered(c, start)
    assert_same_outcome(c, r, **options)


@given(
    checkpoint_pairs(layout="flat", kind="model"),
    st.sampled_from(["param_groups.", "state.", "enc.param_groups.", "x.state.", ""]),
    OPTIONS,
)
def test_a_model_under_optimizer_like_segments_merges_key_by_key(pair, prefix, options):
    """A model whose modules are named ``param_groups`` or ``state`` is a model (its values
    are tensors, not hyperparameters): the merge is the plain key-by-key one, as the semantics
    say, with no param-group rule on any key."""
    c, r = ({prefix + k: v for k, v in sd.items()} for sd in pair)
    assert_same_outcome(c, r, **options)
    out = _spec.outcome(c, r, merge=True, conflicts=True)
    assert out.merged == {**r, **c}
    assert all(out.merged[k] is v for k, v in c.items())
    assert all(out.merged[k] is r[k] for k in r.keys() - c.keys())
    assert out.conflicts == []


@given(
    st.one_of(
        checkpoint_pairs(layout="flat", kind="model", min_missing=1),
        checkpoint_pairs(layout="nested", kind="model", min_missing=1),
    ),
    st.integers(0, 2**32 - 1),
    OPTIONS,
)
def test_tied_weights_equal_the_semantics(pair, seed, options):
    """A reference holding one tensor under a missing key and a key the checkpoint has (tied
    weights): the engine ties them as the semantics say, and the missing key takes the
    checkpoint's tensor of the other."""
    c, r = pair
    rng = random.Random(seed)
    flat_c, flat_r = (sd.get("model", sd) for sd in (c, r))
    missing = [k for k in flat_r if k not in flat_c]
    present = [k for k in flat_r if k in flat_c]
    if not present:
        return
    key, twin = rng.choice(missing), rng.choice(present)
    tied_r = {k: flat_r[twin] if k == key else v for k, v in flat_r.items()}
    r = {"model": tied_r} if "model" in r else tied_r
    assert_same_outcome(c, r, **options)
    out = taking_reference(dm.merge_with_diff, c, r)
    prefix = "model." if "model" in r else ""
    assert (prefix + key, prefix + twin) in out.diff.tied
    merged = out.state_dict["model"] if prefix else out.state_dict
    assert merged[key] is merged[twin]
