"""dsdmerge reference (the REFERENCE file from a builder), help texts, and the parser's presets."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from test_cli import assert_error, run, run_here

import dsdmerge as dm
from dsdmerge import cli
from dsdmerge.integrations.reference import reference_state_dict

BUILDER = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 4)
            self.indexer = nn.Linear(4, 2)  # never gets a gradient
            self.head = nn.Linear(4, 2)


    def build():
        torch.manual_seed(0)
        model = Net()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


    def parts():
        model, optimizer = build()
        return {"model": model, "optim": optimizer, "step": 0}


    def model_only():
        return build()[0]
    """
)


@pytest.fixture
def builder(tmp_path):
    (tmp_path / "train.py").write_text(BUILDER)
    return tmp_path / "train.py"


def test_reference_writes_what_a_fresh_model_and_optimizer_hold(builder, tmp_path):
    out = tmp_path / "fresh.pt"
    proc = run("reference", f"{builder}:build", "-o", str(out), "--optimizer-layout", "flat")
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out} (torch, " in proc.stdout
    fresh = torch.load(out, weights_only=True)
    assert set(fresh) == {"model", "optim"}
    # DSD's flattened form, with state for every parameter (a fresh state_dict() has none)
    assert fresh["optim"]["state.indexer.weight.step"] == 1
    assert fresh["optim"]["param_groups.head.bias.lr"] == 1e-3
    assert set(fresh["model"]) == {
        f"{m}.{p}" for m in ("body", "indexer", "head") for p in ("weight", "bias")
    }


def test_reference_layouts_and_parts(builder, tmp_path, monkeypatch):
    monkeypatch.chdir(builder.parent)  # module:function, found from the working directory
    assert run_here("reference", "train:parts", "-o", str(tmp_path / "a.pt")).returncode == 0
    parts = torch.load(tmp_path / "a.pt", weights_only=True)
    assert parts["step"] == 0
    assert set(parts["optim"]["state"]) == {
        "body.weight",
        "body.bias",
        "indexer.weight",
        "indexer.bias",
        "head.weight",
        "head.bias",
    }
    args = ["reference", "train:parts", "-o", str(tmp_path / "b.pt"), "--optimizer-layout", "ids"]
    assert run_here(*args).returncode == 0
    assert set(torch.load(tmp_path / "b.pt", weights_only=True)["optim"]["state"]) == set(range(6))
    proc = run_here("reference", "train:model_only", "-o", str(tmp_path / "m.safetensors"))
    assert proc.returncode == 0, proc.stderr
    assert "the model's state_dict()" in proc.stdout
    # the reference file is what diff and merge take
    torch.save({"model": parts["model"], "optim": parts["optim"], "step": 7}, tmp_path / "c.pt")
    report = json.loads(
        run_here("diff", str(tmp_path / "c.pt"), str(tmp_path / "a.pt"), "--json").stdout
    )
    assert report["changed"] == [{"key": "step", "checkpoint": 7, "reference": 0}]


def test_reference_errors(builder, tmp_path):
    out = str(tmp_path / "x.pt")
    assert_error(run_here("reference", "nocolon", "-o", out), "module:function")
    assert_error(run_here("reference", f"{builder}:nope", "-o", out), "no function 'nope'")
    assert_error(run_here("reference", "no_such_module_xyz:f", "-o", out), "cannot import")
    (tmp_path / "bad.py").write_text("def build():\n    return 42\n")
    assert_error(run_here("reference", f"{tmp_path / 'bad.py'}:build", "-o", out), "returned a int")
    (tmp_path / "x.pt").write_bytes(b"keep")
    assert_error(run_here("reference", f"{builder}:build", "-o", out), "--force")
    assert (tmp_path / "x.pt").read_bytes() == b"keep"


def test_reference_state_dict_doctest_form():
    model = torch.nn.Linear(2, 1)
    sd = reference_state_dict(
        {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)}
    )
    assert "momentum_buffer" in sd["optim"]["state"]["weight"]


# -- help and the parser ---------------------------------------------------------------


@pytest.mark.parametrize("command", ["inspect", "diff", "check", "merge", "reference", "demo"])
def test_help_examples_render_one_command_per_line(command, capsys):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    out = capsys.readouterr().out
    examples = out.split("example")[1]
    for line in examples.splitlines():
        if line.startswith("  dsdmerge "):
            # a command never runs into the next one (the backslash of a continuation)
            assert line.count(" dsdmerge ") == 1, line
            assert line.rstrip().endswith("\\") or "  dsdmerge" not in line[3:], line
    assert f"dsdmerge {command}" in examples


def test_preset_choices_are_the_library_presets():
    assert tuple(dm.RENAME_PRESETS) == cli._PRESET_NAMES


def test_version_is_quick_and_right():
    proc = run("--version")
    assert proc.stdout.strip() == f"dsdmerge {dm.__version__}"
