"""Small truths, on merge/diff/flatten directly: what torch keeps is kept.

Keys beside state and param_groups, optimizer-level state entries, regrouped
parameters, a total mismatch, module ``_metadata``, scalar ``step`` shapes, one warning
per kind, and ``fresh="as_fresh"``.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch import nn

import dsdmerge as dm


def osd(groups, state=None, **extra):
    return {"state": state or {}, "param_groups": groups, **extra}


# -- what torch carries through ---------------------------------------------------------


def test_heavyball_style_top_level_key_is_kept_by_merge_and_flatten():
    hb = {"step": 12, "schedule": torch.ones(2)}
    c = osd([{"lr": 0.1, "params": [0]}], {0: {"step": torch.tensor(3.0)}}, heavyball=hb)
    r = osd([{"lr": 0.2, "params": [0]}], {0: {"step": torch.tensor(0.0)}})
    out, diff, _ = dm.merge_with_diff(c, r)
    assert out["heavyball"]["schedule"] is hb["schedule"]
    assert out["heavyball"]["step"] == 12
    assert diff.unexpected == ("heavyball.step", "heavyball.schedule")
    flat = dm.flatten(c)
    assert flat["heavyball.schedule"] is hb["schedule"]
    assert dm.unflatten(flat, like=c)["heavyball"] == hb


def test_unexpected_keys_beside_state_and_param_groups_come_in_flatten_order():
    # was: a nested diff reported a checkpoint-only top-level key before the checkpoint-only
    # hyperparameters, while flatten (and so a flat diff) spells param_groups.* first
    c = osd([{"lr": 0.1, "initial_lr": 1.0, "params": [0]}], heavyball={"step": 3})
    r = osd([{"lr": 0.2, "params": [0]}])
    expected = ("param_groups.0.initial_lr", "heavyball.step")
    assert list(dm.flatten(c))[1:] == list(expected)
    assert dm.diff(c, r).unexpected == dm.diff(dm.flatten(c), dm.flatten(r)).unexpected == expected
    assert dm.merge_with_diff(c, r).diff.unexpected == expected


def test_madgrad_style_optimizer_level_state_entry_is_a_leaf_and_kept():
    k = torch.tensor([7])
    c = osd([{"lr": 0.1, "params": [0, 1]}], {0: {"s": torch.ones(2)}, "k": k})
    r = osd([{"lr": 0.1, "params": [0, 1]}], {"k": torch.tensor([0])})
    out = dm.merge(c, r)
    assert out["state"]["k"] is k
    assert dm.flatten(c)["state.k"] is k
    assert dm.unflatten(dm.flatten(c), like=c)["state"]["k"] is k
    # a parameter's state that is a leaf stays malformed
    with pytest.raises(dm.LayoutError, match="must be a mapping"):
        dm.merge(osd([{"lr": 0.1, "params": [0]}], {0: torch.ones(1)}), r)


# -- param groups -----------------------------------------------------------------------


def test_a_moved_parameter_takes_its_new_groups_hyperparameters_nested():
    # biases moved from the decay group to the no-decay group
    c = osd(
        [
            {"lr": 5e-5, "weight_decay": 0.1, "params": ["w1", "w2", "b"]},
            {"lr": 5e-5, "weight_decay": 0.0, "params": ["n1", "n2"]},
        ]
    )
    r = osd(
        [
            {"lr": 1e-3, "weight_decay": 0.1, "params": ["w1", "w2"]},
            {"lr": 1e-3, "weight_decay": 0.0, "params": ["n1", "n2", "b"]},
        ]
    )
    with pytest.warns(dm.DSDMergeWarning, match="b moved") as record:
        merged = dm.merge_with_diff(c, r, policy="warn")
    assert len(record) == 1
    groups = merged.state_dict["param_groups"]
    assert groups[1]["params"] == ["n1", "n2", "b"]
    assert groups[1]["weight_decay"] == 0.0  # b takes its new group's decay
    assert groups[1]["lr"] == 5e-5  # and the scheduled lr, not the fresh one
    with pytest.raises(dm.MergeError, match="moved"):
        dm.merge(c, r, policy="strict")


def test_a_groups_checkpoint_group_is_the_one_at_its_position_else_the_majoritys():
    c = osd([{"lr": 1.0, "params": ["a"]}, {"lr": 2.0, "params": ["b", "c"]}])
    # one group now: its position's checkpoint group holds one of its members (two groups
    # merged, reported as moved members: a warning, an error under strict)
    with pytest.warns(dm.DSDMergeWarning, match=r"b moved: .*'lr' 2\.0 -> 1\.0"):
        out = dm.merge(c, osd([{"lr": 9.0, "params": ["a", "b", "c"]}]))
    assert out["param_groups"][0]["lr"] == 1.0
    with pytest.raises(dm.MergeError, match="moved"):
        dm.merge(c, osd([{"lr": 9.0, "params": ["a", "b", "c"]}]), policy="strict")
    # groups in another order: none of the members comes from the same position
    r = osd([{"lr": 9.0, "params": ["b", "c"]}, {"lr": 9.0, "params": ["a"]}])
    assert [g["lr"] for g in dm.merge(c, r, policy="strict")["param_groups"]] == [2.0, 1.0]


def _biases_moved_to_no_decay():
    """A real AdamW checkpoint with biases in the decay group, and a reference (the same model)
    that moved them to the no-decay group, where they outnumber the one weight already there."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    named = dict(model.named_parameters())

    def adamw(decay, no_decay):
        return torch.optim.AdamW(
            [
                {"params": [named[n] for n in decay], "weight_decay": 0.1},
                {"params": [named[n] for n in no_decay], "weight_decay": 0.0},
            ],
            lr=1e-3,
        )

    def fqn_keyed(optim, order):
        sd = optim.state_dict()
        return {
            "state": {order[i]: entry for i, entry in sd["state"].items()},
            "param_groups": [
                {**g, "params": [order[i] for i in g["params"]]} for g in sd["param_groups"]
            ],
        }

    trained = adamw(["0.weight", "0.bias", "1.bias"], ["1.weight"])
    model(torch.ones(1, 2)).sum().backward()
    trained.step()
    order = ["0.weight", "0.bias", "1.bias", "1.weight"]
    live = adamw(["0.weight"], ["0.bias", "1.bias", "1.weight"])
    return fqn_keyed(trained, order), fqn_keyed(live, order), live, order


def test_a_left_over_checkpoint_group_lists_no_parameter_a_reference_group_has():
    # was (under a majority rule, when the reference's no-decay group took the decay group's
    # hyperparameters): the checkpoint's no-decay group, which no reference group took, was
    # appended whole, listing 1.weight a second time: three groups for a two-group optimizer,
    # which torch rejects (and which merge itself refuses as input)
    ckpt, ref, live, order = _biases_moved_to_no_decay()
    with pytest.warns(dm.DSDMergeWarning, match=r"0\.bias moved: .*'weight_decay' 0\.1 -> 0\.0"):
        out = dm.merge(ckpt, ref)
    assert [g["params"] for g in out["param_groups"]] == [g["params"] for g in ref["param_groups"]]
    ids = {fqn: i for i, fqn in enumerate(order)}
    live.load_state_dict(
        {
            "state": {ids[k]: v for k, v in out["state"].items()},
            "param_groups": [
                {**g, "params": [ids[p] for p in g["params"]]} for g in out["param_groups"]
            ],
        }
    )
    assert dm.merge(out, ref) == out  # and merging again changes nothing
    # a left-over group is still kept for the members the reference no longer has
    gone = osd([{"lr": 1.0, "params": ["w"]}, {"lr": 2.0, "params": ["b", "dead"]}])
    now = osd([{"lr": 9.0, "params": ["w", "b"]}])  # takes group 0 (a tie: the first)
    with pytest.warns(dm.DSDMergeWarning, match=r"b moved: .*'lr' 2\.0 -> 1\.0"):
        groups = dm.merge(gone, now)["param_groups"]
    assert [g["params"] for g in groups] == [["w", "b"], ["dead"]]
    assert groups[1]["lr"] == 2.0


def test_biases_moved_to_the_no_decay_group_get_no_decay():
    ckpt, ref, _, _ = _biases_moved_to_no_decay()
    with pytest.warns(dm.DSDMergeWarning, match="moved"):
        no_decay = dm.merge(ckpt, ref)["param_groups"][1]
    assert no_decay["weight_decay"] == 0.0


def test_a_parameter_listed_twice_is_refused_everywhere():
    bad = osd([{"lr": 1, "params": ["w"]}, {"lr": 2, "params": ["w"]}])
    good = osd([{"lr": 1, "params": ["w"]}])
    for call in (
        dm.flatten,
        lambda x: dm.merge(x, good),
        lambda x: dm.merge(good, x),
        lambda x: dm.diff(x, good),
    ):
        with pytest.raises(dm.LayoutError, match="w"):
            call(bad)


def test_a_lost_parameter_without_state_leaves_the_group_size_torch_expects():
    model = nn.Linear(2, 2)
    c = osd(
        [{"lr": 0.1, "params": ["weight", "bias", "gone"]}], {"weight": {"m": torch.ones(2, 2)}}
    )
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    r = osd([{**optim.param_groups[0], "params": ["weight", "bias"]}])
    out = dm.merge(c, r)
    assert out["param_groups"][0]["params"] == ["weight", "bias"]
    optim.load_state_dict(  # torch maps by position: the sizes must agree
        {
            "state": {0: out["state"]["weight"]},
            "param_groups": [{**out["param_groups"][0], "params": [0, 1]}],
        }
    )


def test_nested_drop_unexpected_drops_checkpoint_only_hyperparameters_as_flat_does():
    c = osd([{"lr": 0.1, "initial_lr": 1.0, "params": ["w"]}])
    r = osd([{"lr": 0.2, "params": ["w"]}])
    policy = dm.DEFAULT.replace(drop_unexpected=True)
    assert "initial_lr" not in dm.merge(c, r, policy=policy)["param_groups"][0]
    assert "param_groups.w.initial_lr" not in dm.merge(dm.flatten(c), dm.flatten(r), policy=policy)
    assert dm.merge(c, r)["param_groups"][0]["initial_lr"] == 1.0  # kept by default


def test_inferred_groups_that_disagree_take_the_majority_and_warn_naming_every_value():
    # two groups built with equal values, then scheduled apart (a LambdaLR per group): a flat
    # reference cannot tell them apart. A new parameter takes the value most members hold (a
    # tie: the first member's, in the reference's order), every candidate is named, and the
    # members keep their own values (nothing says one of them moved)
    c = {"param_groups.a.lr": 5e-5, "param_groups.b.lr": 1e-5}
    r = {"param_groups.a.lr": 1e-3, "param_groups.new.lr": 1e-3, "param_groups.b.lr": 1e-3}
    for policy in ("default", "warn"):
        with pytest.warns(dm.DSDMergeWarning, match=r"5e-05 held by 'a'; 1e-05 held by 'b'"):
            out = dm.merge(c, r, policy=policy, allow_missing="*")
        assert out == {**c, "param_groups.new.lr": 5e-5}
        assert out["param_groups.new.lr"] is c["param_groups.a.lr"]
    c3 = {**c, "param_groups.c.lr": float(repr(1e-5))}  # most members: b's value
    r3 = {**r, "param_groups.c.lr": r["param_groups.a.lr"]}
    with pytest.warns(dm.DSDMergeWarning, match="the group takes 1e-05; backfilled 'new' take it"):
        assert dm.merge(c3, r3)["param_groups.new.lr"] is c3["param_groups.b.lr"]
    with pytest.raises(dm.MergeError, match=r"disagree on 'lr': 5e-05 held by 'a'; 1e-05"):
        dm.merge(c, r, policy="strict", allow_missing="*")
    with pytest.raises(dm.MergeError, match="disagree"):
        dm.check(c, r, policy="strict", allow_missing="*")
    # with the true groups (a nested reference), the new parameter joins its own group
    nested = osd([{"lr": 1e-3, "params": ["a", "new"]}, {"lr": 1e-3, "params": ["b"]}])
    assert dm.merge(c, nested)["param_groups.new.lr"] == 5e-5


# -- refusals and messages ------------------------------------------------------------------


def test_a_total_mismatch_is_refused_naming_the_prefix():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    wrapped = {f"module.{k}": v for k, v in model.state_dict().items()}
    for policy in ("default", "warn", "strict"):
        with pytest.raises(dm.MergeError, match=r"share no keys.*prefix 'module\.'"):
            dm.merge(wrapped, model.state_dict(), policy=policy)
    # the other way round: the reference is wrapped
    with pytest.raises(dm.MergeError, match=r"reference's keys look like .* prefix '_orig_mod\.'"):
        dm.merge(model.state_dict(), {f"_orig_mod.{k}": v for k, v in model.state_dict().items()})
    # allow-lists that cover every key let it through, as does a policy that says so
    dm.merge(wrapped, model.state_dict(), allow_missing="*", allow_unexpected="module.*")
    dm.merge(wrapped, model.state_dict(), policy=dm.DEFAULT.replace(unrelated="ignore"))


def test_resume_model_refuses_a_ddp_checkpoint_and_leaves_the_model_untouched():
    from dsdmerge.integrations import resume_model

    model = nn.Linear(3, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ddp = {f"module.{k}": torch.ones_like(v) for k, v in model.state_dict().items()}
    with pytest.raises(dm.MergeError, match="module"):
        resume_model(model, ddp)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_module_metadata_is_kept():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    grown = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Linear(2, 1))
    out = dm.merge(loaded, grown.state_dict())
    assert out._metadata["1"] == {"version": 2}  # the checkpoint's
    assert "2" in out._metadata  # and the new module's, from the reference
    grown.load_state_dict(out)


def test_a_scalar_step_in_another_shape_is_no_shape_change():
    c = osd([{"lr": 0.1, "params": ["w"]}], {"w": {"step": torch.tensor([3.0])}})
    r = osd([{"lr": 0.1, "params": ["w"]}], {"w": {"step": torch.tensor(1.0)}})
    out, diff, _ = dm.merge_with_diff(c, r, policy="strict")
    assert out["state"]["w"]["step"] is c["state"]["w"]["step"]
    assert diff.mismatched_keys == ("state.w.step",)  # reported, not refused


def test_shape_text_says_torch_rejects_only_model_tensors():
    # (a flattened optimizer: it holds hyperparameters, see test_layout.py for models)
    c = {"w": torch.zeros(2), "state.w.exp_avg": torch.zeros(2), "param_groups.w.lr": 0.1}
    r = {"w": torch.zeros(3), "state.w.exp_avg": torch.zeros(3), "param_groups.w.lr": 0.1}
    with pytest.raises(dm.MergeError) as err:
        dm.merge(c, r)
    model_line, state_line = err.value.problems
    assert "'w'" in model_line
    assert "torch would reject them on load" in model_line
    assert "state.w.exp_avg" in state_line
    assert "without checking its shape" in state_line


def test_at_most_one_warning_per_kind():
    c = {f"param_groups.{p}.lr": lr for p, lr in (("a", 1.0), ("b", 2.0), ("c", 1.0), ("d", 2.0))}
    r = osd(
        [
            {"lr": 0.5, "params": ["a", "b"]},
            {"lr": 0.5, "params": ["c", "d"]},
            {"lr": 0.5, "params": ["x"]},
        ]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dm.merge(c, r, policy="warn")
    kinds = [str(w.message).split(":")[1].strip()[:20] for w in caught]
    assert len(caught) == len(set(kinds)), kinds


# -- fresh ------------------------------------------------------------------------------------


def test_merge_as_fresh_leaves_parameters_without_checkpointed_state_stateless():
    ckpt = {"state.w.step": 7, "param_groups.w.lr": 5e-5, "param_groups.idx.lr": 5e-5}
    fresh = {
        "state.w.step": 1,
        "state.idx.step": 1,
        "param_groups.w.lr": 1e-3,
        "param_groups.idx.lr": 1e-3,
    }
    out, diff, _ = dm.merge_with_diff(ckpt, fresh, fresh="as_fresh")
    assert "state.idx.step" not in out
    assert diff.missing == ("state.idx.step",)
    nested = dm.merge(dm.unflatten(ckpt), dm.unflatten(fresh), fresh="as_fresh")
    assert set(nested["state"]) == {"w"}
    whole = dm.merge({"optim": ckpt}, {"optim": fresh}, fresh="as_fresh")
    assert "idx" not in dm.unflatten(whole["optim"])["state"]
    with pytest.raises(dm.InvalidPolicyError, match="fresh"):
        dm.merge(ckpt, fresh, fresh="new")  # type: ignore[arg-type]


# -- values, not only keys ------------------------------------------------------------------


def test_diff_values_reports_changed_hyperparameters_compressed():
    c = {"param_groups.a.lr": 5e-5, "param_groups.b.lr": 5e-5, "param_groups.a.betas": (0.9, 0.95)}
    r = {"param_groups.a.lr": 1e-3, "param_groups.b.lr": 1e-3, "param_groups.a.betas": (0.9, 0.95)}
    c["state.a.step"], r["state.a.step"] = torch.tensor(3.0), torch.tensor(1.0)
    c["eps"], r["eps"] = float("nan"), float("nan")
    assert not dm.diff(c, r)  # keys only, by default
    d = dm.diff(c, r, values=True)
    assert bool(d)
    assert [x.key for x in d.changed] == ["param_groups.a.lr", "param_groups.b.lr"]
    assert d.changed[0].checkpoint == 5e-5
    assert "param_groups.{a,b}.lr: checkpoint 5e-05, reference 0.001  (2 keys)" in str(d)
    assert d.to_dict()["changed"][1] == {
        "key": "param_groups.b.lr",
        "checkpoint": 5e-5,
        "reference": 1e-3,
    }
    # nested sides compare as flattened; the same object is never "changed"
    nested = dm.diff(dm.unflatten({k: v for k, v in c.items() if "." in k}), r, values=True)
    assert [x.key for x in nested.changed] == ["param_groups.a.lr", "param_groups.b.lr"]


def test_settling_groups_is_a_fixed_point_merging_again_changes_nothing():
    # found by the fuzz profile: wk moved from the 0.0 group to the 0.01 one, where it ties
    # with indexer, and norm from the 0.01 group to the 0.02 one: that norm moved shows only
    # once the 0.01 group is settled. One merge settles both; a second changes nothing.
    def flat(rows):
        return {f"param_groups.{p}.{n}": v for p, hp in rows.items() for n, v in hp.items()}

    c = flat(
        {
            p: {"lr": 5e-4, "weight_decay": wd}
            for p, wd in [
                ("wv", 0.0),
                ("wk", 0.0),
                ("indexer", 0.01),
                ("norm", 0.01),
                ("head", 0.02),
                ("wq", 0.02),
            ]
        }
    )
    r = flat(
        {
            p: {"lr": 1e-3, "weight_decay": wd}
            for p, wd in [
                ("wv", 0.0),
                ("wk", 0.01),
                ("indexer", 0.01),
                ("norm", 0.02),
                ("head", 0.02),
                ("wq", 0.02),
            ]
        }
    )
    with pytest.warns(dm.DSDMergeWarning, match="disagree on 'weight_decay'"):
        once = dm.merge(c, r)
    assert once["param_groups.wk.weight_decay"] == 0.01
    assert once["param_groups.norm.weight_decay"] == 0.02
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dm.merge(once, r) == once  # consistent now: nothing to say or change
