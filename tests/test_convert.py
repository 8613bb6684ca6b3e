"""dsdmerge.convert: the records, every state dict layout, the optimizer rules, the errors."""

from __future__ import annotations

import copy
import warnings

import pytest
import story
import torch
from conftest import Snapshot

import dsdmerge as dm
from dsdmerge.convert import NONELEMENTWISE_OPTIMIZERS, nonelementwise_kind


def t(*shape, fill=0.0, dtype=torch.float32):
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64).reshape(shape) + fill).to(dtype)


def adam_entry(shape, fill, step=3.0):
    return {
        "step": torch.tensor(step),
        "exp_avg": t(*shape, fill=fill),
        "exp_avg_sq": t(*shape, fill=fill + 100),
    }


HYPER = {"lr": 0.1, "betas": (0.9, 0.999), "weight_decay": 0.01}


def qkv_optimizer(keyed="fqn", names=True):
    fqns = ["embed", "a.q_proj.weight", "a.k_proj.weight", "a.v_proj.weight", "head"]
    shapes = {"embed": (5, 2), "head": (2, 5)}
    state = {f: adam_entry(shapes.get(f, (2, 4)), i * 10) for i, f in enumerate(fqns)}
    group = {**HYPER, "params": list(fqns)}
    if names:
        group["param_names"] = list(fqns)
    osd = {"state": state, "param_groups": [group, {**HYPER, "lr": 0.2, "params": []}]}
    if keyed == "id":
        osd["state"] = {i: state[f] for i, f in enumerate(fqns)}
        group["params"] = list(range(len(fqns)))
    return osd


def mixtral_like(layers=2, experts=3, dim=4, inter=6):
    sd = {}
    for i in range(layers):
        for e in range(experts):
            p = f"model.layers.{i}.block.experts.{e}."
            sd[p + "gate_proj.weight"] = t(inter, dim, fill=100 * i + 10 * e)
            sd[p + "up_proj.weight"] = t(inter, dim, fill=100 * i + 10 * e + 1)
            sd[p + "down_proj.weight"] = t(dim, inter, fill=100 * i + 10 * e + 2)
    return sd


def shapes(sd):
    return {k: tuple(v.shape) for k, v in sd.items()}


# -- records -----------------------------------------------------------------------------


RECORDS = [
    dm.Fuse(["{L}.q", "{L}.k"], "{L}.qk"),
    dm.Fuse(["{P*}.q", "{P*}.k"], "{P*}.qk", dim=1),
    dm.Split("{L}.qk", ["{L}.q", "{L}.k"], dim=1, sizes=[2, 3]),
    dm.Split("w", ["a", "b"]),
    dm.Stack("e.{E}.w", "e.w", over="E"),
    dm.Stack("{P*}.e.{E}.w", "{P*}.e.w", over="E", dim=1),
    dm.Unstack("{P*}.e.w", "{P*}.e.{E}.w", over="E", dim=-1),
    dm.Transpose("{P*}.w", dims=(1, 2)),
]


@pytest.mark.parametrize("record", RECORDS, ids=repr)
def test_records_are_frozen_hashable_and_repr_rebuilds_them(record):
    assert eval(repr(record), {k: getattr(dm, k) for k in dm.__all__}) == record
    assert hash(record) == hash(copy.copy(record))
    with pytest.raises(AttributeError):
        record.dim = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: dm.Fuse("ab", "c"), "list of at least two"),
        (lambda: dm.Fuse(["a"], "c"), "at least two"),
        (lambda: dm.Fuse(["a", "a"], "c"), "twice"),
        (lambda: dm.Fuse(["{L}.a", "b"], "{L}.c"), "same placeholders"),
        (lambda: dm.Fuse(["{L}.a", "{L}.b"], "c"), "same placeholders"),
        (lambda: dm.Fuse(["{P*}.a", "{P}.b"], "{P*}.c"), "same placeholders"),
        (lambda: dm.Fuse(["a", "b"], "c", dim=True), "dim must be an int"),
        (lambda: dm.Fuse(["a", "b"], "c", dim=1.0), "dim must be an int"),
        (lambda: dm.Fuse(["a..b", "b"], "c"), "empty segment"),
        (lambda: dm.Fuse(["a.", "b"], "c"), "empty segment"),
        (lambda: dm.Fuse(["layer{L}.a", "layer{L}.b"], "c"), "whole segment"),
        (lambda: dm.Fuse(["{L}.{L}", "b"], "c"), "twice"),
        (lambda: dm.Fuse(["{A*}.{B*}", "b"], "c"), "two many-segment"),
        (lambda: dm.Fuse(["a", 3], "c"), "non-empty str"),
        (lambda: dm.Fuse(["a", "b"], ""), "non-empty str"),
        (lambda: dm.Split("a", ["b"]), "at least two"),
        (lambda: dm.Split("a", ["b", "c"], sizes=[1]), "one positive size per target"),
        (lambda: dm.Split("a", ["b", "c"], sizes=[1, 0]), "one positive size per target"),
        (lambda: dm.Split("a", ["b", "c"], sizes="12"), "list of ints"),
        (lambda: dm.Split("{L}.a", ["b", "c"]), "same placeholders"),
        (lambda: dm.Stack("e.{E}.w", "e.w", over="F"), "must be a placeholder of"),
        (lambda: dm.Stack("e.{E}.w", "e.{E}.w2", over="E"), "must not appear"),
        (lambda: dm.Stack("{E*}.w", "x", over="E"), "one-segment placeholder"),
        (lambda: dm.Stack("{L}.e.{E}.w", "e.w", over="E"), "same placeholders"),
        (lambda: dm.Stack("e.{E}.w", "e.w", over=1), "placeholder name"),
        (lambda: dm.Unstack("e.w", "e.w2", over="E"), "must be a placeholder of"),
        (lambda: dm.Transpose("w", dims=(0,)), "two ints"),
        (lambda: dm.Transpose("w", dims=(1, 1)), "two different"),
        (lambda: dm.Transpose("w", dims="01"), "two ints"),
    ],
)
def test_bad_records_are_refused_where_they_are_written(build, match):
    with pytest.raises(dm.ConversionError, match=match):
        build()


def test_placeholders_match_whole_segments_and_many_segments():
    sd = {"a.0.w": t(2), "a.0.1.w": t(2), "b.c.w": t(2)}
    got = dm.convert(sd, [dm.Split("a.{L}.w", ["a.{L}.x", "a.{L}.y"])])
    assert list(got) == ["a.0.x", "a.0.y", "a.0.1.w", "b.c.w"]  # {L}: one segment only
    got = dm.convert(sd, [dm.Split("{P*}.w", ["{P*}.x", "{P*}.y"])])
    assert list(got) == ["a.0.x", "a.0.y", "a.0.1.x", "a.0.1.y", "b.c.x", "b.c.y"]


def test_conversions_must_be_records_or_preset_names():
    with pytest.raises(dm.ConversionError, match="unknown conversion preset 'qvk'"):
        dm.convert({}, ["qvk"])
    with pytest.raises(dm.ConversionError, match="not a conversion"):
        dm.convert({}, [{"a": "b"}])
    with pytest.raises(dm.ConversionError, match="must be a list"):
        dm.convert({}, {"a": "b"})
    with pytest.raises(dm.ConversionError, match="nonelementwise"):
        dm.convert({"w": t(2, 2)}, [dm.Transpose("w", dims=(0, 1))], nonelementwise="drop")
    with pytest.raises(dm.StateDictTypeError):
        dm.convert([1], [dm.Transpose("w", dims=(0, 1))])


# -- model state dicts -------------------------------------------------------------------


def test_fuse_concatenates_in_order_and_takes_the_first_sources_place():
    sd = {"e": t(1), "a.q.w": t(2, 3), "a.k.w": t(1, 3, fill=10), "b": 1, "a.v.w": t(2, 3, fill=20)}
    out = dm.convert(sd, [dm.Fuse(["{P}.q.w", "{P}.k.w", "{P}.v.w"], "{P}.qkv.w")])
    assert list(out) == ["e", "a.qkv.w", "b"]
    assert torch.equal(out["a.qkv.w"], torch.cat([sd["a.q.w"], sd["a.k.w"], sd["a.v.w"]]))
    assert out["e"] is sd["e"]
    assert out["b"] is sd["b"]


def test_fuse_along_another_dim_and_a_negative_one():
    sd = {"x": t(2, 3), "y": t(2, 1)}
    out = dm.convert(sd, [dm.Fuse(["x", "y"], "xy", dim=-1)])
    assert torch.equal(out["xy"], torch.cat([sd["x"], sd["y"]], dim=1))


def test_split_equal_parts_and_given_sizes_each_a_new_contiguous_tensor():
    sd = {"qkv": t(6, 4)}
    out = dm.convert(sd, [dm.Split("qkv", ["q", "k", "v"])])
    assert list(out) == ["q", "k", "v"]
    for got, want in zip(out.values(), torch.split(sd["qkv"], 2), strict=True):
        assert torch.equal(got, want)
        assert got.is_contiguous()
        assert got.untyped_storage().data_ptr() != sd["qkv"].untyped_storage().data_ptr()
    out = dm.convert(sd, [dm.Split("qkv", ["a", "b"], dim=1, sizes=[3, 1])])
    assert shapes(out) == {"a": (6, 3), "b": (6, 1)}
    assert out["a"].is_contiguous()
    assert torch.equal(out["b"], sd["qkv"][:, 3:])


def test_stack_orders_parts_by_index_not_by_text():
    sd = {f"e.{i}.w": t(2, fill=i) for i in (10, 2, 0, 1, 3, 4, 5, 6, 7, 8, 9)}
    out = dm.convert(sd, [dm.Stack("e.{E}.w", "e.w", over="E")])
    assert torch.equal(out["e.w"], torch.stack([sd[f"e.{i}.w"] for i in range(11)]))


def test_stack_experts_preset_gives_transformers_v5_layout():
    sd = mixtral_like()
    out = dm.convert(sd, ["stack_experts"])
    assert shapes(out) == {
        "model.layers.0.block.experts.gate_up_proj": (3, 12, 4),
        "model.layers.0.block.experts.down_proj": (3, 4, 6),
        "model.layers.1.block.experts.gate_up_proj": (3, 12, 4),
        "model.layers.1.block.experts.down_proj": (3, 4, 6),
    }
    p = "model.layers.1.block.experts."
    gate = torch.stack([sd[f"{p}{e}.gate_proj.weight"] for e in range(3)])
    up = torch.stack([sd[f"{p}{e}.up_proj.weight"] for e in range(3)])
    assert torch.equal(out[p + "gate_up_proj"], torch.cat([gate, up], dim=1))


def test_unstack_and_transpose():
    sd = {"e.w": t(3, 2, 4)}
    out = dm.convert(sd, [dm.Unstack("e.w", "e.{E}.w", over="E")])
    assert list(out) == ["e.0.w", "e.1.w", "e.2.w"]
    assert torch.equal(out["e.2.w"], sd["e.w"][2])
    out = dm.convert(sd, [dm.Unstack("e.w", "e.{E}.w", over="E", dim=2)])
    assert len(out) == 4
    assert torch.equal(out["e.3.w"], sd["e.w"][:, :, 3])
    out = dm.convert(sd, [dm.Transpose("e.w", dims=(1, 2))])
    assert torch.equal(out["e.w"], sd["e.w"].transpose(1, 2))
    assert out["e.w"].is_contiguous()


def test_qkv_preset_fuses_weights_and_biases_under_any_prefix():
    sd = {}
    for p in ("model.layers.0.self_attn", "vision.blocks.3.attn"):
        for n in "qkv":
            sd[f"{p}.{n}_proj.weight"] = t(4, 8)
            sd[f"{p}.{n}_proj.bias"] = t(4)
    out = dm.convert(sd, ["qkv"])
    assert shapes(out) == {
        "model.layers.0.self_attn.qkv_proj.weight": (12, 8),
        "model.layers.0.self_attn.qkv_proj.bias": (12,),
        "vision.blocks.3.attn.qkv_proj.weight": (12, 8),
        "vision.blocks.3.attn.qkv_proj.bias": (12,),
    }


def test_meta_tensors_and_tensor_metadata_convert_by_shape():
    sd = {"a": torch.empty(3, 2, device="meta"), "b": torch.empty(1, 2, device="meta")}
    out = dm.convert(sd, [dm.Fuse(["a", "b"], "ab")])
    assert out["ab"].device.type == "meta"
    assert out["ab"].shape == (4, 2)
    view = {"a": dm.TensorMeta((3, 2), torch.bfloat16), "b": dm.TensorMeta((1, 2), torch.bfloat16)}
    assert dm.convert(view, [dm.Fuse(["a", "b"], "ab")]) == {
        "ab": dm.TensorMeta((4, 2), torch.bfloat16)
    }
    view = {"x.experts.gate_up_proj": dm.TensorMeta((3, 2, 5), "BF16")}
    view["x.experts.down_proj"] = dm.TensorMeta((3, 5, 2), "BF16")
    assert dm.convert(view, ["transpose_experts"]) == {
        "x.experts.gate_up_proj": dm.TensorMeta((3, 5, 2), "BF16"),
        "x.experts.down_proj": dm.TensorMeta((3, 2, 5), "BF16"),
    }


def test_parameters_that_require_grad_convert_without_autograd():
    w = torch.nn.Parameter(torch.ones(2, 3))
    out = dm.convert({"w": w}, [dm.Transpose("w", dims=(0, 1))])
    assert not out["w"].requires_grad
    assert out["w"].grad_fn is None


# -- optimizer state -----------------------------------------------------------------------


QKV = dm.Fuse(
    ["{P}.q_proj.weight", "{P}.k_proj.weight", "{P}.v_proj.weight"], "{P}.qkv_proj.weight"
)


def test_nested_optimizer_state_is_fused_and_the_target_takes_the_first_place():
    osd = qkv_optimizer()
    out = dm.convert(osd, [QKV])
    assert list(out["state"]) == ["embed", "a.qkv_proj.weight", "head"]
    group = out["param_groups"][0]
    assert group["params"] == ["embed", "a.qkv_proj.weight", "head"]
    assert group["param_names"] == group["params"]
    entry = out["state"]["a.qkv_proj.weight"]
    assert entry["step"] is osd["state"]["a.q_proj.weight"]["step"]
    parts = [osd["state"][f"a.{n}_proj.weight"]["exp_avg_sq"] for n in "qkv"]
    assert torch.equal(entry["exp_avg_sq"], torch.cat(parts))
    assert out["state"]["embed"]["exp_avg"] is osd["state"]["embed"]["exp_avg"]
    assert out["state"]["embed"] is not osd["state"]["embed"]  # new containers
    assert {k: v for k, v in group.items() if k not in ("params", "param_names")} == HYPER
    assert out["param_groups"][1] == osd["param_groups"][1]


def test_int_keyed_optimizer_with_param_names_is_renumbered_as_torch_numbers_it():
    osd = qkv_optimizer(keyed="id")
    out = dm.convert(osd, [QKV])
    assert out["param_groups"][0]["params"] == [0, 1, 2]
    assert out["param_groups"][0]["param_names"] == ["embed", "a.qkv_proj.weight", "head"]
    assert list(out["state"]) == [0, 1, 2]
    assert out["state"][2]["exp_avg"] is osd["state"][4]["exp_avg"]
    assert out["state"][1]["exp_avg"].shape == (6, 4)
    # a DCP round trip spells state keys as str: they stay str
    dcp = {**osd, "state": {str(k): v for k, v in osd["state"].items()}}
    assert list(dm.convert(dcp, [QKV])["state"]) == ["0", "1", "2"]


def test_int_keyed_optimizer_without_param_names_is_refused_naming_rekey():
    osd = qkv_optimizer(keyed="id", names=False)
    snap = Snapshot(osd)
    with pytest.raises(dm.ConversionError, match=r"no 'param_names'.*dsdmerge\.rekey"):
        dm.convert({"model": {"a.q_proj.weight": t(2, 4)}, "optim": osd}, [QKV])
    assert snap.unchanged()


def test_flat_optimizer_keys_are_spelled_in_place_and_param_names_follow():
    flat = dm.flatten(qkv_optimizer())
    out = dm.convert(flat, [QKV])
    assert story.tree_differences(dm.flatten(dm.convert(qkv_optimizer(), [QKV])), out) == []
    keys = list(out)
    assert keys[:3] == ["state.embed.step", "state.embed.exp_avg", "state.embed.exp_avg_sq"]
    assert keys[3:6] == [f"state.a.qkv_proj.weight.{n}" for n in ("step", "exp_avg", "exp_avg_sq")]
    names = out["param_groups.embed.param_names"]
    assert names == ["embed", "a.qkv_proj.weight", "head"]
    assert out["param_groups.head.param_names"] is names  # one new list, shared as before
    assert out["param_groups.embed.lr"] is flat["param_groups.embed.lr"]


def test_param_names_behind_a_prefix_follow_the_prefix():
    osd = qkv_optimizer()
    osd["param_groups"][0]["param_names"] = [
        "module." + n for n in osd["param_groups"][0]["params"]
    ]
    out = dm.convert(osd, [QKV])
    assert out["param_groups"][0]["param_names"] == [
        "module.embed",
        "module.a.qkv_proj.weight",
        "module.head",
    ]
    flat = dm.convert(dm.flatten(osd), [QKV])
    assert flat["param_groups.embed.param_names"] == out["param_groups"][0]["param_names"]


def test_whole_checkpoints_convert_every_part_and_keep_the_rest():
    osd = qkv_optimizer()
    model = {f: t(*osd["state"][f]["exp_avg"].shape) for f in osd["param_groups"][0]["params"]}
    ckpt = {"model": model, "optim": osd, "sched": {"last_epoch": 3}, "step": 7}
    out = dm.convert(ckpt, [QKV])
    assert list(out["model"]) == ["embed", "a.qkv_proj.weight", "head"]
    assert list(out["optim"]["state"]) == ["embed", "a.qkv_proj.weight", "head"]
    assert out["sched"] == {"last_epoch": 3}
    assert out["sched"] is not ckpt["sched"]
    assert out["step"] == 7
    # flattened with dots, as DCP's metadata spells it: the same result
    got = dm.convert(dm.flatten(ckpt), [QKV])
    assert story.tree_differences(dm.flatten(out), got) == []


def test_split_targets_get_copies_of_scalars_and_their_own_step():
    osd = {
        "state": {"qk": {"step": torch.tensor(5.0), "exp_avg": t(4, 2), "flag": {0}, "n": 3}},
        "param_groups": [{**HYPER, "params": ["qk"]}],
    }
    out = dm.convert(osd, [dm.Split("qk", ["q", "k"])])
    q, k = out["state"]["q"], out["state"]["k"]
    assert torch.equal(q["exp_avg"], osd["state"]["qk"]["exp_avg"][:2])
    assert q["step"] is not k["step"]  # an optimizer increments step in place
    assert q["step"] is not osd["state"]["qk"]["step"]
    assert torch.equal(q["step"], torch.tensor(5.0))
    assert q["flag"] == {0}
    assert q["flag"] is not k["flag"]
    assert q["n"] == 3
    assert out["param_groups"][0]["params"] == ["q", "k"]


def test_nested_state_such_as_heavyballs_converts_leaf_by_leaf():
    def entry(fill):
        return {0: {"exp_avg_0": t(2, 3, fill=fill), "is_initialized": {0}}}

    osd = {
        "state": {"a": {0: {**entry(0)[0], "step": torch.tensor(2.0)}}, "b": entry(10)},
        "param_groups": [{"lr": 0.1, "params": ["a", "b"]}],
        "heavyball": {"inner_group": {}},
    }
    out = dm.convert(osd, [dm.Fuse(["a", "b"], "ab")])
    assert torch.equal(out["state"]["ab"][0]["exp_avg_0"], torch.cat([t(2, 3), t(2, 3, fill=10)]))
    assert out["state"]["ab"][0]["step"] is osd["state"]["a"][0]["step"]  # on one source only
    assert out["heavyball"] == {"inner_group": {}}


def test_transpose_keeps_scalars_and_hyperparameters():
    osd = {"state": {"w": adam_entry((2, 3), 0)}, "param_groups": [{**HYPER, "params": ["w"]}]}
    out = dm.convert(osd, [dm.Transpose("w", dims=(0, 1))])
    assert out["state"]["w"]["step"] is osd["state"]["w"]["step"]
    assert torch.equal(out["state"]["w"]["exp_avg"], osd["state"]["w"]["exp_avg"].t())


def test_a_parameter_without_state_converts_its_hyperparameters_only():
    osd = qkv_optimizer()
    for n in "qkv":
        del osd["state"][f"a.{n}_proj.weight"]
    out = dm.convert(osd, [QKV])
    assert "a.qkv_proj.weight" not in out["state"]
    assert out["param_groups"][0]["params"] == ["embed", "a.qkv_proj.weight", "head"]


def test_optimizer_level_entries_and_empty_groups_are_kept():
    osd = qkv_optimizer()
    osd["state"] = {"k": torch.tensor([7]), **osd["state"]}
    out = dm.convert(osd, [QKV])
    assert next(iter(out["state"])) == "k"
    assert out["state"]["k"] is osd["state"]["k"]
    flat = dm.flatten(osd)
    got = dm.convert(flat, [QKV])
    assert got["state.k"] is flat["state.k"]


def test_stacking_0d_parameters_with_state_is_refused():
    """A 0-d parameter's moments are 0-d: they cannot be told from its step."""
    osd = {
        "state": {f"e.{i}.s": adam_entry((), i) for i in range(2)},
        "param_groups": [{"lr": 1.0, "params": ["e.0.s", "e.1.s"]}],
    }
    rule = dm.Stack("e.{E}.s", "e.s", over="E")
    for sd in (osd, {"model": {"e.0.s": t(), "e.1.s": t()}, "optim": osd}):
        with pytest.raises(dm.ConversionError, match="0-d parameter"):
            dm.convert(sd, [rule])
    del osd["state"]
    osd["state"] = {}
    assert dm.convert(osd, [rule])["param_groups"][0]["params"] == ["e.s"]


def test_unstack_of_optimizer_state_alone_takes_the_count_from_the_state():
    osd = {
        "state": {"e.w": adam_entry((3, 2), 0)},
        "param_groups": [{"lr": 1.0, "params": ["e.w"]}],
    }
    out = dm.convert(osd, [dm.Unstack("e.w", "e.{E}.w", over="E")])
    assert list(out["state"]) == ["e.0.w", "e.1.w", "e.2.w"]
    assert torch.equal(out["state"]["e.1.w"]["exp_avg"], osd["state"]["e.w"]["exp_avg"][1])
    del osd["state"]["e.w"]
    with pytest.raises(dm.ConversionError, match="how many parts"):
        dm.convert(osd, [dm.Unstack("e.w", "e.{E}.w", over="E")])


# -- what cannot be converted elementwise --------------------------------------------------


def factored():
    """An Adafactor-like entry: row and column statistics of a (4, 3) parameter."""
    return {
        "state": {
            "a": {"step": torch.tensor(1.0), "row": torch.ones(4, 1), "col": torch.ones(1, 3)},
            "b": {"step": torch.tensor(1.0), "row": torch.ones(4, 1), "col": torch.ones(1, 3)},
        },
        "param_groups": [{"lr": 0.1, "params": ["a", "b"]}],
    }


def test_state_not_shaped_like_the_parameter_raises_naming_it():
    osd = factored()
    snap = Snapshot(osd)
    with pytest.raises(
        dm.ConversionError, match=r"'row' of shape \[4, 1\].*nonelementwise='reset'"
    ):
        dm.convert(osd, [dm.Fuse(["a", "b"], "ab")])
    # with the model beside it, the shape is known, and the same holds
    with pytest.raises(dm.ConversionError, match=r"not shaped like the parameter \[4, 3\]"):
        dm.convert(
            {"model": {"a": t(4, 3), "b": t(4, 3)}, "optim": osd}, [dm.Fuse(["a", "b"], "ab")]
        )
    assert snap.unchanged()


def test_reset_leaves_the_target_fresh_and_warns_naming_it():
    with pytest.warns(dm.DSDMergeWarning, match=r"fresh optimizer state.*'row'") as caught:
        out = dm.convert(factored(), [dm.Fuse(["a", "b"], "ab")], nonelementwise="reset")
    assert len(caught) == 1
    assert out["state"] == {}
    assert out["param_groups"][0]["params"] == ["ab"]


def test_scalar_fields_must_agree_across_the_parts():
    osd = qkv_optimizer()
    osd["state"]["a.k_proj.weight"]["step"] = torch.tensor(4.0)
    with pytest.raises(dm.ConversionError, match=r"'step' differs.*a\.k_proj\.weight") as err:
        dm.convert(osd, [QKV])
    assert err.value.keys == ("a.q_proj.weight", "a.k_proj.weight")
    assert err.value.rule == QKV


def test_state_for_some_parts_only_is_refused():
    osd = qkv_optimizer()
    del osd["state"]["a.v_proj.weight"]
    with pytest.raises(dm.ConversionError, match=r"a\.v_proj\.weight has none"):
        dm.convert(osd, [QKV])


def test_hyperparameters_must_agree_naming_the_hyperparameter_and_the_keys():
    osd = qkv_optimizer()
    osd["param_groups"][0]["params"].remove("a.k_proj.weight")
    osd["param_groups"][1]["params"].append("a.k_proj.weight")
    with pytest.raises(
        dm.ConversionError,
        match=r"hyperparameter 'lr' differs \(a\.q_proj\.weight: 0\.1, a\.k_proj\.weight: 0\.2\)",
    ):
        dm.convert(osd, [QKV])
    flat = dm.flatten(osd)
    with pytest.raises(dm.ConversionError, match="hyperparameter 'lr' differs"):
        dm.convert(flat, [QKV])
    # in another group with equal hyperparameters: fine, the target joins the first's group
    osd["param_groups"][1]["lr"] = 0.1
    out = dm.convert(osd, [QKV])
    assert out["param_groups"][1]["params"] == []


def test_a_known_nonelementwise_optimizer_warns_once():
    lamb = {"adam": False, "grad_averaging": True, "lr": 0.1}
    osd = qkv_optimizer()
    for g in osd["param_groups"]:
        g.update(lamb)
    with pytest.warns(
        dm.DSDMergeWarning, match=r"not elementwise \(pytorch_optimizer\.Lamb"
    ) as caught:
        dm.convert({"a": osd, "b": copy.deepcopy(osd)}, [QKV])
    assert len(caught) == 1


@pytest.mark.parametrize(
    "name", ["Adam", "AdamW", "SGD", "RMSprop", "Adagrad", "NAdam", "RAdam", "Adamax", "ASGD"]
)
def test_elementwise_torch_optimizers_are_not_taken_for_nonelementwise_ones(name):
    optim = getattr(torch.optim, name)([torch.nn.Parameter(torch.zeros(2))])
    assert nonelementwise_kind(optim.param_groups[0]) is None


def test_the_table_recognises_the_real_optimizers_it_names():
    p = [torch.nn.Parameter(torch.zeros(2, 2))]
    found = {
        "torch.optim.Adafactor": torch.optim.Adafactor(p),
        "Muon": torch.optim.Muon(p),
        "torch.optim.LBFGS": torch.optim.LBFGS(p),
    }
    for label, optim in found.items():
        kind = nonelementwise_kind(optim.param_groups[0])
        assert kind is not None
        assert kind[0].startswith(label)
    assert len(NONELEMENTWISE_OPTIMIZERS) >= 10


def test_real_nonelementwise_optimizers_convert_with_a_warning():
    model = {"a": t(2, 2), "b": t(2, 2)}
    params = {n: torch.nn.Parameter(v.clone()) for n, v in model.items()}
    optim = torch.optim.Muon([{"params": list(params.values())}])
    for p in params.values():
        p.grad = torch.ones(2, 2)
    optim.step()
    osd = optim.state_dict()
    osd = dm.rekey(osd, list(params))
    with pytest.warns(dm.DSDMergeWarning, match="Newton-Schulz"):
        out = dm.convert({"model": model, "optim": osd}, [dm.Fuse(["a", "b"], "ab")])
    assert out["optim"]["state"]["ab"]["momentum_buffer"].shape == (4, 2)


# -- errors ----------------------------------------------------------------------------------


ERRORS = [
    ({"a": t(2)}, [dm.Transpose("b", dims=(0, 1))], "match no parameter; fqns look like 'a'"),
    ({}, [dm.Transpose("b", dims=(0, 1))], "names no parameters"),
    (
        {"a.q": t(2), "a.k": t(2)},
        [dm.Fuse(["{P}.q", "{P}.k", "{P}.v"], "{P}.x")],
        r"found a\.q, a\.k but not a\.v",
    ),
    ({"a": t(2), "b": t(2, dtype=torch.float16)}, [dm.Fuse(["a", "b"], "c")], "different dtypes"),
    ({"a": t(2, 3), "b": t(3, 2)}, [dm.Fuse(["a", "b"], "c")], "cannot concatenate"),
    ({"a": t(2), "b": t(3)}, [dm.Fuse(["a", "b"], "c", dim=1)], "cannot concatenate"),
    (
        {"a": torch.tensor(1.0), "b": torch.tensor(2.0)},
        [dm.Fuse(["a", "b"], "c")],
        "cannot concatenate",
    ),
    ({"a": 3, "b": t(2)}, [dm.Fuse(["a", "b"], "c")], "not a tensor"),
    ({"a": t(2), "b": t(2), "c": 1}, [dm.Fuse(["a", "b"], "c")], "target c already exists"),
    ({"w": t(5)}, [dm.Split("w", ["x", "y"])], "does not divide into 2 equal parts"),
    ({"w": t(5)}, [dm.Split("w", ["x", "y"], sizes=[1, 2])], "add up to 3"),
    ({"w": t(5)}, [dm.Transpose("w", dims=(0, 1))], "no two distinct dimensions"),
    ({"w": t(5)}, [dm.Transpose("w", dims=(0, -1))], "no two distinct dimensions"),
    ({"e.0.w": t(2), "e.2.w": t(2)}, [dm.Stack("e.{E}.w", "e.w", over="E")], r"e\.1\.w is missing"),
    ({"e.01.w": t(2), "e.0.w": t(2)}, [dm.Stack("e.{E}.w", "e.w", over="E")], "not an index"),
    ({"e.x.w": t(2)}, [dm.Stack("e.{E}.w", "e.w", over="E")], "not an index"),
    ({"e.0.w": t(2), "e.1.w": t(3)}, [dm.Stack("e.{E}.w", "e.w", over="E")], "cannot stack"),
    ({"e.w": t(0, 2)}, [dm.Unstack("e.w", "e.{E}.w", over="E")], "nothing to unstack"),
    ({"e.w": torch.tensor(1.0)}, [dm.Unstack("e.w", "e.{E}.w", over="E")], "has no dimension 0"),
    ({"a.a": t(2)}, [dm.Fuse(["a.{X}", "{X}.a"], "{X}.f")], "matches two of its sources"),
]


@pytest.mark.parametrize(("sd", "rules", "match"), ERRORS)
def test_errors_name_the_rule_and_the_keys_and_change_nothing(sd, rules, match):
    snap = Snapshot(sd)
    with pytest.raises(dm.ConversionError, match=match) as err:
        dm.convert(sd, rules)
    assert str(err.value).startswith(f"rule {rules[0]!r}")
    assert err.value.rule == rules[0]
    assert snap.unchanged()


def test_a_later_rule_failing_leaves_everything_unchanged():
    osd = qkv_optimizer()
    ckpt = {"model": {"a.q_proj.weight": t(2, 4)}, "optim": osd}
    snap = Snapshot(ckpt)
    with pytest.raises(dm.ConversionError, match="match no parameter"):
        dm.convert(osd, [QKV, dm.Transpose("nothing", dims=(0, 1))])
    with pytest.raises(dm.ConversionError):
        dm.convert(ckpt, [QKV])  # the model lacks k and v
    assert snap.unchanged()


def test_cycles_are_layout_errors():
    sd: dict = {"m": {}}
    sd["m"]["self"] = sd["m"]
    with pytest.raises(dm.LayoutError, match="cycle"):
        dm.convert(sd, [dm.Transpose("x", dims=(0, 1))])
    entry: dict = {"step": 1}
    entry["again"] = {"x": entry}
    osd = {"state": {"w": entry}, "param_groups": [{"lr": 1, "params": ["w"]}]}
    with pytest.raises(dm.LayoutError, match="cycle"):
        dm.convert(osd, [dm.Transpose("w", dims=(0, 1))])


# -- round trips -------------------------------------------------------------------------------


def with_model(osd):
    model = {f: t(*e["exp_avg"].shape, fill=-1) for f, e in osd["state"].items()}
    return {"model": model, "optim": osd}


ROUND_TRIPS = [
    ([QKV], [dm.Split("{P}.qkv_proj.weight", [f"{{P}}.{n}_proj.weight" for n in "qkv"])]),
    ([dm.Transpose("embed", dims=(0, 1))], [dm.Transpose("embed", dims=(1, 0))]),
    (
        [dm.Fuse(["a.q_proj.weight", "a.k_proj.weight"], "a.qk", dim=1)],
        [dm.Split("a.qk", ["a.q_proj.weight", "a.k_proj.weight"], dim=1, sizes=[4, 4])],
    ),
]


@pytest.mark.parametrize("layout", ["nested", "flat", "int", "checkpoint"])
@pytest.mark.parametrize(("there", "back"), ROUND_TRIPS, ids=["qkv", "transpose", "dim1"])
def test_round_trips_give_back_equal_values_and_state(there, back, layout):
    osd = qkv_optimizer(keyed="id" if layout == "int" else "fqn")
    sd = {"flat": dm.flatten, "checkpoint": with_model}.get(layout, lambda x: x)(osd)
    again = dm.convert(dm.convert(sd, there), back)
    assert story.tree_differences(sd, again) == []


def test_stack_then_unstack_round_trips_experts_with_their_state():
    sd = mixtral_like(layers=1)
    osd = {
        "state": {f: adam_entry(v.shape, i) for i, (f, v) in enumerate(sd.items())},
        "param_groups": [{**HYPER, "params": list(sd)}],
    }
    ckpt = {"model": sd, "optim": osd}
    there = dm.convert(ckpt, ["stack_experts"])
    assert list(there["optim"]["state"]) == [
        "model.layers.0.block.experts.gate_up_proj",
        "model.layers.0.block.experts.down_proj",
    ]
    p = "{P*}.experts"
    back = [
        dm.Split(f"{p}.gate_up_proj", [f"{p}.gate_proj", f"{p}.up_proj"], dim=1),
        *(
            dm.Unstack(f"{p}.{n}", f"{p}.{{E}}.{n}.weight", over="E")
            for n in ("gate_proj", "up_proj", "down_proj")
        ),
    ]
    again = dm.convert(there, back)
    assert (
        story.tree_differences(
            {**ckpt, "optim": {**osd, "param_groups": [{**HYPER, "params": sorted(sd)}]}},
            {
                **again,
                "optim": {
                    **again["optim"],
                    "param_groups": [
                        {**HYPER, "params": sorted(again["optim"]["param_groups"][0]["params"])}
                    ],
                },
            },
        )
        == []
    )


def test_convert_warns_nothing_for_elementwise_state():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dm.convert(with_model(qkv_optimizer()), [QKV])


@pytest.mark.parametrize("rules", [[QKV], [QKV, dm.Split("a.qkv_proj.weight", ["x", "y", "z"])]])
def test_a_flat_optimizer_in_any_key_order_converts_as_in_torchs_order(rules):
    """Torch's layout is read as a table of rows; keys in another order, key by key: the same."""
    flat = dm.flatten(qkv_optimizer())
    shuffled = dict(reversed(flat.items()))
    assert story.tree_differences(dm.convert(flat, rules), dm.convert(shuffled, rules)) == []
    moved = dict(flat)  # a row out of its place: the keys of one parameter apart
    moved["state.head.exp_avg"] = moved.pop("state.head.exp_avg")
    assert story.tree_differences(dm.convert(flat, rules), dm.convert(moved, rules)) == []


def test_warnings_point_at_the_caller():
    with pytest.warns(dm.DSDMergeWarning) as caught:
        dm.convert(factored(), [dm.Fuse(["a", "b"], "ab")], nonelementwise="reset")
    assert caught[0].filename == __file__
