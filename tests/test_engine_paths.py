"""The fast paths of the engine against the plain definition of diff and merge (dsdmerge._spec).

The engine finds key differences from the union ``{**reference, **checkpoint}`` and value
identity, compares tensors in C-level passes, and takes shortcuts for common value types;
these tests feed it what breaks shortcuts: shared objects on both sides, reordered keys,
singleton values, tensor-likes of other types, tensors where the other side has a scalar.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch
from conftest import Snapshot
from helpers import taking_reference
from hypothesis import given, settings
from hypothesis import strategies as st
from semantics_check import assert_same_outcome

import dsdmerge as dm
from dsdmerge import _spec
from dsdmerge._keys import align, values_at
from dsdmerge._verdict import reshaped

MERGING = dm.DEFAULT.replace(unrelated="ignore", conflict="ignore")

SHARED = [torch.zeros(2), torch.zeros(3), torch.zeros(2, dtype=torch.float16), True, None, 0.5]


def model(c: dict, r: dict) -> tuple[list[str], list[str], list[str]]:
    """missing (reference order), unexpected (checkpoint order), mismatched (reference order):
    the plain definition of dsdmerge._spec."""
    plain = _spec.flat(c, r, merge=False)
    return plain.missing, plain.unexpected, [m.key for m in plain.mismatches]


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
    # optimizer-level keys (MADGRAD's state['k'], heavyball's own key): keys like any other
    + ["state.k", "heavyball.step", "heavyball.schedule"]
)


def merged_order(c: dict, r: dict) -> list[str]:
    """A flat merge's key order: the checkpoint's keys, then the backfilled ones."""
    return [*c, *(k for k in r if k not in c)]


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


@given(flat_pairs(), st.booleans(), st.booleans(), st.booleans())
def test_the_engine_equals_the_semantics_on_shared_and_odd_values(pair, merge, keep, conflicts):
    assert_same_outcome(*pair, merge=merge, keep_unexpected=keep, conflicts=conflicts)


@given(flat_pairs())
def test_diff_matches_the_model(pair):
    c, r = pair
    missing, unexpected, mismatched = model(c, r)
    d = dm.diff(c, r)
    assert list(d.missing) == missing
    assert list(d.unexpected) == unexpected
    assert list(d.mismatched_keys) == mismatched


def refused_only_what_cannot_be_told(err: dm.MergeError, c: dict, missing: list[str]) -> bool:
    """Whether every reason ``err`` gives is the one refusal beyond the per-key model: a
    backfilled ``param_groups.*`` key of a group inferred from equal reference values whose
    checkpoint members hold different values (two groups scheduled apart?), naming two of them."""
    for problem in err.problems:
        found = re.search(
            r"disagree on '(\w+)' \((\w+) has .*, (\w+) has .*the value for '(.+?)'",
            problem,
            re.DOTALL,  # a value's repr may span lines
        )
        if found is None or "cannot be told" not in problem:
            return False
        name, a, b, key = found.groups()
        if key not in missing or not key.startswith("param_groups.") or not key.endswith(name):
            return False
        if c[f"param_groups.{a}.{name}"] is c[f"param_groups.{b}.{name}"]:
            return False
    return bool(err.problems)


@given(flat_pairs(), st.booleans())
def test_merge_matches_the_model(pair, drop):
    c, r = pair
    snaps = Snapshot(c), Snapshot(r)
    policy = MERGING.replace(drop_unexpected=drop, missing="ignore", unexpected="ignore")
    missing, unexpected, mismatched = model(c, r)
    refusal = None
    try:
        out, d, _ = taking_reference(dm.merge_with_diff, c, r, policy=policy)
    except dm.MergeError as err:
        refusal = err
    if refusal is not None:
        assert refused_only_what_cannot_be_told(refusal, c, missing)
        assert (list(refusal.diff.missing), list(refusal.diff.unexpected)) == (missing, unexpected)
        assert all(s.unchanged() for s in snaps)
        return
    assert (list(d.missing), list(d.unexpected), list(d.mismatched_keys)) == (
        missing,
        unexpected,
        mismatched,
    )
    # the checkpoint's keys in its order, then the backfilled ones in the reference's order
    expected = {k: c[k] if k in c else r[k] for k in merged_order(c, r)}
    assert expected == {**r, **c}
    for k in unexpected if drop else ():
        del expected[k]
    for k in mismatched:
        if reshaped(d.mismatched[mismatched.index(k)]):  # a 1-element scalar is kept
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


# -- the key walk of flat pairs ------------------------------------------------------


def test_many_scattered_differences_give_up_the_walk_and_still_agree_with_the_model():
    # 250 differences: beyond the walk's budget (64 + 500 // 16 = 95), so it gives up early
    # in the first chunk and the hashed union answers; more keys would only time the model
    r = {f"state.p{i}.exp_avg": torch.zeros(1) for i in range(500)}
    c = {k: torch.zeros(1) for i, k in enumerate(r) if i % 2}  # every other key missing
    c["unexpected.one"] = torch.zeros(2)
    assert align(c, r, set(), set()) is None  # the walk gave up
    missing, unexpected, mismatched = model(c, r)
    d = dm.diff(c, r)
    assert (list(d.missing), list(d.unexpected), list(d.mismatched_keys)) == (
        missing,
        unexpected,
        mismatched,
    )
    assert list(dm.merge(c, r)) == merged_order(c, r)


def test_a_large_merge_keeps_every_object_in_place():
    r = {f"k{i}": (torch.zeros(1) if i % 3 else False) for i in range(40_000)}
    c = {k: (torch.zeros(1) if i % 3 else False) for i, k in enumerate(r) if i % 1000 != 7}
    c["new"] = 1.5
    out = dm.merge(c, r)
    assert list(out) == merged_order(c, r)
    assert all(out[k] is (c[k] if k in c else r[k]) for k in out)


def test_keys_in_another_order_agree_with_the_model():
    r = {f"k{i}": torch.zeros(i % 3 + 1) for i in range(5000)}
    c = {k: torch.zeros(3) for k in reversed(list(r)) if k != "k17"}
    missing, _, mismatched = model(c, r)
    d = dm.diff(c, r)
    assert (list(d.missing), list(d.mismatched_keys)) == (missing, mismatched)
    assert not d.unexpected
    out = taking_reference(dm.merge, c, r, policy=MERGING)
    assert list(out) == merged_order(c, r)
    assert list(out)[-1] == "k17"  # backfilled: after the checkpoint's keys


@pytest.mark.parametrize("side", ["checkpoint", "reference"])
def test_str_subclass_keys_are_still_refused_on_either_side(side):
    class Key(str):
        pass

    plain = {"a": torch.zeros(1), "b": torch.zeros(1)}
    odd = {Key("a"): torch.zeros(1), "b": torch.zeros(1)}  # equal to plain's keys
    c, r = (odd, plain) if side == "checkpoint" else (plain, odd)
    with pytest.raises(dm.StateDictTypeError, match=side):
        dm.diff(c, r)
    with pytest.raises(dm.StateDictTypeError, match=side):
        dm.merge(c, r)


# -- nested optimizers: the batched per-parameter pass --------------------------------


def _osd(entries: dict, lr: float = 0.1) -> dict:
    return {"state": entries, "param_groups": [{"lr": lr, "params": list(entries)}]}


def test_nested_reports_follow_the_walk_order_across_batched_and_one_by_one_parameters():
    def entry(*shape):
        return {"step": torch.zeros(()), "exp_avg": torch.zeros(shape)}

    r = _osd({f"p{i}": entry(2) for i in range(6)})
    c = _osd(
        {
            "p0": entry(3),  # batched, mismatched
            "p1": {**entry(3), "extra": torch.zeros(1)},  # other names: one by one, mismatched
            "p3": entry(2),  # p2 missing: backfilled between batched ones
            "p4": entry(5),  # batched, mismatched
            "p5": {"exp_avg": torch.zeros(2), "step": torch.zeros(())},  # other order
        }
    )
    d = dm.diff(c, r)
    assert d.mismatched_keys == ("state.p0.exp_avg", "state.p1.exp_avg", "state.p4.exp_avg")
    assert d.missing[:2] == ("state.p2.step", "state.p2.exp_avg")
    assert d.unexpected == ("state.p1.extra",)
    assert d == dm.diff(dm.flatten(c), dm.flatten(r))
    out = taking_reference(dm.merge, c, r, policy=MERGING)
    assert list(out["state"]) == list(r["state"])
    assert out["state"]["p0"]["exp_avg"] is r["state"]["p0"]["exp_avg"]  # shape: reference's
    assert out["state"]["p3"]["exp_avg"] is c["state"]["p3"]["exp_avg"]
    assert list(out["state"]["p5"]) == ["exp_avg", "step"]  # the checkpoint's order


def test_nested_state_values_take_the_general_walk():
    r = _osd({"w": {"step": 1, "shampoo": {"factor": torch.zeros(2)}}})
    c = _osd({"w": {"step": 2, "shampoo": {"factor": torch.zeros(3)}}})
    d = dm.diff(c, r)
    assert d.mismatched_keys == ("state.w.shampoo.factor",)
    assert d == dm.diff(dm.flatten(c), dm.flatten(r))
    out = taking_reference(dm.merge, c, r, policy=MERGING)
    assert out["state"]["w"]["shampoo"]["factor"] is r["state"]["w"]["shampoo"]["factor"]
    assert out["state"]["w"]["step"] == 2


def test_nested_merge_shares_leaves_and_makes_new_entries():
    r = _osd({i: {"step": torch.zeros(())} for i in range(4)})
    c = _osd({i: {"step": torch.zeros(())} for i in range(4)})
    out = dm.merge(c, r)
    for i in range(4):
        assert out["state"][i] is not c["state"][i]
        assert out["state"][i]["step"] is c["state"][i]["step"]


# -- flatten: the C-level pass and its fallbacks --------------------------------------


def test_flatten_spells_int_subclass_ids_like_ints_and_refuses_bools():
    import enum

    class Pid(enum.IntEnum):
        W = 3

    osd = {"state": {Pid.W: {"step": 1}}, "param_groups": [{"lr": 0.1, "params": [Pid.W]}]}
    assert dm.flatten(osd) == {"state.3.step": 1, "param_groups.3.lr": 0.1}
    with pytest.raises(dm.StateDictTypeError):
        dm.flatten({"state": {True: {"step": 1}}, "param_groups": []})
    with pytest.raises(dm.StateDictTypeError):
        dm.flatten({"state": {}, "param_groups": [{"lr": 0.1, "params": [True]}]})


def test_flatten_finds_collisions_between_int_and_str_ids():
    osd = {"state": {1: {"step": 1}, "1": {"step": 2}}, "param_groups": []}
    with pytest.raises(dm.LayoutError, match=r"same key 'state\.1\.step'"):
        dm.flatten(osd)


def test_flatten_of_many_parameters_keeps_torchs_order():
    from torch.distributed.checkpoint.state_dict import _flatten_optim_state_dict

    fqns = [f"m.{i}.w" for i in range(2500)]
    osd = {
        "state": {f: {"step": torch.zeros(()), "exp_avg": torch.zeros(1)} for f in fqns[::2]},
        "param_groups": [
            {"lr": 0.1, "betas": (0.9, 0.99), "params": fqns[:1000]},
            {"lr": 0.2, "betas": (0.9, 0.99), "params": fqns[1000:]},
        ],
    }
    ours = dm.flatten(osd)
    theirs = _flatten_optim_state_dict(
        {"state": osd["state"], "param_groups": [dict(g) for g in osd["param_groups"]]}
    )
    assert list(ours) == list(theirs)
    assert all(ours[k] is theirs[k] for k in theirs)


# -- group-consistent hyperparameters: the table path and the key-by-key path ----------


def _flat_osd(groups: list[tuple[dict, list[str]]], with_state: set[str]) -> dict:
    """A flat optimizer dict in torch's order: every state.* key, then every param_groups.* key."""
    fqns = [f for _, members in groups for f in members]
    state = {f"state.{f}.step": torch.zeros(()) for f in fqns if f in with_state}
    pgs = {
        f"param_groups.{f}.{name}": value
        for hyper, members in groups
        for f in members
        for name, value in hyper.items()
    }
    return {**state, **pgs}


def _orders(sd: dict) -> dict[str, dict]:
    """``sd`` as torch orders it, with each parameter's keys together, and with one parameter's
    hyperparameters in another order (the same members, in the same order, every time)."""
    per_param = sorted(sd, key=lambda k: (k.split(".", 1)[1].rsplit(".", 1)[0], k))
    # the last parameter's names in another order: a block of its own (as torch writes a
    # group whose dict orders its hyperparameters differently)
    own_order = [k for k in sd if k != "param_groups.n.lr"] + ["param_groups.n.lr"]
    # two parameters' keys interleaved (each in its own order still): no rows, key by key
    mixed = [f"param_groups.{f}.{name}" for name in ("lr", "weight_decay") for f in ("a", "new")]
    odd = [k for k in sd if k not in mixed] + mixed
    return {
        "table": sd,
        "table after a full scan": {k: sd[k] for k in per_param},
        "table with a block in its own order": {k: sd[k] for k in own_order},
        "key by key": {k: sd[k] for k in odd},
    }


@pytest.mark.parametrize("policy", ["default", "warn"])
def test_group_hyperparameters_agree_on_every_path(policy, monkeypatch):
    from dsdmerge import _groups, _table

    paths: list[str] = []
    shaped, by_key = _table.PgTable._shaped.__func__, _groups._resolve_by_keys

    def spy_shaped(cls, picked, *args):
        table = shaped(cls, picked, *args)
        paths.append("no table" if table is None else f"table of {picked.count(1)}")
        return table

    def spy_by_key(*args, **kwargs):
        paths.append("key by key")
        return by_key(*args, **kwargs)

    monkeypatch.setattr(_table.PgTable, "_shaped", classmethod(spy_shaped))
    monkeypatch.setattr(_groups, "_resolve_by_keys", spy_by_key)

    # "new" has no keys in the checkpoint; "a" and "b" are in one reference group but disagree
    fresh = {"lr": 1e-3, "weight_decay": 0.1}
    r = _flat_osd([(fresh, ["a", "new", "b"]), ({"lr": 1e-3, "weight_decay": 0.0}, ["n"])], set())
    r = {**{f"state.{f}.step": torch.zeros(()) for f in ("a", "new", "b", "n")}, **r}
    trained = [
        ({"lr": 5e-5, "weight_decay": 0.1}, ["a"]),
        ({"lr": 4e-5, "weight_decay": 0.1}, ["b"]),
        ({"lr": 5e-5, "weight_decay": 0.0}, ["n"]),
    ]
    c = _flat_osd(trained, {"a", "b", "n"})
    # a and b disagree on lr, so the inferred group may be two groups scheduled apart: every
    # path warns naming both values, keeps them, and gives "new" the first member's (a tie),
    # in the reference's key order (the interleaved reference lists b first)
    for name, ref in _orders(r).items():
        first = "b" if name == "key by key" else "a"
        with pytest.warns(dm.DSDMergeWarning, match=r"disagree on 'lr': (5e-05|4e-05) held by"):
            out = dm.merge(c, ref, policy=policy, allow_missing="*")
        assert out["param_groups.new.lr"] is c[f"param_groups.{first}.lr"]
        assert out["param_groups.a.lr"] is c["param_groups.a.lr"]
        assert out["param_groups.b.lr"] is c["param_groups.b.lr"]
        with pytest.raises(dm.MergeError, match="disagree on 'lr'"):
            dm.merge(c, ref, policy="strict", allow_missing="*")
    # with b's lr as a's, the group's value is plain: every path gives it to "new"
    c = {**c, "param_groups.b.lr": c["param_groups.a.lr"]}
    c = {**c, "param_groups.b.weight_decay": 0.1}  # equal, not the same object: a conflict-free
    results = {}
    for name, ref in _orders(r).items():
        paths.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = dm.merge_with_diff(c, ref, policy=policy)
        caught = [w for w in caught if "missing from the checkpoint" not in str(w.message)]
        results[name] = (out.state_dict, out.conflicts, len(caught), list(paths))
        assert out.state_dict["param_groups.new.lr"] is c["param_groups.a.lr"]
        assert out.state_dict["param_groups.new.weight_decay"] is c["param_groups.a.weight_decay"]
    assert results["table"][3] == ["table of 8"]
    assert results["table after a full scan"][3] == ["no table", "table of 8"]
    assert results["table with a block in its own order"][3] == ["table of 8"]
    assert results["key by key"][3] == ["no table", "key by key"]  # one try: same keys
    first, conflicts, n_warnings, _ = results["table"]
    for sd, *rest in results.values():
        assert sd.keys() == first.keys()
        assert all(sd[k] is first[k] for k in first)
        assert rest[:2] == [conflicts, n_warnings]
    assert conflicts == ()


_FQNS = ["a", "b", "a.b", "b\0c", "a\0", "c", "c\0param_groups.a"]
_NAMES = ["lr", "wd", "x\0", "y", "lr.z"]


@settings(max_examples=500)  # cheap: a few milliseconds per example
@given(
    st.lists(st.sampled_from(_FQNS), min_size=1, max_size=6, unique=True),
    st.lists(st.sampled_from(_NAMES), min_size=1, max_size=3, unique=True),
    st.lists(st.tuples(st.integers(0, 17), st.sampled_from(_FQNS), st.sampled_from(_NAMES))),
    st.sampled_from(["", "param_groups.a\0param_groups.b.lr", "param_groups.b\0c.lr"]),
    st.integers(0, 7),
)
def test_the_param_group_table_reads_every_key_as_parse_groups_does(
    fqns, names, edits, extra, reversed_from
):
    """PgTable.of's shape check (one comparison of NUL-joined keys) accepts only keys that are
    exactly param_groups.<row fqn>.<column name>, read as parse_groups reads them, even when
    fqns or names hold NULs or dots, or keys are replaced by others or an extra key sits
    among them."""
    from dsdmerge._table import PgTable, parse_groups

    # rows from reversed_from on list the names in reverse (a block in its own order)
    keys = [
        f"param_groups.{f}.{n}"
        for i, f in enumerate(fqns)
        for n in (names[::-1] if i >= reversed_from else names)
    ]
    for at, fqn, name in edits:  # a key replaced by another spelling
        if at < len(keys):
            keys[at] = f"param_groups.{fqn}.{name}"
    if extra:
        keys.insert(len(keys) // 2, extra)
    keys = list(dict.fromkeys(keys))
    r = {"state.x.step": 0, **{k: i for i, k in enumerate(keys)}}
    table = PgTable.of(r)
    if table is None:
        return
    k = len(table.names)
    assert len(table.keys) == len(table.fqns) * k
    hyper, _ = parse_groups(r)
    pg_keys = [key for key in r if key.startswith("param_groups.")]
    in_r = pg_keys if table.order is None else [pg_keys[i] for i in table.order]
    assert table.keys == in_r
    assert sorted(table.keys) == sorted(pg_keys)
    if table.order is not None:
        assert sorted(table.order) == list(range(len(pg_keys)))
    for i, fqn in enumerate(table.fqns):
        for j, name in enumerate(table.names):
            key = table.keys[i * k + j]
            assert key == f"param_groups.{fqn}.{name}"
            assert hyper[fqn][name] == r[key] == table.values[i * k + j]
    assert list(hyper) == table.fqns


@given(
    st.lists(st.sampled_from("abcdefghij"), unique=True, max_size=10),
    st.sets(st.sampled_from("abcdefghij")),
    st.lists(st.tuples(st.sampled_from("uvwxyz"), st.integers(0, 10)), unique_by=lambda t: t[0]),
    st.integers(min_value=0, max_value=12),
    st.sampled_from([None, "fill"]),
)
def test_values_at_are_the_checkpoints_value_at_each_reference_key(
    r_keys, dropped, extra, start, fill
):
    # the keys both have in the reference's order (align's case); unexpected ones anywhere
    c_keys = [k for k in r_keys if k not in dropped]
    for key, at in extra:
        c_keys.insert(min(at, len(c_keys)), key)
    r = {k: f"r.{k}" for k in r_keys}
    c = {k: f"c.{k}" for k in c_keys}
    aligned = align(c, r, {str}, {str})
    assert aligned is not None
    got = list(values_at(c, r, aligned.runs, aligned.missing, fill, start))
    plain = [c.get(k, r[k] if fill is None else fill) for k in r_keys]
    assert got == plain[start:]
