"""Tied weights: a checkpoint that stores one of two keys sharing a tensor keeps the tie.

A language model whose output head is its embedding (``lm_head.weight = embed.weight``)
holds one tensor under two keys; ``save_pretrained`` (and safetensors' ``save_model``)
write one of them. Merged over the model's own ``state_dict()``, the other key must take
the checkpoint's tensor: ``load_state_dict`` copies key after key into the one
parameter, so a fresh copy under the second key would overwrite the trained one.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import dsdmerge as dm

ROOT = Path(__file__).resolve().parents[1]


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 4)
        self.body = nn.Linear(4, 4)
        self.lm_head = nn.Linear(4, vocab, bias=False)
        self.lm_head.weight = self.embed.weight  # tied


def trained(vocab: int = 10) -> TiedLM:
    torch.manual_seed(0)
    model = TiedLM(vocab)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0).add_(1.0)
    return model


def saved_like_save_pretrained(model: nn.Module, drop: str = "lm_head.weight") -> dict:
    """The state dict without the tied duplicate, as ``save_pretrained`` writes it."""
    return {k: v.clone() for k, v in model.state_dict().items() if k != drop}


@pytest.mark.parametrize("drop", ["lm_head.weight", "embed.weight"])
def test_a_tied_key_the_checkpoint_lacks_takes_its_twins_tensor_and_loading_keeps_it(drop):
    old = trained()
    ckpt = saved_like_save_pretrained(old, drop)
    other = "embed.weight" if drop == "lm_head.weight" else "lm_head.weight"
    model = TiedLM()
    out, diff, _ = dm.merge_with_diff(ckpt, model.state_dict())
    # was: the reference's fresh tensor, and load_state_dict overwrote the trained embedding
    assert out[drop] is ckpt[other]
    assert diff.missing == (drop,)  # still missing from the checkpoint: the fact stands
    assert diff.tied == ((drop, other),)
    assert diff.to_dict()["tied"] == [{"key": drop, "takes": other}]
    assert f"{drop} <- {other}" in str(diff)
    model.load_state_dict(out)
    assert model.lm_head.weight is model.embed.weight
    assert torch.equal(model.embed.weight, old.embed.weight)
    assert all(torch.equal(v, old.state_dict()[k]) for k, v in model.state_dict().items())


def test_policies_report_a_tie_and_never_refuse_it():
    ckpt = saved_like_save_pretrained(trained())
    ref = TiedLM().state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dm.merge(ckpt, ref)["lm_head.weight"] is ckpt["embed.weight"]  # default: silent
        strict = dm.merge(ckpt, ref, policy="strict", allow_missing="lm_head.*")
        assert strict["lm_head.weight"] is ckpt["embed.weight"]
    for policy in ("warn", "strict"):  # (nothing is lost, nothing taken from the reference)
        with pytest.warns(dm.DSDMergeWarning, match=r"'lm_head\.weight' takes 'embed\.weight'"):
            out = dm.merge(ckpt, ref, policy=policy)
        assert out["lm_head.weight"] is ckpt["embed.weight"]
        with pytest.warns(dm.DSDMergeWarning, match="tied"):
            assert dm.check(ckpt, ref, policy=policy).tied == (("lm_head.weight", "embed.weight"),)


def test_a_grown_tied_embedding_is_resized_once_for_both_keys():
    old = trained(10)
    ckpt = saved_like_save_pretrained(old)
    model = TiedLM(12)
    out, diff, _ = dm.merge_with_diff(ckpt, model.state_dict(), on_shape_mismatch="resize")
    assert out["lm_head.weight"] is out["embed.weight"]
    assert [r.key for r in diff.resized] == ["embed.weight"]
    model.load_state_dict(out)
    assert torch.equal(model.embed.weight[:10], old.embed.weight)


def test_untied_copies_and_meta_tensors_are_not_ties():
    old = trained()
    ckpt = saved_like_save_pretrained(old)
    ref = TiedLM().state_dict()
    ref = {**ref, "lm_head.weight": ref["lm_head.weight"].clone()}  # equal values, own memory
    assert dm.merge(ckpt, ref)["lm_head.weight"] is ref["lm_head.weight"]
    with torch.device("meta"):
        meta = TiedLM().state_dict()
    assert dm.merge_with_diff(ckpt, meta).diff.tied == ()
    view = dm.merge_with_diff(  # another view of the same memory is no tie
        ckpt, {**ref, "lm_head.weight": ref["embed.weight"][:5]}
    )
    assert view.diff.tied == ()


def test_a_tie_inside_a_whole_checkpoint_is_kept():
    old = trained()
    ckpt = {"model": saved_like_save_pretrained(old), "step": 3}
    model = TiedLM()
    out, diff, _ = dm.merge_with_diff(ckpt, {"model": model.state_dict(), "step": 0})
    assert diff.tied == (("model.lm_head.weight", "model.embed.weight"),)
    model.load_state_dict(out["model"])
    assert torch.equal(model.embed.weight, old.embed.weight)


def test_the_command_line_merge_keeps_a_tie(tmp_path):
    old = trained()
    save_file(saved_like_save_pretrained(old), tmp_path / "ckpt.safetensors")
    torch.save(TiedLM().state_dict(), tmp_path / "ref.pt")  # (torch.save keeps the sharing)
    out_path = tmp_path / "out.pt"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsdmerge",
            "merge",
            str(tmp_path / "ckpt.safetensors"),
            str(tmp_path / "ref.pt"),
            "-o",
            str(out_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    model = TiedLM()
    model.load_state_dict(torch.load(out_path, weights_only=True))
    assert model.lm_head.weight is model.embed.weight
    assert torch.equal(model.embed.weight, old.embed.weight)
