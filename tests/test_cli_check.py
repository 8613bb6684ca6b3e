"""check (a merge's dry run for CI), diff's values and allow-lists, --key parts, --only/--exclude,
--stat, and allow-lists that take the patterns reports print; on real trained checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import dcp_save
from test_cli import assert_error, run, run_here
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
)

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class Net(nn.Module):
    """Layers with an indexer that never gets a gradient; ``grown`` adds a layer."""

    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleDict({"proj": nn.Linear(4, 4), "indexer": nn.Linear(4, 2)})
            for _ in range(layers)
        )
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer["proj"](x))
        return self.head(x)


def trained(layers: int, *, lr: float, weight_decay: float) -> dict[str, object]:
    torch.manual_seed(0)
    model = Net(layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    optim = get_optimizer_state_dict(model, optimizer, options=FLAT)
    return {"model": model.state_dict(), "optim": optim, "step": 2}


def fresh(layers: int) -> dict[str, object]:
    torch.manual_seed(1)
    model = Net(layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    optim = get_optimizer_state_dict(model, optimizer, options=FLAT)  # DSD's zero-grad step
    return {"model": model.state_dict(), "optim": optim, "step": 0}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("check")
    torch.save(trained(3, lr=5e-5, weight_decay=0.1), d / "step-2.pt")
    torch.save(fresh(4), d / "fresh.pt")  # a layer more
    torch.save(fresh(3), d / "fresh3.pt")
    torch.save(fresh(4)["model"], d / "model.pt")
    dcp_save(trained(3, lr=5e-5, weight_decay=0.1), d / "step-2_dcp")
    return d


def args(ckpts, *extra: str) -> list[str]:
    return [str(ckpts / "step-2.pt"), str(ckpts / "fresh.pt"), *extra]


INDEXER = "optim.state.layers.{0..2}.indexer.{bias,weight}.{exp_avg,exp_avg_sq,step}"
NEW_LAYER_MODEL = "model.layers.3.{indexer,proj}.{bias,weight}"
NEW_LAYER_OPTIM = "optim.*.layers.3.*"


# -- check: exit codes and the --json schema --------------------------------------------


def test_check_exit_codes(ckpts):
    assert run_here("check", *args(ckpts)).returncode == 0  # default: backfill quietly
    proc = run("check", *args(ckpts, "--policy", "strict"))
    assert proc.returncode == 1, proc.stderr
    assert "policy 'strict' rejects the merge:" in proc.stdout
    assert "--allow-missing GLOB" in proc.stdout  # advice in the CLI's words
    allowed = ["--allow-missing", INDEXER, "--allow-missing", NEW_LAYER_MODEL]
    allowed += ["--allow-missing", NEW_LAYER_OPTIM]
    proc = run_here("check", *args(ckpts, "--policy", "strict", *allowed))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1] == "policy 'strict' accepts the merge"
    assert_error(run_here("check", str(ckpts / "nope.pt"), str(ckpts / "fresh.pt")), "nope.pt")
    assert_error(run_here("check", *args(ckpts, "--key", "modle")), "modle", "model, optim, step")


CHECK_KEYS = {
    "checkpoint": str,
    "reference": str,
    "checkpoint_key": (str, type(None)),
    "reference_key": (str, type(None)),
    "policy": str,
    "accepted": bool,
    "errors": list,
    "warnings": list,
    "backfilled": list,
    "kept": list,
    "dropped": list,
    "resized": list,
    "replaced": list,
    "cast": list,
    "renamed": list,
    "missing": list,
    "unexpected": list,
    "mismatched": list,
    "allowed": dict,
    "unmatched_globs": dict,
    "suggested_renames": list,
    "summary": dict,
}


def check_json(*argv: str) -> tuple[int, dict[str, object]]:
    proc = run_here("check", *argv, "--json")
    assert proc.returncode in (0, 1), proc.stderr
    report = json.loads(proc.stdout)
    assert set(report) == set(CHECK_KEYS)
    for key, kind in CHECK_KEYS.items():
        assert isinstance(report[key], kind), key
    assert report["accepted"] is (proc.returncode == 0)
    return proc.returncode, report


def test_check_json_says_what_the_merge_would_do(ckpts):
    code, report = check_json(*args(ckpts, "--policy", "strict", "--allow-missing", INDEXER))
    assert code == 1
    assert report["policy"] == "strict"
    assert len(report["errors"]) == 1
    assert "missing from the checkpoint" in report["errors"][0]
    assert "model.layers.3.proj.weight" in report["backfilled"]
    assert "optim.state.layers.0.indexer.weight.exp_avg" in report["backfilled"]
    indexer_state = {
        k
        for k in report["missing"]
        if k.startswith("optim.state.layers.") and ".indexer." in k and k.split(".")[3] in "012"
    }
    assert len(indexer_state) == 18
    assert set(report["allowed"]["missing"]) == indexer_state
    assert report["kept"] == report["unexpected"] == []
    # merged, the policy's verdict is the same: what check said is what merge does
    assert (
        run_here(
            "merge",
            *args(
                ckpts,
                "--policy",
                "strict",
                "--allow-missing",
                INDEXER,
                "-o",
                str(ckpts / "never.pt"),
            ),
        ).returncode
        == 1
    )
    assert not (ckpts / "never.pt").exists()


def test_check_json_kept_dropped_resized_replaced_renamed(ckpts, tmp_path):
    small = {"embed.weight": torch.ones(4, 2), "old.w": torch.ones(1), "b": torch.ones(2)}
    big = {"embed.weight": torch.zeros(6, 2), "new.w": torch.zeros(1), "b": torch.zeros(2)}
    torch.save(small, tmp_path / "a.pt")
    torch.save(big, tmp_path / "b.pt")
    pair = [str(tmp_path / "a.pt"), str(tmp_path / "b.pt")]
    code, report = check_json(*pair, "--on-shape-mismatch", "resize", "--allow-unexpected", "x.*")
    assert code == 0
    assert report["kept"] == ["old.w"]
    assert report["backfilled"] == ["new.w"]
    assert [r["key"] for r in report["resized"]] == ["embed.weight"]
    assert report["resized"][0]["reference"] == {"shape": [6, 2], "dtype": "float32"}
    assert report["unmatched_globs"] == {"allow_missing": [], "allow_unexpected": ["x.*"]}
    code, report = check_json(*pair, "--on-shape-mismatch", "take-reference")
    assert [r["key"] for r in report["replaced"]] == ["embed.weight"]
    assert report["resized"] == []
    assert any("reference's were taken" in w for w in report["warnings"])
    code, report = check_json(*pair, "--rename", "^old\\.=new.", "--on-shape-mismatch", "resize")
    assert report["renamed"] == [{"from": "old.w", "to": "new.w"}]
    assert report["backfilled"] == report["kept"] == []
    code, report = check_json(*pair, "--policy", "strict")
    assert code == 1
    assert len(report["errors"]) == 3  # missing, unexpected, shape
    assert report["suggested_renames"][0]["pattern"] == "^old\\."


# -- diff: values, allow-lists, parts -----------------------------------------------------


def test_diff_compares_values_and_exits_1_when_only_they_differ(ckpts, tmp_path):
    same_keys = trained(3, lr=5e-5, weight_decay=0.1)
    scheduled = trained(3, lr=1e-3, weight_decay=0.01)  # another lr and weight decay
    torch.save(same_keys, tmp_path / "a.pt")
    torch.save(scheduled, tmp_path / "b.pt")
    pair = [str(tmp_path / "a.pt"), str(tmp_path / "b.pt")]
    proc = run_here("diff", *pair, "--key", "optim")
    assert proc.returncode == 1, proc.stdout
    assert "non-tensor values differ" in proc.stdout
    assert "param_groups.{head,layers.{0..2}.{indexer,proj}}" not in proc.stdout  # exact only
    report = json.loads(run_here("diff", *pair, "--key", "optim", "--json").stdout)
    assert report["missing"] == report["unexpected"] == report["mismatched"] == []
    assert report["differs"] is True
    lrs = [c for c in report["changed"] if c["key"].endswith(".lr")]
    assert len(lrs) == 14  # every param of the 7 modules, weight and bias
    assert lrs[0] == {"key": lrs[0]["key"], "checkpoint": 5e-05, "reference": 0.001}
    assert {c["key"].rsplit(".", 1)[1] for c in report["changed"]} == {"lr", "weight_decay"}
    assert run_here("diff", *pair, "--key", "optim", "--ignore-values").returncode == 0
    report = json.loads(run_here("diff", *pair, "--ignore-values", "--json").stdout)
    assert report["changed"] == []  # always there, empty
    # the step differs too at the top level: 2 vs 2 here, so not changed
    assert run_here("diff", str(tmp_path / "a.pt"), str(tmp_path / "a.pt")).returncode == 0


def test_diff_allow_lists_exit_0_when_only_allowed_differences_remain(ckpts):
    base = args(ckpts, "--ignore-values")
    assert run_here("diff", *base).returncode == 1
    allowed = ["--allow-missing", NEW_LAYER_MODEL, "--allow-missing", NEW_LAYER_OPTIM]
    proc = run_here("diff", *base, *allowed)
    assert proc.returncode == 1  # the indexer's state is missing too
    assert "other differences remain" in proc.stdout
    proc = run_here("diff", *base, *allowed, "--allow-missing", INDEXER)
    assert proc.returncode == 0, proc.stdout
    assert "nothing else differs" in proc.stdout
    report = json.loads(
        run_here("diff", *base, *allowed, "--allow-missing", INDEXER, "--json").stdout
    )
    assert report["differs"] is False
    assert sorted(report["allowed"]["missing"]) == sorted(report["missing"])
    # the pattern the report printed, copied into --allow-missing, allows exactly its keys
    text = run_here("diff", *base).stdout
    printed = [line.split()[0] for line in text.splitlines() if "indexer" in line]
    assert INDEXER in printed


def test_diff_reports_globs_that_match_nothing(ckpts):
    proc = run_here("diff", *args(ckpts, "--allow-missing", "optim.state.*.indxer.*"))
    assert "--allow-missing 'optim.state.*.indxer.*' matches no key of the reference" in proc.stderr
    report = json.loads(
        run_here(
            "diff", *args(ckpts, "--allow-unexpected", "ema.*", "--only", "zz*", "--json")
        ).stdout
    )
    assert report["unmatched_globs"]["allow_unexpected"] == ["ema.*"]
    assert report["unmatched_globs"]["only"] == ["zz*"]


def test_key_selects_a_part_on_either_side(ckpts):
    # a whole training checkpoint against a model-only reference
    proc = run_here(
        "diff", str(ckpts / "step-2.pt"), str(ckpts / "model.pt"), "--ckpt-key", "model"
    )
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert lines[0] == f"checkpoint: {ckpts / 'step-2.pt'} [model] (torch, 14 keys)"
    assert "  layers.3.{indexer,proj}.{bias,weight}  (4 keys)" in proc.stdout
    report = json.loads(
        run_here(
            "diff",
            str(ckpts / "step-2_dcp"),
            str(ckpts / "fresh3.pt"),
            "--key",
            "optim",
            "--ignore-values",
            "--json",
        ).stdout
    )
    assert report["checkpoint_key"] == report["reference_key"] == "optim"
    # a DCP view and a torch file of the same part: the same flat keys but the indexer's state
    assert report["unexpected"] == []
    assert {k.split(".")[3] for k in report["missing"]} == {"indexer"}
    assert len(report["missing"]) == 18
    proc = run_here("inspect", str(ckpts / "step-2.pt"), "--key", "optim", "--json")
    assert json.loads(proc.stdout)["layout"] == "flat"  # DSD's flattened optimizer state
    assert_error(run_here("inspect", str(ckpts / "step-2.pt"), "--key", "step"), "'step'")


def test_merge_key_writes_the_whole_checkpoint_with_its_part_merged(ckpts, tmp_path):
    out = tmp_path / "resumable.pt"
    proc = run_here(
        "merge",
        str(ckpts / "step-2.pt"),
        str(ckpts / "model.pt"),
        "-o",
        str(out),
        "--ckpt-key",
        "model",
    )
    assert proc.returncode == 0, proc.stderr
    assert "'model' merged, the rest as it was" in proc.stdout
    merged = torch.load(out, weights_only=True)
    before = torch.load(ckpts / "step-2.pt", weights_only=True)
    assert merged["step"] == 2
    assert merged["optim"].keys() == before["optim"].keys()  # untouched part, all of it
    assert "layers.3.proj.weight" in merged["model"]
    assert torch.equal(merged["model"]["head.weight"], before["model"]["head.weight"])


# -- filters -------------------------------------------------------------------------------


def test_only_exclude_and_stat(ckpts):
    proc = run_here("inspect", str(ckpts / "step-2.pt"), "--stat", "--json")
    stat = {row["prefix"]: row for row in json.loads(proc.stdout)["stat"]}
    assert set(stat) == {"model", "optim", "step"}
    assert stat["model"]["tensors"] == stat["model"]["keys"] == 14
    proc = run_here("inspect", str(ckpts / "step-2.pt"), "--only", "model.*", "--exclude", "*.bias")
    assert "keys: 7" in proc.stdout
    assert "filter: --only 'model.*' --exclude '*.bias' (7 of " in proc.stdout
    proc = run_here("diff", *args(ckpts, "--ignore-values", "--only", "model.*", "--stat"))
    assert proc.returncode == 1
    stat = proc.stdout.split("top-level key")[1].split("keys missing")[0]
    assert "optim" not in stat
    assert [line.split() for line in stat.splitlines() if line.startswith("  model ")] == [
        ["model", "14", "18", "4", "0", "0", "0"]
    ]
    proc = run_here("diff", *args(ckpts, "--ignore-values", "--only", "step"))
    assert proc.returncode == 0  # nothing differs among the keys shown
