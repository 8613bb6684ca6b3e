"""``convert=`` on merge, merge_with_diff, diff, check and the resume helpers; ``--convert``.

Applied to the checkpoint first, after ``rename=`` (rename, then convert), before the
comparison with the reference, so ``on_shape_mismatch`` sees the converted tensors;
``diff`` suggests a preset when unexpected and missing keys fit one.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import warnings

import convert_story as cs
import pytest
import story
import torch
from conftest import Snapshot
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

import dsdmerge as dm
from dsdmerge import cli
from dsdmerge.integrations import (
    backfill_optimizer_state,
    read_metadata,
    resume_model,
    resume_optimizer,
)

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class Split(nn.Module):
    def __init__(self, vocab: int = 5) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 4)
        self.attn = nn.Module()
        for n in "qkv":
            setattr(self.attn, f"{n}_proj", nn.Linear(4, 4))


class Fused(nn.Module):
    def __init__(self, vocab: int = 5) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 4)
        self.attn = nn.Module()
        self.attn.qkv_proj = nn.Linear(4, 12)


def trained(model: nn.Module) -> torch.optim.Optimizer:
    optim = torch.optim.AdamW([{"params": list(model.named_parameters())}], lr=1e-2)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optim.step()
    return optim


@pytest.fixture
def split():
    torch.manual_seed(0)
    model = Split()
    return model, trained(model)


# -- merge, merge_with_diff, check, diff ---------------------------------------------------


def test_merge_converts_the_checkpoint_before_comparing(split):
    model, _ = split
    ckpt = model.state_dict()
    ref = Fused().state_dict()
    snap = Snapshot(ckpt)
    merged = dm.merge(ckpt, ref, convert=["qkv"], policy="strict")
    assert snap.unchanged()
    want = dm.convert(ckpt, ["qkv"])
    assert story.tree_differences(want, merged) == []
    d = dm.merge_with_diff(ckpt, ref, convert=["qkv"], policy="strict").diff
    assert not d
    assert not dm.check(ckpt, ref, convert=["qkv"], policy="strict")
    assert not dm.diff(ckpt, ref, convert=["qkv"])
    with pytest.raises(dm.MergeError):  # without the conversion: unexpected and missing keys
        dm.merge(ckpt, ref, policy="strict")


def test_rename_then_convert(split):
    model, _ = split
    ckpt = dm.rename(model.state_dict(), {"^": "module."})
    ref = Fused().state_dict()
    merged = dm.merge(ckpt, ref, rename="ddp", convert=["qkv"], policy="strict")
    assert list(merged) == list(ref)
    # the other way round the conversion would have to name module.-prefixed fqns: converted
    # first, the rename has nothing left to pair
    assert dm.diff(ckpt, ref, rename="ddp", convert=["qkv"]) == dm.KeyDiff()


def test_on_shape_mismatch_sees_the_converted_tensors(split):
    model, _ = split
    ckpt = model.state_dict()
    ref = Fused(vocab=7).state_dict()  # the vocabulary grew as well
    with pytest.raises(dm.MergeError, match=r"embed\.weight"):
        dm.merge(ckpt, ref, convert=["qkv"], policy="strict")
    merged, d, _ = dm.merge_with_diff(ckpt, ref, convert=["qkv"], on_shape_mismatch="resize")
    assert [r.key for r in d.resized] == ["embed.weight"]
    assert merged["embed.weight"].shape == (7, 4)
    assert torch.equal(merged["embed.weight"][:5], ckpt["embed.weight"])
    assert torch.equal(merged["attn.qkv_proj.bias"][4:8], ckpt["attn.k_proj.bias"])


def test_a_nested_optimizer_merges_through_the_conversion(split):
    _, optim = split
    osd = dm.rekey(optim.state_dict())
    fused = Fused()
    ref = dm.rekey(trained(fused).state_dict())
    merged = dm.merge(osd, ref, convert=["qkv"], policy="strict")
    got = merged["state"]["attn.qkv_proj.weight"]["exp_avg"]
    want = torch.cat([osd["state"][f"attn.{n}_proj.weight"]["exp_avg"] for n in "qkv"])
    assert torch.equal(got, want)


def test_check_converts_a_metadata_view_without_reading_a_tensor(split, tmp_path):
    model, optim = split
    path = tmp_path / "split.pt"
    torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, path)
    view = read_metadata(path, key="model")
    ref = Fused().state_dict()
    assert not dm.check(view, ref, convert=["qkv"], policy="strict")
    d = dm.diff(view, ref)
    assert d.conversions == ("qkv",)


def test_diff_suggests_a_preset_when_the_keys_fit_one(split):
    model, optim = split
    ckpt, ref = model.state_dict(), Fused().state_dict()
    d = dm.diff(ckpt, ref)
    assert d.conversions == ("qkv",)
    assert "convert=['qkv'] would convert them" in str(d)
    assert d.to_dict()["conversions"] == ["qkv"]
    assert "conversions=('qkv',)" in repr(d)
    # optimizer state too, flat and nested
    fused = Fused()
    fresh = trained(fused)
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    for options in (FLAT, None):
        c = get_optimizer_state_dict(model, optim, options=options)
        r = get_optimizer_state_dict(fused, fresh, options=options)
        assert dm.diff(c, r).conversions == ("qkv",)
    # no suggestion when the shapes would not fit, or nothing is missing
    assert dm.diff(ckpt, {**ref, "attn.qkv_proj.weight": torch.zeros(9, 4)}).conversions == ()
    assert dm.diff(ckpt, {}).conversions == ()
    assert dm.KeyDiff().to_dict().keys() == {
        "missing",
        "unexpected",
        "mismatched",
        "renames",
        "resized",
    }


def test_convert_errors_pass_through_and_change_nothing(split):
    model, _ = split
    ckpt = model.state_dict()
    snap = Snapshot(ckpt)
    for call in (dm.merge, dm.check, dm.diff):
        with pytest.raises(dm.ConversionError, match="match no parameter"):
            call(ckpt, Fused().state_dict(), convert=["stack_experts"])
    assert snap.unchanged()


# -- the resume helpers: the life of a run -------------------------------------------------


@pytest.mark.parametrize("layout", ["flat", "nested", "int"])
@pytest.mark.parametrize("name", ["torch.Adam", "torch.SGD-momentum", "pytorch_optimizer.Lion"])
def test_resume_helpers_convert_and_training_continues_exactly(name, layout, tmp_path):
    """resume_model / resume_optimizer with convert= straight from the split checkpoint."""
    spec = next(s for s in cs.SPECS if s.id == name)
    if spec.package is not None:
        pytest.importorskip(spec.package)
    from test_convert_story import compare, save_and_load

    split = cs.build(spec, fused=False)
    for i in range(cs.N_STEPS):
        cs.step_split(split, i)
    loaded = save_and_load(split, layout, tmp_path / "split.pt")
    snap = Snapshot(loaded)
    fused = cs.build(spec, fused=True)
    resume_model(fused.model, loaded["model"], convert=cs.CONVERSIONS, policy="strict")
    resume_optimizer(
        fused.model,
        fused.optim,
        loaded["optim"],
        options=FLAT if layout == "flat" else None,
        convert=cs.CONVERSIONS,
        policy="strict",
    )
    assert snap.unchanged()
    fused.sched.load_state_dict(loaded["sched"])  # (LambdaLR pops from what it is given)
    cs.step_fused(fused, cs.N_STEPS, cs.step_split(split, cs.N_STEPS))
    compare(split, fused, f"{name} {layout}: resumed with convert=")


def test_backfill_optimizer_state_converts(split):
    _, optim = split
    saved = copy.deepcopy(optim.state_dict())
    fused = Fused()
    fresh = torch.optim.AdamW([{"params": list(fused.named_parameters())}], lr=1e-2)
    sd = backfill_optimizer_state(fresh, saved, model=fused, convert=["qkv"], policy="strict")
    fresh.load_state_dict(sd)
    state = fresh.state[fused.attn.qkv_proj.bias]
    want = torch.cat([saved["state"][i]["exp_avg"] for i in (2, 4, 6)])  # q, k, v biases
    assert torch.equal(state["exp_avg"], want)


# -- the command line ----------------------------------------------------------------------


def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with (
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
        warnings.catch_warnings(),
    ):
        try:
            code = cli.main(list(args))
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else 2
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def files(split, tmp_path):
    model, _ = split
    ckpt, ref = tmp_path / "split.pt", tmp_path / "fused.pt"
    torch.save(model.state_dict(), ckpt)
    torch.save(Fused().state_dict(), ref)
    return ckpt, ref, tmp_path


def test_cli_diff_suggests_the_preset_and_applies_it(files):
    ckpt, ref, _ = files
    code, out, _ = run_cli("diff", str(ckpt), str(ref), "--color", "never")
    assert code == 1
    assert "to convert: --convert qkv" in out
    code, out, _ = run_cli("diff", str(ckpt), str(ref), "--json")
    assert json.loads(out)["conversions"] == ["qkv"]
    code, out, _ = run_cli("diff", str(ckpt), str(ref), "--convert", "qkv")
    assert code == 0, out


def test_cli_check_and_merge_with_convert(files):
    ckpt, ref, where = files
    code, out, err = run_cli("check", str(ckpt), str(ref), "--policy", "strict")
    assert code == 1
    code, out, err = run_cli("check", str(ckpt), str(ref), "--policy", "strict", "--convert", "qkv")
    assert code == 0, (out, err)
    out_path = where / "merged.pt"
    code, out, err = run_cli(
        "merge", str(ckpt), str(ref), "-o", str(out_path), "--convert", "qkv", "--policy", "strict"
    )
    assert code == 0, (out, err)
    merged = torch.load(out_path, weights_only=True)
    assert list(merged) == list(Fused().state_dict())
    assert torch.equal(
        merged["attn.qkv_proj.weight"],
        dm.convert(torch.load(ckpt), ["qkv"])["attn.qkv_proj.weight"],
    )


def test_cli_knows_every_preset():
    assert tuple(dm.CONVERSION_PRESETS) == cli._CONVERSION_NAMES
    code, _, err = run_cli("diff", "a.pt", "b.pt", "--convert", "qvk")
    assert code == 2
    assert "invalid choice" in err
