"""The command line's model surgery: --rename, --strip-prefix, --preset, resizing merges."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import dcp_save
from safetensors.torch import load_file, save_file
from test_cli import assert_error, run, run_here
from torch import nn

from dsdmerge.integrations import load_checkpoint


class Model(nn.Module):
    """Two attention layers and an embedding of ``vocab`` rows, with the new names."""

    def __init__(self, vocab: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 4)
        self.layers = nn.ModuleList(
            nn.ModuleDict(
                {"attn": nn.ModuleDict({"q_proj": nn.Linear(4, 4), "wo": nn.Linear(4, 4)})}
            )
            for _ in range(2)
        )


def reference_sd() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.detach().clone() for k, v in Model().state_dict().items()}


def refactored_sd() -> dict[str, torch.Tensor]:
    """The checkpoint of the old model: wq instead of q_proj, 8 embedding rows, trained (+1)."""
    sd = {k.replace(".q_proj.", ".wq."): v + 1 for k, v in reference_sd().items()}
    sd["embed.weight"] = torch.full((8, 4), 7.0)
    return sd


def ddp_sd() -> dict[str, torch.Tensor]:
    return {"module." + k: v + 1 for k, v in reference_sd().items()}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("surgery")
    for name, sd in (("ref", reference_sd()), ("old", refactored_sd()), ("ddp", ddp_sd())):
        torch.save(sd, d / f"{name}.pt")
        save_file(sd, str(d / f"{name}.safetensors"))
        dcp_save({"model": sd}, d / f"{name}_dcp")
    return d


def test_diff_prints_the_rename_it_suggests(files):
    proc = run_here("diff", str(files / "old.pt"), str(files / "ref.pt"))
    assert proc.returncode == 1, proc.stderr
    assert "look renamed" in proc.stdout
    assert r"r'\.attn\.wq\.' -> '.attn.q_proj.'" in proc.stdout
    assert r"to apply: --rename '\.attn\.wq\.=.attn.q_proj.'" in proc.stdout
    report = json.loads(
        run_here("diff", str(files / "old.pt"), str(files / "ref.pt"), "--json").stdout
    )
    assert report["renames"] == [
        {
            "pattern": r"\.attn\.wq\.",
            "replacement": ".attn.q_proj.",
            "params": 4,  # in a model state dict every key is an fqn: weight and bias
            "keys": 4,
            "example": ["layers.0.attn.wq.weight", "layers.0.attn.q_proj.weight"],
            "preset": None,
        }
    ]
    assert report["summary"]["renames"] == report["renames"]
    ddp = run_here("diff", str(files / "ddp.safetensors"), str(files / "ref.safetensors"))
    assert "preset 'ddp'" in ddp.stdout
    assert "to apply: --rename '^module\\.='" in ddp.stdout


def test_diff_through_a_rename(files):
    args = [str(files / "ddp.pt"), str(files / "ref.pt")]
    assert run_here("diff", *args, "--strip-prefix", "module.").returncode == 0
    assert run_here("diff", *args, "--preset", "ddp").returncode == 0
    proc = run_here("diff", *args, "--rename", r"^modul\.=")
    assert proc.returncode == 1
    assert "dsdmerge: warning: 1 rename rule(s) matched no key: '^modul\\\\.'" in proc.stderr
    # a DCP view of the whole checkpoint: its flat keys are fqns (no optimizer says otherwise)
    dcp = [str(files / "ddp_dcp"), str(files / "ref_dcp")]
    assert run("diff", *dcp, "--rename", r"^model\.module\.=model.").returncode == 0


def _load(path, fmt):
    if fmt == "torch":
        return torch.load(path, weights_only=True)
    if fmt == "safetensors":
        return load_file(str(path))
    return load_checkpoint(path)["model"]


@pytest.mark.parametrize(
    ("suffix", "fmt"), [(".pt", "torch"), (".safetensors", "safetensors"), ("_dcp", "dcp")]
)
def test_merge_rename_and_resize_write_loadable_checkpoints_in_every_format(
    files, tmp_path, suffix, fmt
):
    out = tmp_path / f"out{suffix}"
    args = [str(files / f"old{suffix}"), str(files / f"ref{suffix}"), "-o", str(out)]
    refused = (run if fmt == "dcp" else run_here)("merge", *args, "--policy", "strict")
    assert refused.returncode == 1
    assert "--on-shape-mismatch resize" in refused.stderr
    assert "--rename '\\.attn\\.wq\\.=.attn.q_proj.'" in refused.stderr
    assert not out.exists()
    proc = (run if fmt == "dcp" else run_here)(
        "merge",
        *args,
        "--policy",
        "strict",
        "--rename",
        r"\.attn\.wq\.=.attn.q_proj.",
        "--on-shape-mismatch",
        "resize",
    )
    assert proc.returncode == 0, proc.stderr
    assert "1 tensor resized" in proc.stdout
    assert "embed.weight: dim 0 8 -> 10; 32 elements kept, 8 from the reference" in proc.stdout
    assert "tensor(s) resized" in proc.stderr  # strict: a warning, not an error
    merged = _load(out, fmt)
    model = Model()
    model.load_state_dict(merged)  # strict: every key and shape as the model has them
    old, ref = refactored_sd(), reference_sd()
    assert torch.equal(model.embed.weight[:8], old["embed.weight"])
    assert torch.equal(model.embed.weight[8:], ref["embed.weight"][8:])
    assert torch.equal(model.layers[1]["attn"]["q_proj"].weight, old["layers.1.attn.wq.weight"])


@pytest.mark.parametrize(
    ("suffix", "fmt"), [(".pt", "torch"), (".safetensors", "safetensors"), ("_dcp", "dcp")]
)
def test_merge_strip_prefix_writes_loadable_checkpoints_in_every_format(
    files, tmp_path, suffix, fmt
):
    out = tmp_path / f"out{suffix}"
    args = [str(files / f"ddp{suffix}"), str(files / f"ref{suffix}"), "-o", str(out)]
    proc = (run if fmt == "dcp" else run_here)(
        "merge", *args, "--strip-prefix", "module", "--policy", "strict"
    )
    assert proc.returncode == 0, proc.stderr
    model = Model()
    model.load_state_dict(_load(out, fmt))
    assert torch.equal(model.embed.weight, ddp_sd()["module.embed.weight"])


def test_rename_options_are_checked(files, tmp_path):
    args = [str(files / "ddp.pt"), str(files / "ref.pt"), "-o", str(tmp_path / "o.pt")]
    bad = run_here("merge", *args, "--rename", "no-equals-sign")
    assert bad.returncode == 2
    assert "PATTERN=REPLACEMENT" in bad.stderr
    assert_error(run_here("merge", *args, "--rename", "(=x"), "not a regular expression")
    assert_error(run_here("merge", *args, "--rename", r"^module\..*weight$=w"), "same name")
    assert not (tmp_path / "o.pt").exists()
    help_text = run_here("merge", "--help").stdout
    assert "--on-shape-mismatch resize" in help_text  # offered for a grown model
    assert "{raise,take-reference,resize}" in help_text


def test_rules_apply_in_command_line_order(files, tmp_path):
    out = tmp_path / "o.pt"
    args = [str(files / "ddp.pt"), str(files / "ref.pt"), "-o", str(out), "--policy", "strict"]
    proc = run_here(
        "merge",
        *args,
        "--preset",
        "ddp",
        "--rename",
        r"^embed\.=emb.",
        "--rename",
        r"^emb\.=embed.",
    )
    assert proc.returncode == 0, proc.stderr
    assert set(torch.load(out, weights_only=True)) == set(reference_sd())
