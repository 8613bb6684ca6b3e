"""What the terminal shows is what the file holds: names from a checkpoint cannot move the
cursor, recolour or print fake lines in any human-readable report (``--json`` keeps them
exact), and names stdout cannot encode never stop a report or misreport a merge.
The attacker's checkpoints are built here; commands run in child processes with the
encodings people have (``PYTHONIOENCODING=ascii``, ``LC_ALL=C``)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_cli import ROOT

import dsdmerge as dm
from dsdmerge.integrations import load_checkpoint

FAKE = "policy 'strict' accepts the merge"
EVIL = [
    # clear the screen, go home, print a fake verdict, then return to overwrite the line
    f"layers.0.\x1b[2J\x1b[1;1H{FAKE}\r.w",
    f"layers.1.w\n{FAKE}",  # a line of its own
    "layers.2.\x1b]0;pwned\x07.w",  # set the window title
    "layers.3.\u202ew.evil",  # right-to-left override: reverses what follows
    "layers.4.\x9b31m.w",  # an 8-bit CSI
    "layers.5.w\x00",
]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    """``python -m dsdmerge ARGS`` in a child; its output as bytes (never decoded by us)."""
    child_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    child_env.pop("DSDMERGE_TRACEBACK", None)
    return subprocess.run(
        [sys.executable, "-m", "dsdmerge", *args],
        capture_output=True,
        timeout=120,
        env=child_env,
    )


def run_with(
    *args: str, encoding: str = "utf-8", errors: str = "strict"
) -> subprocess.CompletedProcess[bytes]:
    """``dsdmerge ARGS`` in this process, its stdout and stderr streams of that encoding, as
    Python makes them for ``PYTHONIOENCODING`` (``ascii``: strict) or a C locale (UTF-8 with
    ``surrogateescape``); their bytes are returned undecoded."""
    from dsdmerge import cli

    out = io.TextIOWrapper(io.BytesIO(), encoding=encoding, errors=errors, newline="\n")
    err = io.TextIOWrapper(io.BytesIO(), encoding=encoding, errors=errors, newline="\n")
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(args))
        out.flush()
        err.flush()
    return subprocess.CompletedProcess(
        list(args), code, out.buffer.getvalue(), err.buffer.getvalue()
    )


def assert_nothing_raw(data: bytes) -> None:
    """No byte or character that drives a terminal: only printable text and newlines."""
    text = data.decode("utf-8", errors="replace")
    for line in text.split("\n"):
        bad = [c for c in line if not c.isprintable() and c != "\ufffd"]
        assert not bad, (bad, line)
        assert not line.startswith(FAKE), line
    assert b"\x1b" not in data
    assert b"\r" not in data
    assert b"\x07" not in data


@pytest.fixture
def evil(tmp_path) -> tuple[Path, Path]:
    ckpt = {k: torch.zeros(2) for k in EVIL}
    ckpt["shared.w"] = torch.ones(2)
    torch.save(ckpt, tmp_path / "ckpt.pt")
    ref = {"shared.w": torch.zeros(2), "head.\x1b[31mw": torch.zeros(3)}
    torch.save(ref, tmp_path / "ref.pt")
    return tmp_path / "ckpt.pt", tmp_path / "ref.pt"


@pytest.mark.parametrize("color", ["never", "always"])
def test_control_characters_in_keys_are_escaped_in_every_report(evil, tmp_path, color):
    ckpt, ref = evil
    for command, code in (
        (["inspect", str(ckpt), "--stat"], 0),
        (["diff", str(ckpt), str(ref), "--stat"], 1),
        (["check", str(ckpt), str(ref), "--policy", "strict"], 1),
        (["check", str(ckpt), str(ref), "--policy", "warn"], 0),
        (["merge", str(ckpt), str(ref), "-o", str(tmp_path / f"out-{color}.pt"), "--force"], 0),
        (["merge", str(ckpt), str(ref), "-o", str(tmp_path / "w.pt"), "--policy", "warn"], 0),
    ):
        proc = run_with(*command, "--color", color)
        assert proc.returncode == code, (command, proc.stderr)
        if color == "never":
            assert_nothing_raw(proc.stdout)
        else:  # our own colours, and nothing else: every ESC starts one of them
            stripped = proc.stdout
            for sgr in (
                b"\x1b[0m",
                b"\x1b[1m",
                b"\x1b[2m",
                *(b"\x1b[%dm" % n for n in range(30, 37)),
            ):
                stripped = stripped.replace(sgr, b"")
            assert_nothing_raw(stripped)
        assert_nothing_raw(proc.stderr)
    # the merge kept the exact keys
    assert set(load_checkpoint(tmp_path / f"out-{color}.pt")) == {
        *EVIL,
        "shared.w",
        "head.\x1b[31mw",
    }


def test_json_keeps_the_exact_keys(evil):
    ckpt, ref = evil
    proc = run_with("diff", str(ckpt), str(ref), "--json")
    assert proc.returncode == 1
    assert b"\x1b" not in proc.stdout  # JSON escapes them ...
    out = json.loads(proc.stdout)
    assert set(out["unexpected"]) == set(EVIL)  # ... and they read back exactly
    assert out["missing"] == ["head.\x1b[31mw"]
    proc = run_with("inspect", str(ckpt), "--json")
    assert json.loads(proc.stdout)["keys"] == len(EVIL) + 1


def test_names_that_are_not_keys_are_escaped_too(tmp_path):
    """Paths and safetensors metadata reach the terminal as well."""
    where = tmp_path / "run\x1b[2J"
    where.mkdir()
    save_file({"w": torch.zeros(1)}, str(where / "m.safetensors"), metadata={"note": "\x1b[31mx"})
    proc = run_with("inspect", str(where / "m.safetensors"))
    assert proc.returncode == 0, proc.stderr
    assert_nothing_raw(proc.stdout)
    assert b"\\x1b[31mx" in proc.stdout
    proc = run_with("inspect", str(where / "missing.pt"))
    assert proc.returncode == 2
    assert_nothing_raw(proc.stderr)


UNENCODABLE = ["layers.0.\udc80.w", "layers.1.\ud800", "层.0.w", "émbed.weight", "x.\U0001f600"]


@pytest.fixture
def unencodable(tmp_path) -> tuple[str, str]:
    ckpt = {k: torch.zeros(2) for k in UNENCODABLE}
    ckpt["shared.w"] = torch.ones(2)
    torch.save(ckpt, tmp_path / "ckpt.pt")
    torch.save({"shared.w": torch.zeros(2)}, tmp_path / "ref.pt")
    return str(tmp_path / "ckpt.pt"), str(tmp_path / "ref.pt")


@pytest.mark.parametrize(
    ("encoding", "errors"),
    [("ascii", "strict"), ("utf-8", "surrogateescape"), ("utf-8", "strict")],
    ids=["PYTHONIOENCODING=ascii", "C-locale", "utf-8"],
)
def test_keys_stdout_cannot_encode_never_stop_a_report(unencodable, tmp_path, encoding, errors):
    c, r = unencodable
    for command, code, last in (
        (["inspect", c], 0, b""),
        (["diff", c, r], 1, b""),
        (["check", c, r, "--policy", "strict"], 1, b""),
        (["check", c, r], 0, b"accepts the merge"),
    ):
        proc = run_with(*command, encoding=encoding, errors=errors)
        assert proc.returncode == code, (command, proc.stderr)
        assert proc.stdout.endswith(b"\n")
        assert last in proc.stdout.splitlines()[-1]
    out = tmp_path / "out.pt"
    proc = run_with("merge", c, r, "-o", str(out), encoding=encoding, errors=errors)
    assert proc.returncode == 0, proc.stderr  # OUT was written: exit 0, whatever the report
    assert proc.stdout.startswith(b"wrote ")
    assert set(load_checkpoint(out)) == {*UNENCODABLE, "shared.w"}
    proc = run_with("diff", c, r, "--json", encoding=encoding, errors=errors)
    assert set(json.loads(proc.stdout)["unexpected"]) == set(UNENCODABLE)


@pytest.mark.parametrize(
    "env",
    [{"PYTHONIOENCODING": "ascii"}, {"LC_ALL": "C", "LANG": "C"}],
    ids=["PYTHONIOENCODING=ascii", "LC_ALL=C"],
)
def test_a_merge_under_an_ascii_locale_exits_0_having_written_out(unencodable, tmp_path, env):
    c, r = unencodable
    out = tmp_path / "out.pt"
    proc = run("merge", c, r, "-o", str(out), "--policy", "warn", env=env)
    assert proc.returncode == 0, proc.stderr
    assert b"Traceback" not in proc.stderr
    assert proc.stdout.startswith(b"wrote ")
    assert proc.stdout.endswith(b"\n")
    assert set(load_checkpoint(out)) == {*UNENCODABLE, "shared.w"}


def test_the_library_report_escapes_what_does_not_print():
    d = dm.diff({k: torch.zeros(1) for k in EVIL}, {"x\r": torch.zeros(1)})
    text = str(d)
    assert all(c.isprintable() for line in text.split("\n") for c in line), text
    assert "layers.1.w\\npolicy" in text
    assert set(d.unexpected) == set(EVIL)


def test_a_merge_whose_report_cannot_be_printed_still_exits_0(evil, tmp_path, monkeypatch):
    """stdout fails after OUT is written (EIO on a closed terminal): the status is OUT's."""
    from dsdmerge import cli

    ckpt, ref = evil
    out = tmp_path / "out.pt"

    class Broken(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError(5, "Input/output error")

    err = io.StringIO()
    with contextlib.redirect_stdout(Broken()), contextlib.redirect_stderr(err):
        code = cli.main(["merge", str(ckpt), str(ref), "-o", str(out)])
    assert code == 0, err.getvalue()
    assert out.is_file()
    assert "its report could not be printed" in err.getvalue()
