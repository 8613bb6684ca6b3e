"""dsdmerge.rename: one rule set for every place an fqn appears; laws, presets, suggestions."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from conftest import Snapshot, leaves, same_tree
from helpers import quietly, taking_reference
from hypothesis import given
from hypothesis import strategies as st

import dsdmerge as dm
from dsdmerge.strategies import checkpoint_pairs, flat_state_dicts, nested_state_dicts

# -- laws -----------------------------------------------------------------------------

# every kind of state dict the strategies draw: flat and nested, fqn- and id-keyed, models,
# optimizers, whole checkpoints
state_dicts = st.one_of(
    flat_state_dicts(),
    flat_state_dicts(kind="model"),
    flat_state_dicts(kind="checkpoint", min_params=1),
    flat_state_dicts(allow_meta=True),
    nested_state_dicts(),
    nested_state_dicts(keyed="id"),
    nested_state_dicts(kind="checkpoint"),
    nested_state_dicts(kind="checkpoint", keyed="id"),
    nested_state_dicts(kind="model"),
)
# a rule and its inverse (the strategies' fqns hold no "module." and no "attention")
inverses = st.sampled_from(
    [
        ({r"^": "module."}, {r"^module\.": ""}),
        ({r"\.attn\.": ".attention."}, {r"\.attention\.": ".attn."}),
        ({r"(?<![^.])(\d+)\.": r"\1._orig_mod."}, "compile"),
        ({r"^model\.": "base_model.model.model."}, "peft"),
    ]
)


def same_but_names(a, b) -> bool:
    """Equal as state dicts: same structure and keys, identical leaves except param_names lists."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_but_names(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_but_names(x, y) for x, y in zip(a, b, strict=True))
    return a is b or (type(a) is str and a == b)


@given(state_dicts, inverses)
def test_rename_then_inverse_is_the_identity(sd, rules):
    forward, back = rules
    snap = Snapshot(sd)
    there = quietly(dm.rename, sd, forward)
    assert same_but_names(quietly(dm.rename, there, back), sd)
    assert snap.unchanged()


@given(state_dicts, inverses)
def test_rename_shares_every_leaf_and_no_container(sd, rules):
    out = quietly(dm.rename, sd, rules[0])
    ids = {id(x) for x in leaves(sd)}
    assert all(id(x) in ids for x in leaves(out) if not isinstance(x, str))
    containers = set()
    stack = [sd]
    while stack:
        node = stack.pop()
        if isinstance(node, (dict, list)):
            containers.add(id(node))
            stack.extend(node.values() if isinstance(node, dict) else node)
    stack = [out]
    while stack:
        node = stack.pop()
        if isinstance(node, (dict, list)):
            assert id(node) not in containers
            stack.extend(node.values() if isinstance(node, dict) else node)


nested_with_fqns = st.one_of(
    nested_state_dicts(),
    nested_state_dicts(keyed="id"),
    nested_state_dicts(kind="checkpoint", min_params=1),
    nested_state_dicts(kind="checkpoint", keyed="id", min_params=1),
    nested_state_dicts(allow_meta=True),
)


@given(nested_with_fqns, inverses)
def test_rename_commutes_with_flatten(sd, rules):
    """Where the flat form says where fqns start (models, optimizers, checkpoints with one)."""
    assert same_but_names(
        dm.flatten(quietly(dm.rename, sd, rules[0])), quietly(dm.rename, dm.flatten(sd), rules[0])
    )


@given(flat_state_dicts(kind="model"), inverses)
def test_a_model_state_dict_renames_key_by_key(sd, rules):
    forward = rules[0]
    out = quietly(dm.rename, sd, forward)
    [(pattern, replacement)] = forward.items()
    assert list(out) == [re.sub(pattern, replacement, k) for k in sd]
    assert all(out[re.sub(pattern, replacement, k)] is v for k, v in sd.items())


@given(
    st.one_of(
        checkpoint_pairs(layout="flat"),
        checkpoint_pairs(layout="nested"),
        checkpoint_pairs(layout="nested", keyed="id", max_unexpected=0),
        checkpoint_pairs(layout="flat", kind="model"),
    ),
    inverses,
)
def test_merging_through_a_rename_equals_merging_the_renamed_checkpoint(pair, rules):
    ckpt, ref = pair
    forward, back = rules
    moved = quietly(dm.rename, ckpt, forward)  # as a wrapper or a refactor saved it
    merging = dm.DEFAULT.replace(unmatched_rename="ignore")
    through = taking_reference(dm.merge_with_diff, moved, ref, policy=merging, rename=back)
    renamed_back = quietly(dm.rename, moved, back)
    direct = taking_reference(dm.merge_with_diff, renamed_back, ref, policy=merging)
    assert same_but_names(through.state_dict, direct.state_dict)
    assert through.diff == direct.diff
    # and the renamed-back checkpoint is the original one: the rename lost nothing
    assert same_but_names(taking_reference(dm.merge, ckpt, ref, policy=merging), through.state_dict)


@given(checkpoint_pairs(layout="flat", min_unexpected=1, min_missing=1))
def test_diff_never_suggests_a_rename_that_does_not_explain_keys(pair):
    ckpt, ref = pair
    d = dm.diff(ckpt, ref)
    for s in d.renames:  # the strategies rename nothing, so any suggestion must still hold
        renamed = dm.rename(ckpt, {s.pattern: s.replacement})
        assert len(dm.diff(renamed, ref).unexpected) <= len(d.unexpected) - s.keys


@given(
    st.one_of(
        checkpoint_pairs(layout="flat", max_mismatched=0),
        checkpoint_pairs(layout="nested", max_mismatched=0),
    )
)
def test_diff_suggests_the_rule_a_refactor_applied_and_it_explains_every_key(pair):
    ckpt, ref = pair
    moved = quietly(dm.rename, ckpt, {r"\.attn\.wq\.": ".attn.query."})
    plain = dm.diff(ckpt, ref)
    d = dm.diff(moved, ref)
    moved_keys = [k for k in d.unexpected if ".attn.query." in k]
    back = {k.replace(".attn.query.", ".attn.wq.") for k in moved_keys}
    if plain.unexpected or not moved_keys or not back <= set(dm.flatten(ref)):
        return  # no wq parameter both sides have, or others another rule could explain
    assert [(s.pattern, s.replacement) for s in d.renames] == [(r"\.attn\.query\.", ".attn.wq.")]
    assert dm.diff(moved, ref, rename=d.suggested_rules) == plain


# -- examples ---------------------------------------------------------------------------


def adam_osd(fqns):
    return {
        "state": {f: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)} for f in fqns},
        "param_groups": [{"lr": 0.1, "params": list(fqns), "param_names": list(fqns)}],
    }


def test_every_place_an_fqn_appears():
    osd = adam_osd(["module.a.w", "module.b"])
    ckpt = {
        "model": {"module.a.w": torch.ones(2), "module.b": torch.ones(2)},
        "optim": osd,
        "step": 5,
    }
    out = dm.rename(ckpt, "ddp")
    assert list(out["model"]) == ["a.w", "b"]
    assert list(out["optim"]["state"]) == ["a.w", "b"]
    assert out["optim"]["param_groups"][0]["params"] == ["a.w", "b"]
    assert out["optim"]["param_groups"][0]["param_names"] == ["a.w", "b"]
    assert out["step"] == 5
    flat = dm.rename(dm.flatten(ckpt), "ddp")
    assert flat == dm.flatten(out)
    assert flat["optim.param_groups.a.w.param_names"] == ["a.w", "b"]


def test_int_ids_are_never_renamed():
    osd = {
        "state": {0: {"step": 1}, "1": {"step": 2}},
        "param_groups": [{"lr": 0.1, "params": [0, 1]}],
    }
    with pytest.warns(dm.DSDMergeWarning, match="matched no key"):
        assert dm.rename(osd, {r"^": "module."}) == osd
    with pytest.warns(dm.DSDMergeWarning, match="matched no key"):
        assert dm.rename(dm.flatten(osd), {r"^": "module."}) == dm.flatten(osd)


def test_nested_state_in_a_flat_optimizer_is_split_at_the_known_fqn():
    osd = {
        "state": {"l.0.w": {"step": 1, "factors": {"0": torch.ones(1), "1": torch.ones(1)}}},
        "param_groups": [{"lr": 0.1, "params": ["l.0.w"]}],
    }
    flat = dm.flatten(osd)
    assert "state.l.0.w.factors.0" in flat
    out = dm.rename(flat, {r"^l\.": "layers."})
    assert out == dm.flatten(dm.rename(osd, {r"^l\.": "layers."}))
    assert "state.layers.0.w.factors.1" in out


def test_rules_are_chained_in_order():
    sd = {"a.w": 1}
    assert dm.rename(sd, {r"^a\.": "b.", r"^b\.": "c."}) == {"c.w": 1}
    with pytest.warns(dm.DSDMergeWarning, match=r"'\^b"):  # it ran before "b." existed
        assert dm.rename(sd, [{r"^b\.": "c."}, {r"^a\.": "b."}]) == {"b.w": 1}
    # a rule that only matches what an earlier rule made counts as matching
    with warnings.catch_warnings():
        warnings.simplefilter("error", dm.DSDMergeWarning)
        dm.rename(sd, {r"^a\.": "b.", r"^b\.": "c."})


def test_backreferences_and_presets():
    sd = {"layers.0.attn.wq.weight": 1, "layers.1.attn.wq.weight": 2}
    out = dm.rename(sd, {r"layers\.(\d+)\.attn\.wq": r"blocks.\1.q"})
    assert out == {"blocks.0.q.weight": 1, "blocks.1.q.weight": 2}
    assert dm.rename({"_orig_mod.l._orig_mod.w": 1}, "compile") == {"l.w": 1}
    assert dm.rename({"base_model.model.q.base_layer.weight": 1}, ["peft", "lora"]) == {
        "q.weight": 1
    }
    assert dm.rename(
        {"a._fsdp_wrapped_module.b._checkpoint_wrapped_module.w": 1},
        ["fsdp1", "checkpoint_wrapper"],
    ) == {"a.b.w": 1}
    assert set(dm.RENAME_PRESETS) == {
        "ddp",
        "compile",
        "checkpoint_wrapper",
        "fsdp1",
        "peft",
        "lora",
        "to_peft",
        "lora_adapter_name",
        "to_lora_adapter_name",
    }
    with pytest.raises(TypeError):
        dm.RENAME_PRESETS["mine"] = {}  # type: ignore[index]


PLAIN = "model.layers.0.self_attn.q_proj"
PEFT = "base_model.model." + PLAIN


@pytest.mark.parametrize(
    ("keys", "preset", "renamed"),
    [
        # a plain checkpoint into a PEFT model, and back
        ([f"{PLAIN}.weight"], "to_peft", [f"{PEFT}.weight"]),
        ([f"{PEFT}.weight"], "to_peft", [f"{PEFT}.weight"]),  # already there: untouched
        ([f"{PEFT}.weight"], "peft", [f"{PLAIN}.weight"]),
        # PEFT's adapter name: in the model, not in the adapter file save_pretrained writes
        (
            [f"{PEFT}.lora_A.default.weight", f"{PEFT}.lora_embedding_B.default"],
            "lora_adapter_name",
            [f"{PEFT}.lora_A.weight", f"{PEFT}.lora_embedding_B"],
        ),
        (
            [f"{PEFT}.lora_A.weight", f"{PEFT}.lora_magnitude_vector", "x.lora_Ab.weight"],
            "to_lora_adapter_name",
            [
                f"{PEFT}.lora_A.default.weight",
                f"{PEFT}.lora_magnitude_vector.default",
                "x.lora_Ab.weight",
            ],
        ),
        (
            [f"{PEFT}.lora_A.default.weight"],
            "to_lora_adapter_name",
            [f"{PEFT}.lora_A.default.weight"],
        ),
    ],
)
def test_peft_presets_both_directions(keys, preset, renamed):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dm.DSDMergeWarning)  # a rule that matches nothing
        out = dm.rename(dict.fromkeys(keys, 1), preset)
    assert list(out) == renamed


def _t(*shape):
    return torch.zeros(shape)


def test_diff_suggests_the_peft_presets():
    adapter_file = {f"{PEFT}.lora_A.weight": _t(2, 8), f"{PEFT}.lora_B.weight": _t(8, 2)}
    model = {f"{PEFT}.lora_A.default.weight": _t(2, 8), f"{PEFT}.lora_B.default.weight": _t(8, 2)}
    assert [s.preset for s in dm.diff(adapter_file, model).renames] == ["to_lora_adapter_name"]
    assert [s.preset for s in dm.diff(model, adapter_file).renames] == ["lora_adapter_name"]
    plain = {f"{PLAIN}.weight": _t(8, 8), "model.norm.weight": _t(8)}
    peft = {"base_model.model." + k: v for k, v in plain.items()}
    d = dm.diff(plain, peft)
    assert [s.preset for s in d.renames] == ["to_peft"]
    assert not dm.diff(plain, peft, rename=d.suggested_rules)
    assert [s.preset for s in dm.diff(peft, plain).renames] == ["peft"]


def test_diff_suggests_base_layer_for_a_new_lora_target():
    """A full PEFT checkpoint resumed after v_proj became a LoRA target: its weights moved."""
    v = "base_model.model.model.layers.0.self_attn.v_proj"
    old = {f"{v}.weight": _t(8, 8), f"{v}.bias": _t(8), f"{PEFT}.base_layer.weight": _t(8, 8)}
    new = {
        f"{v}.base_layer.weight": _t(8, 8),
        f"{v}.base_layer.bias": _t(8),
        f"{v}.lora_A.default.weight": _t(2, 8),
        f"{PEFT}.base_layer.weight": _t(8, 8),
    }
    d = dm.diff(old, new)
    assert len(d.renames) == 1
    assert d.renames[0].params == 2
    assert dm.diff(old, new, rename=d.suggested_rules).missing == (f"{v}.lora_A.default.weight",)


def test_strip_prefix_strips_whole_segments_only():
    rule = dm.strip_prefix("module")
    assert dm.rename({"module.w": 1, "modules.x": 2}, rule) == {"w": 1, "modules.x": 2}
    assert dm.rename({"a.b.w": 1}, dm.strip_prefix("a.b.")) == {"w": 1}
    with pytest.raises(dm.RenameError):
        dm.strip_prefix("")


def test_a_rule_that_matches_nothing_warns_naming_it_and_raises_under_strict():
    sd = {"module.w": torch.ones(1)}
    with pytest.warns(dm.DSDMergeWarning, match=r"'\^modul\\\\\.' -> ''.*'module\.w'"):
        dm.rename(sd, {r"^modul\.": ""})
    with pytest.raises(dm.MergeError, match="matched no key"):
        dm.rename(sd, {r"^modul\.": ""}, unmatched="raise")
    assert dm.rename(sd, {r"^modul\.": ""}, unmatched="ignore") == sd
    ref = {"w": torch.ones(1)}
    with pytest.raises(dm.MergeError, match="matched no key") as err:
        dm.merge(sd, ref, policy="strict", rename={r"^modul\.": ""})
    assert any("matched no key" in p for p in err.value.problems)
    with pytest.warns(dm.DSDMergeWarning, match="matched no key"):
        dm.merge(sd, ref, rename={r"^modul\.": "", r"^module\.": ""})
    with pytest.raises(dm.MergeError, match="matched no key"):
        dm.check(sd, ref, policy="strict", rename={r"^modul\.": ""})
    with pytest.warns(dm.DSDMergeWarning, match="matched no key"):
        dm.diff(sd, ref, rename={r"^modul\.": ""})


def test_two_keys_renamed_to_one_is_an_error_naming_both():
    with pytest.raises(dm.RenameError, match=r"'a\.w' and 'b\.w'") as err:
        dm.rename({"a.w": 1, "b.w": 2}, {r"^[ab]\.": ""})
    assert err.value.keys == ("a.w", "b.w")
    assert err.value.target == "w"
    assert isinstance(err.value, dm.DSDMergeError)
    assert isinstance(err.value, ValueError)
    # onto an existing key that keeps its name
    with pytest.raises(dm.RenameError, match=r"'module\.w' and 'w'"):
        dm.rename({"module.w": 1, "w": 2}, "ddp")
    # in an optimizer's fqns, nested and flat
    osd = adam_osd(["module.w", "w"])
    with pytest.raises(dm.RenameError, match=r"'module\.w' and 'w'"):
        dm.rename(osd, "ddp")
    with pytest.raises(dm.RenameError, match=r"module\.w"):
        dm.rename(dm.flatten(osd), "ddp")
    # and merge refuses before building anything
    snap = Snapshot(osd)
    with pytest.raises(dm.RenameError):
        dm.merge(osd, adam_osd(["w"]), rename="ddp")
    assert snap.unchanged()


@pytest.mark.parametrize(
    "rules",
    [{"(": ""}, {"a": 3}, {3: "a"}, "no_such_preset", 7, {r"(a)": r"\2"}, [("a",)]],
)
def test_bad_rules_are_rename_errors(rules):
    with pytest.raises(dm.RenameError):
        dm.rename({"a": 1}, rules)


def test_a_metadata_view_renames_without_reading_tensors(tmp_path):
    from helpers import dcp_save

    from dsdmerge.integrations import read_metadata

    model = torch.nn.Sequential(torch.nn.Linear(2, 3))
    optim = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optim.step()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, optim)
    ckpt = dm.rename({"model": model.state_dict(), "optim": osd}, {r"^": "module."})
    dcp_save(ckpt, tmp_path / "dcp")
    view = read_metadata(tmp_path / "dcp")
    # no data file is opened: a view renames from its metadata alone
    for f in tmp_path.glob("dcp/*.distcp"):
        f.unlink()
    out = dm.rename(view, "ddp")
    assert type(out) is dict
    assert "model.0.weight" in out
    assert "optim.state.0.weight.exp_avg" in out
    assert out["model.0.weight"] == dm.TensorMeta((3, 2), torch.float32)
    ref = {"model": model.state_dict(), "optim": osd}
    assert not dm.diff(view, ref, rename="ddp")
    d = dm.diff(view, ref)
    assert [s.preset for s in d.renames] == ["ddp"]
    dm.check(view, ref, policy="strict", rename="ddp")


def test_rename_is_pure_and_shares_leaves():
    osd = adam_osd(["module.a", "module.b"])
    snap = Snapshot(osd)
    out = dm.rename(osd, "ddp")
    assert snap.unchanged()
    assert out["state"]["a"]["exp_avg"] is osd["state"]["module.a"]["exp_avg"]
    assert out["state"]["a"] is not osd["state"]["module.a"]


def test_flat_dicts_with_optimizer_sections_at_two_depths_are_refused():
    flat = {"a.param_groups.w.lr": 1, "b.c.param_groups.w.lr": 1, "m.w": 2}
    with pytest.raises(dm.LayoutError, match="different depths"):
        dm.rename(flat, {"^": "x."})


def test_same_tree_for_a_rename_that_changes_nothing():
    sd = {"model": {"w": torch.ones(1)}, "optim": adam_osd(["w"])}
    out = dm.rename(sd, {r"^w$": "w"})
    assert same_tree(out, sd)


# -- suggestions ----------------------------------------------------------------------------


def test_suggestions_for_a_refactor_in_every_layer():
    ref = {
        f"layers.{i}.attn.{n}.weight": torch.zeros(4, 4)
        for i in range(4)
        for n in ("q_proj", "k_proj", "v_proj", "wo")
    }
    ckpt = {
        k.replace("q_proj", "wq").replace("k_proj", "wk").replace("v_proj", "wv"): v
        for k, v in ref.items()
    }
    d = dm.diff(ckpt, ref)
    assert {(s.pattern, s.replacement, s.params) for s in d.renames} == {
        (rf"\.attn\.{o}\.", f".attn.{n}.", 4)
        for o, n in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"))
    }
    text = str(d)
    assert "look renamed" in text
    assert r"r'\.attn\.wq\.' -> '.attn.q_proj.'" in text
    assert d.to_dict()["renames"][0]["params"] == 4
    assert not dm.diff(ckpt, ref, rename=d.suggested_rules)


def test_no_suggestion_when_shapes_differ_or_a_matched_key_would_move():
    ckpt = {"a.wq": torch.zeros(2), "b.wq": torch.zeros(3)}
    ref = {"a.q": torch.zeros(2), "b.q": torch.zeros(4)}  # b's shape changed
    d = dm.diff(ckpt, ref)
    assert [s.pattern for s in d.renames] == [r"^a\.wq(?![^.])"] or all(
        "b" not in s.example[0] for s in d.renames
    )
    # renaming wq -> q in "a" would also rename the matched "c.wq": no suggestion covers it
    ckpt = {"a.wq": torch.zeros(2), "c.wq": torch.zeros(2)}
    ref = {"a.q": torch.zeros(2), "c.wq": torch.zeros(2)}
    assert all(dm.rename(ckpt, {s.pattern: s.replacement}) for s in dm.diff(ckpt, ref).renames)
    for s in dm.diff(ckpt, ref).renames:
        assert "c.wq" in dm.rename(ckpt, {s.pattern: s.replacement})


def test_suggestions_for_wrappers_name_the_preset():
    ref = {"l.0.w": torch.zeros(2), "l.1.w": torch.zeros(2)}
    for ckpt, preset in (
        ({"module." + k: v for k, v in ref.items()}, "ddp"),
        ({"_orig_mod." + k: v for k, v in ref.items()}, "compile"),
        (
            {k.replace("l.", "l._checkpoint_wrapped_module."): v for k, v in ref.items()},
            "checkpoint_wrapper",
        ),
    ):
        d = dm.diff(ckpt, ref)
        assert [s.preset for s in d.renames] == [preset], (ckpt, d.renames)
        assert "look renamed" in str(d)
        assert f"preset {preset!r}" in str(d)
    # a wrapper the reference has and the checkpoint lacks: add the prefix
    d = dm.diff(ref, {"module." + k: v for k, v in ref.items()})
    assert d.suggested_rules == {"^": "module."}


def test_suggestions_in_a_strict_merge_error():
    with pytest.raises(dm.MergeError, match=r"look renamed.*rename=\{r'\^module\\\.': ''\}"):
        dm.merge({"module.w": torch.zeros(1)}, {"w": torch.zeros(1)}, policy="strict")


# -- the fast paths give what the general path gives -------------------------------------

literal_rules = st.sampled_from(
    [
        {r"^model\.": ""},
        {r"^model\.layers\.": "blocks."},
        {r"\.attn\.": ".attention."},
        {r"(?<![^.])wq(?![^.])": "q_proj"},
        {r"\.weight$": ".w"},
        {r"^model\.": "", r"\.attn\.": ".attention."},
        {r"^model\.embed\.weight\.": "x."},  # reaches past an fqn: the general path decides
        {r"^lm_head\.weight": "head"},
    ]
)


@given(
    st.one_of(
        flat_state_dicts(),
        flat_state_dicts(kind="model"),
        flat_state_dicts(allow_meta=True),
        flat_state_dicts(kind="checkpoint"),
    ),
    literal_rules,
    st.booleans(),
)
def test_fast_paths_equal_the_general_path(sd, rules, wrapped):
    from dsdmerge.rename import compile_rules, renamed

    if wrapped:  # every fqn behind DDP's prefix, stripped again: the fastest path
        sd = quietly(dm.rename, sd, {r"^": "module."})
        rules = {r"^module\.": ""}

    def run(fast):
        try:
            return renamed(sd, compile_rules(rules), fast=fast)
        except dm.DSDMergeError as err:
            return type(err), str(err)

    fast, general = run(True), run(False)
    if isinstance(fast[0], dict):
        assert fast[1:] == general[1:]  # the unmatched rules and the example fqn shown
        assert list(fast[0]) == list(general[0])
        assert same_but_names(fast[0], general[0])
    else:
        assert fast == general


def test_a_literal_that_reaches_past_an_fqn_is_renamed_by_the_fqn():
    flat = {
        "state.module.step": 1,  # the fqn "module" (a parameter named so), not "module.x"
        "param_groups.module.lr": 0.1,
        "state.module.x.step": 2,
        "param_groups.module.x.lr": 0.1,
    }
    assert dm.rename(flat, {r"^module\.": ""}) == {
        "state.module.step": 1,
        "param_groups.module.lr": 0.1,
        "state.x.step": 2,
        "param_groups.x.lr": 0.1,
    }


@given(st.one_of(flat_state_dicts(min_params=1), flat_state_dicts(allow_meta=True, min_params=1)))
def test_stripping_a_prefix_every_fqn_has_equals_the_general_path(sd):
    from dsdmerge.rename import compile_rules, renamed

    wrapped = dm.rename(sd, {r"^": "module."})
    fast = dm.rename(wrapped, "ddp")
    general = renamed(wrapped, compile_rules("ddp"), fast=False)[0]
    assert list(fast) == list(general) == list(sd)
    assert same_but_names(fast, sd)
