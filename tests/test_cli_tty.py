"""Terminals: progress on stderr (tqdm) and colours on stdout only where a person is watching,
checked on a real pseudo-terminal; nothing of either when piped."""

from __future__ import annotations

import os
import select
import struct
import subprocess
import sys

import pytest
import torch
from test_cli import ANSI, ROOT

pty = pytest.importorskip("pty")
fcntl = pytest.importorskip("fcntl")
termios = pytest.importorskip("termios")


def _drain(fd: int) -> bytes:
    out = b""
    while True:
        ready, _, _ = select.select([fd], [], [], 10)
        if not ready:
            return out
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the child side is closed
            return out
        if not chunk:
            return out
        out += chunk


def run_on(
    *args: str, tty_out: bool, tty_err: bool, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    """``python -m dsdmerge ARGS`` with stdout and/or stderr on a pseudo-terminal."""
    child_env = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "xterm", **(env or {})}
    for name in ("NO_COLOR", "FORCE_COLOR"):
        if name not in (env or {}):
            child_env.pop(name, None)
    masters, slaves = [], []
    streams: dict[str, int] = {}
    for name, tty in (("stdout", tty_out), ("stderr", tty_err)):
        if tty:
            master, slave = pty.openpty()
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
            masters.append(master)
            slaves.append(slave)
            streams[name] = slave
        else:
            streams[name] = subprocess.PIPE
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsdmerge", *args],
        stdout=streams["stdout"],
        stderr=streams["stderr"],
        stdin=subprocess.DEVNULL,
        env=child_env,
    )
    for slave in slaves:
        os.close(slave)
    outputs = {}
    it = iter(masters)
    for name, tty in (("stdout", tty_out), ("stderr", tty_err)):
        if tty:
            outputs[name] = _drain(next(it)).decode(errors="replace")
    piped_out, piped_err = proc.communicate(timeout=120)
    for master in masters:
        os.close(master)
    out = outputs.get("stdout", (piped_out or b"").decode())
    err = outputs.get("stderr", (piped_err or b"").decode())
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("tty")
    ref = {f"layers.{i}.w": torch.zeros(2) for i in range(4)}
    torch.save({k: v + 1 for k, v in ref.items() if k != "layers.3.w"}, d / "ckpt.pt")
    torch.save(ref, d / "ref.pt")
    save_file(ref, str(d / "ref.safetensors"))
    return d


def test_progress_on_a_terminal_only(pair, tmp_path):
    args = ["merge", str(pair / "ckpt.pt"), str(pair / "ref.pt")]
    shown = {"DSDMERGE_PROGRESS_DELAY": "0"}  # a small merge is quick: show it at once
    code, out, err = run_on(
        *args, "-o", str(tmp_path / "a.pt"), tty_out=False, tty_err=True, env=shown
    )
    assert code == 0, err
    assert "merge" in err
    assert "reading" in err or "writing" in err or "merging" in err
    assert "\r" in err  # tqdm redraws its line
    assert "wrote" in out  # the report itself is on stdout, untouched
    assert "\r" not in out
    # piped: not one byte of progress
    code, out, err = run_on(
        *args, "-o", str(tmp_path / "b.pt"), tty_out=False, tty_err=False, env=shown
    )
    assert code == 0
    assert err == ""
    # a terminal, but done before the delay: nothing (the default delay is 1.5 s; a long one
    # here, so that a loaded machine cannot make this merge slower than the delay)
    code, out, err = run_on(
        *args,
        "-o",
        str(tmp_path / "c.pt"),
        tty_out=False,
        tty_err=True,
        env={"DSDMERGE_PROGRESS_DELAY": "300"},
    )
    assert code == 0
    assert err == ""
    # and never with DSDMERGE_PROGRESS=0
    code, out, err = run_on(
        *args,
        "-o",
        str(tmp_path / "d.pt"),
        tty_out=False,
        tty_err=True,
        env={**shown, "DSDMERGE_PROGRESS": "0"},
    )
    assert "merge" not in err


@pytest.mark.parametrize(
    ("tty", "flags", "env", "coloured"),
    [
        (True, [], {}, True),
        (True, ["--color", "never"], {}, False),
        (True, [], {"NO_COLOR": "1"}, False),
        (False, [], {}, False),
        (False, ["--color", "always"], {}, True),
        (False, [], {"FORCE_COLOR": "1"}, True),
        (False, [], {"FORCE_COLOR": "0"}, False),
        (False, [], {"FORCE_COLOR": "1", "NO_COLOR": "1"}, False),
        (True, ["--color", "always"], {"NO_COLOR": "1"}, True),  # the flag wins
    ],
)
def test_colour(pair, tty, flags, env, coloured):
    # inspect of a safetensors file: no torch import, so the matrix is cheap
    code, out, _err = run_on(
        "inspect", str(pair / "ref.safetensors"), *flags, tty_out=tty, tty_err=False, env=env
    )
    assert code == 0
    assert "layers.{0..3}.w" in out
    assert (ANSI in out) is coloured, out
    assert ("  format   safetensors" in out) is tty  # aligned tables only on a terminal


def test_diff_on_a_terminal_is_coloured_and_aligned(pair):
    code, out, err = run_on(
        "diff",
        str(pair / "ckpt.pt"),
        str(pair / "ref.pt"),
        tty_out=True,
        tty_err=True,
        env={"DSDMERGE_PROGRESS": "0"},
    )
    assert code == 1
    assert "\x1b[33m1 key missing from the checkpoint" in out
    assert "layers.3.w" in out
    assert err == ""  # DSDMERGE_PROGRESS=0: no progress bar, even on a loaded machine
