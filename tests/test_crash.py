"""A write killed at any step leaves OUT whole: the old checkpoint or the new one, never a
mix and never nothing (where directories are replaced in two renames, the next run finds the
old one moved aside and puts it back). Each write runs in a forked child that SIGKILLs itself
just before its N-th file-system step, for every N until the write completes."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

import dsdmerge as dm
from dsdmerge.integrations import load_checkpoint, writing

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="uses os.fork and SIGKILL")

STEPS = {
    os: ["rename", "replace", "link", "unlink", "chmod", "fsync", "mkdir", "rmdir", "open"],
    shutil: ["rmtree", "copyfileobj"],
    tempfile: ["mkdtemp", "mkstemp"],
    writing: ["_renameat2", "_write_torch", "_write_dcp", "_write_safetensors"],
}


def write_killed_at(n: int, out: Path, fmt: str, value: float, *, exchange: bool) -> bool:
    """Write ``value`` to ``out`` in a child killed just before its ``n``-th step; whether
    the child completed the write (``False``: it was killed)."""
    pid = os.fork()
    if pid == 0:  # the child: count the steps, die at the n-th
        try:
            count = 0

            def counted(fn):
                def step(*args, **kwargs):
                    nonlocal count
                    count += 1
                    if count == n:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return fn(*args, **kwargs)

                return step

            if not exchange:
                writing._renameat2 = lambda src, dst, flags: False
            for module, names in STEPS.items():
                for name in names:
                    setattr(module, name, counted(getattr(module, name)))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                writing.write_checkpoint({"w": torch.full((3,), value)}, out, fmt, force=True)
        except BaseException:  # noqa: BLE001 - the parent sees the status
            os._exit(3)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL
        return False
    assert os.WEXITSTATUS(status) == 0, f"the write failed at step {n}"
    return True


def value_of(out: Path) -> float:
    return float(load_checkpoint(out)["w"][0])


@pytest.mark.parametrize("fmt", ["torch", "safetensors", "dcp"])
@pytest.mark.parametrize("exchange", [True, False], ids=["one-rename", "two-renames"])
def test_a_write_killed_at_any_step_leaves_out_whole(tmp_path, fmt, exchange):
    if exchange and fmt == "dcp" and writing._libc_renameat2() is None:
        pytest.skip("no renameat2 here")
    name = {"torch": "out.pt", "safetensors": "out.safetensors", "dcp": "out"}[fmt]
    out = tmp_path / name
    seen: dict[str, int] = {}
    n = 0
    while True:
        n += 1
        shutil.rmtree(tmp_path, ignore_errors=True)
        tmp_path.mkdir()
        writing.write_checkpoint({"w": torch.full((3,), 1.0)}, out, fmt, force=False)
        if write_killed_at(n, out, fmt, 2.0, exchange=exchange):
            assert value_of(out) == 2.0
            assert sorted(p.name for p in tmp_path.iterdir()) == [name]
            break
        left = sorted(p.name for p in tmp_path.iterdir() if p.name != name)
        if out.exists():
            state = f"old ({value_of(out):.0f})" if value_of(out) == 1.0 else "new"
            assert value_of(out) in (1.0, 2.0)
        else:  # only between the two renames of a directory, and the next run restores it
            assert fmt == "dcp", (n, left)
            assert not exchange, (n, left)
            with pytest.warns(dm.DSDMergeWarning, match="restored"):
                assert writing.recover_interrupted(out) == out
            assert value_of(out) == 1.0
            state = "missing, restored by the next run"
        seen[state] = seen.get(state, 0) + 1
        # whatever was left, the next write completes and leaves nothing of the old one
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", dm.DSDMergeWarning)
            writing.write_checkpoint({"w": torch.full((3,), 3.0)}, out, fmt, force=True)
        assert value_of(out) == 3.0
        assert not [p for p in tmp_path.iterdir() if p.name.endswith(".old")]
        assert all(p.name.endswith(".tmp") for p in tmp_path.iterdir() if p.name != name), left
    assert n > 3  # the steps were really counted
    assert seen.get("new", 0) >= 1 or fmt != "dcp"
    if fmt == "dcp" and not exchange:
        assert seen.get("missing, restored by the next run", 0) >= 1, seen


def test_several_copies_aside_are_not_guessed_between(tmp_path):
    out = tmp_path / "out"
    for i in range(2):
        aside = tmp_path / f".out.{i:012x}.old"
        writing.write_checkpoint({"w": torch.full((1,), float(i))}, aside, "dcp", force=False)
    with pytest.raises(dm.CheckpointWriteError, match="2 interrupted replaces"):
        writing.recover_interrupted(out)
    assert not out.exists()
    assert len(list(tmp_path.glob(".out.*.old"))) == 2
