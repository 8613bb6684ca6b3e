"""dsdmerge.strategies is public API: arguments are validated, contracts hold, examples shrink."""

from __future__ import annotations

import pytest
import torch
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

import dsdmerge as dm
from dsdmerge import strategies as ds

# -- validation: every bad argument raises InvalidArgument when the strategy is built ----

BAD = [
    (ds.fqns, {"min_layers": -1}),
    (ds.fqns, {"min_layers": 4, "max_layers": 3}),
    (ds.fqns, {"max_layers": None}),
    (ds.fqns, {"max_layers": 2.0}),
    (ds.fqns, {"max_experts": -1}),
    (ds.fqns, {"max_experts": True}),
    (ds.model_state_dicts, {"min_params": -1}),
    (ds.model_state_dicts, {"min_params": 3, "max_params": 2}),
    (ds.model_state_dicts, {"max_params": None}),
    (ds.model_state_dicts, {"dtypes": ()}),
    (ds.model_state_dicts, {"dtypes": (torch.int64,)}),
    (ds.model_state_dicts, {"dtypes": ("float32",)}),
    (ds.model_state_dicts, {"dtypes": 5}),
    (ds.model_state_dicts, {"allow_meta": 1}),
    (ds.optimizer_state_dicts, {"layout": "tree"}),
    (ds.optimizer_state_dicts, {"layout": None}),
    (ds.optimizer_state_dicts, {"keyed": "name"}),
    (ds.optimizer_state_dicts, {"keyed": "id", "layout": "flat"}),
    (ds.optimizer_state_dicts, {"optimizers": ()}),
    (ds.optimizer_state_dicts, {"optimizers": ("adamw",)}),
    (ds.optimizer_state_dicts, {"optimizers": "lion"}),
    (ds.optimizer_state_dicts, {"optimizers": 3}),
    (ds.optimizer_state_dicts, {"optimizers": [["adam"]]}),
    (ds.optimizer_state_dicts, {"min_groups": 0}),
    (ds.optimizer_state_dicts, {"min_groups": 2, "max_groups": 1}),
    (ds.optimizer_state_dicts, {"dtypes": [torch.bool]}),
    (ds.optimizer_state_dicts, {"allow_meta": "yes"}),
    (ds.flat_state_dicts, {"kind": "models"}),
    (ds.flat_state_dicts, {"kind": "model", "min_params": 2, "max_params": 1}),
    (ds.flat_state_dicts, {"optimizers": ()}),
    (ds.flat_state_dicts, {"dtypes": ()}),
    (ds.flat_state_dicts, {"kind": "model", "optimizers": ("lion",)}),
    (ds.flat_state_dicts, {"kind": "model", "allow_meta": None}),
    (ds.nested_state_dicts, {"kind": "model", "optimizers": ()}),
    (ds.nested_state_dicts, {"kind": "both"}),
    (ds.nested_state_dicts, {"keyed": 0}),
    (ds.nested_state_dicts, {"optimizers": ("sgd", "rmsprop")}),
    (ds.nested_state_dicts, {"min_params": -2}),
    (ds.checkpoint_pairs, {"layout": "Flat"}),
    (ds.checkpoint_pairs, {"kind": "checkpoint"}),
    (ds.checkpoint_pairs, {"keyed": "id"}),  # the default layout is flat
    (ds.checkpoint_pairs, {"keyed": "id", "layout": "nested", "kind": "model"}),
    (ds.checkpoint_pairs, {"keyed": "id", "layout": "nested", "min_unexpected": 1}),
    (ds.checkpoint_pairs, {"min_mismatched": 7, "max_mismatched": 7}),  # > max_params=6
    (ds.checkpoint_pairs, {"optimizers": ("sgd",), "min_mismatched": 1}),
    (
        ds.checkpoint_pairs,
        {"optimizers": "sgd", "keyed": "id", "layout": "nested", "min_missing": 1},
    ),
    (ds.checkpoint_pairs, {"min_missing": 3, "max_missing": 2}),
    (ds.checkpoint_pairs, {"min_unexpected": -1}),
    (ds.checkpoint_pairs, {"max_mismatched": 1.5}),
    (ds.checkpoint_pairs, {"min_groups": 0}),
    (ds.checkpoint_pairs, {"min_params": 2, "max_params": 1}),
    (ds.checkpoint_pairs, {"allow_new_hyperparameters": None}),
    (ds.checkpoint_pairs, {"allow_meta": 0}),
    (ds.checkpoint_pairs, {"dtypes": torch.int8}),
    (ds.checkpoint_pairs, {"allow_missing_fields": 1}),
    (ds.checkpoint_pairs, {"allow_extra_keys": None}),
    (ds.checkpoint_pairs, {"allow_optimizer_entries": "yes"}),
    (ds.checkpoint_pairs, {"min_moved": -1}),
    (ds.checkpoint_pairs, {"min_moved": 2, "max_moved": 1}),
    (ds.checkpoint_pairs, {"max_moved": 1.0}),
    (ds.checkpoint_pairs, {"min_moved": 1, "max_moved": 1, "max_groups": 1}),
    (ds.checkpoint_pairs, {"min_moved": 6, "max_moved": 6, "min_mismatched": 1}),  # > 6 shared
    (ds.checkpoint_pairs, {"keyed": "id", "layout": "nested", "min_moved": 1, "max_moved": 1}),
    (ds.checkpoint_pairs, {"kind": "model", "min_moved": 1, "max_moved": 1}),
    (ds.checkpoint_pairs, {"kind": "model", "allow_missing_fields": True}),
    (ds.checkpoint_pairs, {"kind": "model", "allow_extra_keys": True}),
    (ds.checkpoint_pairs, {"kind": "model", "allow_optimizer_entries": True}),
    (ds.optimizer_state_dicts, {"allow_extra_keys": 1}),
    (ds.optimizer_state_dicts, {"allow_optimizer_entries": None}),
    (ds.nested_state_dicts, {"allow_extra_keys": "no"}),
    (ds.nested_state_dicts, {"kind": "model", "allow_extra_keys": True}),
    (ds.nested_state_dicts, {"kind": "model", "allow_optimizer_entries": True}),
]


@pytest.mark.parametrize(("strategy", "kwargs"), BAD, ids=[f"{s.__name__}-{k}" for s, k in BAD])
def test_bad_arguments_raise_invalid_argument_up_front(strategy, kwargs):
    with pytest.raises(InvalidArgument):
        strategy(**kwargs)  # no draw needed: validation is eager


@pytest.mark.parametrize(
    "strategy",
    [
        ds.fqns,
        ds.model_state_dicts,
        ds.optimizer_state_dicts,
        ds.flat_state_dicts,
        ds.nested_state_dicts,
        ds.checkpoint_pairs,
    ],
)
def test_arguments_are_keyword_only(strategy):
    with pytest.raises(TypeError):
        strategy("flat")


def test_good_edge_arguments_are_accepted():
    ds.fqns(min_layers=2, max_layers=2, max_experts=0).example()
    ds.optimizer_state_dicts(optimizers="adam", dtypes=torch.float64, min_params=0, max_params=0)
    ds.checkpoint_pairs(optimizers=("sgd",), min_missing=1)  # fqn-keyed: new params are missing
    ds.checkpoint_pairs(min_mismatched=6, max_mismatched=6, max_params=6)
    ds.checkpoint_pairs(min_mismatched=3, max_mismatched=3, min_moved=3, max_moved=3)
    # an upper bound alone asks for nothing those pairs cannot have (as max_unexpected)
    ds.checkpoint_pairs(kind="model", max_moved=2)
    ds.checkpoint_pairs(layout="nested", keyed="id", max_moved=2)
    ds.checkpoint_pairs(max_groups=1, max_moved=2)
    ds.nested_state_dicts(kind="checkpoint", allow_extra_keys=True, allow_optimizer_entries=True)


# -- contracts -------------------------------------------------------------------------


def _param_ids(sd):
    """Param ids (as flat-key spellings) of an optimizer state dict in either layout."""
    if dm.is_optimizer_state_dict(sd):
        return {str(p) for g in sd["param_groups"] for p in g["params"]}
    return {
        k[len("param_groups.") :].rpartition(".")[0] for k in sd if k.startswith("param_groups.")
    }


def _owners(keys, ids):
    """The parameter each flat key belongs to (the longest id it names)."""
    out = set()
    for key in keys:
        rest = key.split(".", 1)[1] if key.startswith(("state.", "param_groups.")) else key
        owner = max(
            (p for p in ids if rest == p or rest.startswith(p + ".")), key=len, default=None
        )
        assert owner is not None, key
        out.add(owner)
    return out


PAIR_ARGS = st.fixed_dictionaries(
    {
        "min_missing": st.integers(0, 2),
        "min_unexpected": st.integers(0, 2),
        "min_mismatched": st.integers(0, 2),
        "min_moved": st.integers(0, 1),
        "min_params": st.integers(1, 3),
    }
).map(
    lambda d: {
        **d,
        "max_missing": d["min_missing"] + 1,
        "max_unexpected": d["min_unexpected"] + 1,
        "max_mismatched": d["min_mismatched"] + 1,
        "max_moved": d["min_moved"] + 1,
        "max_params": d["min_params"] + 2,
    }
)


@given(
    st.data(), PAIR_ARGS, st.sampled_from(["flat", "nested"]), st.sampled_from(OPT := ds.OPTIMIZERS)
)
def test_checkpoint_pairs_have_the_differences_they_were_asked_for(data, args, layout, kind):
    if kind == "sgd" and args["min_mismatched"]:
        args = {**args, "min_mismatched": 0}
    c, r = data.draw(ds.checkpoint_pairs(layout=layout, optimizers=(kind,), **args))
    assert dm.classify(c) == dm.classify(r) == layout
    ids = _param_ids(c) | _param_ids(r)
    d = dm.diff(c, r)
    missing = _owners(d.missing, ids)
    # a removed parameter has param_groups keys; a reshaped Shampoo one only extra state
    unexpected = _owners([k for k in d.unexpected if k.startswith("param_groups.")], ids)
    mismatched = _owners(d.mismatched_keys, ids)
    assert args["min_missing"] <= len(missing) <= args["max_missing"]
    assert args["min_unexpected"] <= len(unexpected) <= args["max_unexpected"]
    assert args["min_mismatched"] <= len(mismatched) <= args["max_mismatched"]
    same = ids - missing - unexpected
    assert args["min_params"] <= len(same) <= args["max_params"]
    assert not missing & unexpected
    # moved parameters have the same keys on both sides; their weight decay tells them
    fc, fr = dm.flatten(c), dm.flatten(r)
    decay = [k for k in fc.keys() & fr.keys() if k.endswith(".weight_decay")]
    moved = _owners([k for k in decay if fc[k] != fr[k]], ids)
    assert args["min_moved"] <= len(moved) <= args["max_moved"]
    assert moved <= same - mismatched


@given(ds.checkpoint_pairs(layout="nested", keyed="id", min_missing=1, max_mismatched=0))
def test_id_keyed_pairs_have_the_same_int_ids_and_group_sizes(pair):
    c, r = pair
    assert [g["params"] for g in c["param_groups"]] == [g["params"] for g in r["param_groups"]]
    assert all(type(p) is int for g in r["param_groups"] for p in g["params"])
    assert set(c["state"]) < set(r["state"])  # the missing ones have no state


@given(ds.checkpoint_pairs(layout="nested", allow_new_hyperparameters=True, optimizers="adam"))
def test_new_hyperparameters_are_what_an_older_torch_lacks(pair):
    c, r = pair
    extra = {k.rpartition(".")[2] for k in dm.diff(c, r).missing if k.startswith("param_groups.")}
    assert extra <= {"decoupled_weight_decay", *r["param_groups"][0]}


# -- the opt-in features of real optimizers and trainers ---------------------------------

FEATURES = {
    "allow_missing_fields": True,
    "allow_extra_keys": True,
    "allow_optimizer_entries": True,
    "max_moved": 2,
}


def _groups_of(osd):
    """{param id: index of its group}."""
    return {p: i for i, g in enumerate(osd["param_groups"]) for p in g["params"]}


def _level(osd):
    """The optimizer-level parts: state entries that are no param id, and the other keys."""
    ids = _groups_of(osd)
    entries = {k: v for k, v in osd["state"].items() if k not in ids}
    return entries, {k: v for k, v in osd.items() if k not in ("state", "param_groups")}


@given(
    st.one_of(
        ds.checkpoint_pairs(layout="nested"),
        ds.checkpoint_pairs(layout="nested", keyed="id", max_unexpected=0),
        ds.checkpoint_pairs(layout="nested", allow_new_hyperparameters=True, allow_meta=True),
    )
)
def test_by_default_pairs_have_none_of_the_opt_in_features(pair):
    c, r = pair
    for osd in pair:
        assert _level(osd) == ({}, {})
        assert all(isinstance(e, dict) and e for e in osd["state"].values())
    moved = {p for p, i in _groups_of(r).items() if _groups_of(c).get(p, i) != i}
    assert not moved
    shared = c["state"].keys() & r["state"].keys()
    assert all(c["state"][p].keys() <= r["state"][p].keys() for p in shared)


@given(
    st.data(),
    st.sampled_from(["fqn", "id"]),
    st.integers(0, 2),
    st.sampled_from(ds.OPTIMIZERS),
)
def test_opt_in_features_are_what_they_say(data, keyed, moved, kind):
    args = {**FEATURES, "min_moved": moved, "max_moved": moved} if keyed == "fqn" else FEATURES
    if keyed == "id":
        args = {**args, "max_unexpected": 0}
    c, r = data.draw(ds.checkpoint_pairs(layout="nested", keyed=keyed, optimizers=kind, **args))
    c_groups, r_groups = _groups_of(c), _groups_of(r)
    # extra keys: only heavyball's, a mapping; the reference's fields are some of the checkpoint's
    (c_entries, c_extra), (r_entries, r_extra) = _level(c), _level(r)
    assert set(c_extra) | set(r_extra) <= {"heavyball"}
    if c_extra and r_extra:
        assert r_extra["heavyball"].keys() <= c_extra["heavyball"].keys()
    # optimizer-level entries: str keys that are no param id, leaves
    for entries in (c_entries, r_entries):
        assert set(entries) <= {"k", "global_step"}
        assert not any(isinstance(v, dict) for v in entries.values())
    # moved: exactly as many as asked, each in another group with another weight decay
    moved_ids = [p for p, i in r_groups.items() if p in c_groups and c_groups[p] != i]
    assert len(moved_ids) == (moved if keyed == "fqn" else 0)
    for p in moved_ids:
        old, new = c["param_groups"][c_groups[p]], r["param_groups"][r_groups[p]]
        assert old["weight_decay"] != new["weight_decay"]
        assert p in c["state"] or kind == "sgd"  # moved parameters are trained ones
    # missing fields: the reference never has a state field the checkpoint lacks for a
    # parameter the checkpoint has state for (but a reshaped parameter's Shampoo factors)
    d = dm.diff(c, r)
    reshaped = {m.key.split(".")[1] for m in d.mismatched} if keyed == "fqn" else set()
    for p in c["state"].keys() & r["state"].keys() & c_groups.keys():
        if str(p) not in {x.split(".factor")[0] for x in reshaped}:
            assert r["state"][p].keys() <= c["state"][p].keys(), p


def _has(strategy, predicate):
    # generate only: an example exists; no need to shrink it
    find(strategy, predicate, settings=settings(max_examples=500, phases=[Phase.generate]))


def _moved(pair):
    c, r = pair
    c_groups = _groups_of(c)
    return [p for p, i in _groups_of(r).items() if p in c_groups and c_groups[p] != i]


def test_each_opt_in_feature_is_drawn():
    pairs = ds.checkpoint_pairs(layout="nested", **FEATURES)
    # heavyball's key on either side or both, and a reference with fewer of its fields
    _has(pairs, lambda p: "heavyball" in p[0] and "heavyball" not in p[1])
    _has(pairs, lambda p: "heavyball" in p[1] and "heavyball" not in p[0])
    _has(pairs, lambda p: "heavyball" in p[0] and 0 < len(p[1].get("heavyball", ())) < 3)
    # MADGRAD's state['k'] on either side, first or last in the state
    _has(pairs, lambda p: "k" in p[0]["state"] and "k" not in p[1]["state"])
    _has(pairs, lambda p: "global_step" in p[1]["state"] and "global_step" not in p[0]["state"])
    _has(pairs, lambda p: next(iter(p[0]["state"]), None) == "k")
    _has(pairs, lambda p: list(p[1]["state"])[-1:] == ["k"])
    # references lacking fields: a changed config, one field less, an empty entry, no entry
    _has(
        pairs,
        lambda p: (
            any("max_exp_avg_sq" in e for e in p[0]["state"].values() if isinstance(e, dict))
            and p[0]["param_groups"][0]["amsgrad"]
            and not p[1]["param_groups"][0]["amsgrad"]
        ),
    )
    _has(pairs, lambda p: any(e == {} for e in p[1]["state"].values()))
    _has(
        pairs,
        lambda p: any(
            isinstance(e, dict) and 0 < len(e) < len(p[0]["state"].get(pid, ()))
            for pid, e in p[1]["state"].items()
        ),
    )
    _has(
        pairs,
        lambda p: any(
            pid not in p[1]["state"]
            for pid in p[1]["param_groups"][0]["params"]
            if pid in p[0]["state"]
        ),
    )
    # moved parameters: two; one alone in its new group (so its old group is that group's
    # majority); a group emptied
    _has(pairs, lambda p: len(_moved(p)) == 2)
    _has(
        pairs,
        lambda p: any(
            len(g["params"]) == 1 and g["params"][0] in _moved(p) for g in p[1]["param_groups"]
        ),
    )
    _has(pairs, lambda p: any(not g["params"] for g in p[1]["param_groups"]))
    _has(
        ds.checkpoint_pairs(layout="flat", min_moved=1, max_moved=1),
        lambda p: any(v != p[1].get(k, v) for k, v in p[0].items() if k.endswith(".weight_decay")),
    )
    # single optimizer state dicts
    _has(ds.optimizer_state_dicts(allow_extra_keys=True), lambda o: "heavyball" in o)
    _has(ds.optimizer_state_dicts(allow_optimizer_entries=True), lambda o: "k" in o["state"])
    _has(
        ds.optimizer_state_dicts(layout="flat", allow_optimizer_entries=True),
        lambda f: "state.global_step" in f,
    )
    _has(
        ds.nested_state_dicts(kind="checkpoint", allow_extra_keys=True),
        lambda sd: "heavyball" in sd["optim"],
    )


@given(ds.nested_state_dicts(kind="checkpoint"))
def test_whole_checkpoints_have_one_set_of_parameters(sd):
    assert set(sd) == {"model", "optim", "step"}
    assert _param_ids(sd["optim"]) == set(sd["model"])


@given(ds.optimizer_state_dicts(dtypes=[torch.float64], optimizers=["adam", "shampoo"]))
def test_dtypes_and_optimizers_are_respected(osd):
    tensors = [v for v in dm.flatten(osd).values() if isinstance(v, torch.Tensor) and v.dim()]
    assert all(t.dtype == torch.float64 for t in tensors)
    assert all(
        {"step", "exp_avg"} <= set(e) or "factor_matrices" in e for e in osd["state"].values()
    )


def test_each_optimizer_kind_and_form_is_drawn():
    def has(strategy, predicate):
        # generate only: an example exists; no need to shrink it
        find(strategy, predicate, settings=settings(max_examples=500, phases=[Phase.generate]))

    has(
        ds.optimizer_state_dicts(min_params=1),
        lambda o: any("exp_avg_sq" in e for e in o["state"].values()),
    )
    has(
        ds.optimizer_state_dicts(min_params=1),
        lambda o: any("momentum_buffer" in e for e in o["state"].values()),
    )
    has(
        ds.optimizer_state_dicts(min_params=1),
        lambda o: any(isinstance(e.get("factor_matrices"), dict) for e in o["state"].values()),
    )
    has(
        ds.optimizer_state_dicts(min_params=2),
        lambda o: not o["state"] and "momentum" in o["param_groups"][0],
    )
    has(ds.optimizer_state_dicts(min_groups=3), lambda o: len(o["param_groups"]) == 3)
    has(ds.optimizer_state_dicts(), lambda o: isinstance(o["param_groups"][0].get("betas"), tuple))
    has(
        ds.nested_state_dicts(keyed="id", min_params=1),
        lambda o: 0 in o["param_groups"][0]["params"],
    )
    has(
        ds.flat_state_dicts(min_params=1),
        lambda f: any(k.startswith("state.model.layers.") for k in f),
    )
    has(ds.fqns(), lambda f: ".mlp.experts." in f)
    has(ds.fqns(), lambda f: ".indexer." in f)
    has(
        ds.model_state_dicts(min_params=1, allow_meta=True),
        lambda m: any(t.is_meta and t.numel() > 10**6 for t in m.values()),
    )
    has(ds.model_state_dicts(min_params=3), lambda m: len({t.dtype for t in m.values()}) == 3)


@given(ds.model_state_dicts(max_params=4))
def test_without_allow_meta_every_tensor_is_small_and_real(sd):
    assert all(not t.is_meta and t.numel() <= 9 for t in sd.values())


# -- shrinking ---------------------------------------------------------------------------


SHRINK = settings(database=None, derandomize=True, phases=[Phase.generate, Phase.shrink])


def test_pairs_shrink_to_a_minimal_readable_example():
    c, r = find(
        ds.checkpoint_pairs(layout="nested", max_params=3),
        lambda p: bool(dm.diff(*p).missing),
        settings=SHRINK,
    )
    # one group; one parameter on both sides and one missing; scalar float32 tensors
    assert len(r["param_groups"]) == len(c["param_groups"]) == 1
    assert len(r["param_groups"][0]["params"]) == 2
    assert len(_owners(dm.diff(c, r).missing, _param_ids(r))) == 1
    tensors = [v for v in dm.flatten(r).values() if isinstance(v, torch.Tensor)]
    assert all(t.shape == () and t.dtype == torch.float32 for t in tensors)


def test_flat_state_dicts_shrink_to_one_short_fqn():
    flat = find(
        ds.flat_state_dicts(max_params=3), lambda f: len(f) > 0, settings=settings(database=None)
    )
    assert _param_ids(flat) == {"model.embed.weight"}
