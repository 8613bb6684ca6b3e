"""The dsdmerge command line: every subcommand and exit code, in subprocesses, and atomic writes."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import Evil, dcp_save

from dsdmerge import cli

ROOT = Path(__file__).resolve().parents[1]
ANSI = "\x1b["


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m dsdmerge ARGS`` with this checkout on the path (never the installed script)."""
    child_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    child_env.pop("DSDMERGE_TRACEBACK", None)
    return subprocess.run(
        [sys.executable, "-m", "dsdmerge", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env,
    )


def run_here(*args: str) -> subprocess.CompletedProcess[str]:
    """``dsdmerge ARGS`` in this process (cheaper: no torch import per call), same result type."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(args))
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else 2
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def assert_error(proc, *words: str) -> None:
    """Exit 2, one line on stderr naming the problem, no traceback."""
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("dsdmerge: error: ")
    assert "Traceback" not in proc.stderr
    for word in words:
        assert word in lines[0], lines[0]


def reference_sd() -> dict[str, torch.Tensor]:
    sd = {f"layers.{i}.attn.{w}.weight": torch.zeros(4, 4) for i in range(6) for w in ("wq", "wk")}
    sd.update({f"layers.{i}.experts.{e}.w1": torch.zeros(2) for i in range(6) for e in range(8)})
    sd["head.weight"] = torch.zeros(3, 4)
    return sd


def checkpoint_sd() -> dict[str, torch.Tensor]:
    """The reference minus layer 2's experts and layer 4's expert 1, trained, plus an EMA value."""
    sd = {
        k: v + 1
        for k, v in reference_sd().items()
        if not k.startswith(("layers.2.experts.", "layers.4.experts.1."))
    }
    sd["ema.decay"] = torch.tensor(0.99)
    return sd


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("cli")
    torch.save(checkpoint_sd(), d / "ckpt.pt")
    torch.save(reference_sd(), d / "ref.pt")
    save_file(checkpoint_sd(), str(d / "ckpt.safetensors"))
    save_file(reference_sd(), str(d / "ref.safetensors"))
    dcp_save({"model": checkpoint_sd()}, d / "ckpt_dcp")
    dcp_save({"model": reference_sd()}, d / "ref_dcp")
    return d


# -- inspect -----------------------------------------------------------------------------


def test_inspect_torch_file(files):
    proc = run("inspect", str(files / "ckpt.pt"))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert ANSI not in out  # piped: plain text
    assert "format: torch" in out
    assert "layout: flat" in out
    assert "keys: 53" in out
    assert "tensors: 53 (" in out
    assert "float32 x 53" in out
    assert "  layers.{0,1,3,5}.experts.{0..7}.w1  (32 keys)" in out
    assert "  layers.4.experts.{0,2..7}.w1  (7 keys)" in out


@pytest.mark.parametrize(
    ("name", "fmt", "layout", "prefix"),
    [
        ("ckpt.pt", "torch", "flat", ""),
        ("ckpt.safetensors", "safetensors", "flat", ""),
        ("ckpt_dcp", "dcp", "nested", "model."),
    ],
)
def test_inspect_json_every_format(files, name, fmt, layout, prefix):
    proc = (run if fmt == "dcp" else run_here)("inspect", str(files / name), "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["format"] == fmt
    assert report["layout"] == layout
    assert report["keys"] == 53
    assert report["tensors"] == 53
    assert report["dtypes"] == {"float32": 53}
    assert sum(p["count"] for p in report["patterns"]) == 53
    assert {"pattern": f"{prefix}layers.{{0..5}}.attn.{{wk,wq}}.weight", "count": 12} in report[
        "patterns"
    ]


def test_inspect_nested_torch_checkpoint(tmp_path, monkeypatch):
    torch.save({"model": reference_sd(), "step": 3}, tmp_path / "full.pt")
    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: loads.append(a) or real_load(*a, **kw))
    report = json.loads(run_here("inspect", str(tmp_path / "full.pt"), "--json").stdout)
    assert report["layout"] == "nested"
    assert report["keys"] == 62
    assert len(loads) == 1  # the layout comes with the metadata view: one (mmap) load


# -- diff --------------------------------------------------------------------------------


def test_diff_reports_and_exits_1_when_something_differs(files):
    proc = run("diff", str(files / "ckpt.pt"), str(files / "ref.pt"))
    assert proc.returncode == 1, proc.stderr
    assert ANSI not in proc.stdout
    assert proc.stdout.splitlines() == [
        f"checkpoint: {files / 'ckpt.pt'} (torch, 53 keys)",
        f"reference: {files / 'ref.pt'} (torch, 61 keys)",
        "9 keys missing from the checkpoint (will be taken from the reference):",
        "  layers.2.experts.{0..7}.w1  (8 keys)",
        "  layers.4.experts.1.w1",
        "1 key unexpected in the checkpoint (not in the reference):",
        "  ema.decay",
    ]


def test_diff_exits_0_when_nothing_differs(files):
    proc = run("diff", str(files / "ref.pt"), str(files / "ref.safetensors"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "no differences"


def test_diff_keeps_its_exit_status_when_the_reader_stops_early(tmp_path):
    # `dsdmerge diff a b --json | head -c 1`: the pipe closes long before the report ends
    torch.save({f"layers.{i}.w": 0.0 for i in range(20_000)}, tmp_path / "many.pt")
    torch.save({}, tmp_path / "empty.pt")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsdmerge", "diff", "many.pt", "empty.pt", "--json"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    assert proc.stdout.read(1) == b"{"
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1, err  # it differs, whoever stopped reading
    assert err == ""


def test_diff_json_across_formats(files):
    proc = run("diff", str(files / "ckpt.safetensors"), str(files / "ref.pt"), "--json")
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    assert report["differs"] is True
    assert sorted(report["missing"]) == sorted(
        [f"layers.2.experts.{e}.w1" for e in range(8)] + ["layers.4.experts.1.w1"]
    )
    assert report["unexpected"] == ["ema.decay"]
    assert report["mismatched"] == []
    assert report["summary"]["missing"]["patterns"][0] == {
        "pattern": "layers.2.experts.{0..7}.w1",
        "count": 8,
    }


def test_diff_dcp_reads_metadata_only(files, tmp_path):
    """With every data file deleted, a DCP diff still works: no tensor bytes are read."""
    import shutil

    copy = tmp_path / "ckpt_dcp"
    shutil.copytree(files / "ckpt_dcp", copy)
    for data in copy.glob("*.distcp"):
        data.unlink()
    proc = run_here("diff", str(copy), str(files / "ref_dcp"), "--json")
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    assert "model.layers.4.experts.1.w1" in report["missing"]
    assert report["unexpected"] == ["model.ema.decay"]


def test_diff_json_mismatches_show_both_sides(tmp_path):
    torch.save({"w": torch.zeros(2, 3), "b": torch.zeros(2)}, tmp_path / "a.pt")
    torch.save(
        {"w": torch.zeros(4, 3), "b": torch.zeros(2, dtype=torch.bfloat16)}, tmp_path / "b.pt"
    )
    proc = run_here("diff", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "--json")
    assert proc.returncode == 1
    mismatched = {m["key"]: m for m in json.loads(proc.stdout)["mismatched"]}
    assert mismatched["w"]["checkpoint"] == {"shape": [2, 3], "dtype": "float32"}
    assert mismatched["w"]["reference"] == {"shape": [4, 3], "dtype": "float32"}
    assert mismatched["b"]["reference"]["dtype"] == "bfloat16"


# -- errors ------------------------------------------------------------------------------


def test_missing_path(tmp_path):
    assert_error(run("inspect", str(tmp_path / "nope.pt")), "nope.pt", "no such file")


@pytest.mark.parametrize("keep", [0, 100, 2000])
def test_truncated_torch_file(files, tmp_path, keep):
    bad = tmp_path / "cut.pt"
    bad.write_bytes((files / "ckpt.pt").read_bytes()[:keep])
    assert_error(
        (run if keep == 100 else run_here)("diff", str(bad), str(files / "ref.pt")), "cut.pt"
    )


def test_corrupt_safetensors(files, tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes((files / "ckpt.safetensors").read_bytes()[:40])
    assert_error(run_here("inspect", str(bad)), "bad.safetensors", "safetensors")


def test_unknown_format(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    assert_error(run_here("inspect", str(tmp_path / "notes.txt")), "notes.txt", "unknown")


def test_unreadable_dcp_directory(files, tmp_path):
    (tmp_path / "empty").mkdir()
    assert_error(
        run_here("diff", str(tmp_path / "empty"), str(files / "ref.pt")), "empty", ".metadata"
    )
    import shutil

    truncated = tmp_path / "truncated_dcp"
    shutil.copytree(files / "ckpt_dcp", truncated)
    meta = truncated / ".metadata"
    meta.write_bytes(meta.read_bytes()[:50])
    assert_error(run_here("inspect", str(truncated)), "truncated_dcp")


def test_malicious_torch_file_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    evil = str(tmp_path / "evil.pt")
    torch.save({"w": torch.zeros(1), "x": Evil(marker)}, evil)
    assert_error(run("inspect", evil), "evil.pt", "refused", "--trust")
    assert not marker.exists()
    assert_error(run_here("diff", evil, evil), "evil.pt", "refused", "--trust")
    assert not marker.exists()
    out = tmp_path / "out.pt"
    assert_error(run_here("merge", evil, evil, "-o", str(out)), "refused")
    assert not marker.exists()
    assert not out.exists()


def test_malicious_dcp_metadata_is_refused_and_never_runs(files, tmp_path):
    import shutil

    marker = tmp_path / "pwned"
    evil = tmp_path / "evil_dcp"
    shutil.copytree(files / "ckpt_dcp", evil)
    (evil / ".metadata").write_bytes(pickle.dumps(Evil(marker)))
    proc = run("diff", str(evil), str(files / "ref_dcp"))
    assert_error(proc, "evil_dcp", "refused")
    assert not marker.exists()


def test_trust_is_loud(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"w": torch.zeros(1), "x": Evil(marker)}, tmp_path / "own.pt")
    proc = run_here("inspect", str(tmp_path / "own.pt"), "--trust")
    assert "--trust given" in proc.stderr
    assert marker.exists()  # the opt-in does what it says


# -- merge -------------------------------------------------------------------------------


def test_merge_writes_the_checkpoints_format_and_values(files, tmp_path):
    out = tmp_path / "merged.pt"
    proc = run("merge", str(files / "ckpt.pt"), str(files / "ref.pt"), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out} (torch, 62 keys)" in proc.stdout
    assert "9 keys missing from the checkpoint (will be taken from the reference):" in proc.stdout
    merged = torch.load(out, weights_only=True)
    ckpt, ref = checkpoint_sd(), reference_sd()
    assert set(merged) == set(ckpt) | set(ref)
    for key, value in merged.items():
        assert torch.equal(value, ckpt[key] if key in ckpt else ref[key]), key
    assert [p.name for p in tmp_path.iterdir()] == ["merged.pt"]  # no temporaries left
    assert (out.stat().st_mode & 0o777) == (0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_merge_never_overwrites_without_force(files, tmp_path):
    out = tmp_path / "out.pt"
    out.write_bytes(b"precious")
    proc = run("merge", str(files / "ckpt.pt"), str(files / "ref.pt"), "-o", str(out))
    assert_error(proc, "out.pt", "--force")
    assert out.read_bytes() == b"precious"
    proc = run_here(
        "merge", str(files / "ckpt.pt"), str(files / "ref.pt"), "-o", str(out), "--force"
    )
    assert proc.returncode == 0, proc.stderr
    assert "layers.0.experts.0.w1" in torch.load(out, weights_only=True)


def test_merge_policy_violation_exits_1_and_writes_nothing(files, tmp_path):
    out = tmp_path / "out.pt"
    args = [str(files / "ckpt.pt"), str(files / "ref.pt"), "-o", str(out), "--policy", "strict"]
    proc = run("merge", *args)
    assert proc.returncode == 1
    assert "rejected the merge" in proc.stderr
    assert "'layers.2.experts.{0..7}.w1' (8 keys)" in proc.stderr
    assert "--allow-missing GLOB" in proc.stderr  # the advice speaks the CLI's language
    assert "nothing written" in proc.stderr
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []
    allowed = ["--allow-missing", "layers.*.experts.*", "--allow-unexpected", "ema.*"]
    proc = run_here("merge", *args, *allowed)
    assert proc.returncode == 0, proc.stderr
    assert out.exists()


def test_merge_warn_policy_prints_warnings(files, tmp_path):
    out = tmp_path / "out.safetensors"
    args = [str(files / "ckpt.safetensors"), str(files / "ref.safetensors"), "-o", str(out)]
    proc = run_here("merge", *args, "--policy", "warn")
    assert proc.returncode == 0, proc.stderr
    assert "dsdmerge: warning: 9 key(s) missing from the checkpoint" in proc.stderr
    from safetensors.torch import load_file

    assert set(load_file(str(out))) == set(checkpoint_sd()) | set(reference_sd())


def test_merge_shape_mismatch(tmp_path):
    torch.save({"head": torch.ones(5)}, tmp_path / "a.pt")
    torch.save({"head": torch.zeros(3)}, tmp_path / "b.pt")
    args = [str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "-o", str(tmp_path / "out.pt")]
    proc = run_here("merge", *args)
    assert proc.returncode == 1
    assert "--on-shape-mismatch take-reference" in proc.stderr
    proc = run_here("merge", *args, "--on-shape-mismatch", "take-reference")
    assert proc.returncode == 0, proc.stderr
    assert "the reference's were taken" in proc.stderr
    assert torch.equal(torch.load(tmp_path / "out.pt")["head"], torch.zeros(3))


def test_merge_dcp_directory_and_replace_it(files, tmp_path):
    out = tmp_path / "merged_dcp"
    args = [str(files / "ckpt_dcp"), str(files / "ref_dcp"), "-o", str(out)]
    proc = run("merge", *args)
    assert proc.returncode == 0, proc.stderr
    assert (out / ".metadata").is_file()
    diff = run_here("diff", str(out), str(files / "ref_dcp"), "--json")
    assert json.loads(diff.stdout)["missing"] == []
    assert_error(run_here("merge", *args), "merged_dcp", "--force")
    proc = run_here("merge", *args, "--force")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged_dcp"]


def test_merge_safetensors_refuses_non_tensor_values(files, tmp_path):
    torch.save({**reference_sd(), "step": 3}, tmp_path / "ref_with_step.pt")
    out = tmp_path / "out.safetensors"
    ckpt, ref = files / "ckpt.safetensors", tmp_path / "ref_with_step.pt"
    proc = run_here("merge", str(ckpt), str(ref), "-o", str(out))
    assert_error(proc, "'step'", "torch checkpoint instead")
    assert not out.exists()


# -- atomic writes (in process, with a failure injected mid-write) ---------------------


@pytest.mark.parametrize(("fmt", "writer"), [("torch", "_write_torch"), ("dcp", "_write_dcp")])
@pytest.mark.parametrize("existing", [False, True])
def test_a_failure_mid_write_leaves_out_as_it_was(
    files, tmp_path, monkeypatch, capsys, fmt, writer, existing
):
    from dsdmerge.integrations import writing

    real = getattr(writing, writer)

    def half_then_fail(state_dict, tmp):
        real(state_dict, tmp)  # the data is written ...
        target = next(tmp.glob("*.distcp")) if tmp.is_dir() else tmp
        with open(target, "r+b") as f:  # ... half of it ...
            f.truncate(target.stat().st_size // 2)
        raise OSError(28, "No space left on device")  # ... and the disk fills up

    monkeypatch.setattr(writing, writer, half_then_fail)
    name = "ckpt.pt" if fmt == "torch" else "ckpt_dcp"
    ref = "ref.pt" if fmt == "torch" else "ref_dcp"
    out = tmp_path / ("out.pt" if fmt == "torch" else "out_dcp")
    if existing:
        if fmt == "torch":
            out.write_bytes(b"old")
        else:  # --force replaces only a DCP checkpoint directory
            dcp_save({"old": torch.ones(1)}, out)
    argv = ["merge", str(files / name), str(files / ref), "-o", str(out), "--force"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err
    assert "Traceback" not in err
    assert [p.name for p in tmp_path.iterdir()] == ([out.name] if existing else [])
    if existing and fmt == "torch":
        assert out.read_bytes() == b"old"
    elif existing:  # the old DCP checkpoint, intact
        from dsdmerge.integrations import load_checkpoint

        assert torch.equal(load_checkpoint(out)["old"], torch.ones(1))


# -- help, demo, terminals ---------------------------------------------------------------


@pytest.mark.parametrize("command", ["inspect", "diff", "merge", "demo"])
def test_help_has_examples(command, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "example" in out
    assert f"dsdmerge {command}" in out


def test_no_command_prints_help_and_exits_2(capsys):
    assert cli.main([]) == 2
    assert "inspect" in capsys.readouterr().err


def test_help_runs_as_a_subprocess():
    proc = run("--help")
    assert proc.returncode == 0
    assert "Exit status" in proc.stdout


def test_colour_and_tables_only_on_a_terminal(files, monkeypatch, capsys):
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    argv = ["diff", str(files / "ckpt.pt"), str(files / "ref.pt")]
    monkeypatch.setattr(cli, "_isatty", lambda stream: True)
    assert cli.main(argv) == 1
    out = capsys.readouterr().out
    assert ANSI in out
    monkeypatch.setenv("NO_COLOR", "1")
    assert cli.main(argv) == 1
    out = capsys.readouterr().out
    assert ANSI not in out
    assert "  8  layers.2.experts.{0..7}.w1" in out  # a table: counts in an aligned column
    assert "  1  layers.4.experts.1.w1" in out
    monkeypatch.setattr(cli, "_isatty", lambda stream: False)
    assert cli.main(argv) == 1
    assert "  layers.2.experts.{0..7}.w1  (8 keys)" in capsys.readouterr().out
