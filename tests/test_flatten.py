from __future__ import annotations

import copy
import re

import pytest
import torch
from conftest import Snapshot, same_tree
from helpers import rows_reordered
from hypothesis import given, settings
from hypothesis import strategies as st
from optimizers import ShampooLike
from torch import nn

import dsdmerge as dm
from dsdmerge.strategies import optimizer_state_dicts

torch_flatten = pytest.importorskip("torch.distributed.checkpoint.state_dict")
_flatten_optim = getattr(torch_flatten, "_flatten_optim_state_dict", None)
needs_private = pytest.mark.skipif(
    _flatten_optim is None, reason="this torch has no _flatten_optim_state_dict"
)


def trained(model: nn.Module, optim: torch.optim.Optimizer, steps: int = 2) -> None:
    for _ in range(steps):
        model(torch.randn(3, 4)).sum().backward()
        optim.step()
        optim.zero_grad()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.frozen_ish = nn.Linear(4, 4)  # never used: no grads, no state
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def dsd_nested(optim_factory):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    torch.manual_seed(0)
    model = Net()
    optim = optim_factory(model)
    trained(model, optim)
    return get_optimizer_state_dict(model, optim)


OPTIMS = {
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
    "adamw-two-groups": lambda m: torch.optim.AdamW(
        [
            {"params": [p for n, p in m.named_parameters() if "weight" in n], "weight_decay": 0.1},
            {"params": [p for n, p in m.named_parameters() if "bias" in n], "weight_decay": 0.0},
        ],
        lr=1e-3,
    ),
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
    "sgd-momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    "shampoo-like": lambda m: ShampooLike(m.parameters(), lr=0.1),
}


@needs_private
@pytest.mark.parametrize("name", sorted(OPTIMS))
def test_flatten_matches_torch_key_for_key(name):
    nested = dsd_nested(OPTIMS[name])
    ours = dm.flatten(nested)
    theirs = _flatten_optim(copy.deepcopy(nested))  # torch's pops "params": give it a copy
    assert list(ours) == list(theirs)
    for key, value in ours.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, theirs[key])
        else:
            assert value == theirs[key]


@needs_private
def test_flatten_of_shampoo_like_nested_state_matches_torch():
    nested = {
        "state": {
            "w": {
                "step": torch.tensor(2.0),
                "factor": {"left": torch.ones(2), "right": torch.ones(3)},
            }
        },
        "param_groups": [{"lr": 0.1, "params": ["w"]}],
    }
    assert list(dm.flatten(nested)) == list(_flatten_optim(copy.deepcopy(nested)))
    assert "state.w.factor.left" in dm.flatten(nested)


@pytest.mark.parametrize("name", sorted(OPTIMS))
def test_flatten_does_not_mutate_and_shares_leaves(name):
    nested = dsd_nested(OPTIMS[name])
    snap = Snapshot(nested)
    flat = dm.flatten(nested)
    assert snap.unchanged()
    for fqn, entry in nested["state"].items():
        for state_name, value in entry.items():
            if isinstance(value, dict):  # nested (Shampoo-like) state: one key per sub-leaf
                for sub, leaf in value.items():
                    assert flat[f"state.{fqn}.{state_name}.{sub}"] is leaf
            else:
                assert flat[f"state.{fqn}.{state_name}"] is value
    assert all("params" in g for g in nested["param_groups"])


def test_int_ids_flatten_to_decimal_strings():
    osd = {
        "state": {0: {"step": 1}, 12: {"step": 2}},
        "param_groups": [{"lr": 0.1, "params": [0, 12]}],
    }
    assert dm.flatten(osd) == {
        "state.0.step": 1,
        "state.12.step": 2,
        "param_groups.0.lr": 0.1,
        "param_groups.12.lr": 0.1,
    }


def test_other_nested_mappings_flatten_to_dotted_paths():
    sd = {"model": {"layers": {"0": {"w": 1}}}, "epoch": 3}
    assert dm.flatten(sd) == {"model.layers.0.w": 1, "epoch": 3}


def test_optimizer_inside_a_checkpoint_flattens_like_torch_under_its_prefix():
    sd = {"optim": {"state": {"w": {"step": 1}}, "param_groups": [{"lr": 0.5, "params": ["w"]}]}}
    assert dm.flatten(sd) == {"optim.state.w.step": 1, "optim.param_groups.w.lr": 0.5}


def test_flatten_of_flat_dict_is_a_new_equal_dict():
    flat = {"a": torch.zeros(1), "b": 2}
    out = dm.flatten(flat)
    assert out == flat or out.keys() == flat.keys()
    assert out is not flat
    assert all(out[k] is flat[k] for k in flat)


@pytest.mark.parametrize(
    "colliding",
    [
        {"a.b": {"c": 1}, "a": {"b.c": 2}},
        {"a": {1: 1, "1": 2}},
        {"state": {}, "param_groups": [{"lr": 1, "params": ["w"]}, {"lr": 2, "params": ["w"]}]},
    ],
)
def test_collisions_raise_layout_error_naming_the_key(colliding):
    with pytest.raises(dm.LayoutError, match="same key"):
        dm.flatten(colliding)


def test_cycles_raise_layout_error():
    cyclic: dict = {"a": {}}
    cyclic["a"]["b"] = cyclic
    with pytest.raises(dm.LayoutError, match="cycle"):
        dm.flatten(cyclic)


def test_deep_nesting_does_not_hit_the_recursion_limit():
    deep: dict = {}
    node = deep
    for _ in range(10_000):
        node["n"] = {}
        node = node["n"]
    node["leaf"] = 1
    flat = dm.flatten(deep)
    assert list(flat.values()) == [1]
    rebuilt = dm.unflatten(flat)
    assert dm.flatten(rebuilt) == flat


@pytest.mark.parametrize("key", [None, 1.5, b"x", (1, 2), True])
def test_bad_key_types_raise_state_dict_type_error(key):
    with pytest.raises(dm.StateDictTypeError, match="keys must be str"):
        dm.flatten({"m": {key: 1}})


def test_unflatten_without_like_rebuilds_fqn_keyed_dsd_form():
    flat = {
        "state.layers.0.w.step": 3,
        "state.layers.0.w.exp_avg": "ea",
        "param_groups.layers.0.w.lr": 0.1,
        "param_groups.layers.0.w.wd": 0.1,
        "param_groups.b.lr": 0.1,
        "param_groups.b.wd": 0.0,
        "param_groups.c.lr": 0.1,
        "param_groups.c.wd": 0.1,
    }
    assert dm.unflatten(flat) == {
        "state": {"layers.0.w": {"step": 3, "exp_avg": "ea"}},
        "param_groups": [
            {"lr": 0.1, "wd": 0.1, "params": ["layers.0.w", "c"]},
            {"lr": 0.1, "wd": 0.0, "params": ["b"]},
        ],
    }


def test_unflatten_without_like_splits_other_dicts_on_dots():
    assert dm.unflatten({"model.a.w": 1, "step": 2}) == {"model": {"a": {"w": 1}}, "step": 2}


def test_unflatten_with_like_restores_int_ids_groups_and_dotted_fqns():
    like = {
        "state": {0: {"step": 1, "nested": {0: "x"}}},
        "param_groups": [{"lr": 0.1, "params": [0]}, {"lr": 0.2, "params": [1]}],
    }
    flat = dm.flatten(like)
    assert dm.unflatten(flat, like=like) == like


def test_unflatten_with_like_places_state_for_params_like_has_no_state_for():
    like = {"state": {}, "param_groups": [{"lr": 0.1, "params": ["a.w", "b.w"]}]}
    flat = {"state.b.w.step": 4, "param_groups.a.w.lr": 0.3, "param_groups.b.w.lr": 0.3}
    assert dm.unflatten(flat, like=like) == {
        "state": {"b.w": {"step": 4}},
        "param_groups": [{"lr": 0.3, "params": ["a.w", "b.w"]}],
    }


def test_unflatten_with_like_rejects_keys_for_unknown_params():
    like = {"state": {}, "param_groups": [{"lr": 0.1, "params": ["a"]}]}
    with pytest.raises(dm.LayoutError, match="no place"):
        dm.unflatten({"param_groups.a.lr": 0.1, "state.zzz.step": 1}, like=like)


def test_unflatten_with_like_places_the_optimizers_own_keys_like_lacks():
    # was: "like has no place ... They name parameters" for a flat merge's heavyball key and
    # MADGRAD's state['k'] when the reference (an optimizer that has not stepped) has none yet
    like = {"state": {}, "param_groups": [{"lr": 0.1, "params": ["a"]}]}
    k = torch.tensor([3])
    flat = {"state.k": k, "param_groups.a.lr": 0.2, "heavyball.step": 3, "heavyball.d.x": 1}
    out = dm.unflatten(flat, like=like)
    assert list(out) == ["state", "param_groups", "heavyball"]
    assert out["state"]["k"] is k
    assert out["heavyball"] == {"step": 3, "d": {"x": 1}}
    assert dm.flatten(out) == flat  # as without like
    assert dm.unflatten(flat)["state"]["k"] is k
    # a parameter's state is a mapping: a leaf where it belongs has no place
    with pytest.raises(dm.LayoutError, match="no place"):
        dm.unflatten({"state.a": 1, "param_groups.a.lr": 0.1}, like=like)
    with pytest.raises(dm.LayoutError, match="both a value and a prefix"):
        dm.unflatten({"param_groups.a.lr": 0.1, "state": 1}, like=like)


def test_unflatten_rejects_group_members_that_disagree():
    like = {"state": {}, "param_groups": [{"lr": 0.1, "params": ["a", "b"]}]}
    with pytest.raises(dm.LayoutError, match="disagree on 'lr'"):
        dm.unflatten({"param_groups.a.lr": 0.1, "param_groups.b.lr": 0.2}, like=like)


def test_unflatten_rejects_nested_input_and_leaf_prefix_conflicts():
    with pytest.raises(dm.LayoutError, match="flat"):
        dm.unflatten({"a": {"b": 1}})
    with pytest.raises(dm.LayoutError, match="prefix"):
        dm.unflatten({"a": 1, "a.b": 2})


@pytest.mark.parametrize("name", sorted(OPTIMS))
def test_round_trip_on_real_dsd_state(name):
    nested = dsd_nested(OPTIMS[name])
    snap = Snapshot(nested)
    back = dm.unflatten(dm.flatten(nested), like=nested)
    assert same_tree(back, nested)
    assert snap.unchanged()


def test_round_trip_on_int_keyed_optimizer_state_dict():
    torch.manual_seed(0)
    model = Net()
    optim = torch.optim.AdamW(model.parameters())
    trained(model, optim)
    osd = optim.state_dict()
    back = dm.unflatten(dm.flatten(osd), like=osd)
    assert same_tree(back, osd)
    fresh = torch.optim.AdamW(Net().parameters())
    fresh.load_state_dict(back)


def two_optimizers_dsd(flatten: bool):
    """Real DSD state of two optimizers on one model (Muon-style split), one param frozen."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    torch.manual_seed(0)
    model = Net()
    model.a.bias.requires_grad_(False)
    adamw = torch.optim.AdamW([p for p in model.parameters() if p.dim() == 2], lr=1e-3)
    sgd = torch.optim.SGD([p for p in model.parameters() if p.dim() == 1], lr=0.1, momentum=0.9)
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        adamw.step()
        sgd.step()
        adamw.zero_grad()
        sgd.zero_grad()
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    return model, (adamw, sgd), get_optimizer_state_dict(model, (adamw, sgd), options=options)


@needs_private
def test_flatten_matches_torch_for_several_optimizers_and_frozen_params():
    _, _, nested = two_optimizers_dsd(flatten=False)
    _, _, flat = two_optimizers_dsd(flatten=True)
    ours = dm.flatten(nested)
    assert list(ours) == list(flat)
    assert list(ours) == list(_flatten_optim(copy.deepcopy(nested)))
    assert "state.a.bias.momentum_buffer" not in ours  # frozen: no state
    assert "param_groups.a.bias.lr" in ours


@pytest.mark.parametrize("like", [True, False], ids=["like", "without-like"])
@pytest.mark.parametrize("name", sorted(OPTIMS))
def test_unflatten_output_loads_through_set_optimizer_state_dict(name, like):
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    flat_options = StateDictOptions(flatten_optimizer_state_dict=True)
    torch.manual_seed(0)
    model = Net()
    optim = OPTIMS[name](model)
    trained(model, optim)
    saved = copy.deepcopy(get_optimizer_state_dict(model, optim, options=flat_options))

    model2 = Net()
    optim2 = OPTIMS[name](model2)
    reference = get_optimizer_state_dict(model2, optim2) if like else None
    # frozen_ish never gets a gradient: give it the reference's state so torch can load it
    full = dm.merge(saved, reference) if like else saved
    nested = dm.unflatten(full, like=reference)
    strict = StateDictOptions(strict=like)  # without like, stateless params have no entry
    set_optimizer_state_dict(model2, optim2, nested, options=strict)
    resumed = get_optimizer_state_dict(model2, optim2, options=flat_options)
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(resumed[key], value), key
        else:
            assert resumed[key] == value, key


def test_unflatten_output_loads_for_several_optimizers():
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    _, _, flat = two_optimizers_dsd(flatten=True)
    saved = copy.deepcopy(flat)
    model, optims, _ = two_optimizers_dsd(flatten=True)
    for o in optims:
        o.state.clear()
    reference = get_optimizer_state_dict(model, optims)
    # frozen_ish never got a gradient: backfill it from the reference so strict DSD loads
    nested = dm.unflatten(dm.merge(saved, reference), like=reference)
    set_optimizer_state_dict(model, optims, nested)
    resumed = get_optimizer_state_dict(
        model, optims, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(resumed[key], value), key


@pytest.mark.parametrize("bad", [[1], None, 1.5, "cycle"])
def test_bad_param_ids_are_refused_even_in_a_group_without_hyperparameters(bad):
    # such a group writes no flat key, but unflatten, diff and merge refuse its ids: so must flatten
    params: list = []
    params.append(params if bad == "cycle" else bad)
    osd = {"state": {}, "param_groups": [{"params": params}]}
    for call in (dm.flatten, lambda x: dm.unflatten({}, like=x), lambda x: dm.diff(x, x)):
        with pytest.raises(dm.StateDictTypeError, match=r"param_groups\[0\]"):
            call(osd)


# --------------------------------------------------------------------------------------
# unflatten's shortcut: runs of keys in flat's own order are sliced, not looked up


@given(
    st.lists(st.text("abc.", min_size=1, max_size=4), min_size=0, max_size=300, unique=True),
    st.lists(st.text("abc.", min_size=1, max_size=4), min_size=0, max_size=300),
    st.integers(0, 2**32 - 1),
    st.integers(0, 3),
)
def test_values_of_equals_one_lookup_per_key(flat_keys, extra, seed, how):
    """_Unflattener._values_of (runs compared, the rest by hash) and _values_of_rows (one
    joined comparison) equal ``[flat.get(k, MISSING) for k in keys]``, whatever the order."""
    import importlib
    import random

    from dsdmerge._values import MISSING

    unflatten_module = importlib.import_module("dsdmerge.flatten")
    rng = random.Random(seed)
    flat = {k: object() for k in flat_keys}
    keys = list(flat_keys)
    if how == 1:  # a few keys moved elsewhere, some absent from flat
        for _ in range(rng.randint(1, 5)):
            if keys:
                keys.append(keys.pop(rng.randrange(len(keys))))
        keys[rng.randrange(len(keys) + 1) : 0] = extra[:5]
    elif how == 2:
        rng.shuffle(keys)
    elif how == 3:  # flat has extra keys among the ones asked for
        keys = [k for k in keys if rng.random() < 0.9]
    u = unflatten_module._Unflattener(flat)
    u.after = rng.randrange(len(flat) + 1)
    assert u._values_of(keys) == [flat.get(k, MISSING) for k in keys]
    bases = sorted({k.partition(".")[0] + "." for k in flat_keys})
    names = sorted({k.rpartition(".")[2] for k in flat_keys})[:3]
    want = [b + n for b in bases for n in names]
    u = unflatten_module._Unflattener(flat)
    assert u._values_of_rows(bases, names) == [flat.get(k, MISSING) for k in want]
    ordered = {k: object() for k in want}
    u = unflatten_module._Unflattener(ordered)
    assert u._values_of_rows(bases, names) == list(ordered.values())


def test_unflatten_keys_holding_nul_are_looked_up():
    """A NUL inside keys cannot fool _values_of_rows' joined comparison: like's members
    ``x`` and ``y<NUL>param_groups.z`` spell the same NUL-joined text as flat's keys
    ``param_groups.x.lr<NUL>param_groups.y`` and ``param_groups.z.lr``, other keys."""
    members = ["x", "y\0param_groups.z", *(f"p{i}" for i in range(70))]
    like = {"state": {}, "param_groups": [{"lr": 0.1, "params": members}]}
    flat = {f"param_groups.{m}.lr": 0.2 for m in members}
    assert dm.unflatten(flat, like=like)["param_groups"][0]["lr"] == 0.2
    bad = {
        "param_groups.x.lr\0param_groups.y": 0.3,
        "param_groups.z.lr": 0.3,
        **{f"param_groups.p{i}.lr": 0.2 for i in range(70)},
    }
    with pytest.raises(dm.LayoutError, match="no place"):
        dm.unflatten(bad, like=like)


# --------------------------------------------------------------------------------------
# unflatten without like: the by-rows path (torch's layout) equals the key-by-key path


def _key_by_key(flat):
    """unflatten with its by-rows shortcuts turned off (the plain, key-by-key path)."""
    import importlib

    module = importlib.import_module("dsdmerge.flatten")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module.PgTable, "of", classmethod(lambda cls, r: None))
        mp.setattr(module, "_state_by_rows", lambda *args: None)
        return dm.unflatten(flat)


def _same_nested(a, b):
    """The same structure, key order included, and the same leaves (strings equal)."""
    if isinstance(a, dict):
        assert type(b) is dict
        assert list(a) == list(b)
        for k in a:
            _same_nested(a[k], b[k])
    elif isinstance(a, list):
        assert type(b) is list
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same_nested(x, y)
    else:
        assert a is b or (type(a) is str and a == b), (a, b)


@settings(max_examples=300)  # a few milliseconds per example
@given(
    optimizer_state_dicts(
        layout="flat", min_params=1, max_params=8, max_groups=3, allow_optimizer_entries=True
    ),
    st.integers(0, 2**32 - 1),
    st.sampled_from(
        [
            "torch",
            "shuffled",
            "one state key dropped",
            "one state name changed",
            "groups in their own orders",
            "equal copies",
        ]
    ),
)
def test_unflatten_by_rows_equals_key_by_key(flat, seed, how):
    import random

    rng = random.Random(seed)
    if how == "shuffled":
        keys = list(flat)
        rng.shuffle(keys)
        flat = {k: flat[k] for k in keys}
    elif how == "one state key dropped":
        state = [k for k in flat if k.startswith("state.")]
        if state:
            flat = {k: v for k, v in flat.items() if k != rng.choice(state)}
    elif how == "one state name changed":  # not torch's shape any more: key by key
        state = [k for k in flat if k.startswith("state.")]
        if len(state) > 1:
            renamed = state[-1].rpartition(".")[0] + ".renamed"
            flat = {(renamed if k == state[-1] else k): v for k, v in flat.items()}
    elif how == "groups in their own orders":
        flat = rows_reordered(flat, rng.choice([0.0, 0.5]))
    elif how == "equal copies":  # equal hyperparameters that are other objects
        flat = {
            k: float(repr(v)) if type(v) is float and rng.random() < 0.3 else v
            for k, v in flat.items()
        }
    try:
        expected, error = _key_by_key(flat), None
    except dm.LayoutError as err:
        expected, error = None, str(err)
    if error is not None:
        with pytest.raises(dm.LayoutError, match=re.escape(error)):
            dm.unflatten(flat)
        return
    out = dm.unflatten(flat)
    _same_nested(out, expected)
    # the groups, by their definition: parameters whose hyperparameters are all equal (names
    # and values, equal objects or not), in order of first appearance
    from dsdmerge._values import freeze

    hyper: dict = {}
    for key, v in flat.items():
        if key.startswith("param_groups."):
            fqn, _, name = key[len("param_groups.") :].rpartition(".")
            hyper.setdefault(fqn, {})[name] = v
    naive: dict = {}
    for fqn, values in hyper.items():
        naive.setdefault(tuple((n, freeze(v)) for n, v in values.items()), []).append(fqn)
    assert [g["params"] for g in out["param_groups"]] == list(naive.values())


def test_unflatten_reads_a_state_name_off_the_pattern_key_by_key():
    """One parameter's state names differ from the first parameter's: the by-rows shortcut
    must notice (its joined comparison) and read that key as it is."""
    names = ("step", "exp_avg", "exp_avg_sq")
    flat = {f"state.p{i}.{n}": (i, n) for i in range(3) for n in names}
    flat |= {f"param_groups.p{i}.lr": 0.1 for i in range(3)}
    flat = {("state.p1.other" if k == "state.p1.exp_avg" else k): v for k, v in flat.items()}
    out = dm.unflatten(flat)
    assert out["state"]["p1"] == {
        "step": (1, "step"),
        "other": (1, "exp_avg"),
        "exp_avg_sq": (1, "exp_avg_sq"),
    }
    assert out["state"]["p0"] == {n: (0, n) for n in names}
    assert out["param_groups"] == [{"lr": 0.1, "params": ["p0", "p1", "p2"]}]


def test_unflatten_groups_by_equal_hyperparameters_not_by_objects():
    """Groups without like: equal values are one group whatever their objects (NaN, a tuple
    spelled twice, floats as torch.load gives them), values of other types are not (1, 1.0
    and True are == but not equal hyperparameters)."""
    nan1, nan2 = float("nan"), float("nan")
    rows = {
        "a": {"lr": float("0.001"), "betas": (0.9, 0.99), "eps": nan1},
        "b": {"lr": float("0.001"), "betas": (0.9, 0.99), "eps": nan2},  # equal, other objects
        "c": {"lr": 1, "betas": (0.9, 0.99), "eps": nan1},
        "d": {"lr": 1.0, "betas": (0.9, 0.99), "eps": nan1},
        "e": {"lr": True, "betas": (0.9, 0.99), "eps": nan1},
        "f": {"lr": 1.0, "betas": (0.9, 0.99), "eps": float("nan")},
    }
    flat = {f"param_groups.{p}.{n}": v for p, hp in rows.items() for n, v in hp.items()}
    flat = {**{f"state.{p}.step": 1 for p in rows}, **flat}
    groups = dm.unflatten(flat)["param_groups"]
    assert [g["params"] for g in groups] == [["a", "b"], ["c"], ["d", "f"], ["e"]]
    assert [type(g["lr"]) for g in groups] == [float, int, float, bool]
