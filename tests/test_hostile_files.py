"""Hostile files fuzzed: every reader returns a faithful view or raises a
DSDMergeError, within a time and an address-space bound, and patches nothing.

Each property runs in a child process (``tests/hostile_files.py``) that caps its own
address space with ``RLIMIT_AS`` at what the interpreter and torch mapped plus 1 GiB,
and checks a canary (class attributes of pathlib, DCP's classes, builtins, torch's
layout cache) after every example. ``HYPOTHESIS_PROFILE=fuzz`` draws 10,000 examples
per property; the default profile draws 60.
"""

from __future__ import annotations

import json
import os

import hostile_files as hf
import pytest

FUZZ = os.environ.get("HYPOTHESIS_PROFILE") == "fuzz"


@pytest.mark.parametrize("kind", ["metadata", "safetensors", "zip"])
def test_hostile_files_are_refused_or_read_faithfully(kind, tmp_path):
    proc = hf.run_child(kind, str(tmp_path), timeout=3 * 3600 if FUZZ else 600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    # the strategies reach both outcomes, so the property is not vacuous
    assert seen["refused"] > 0, seen
    assert seen["ok"] > 0, seen


@pytest.mark.parametrize("kind", ["hf_links", "keys"])
def test_the_command_line_on_hostile_directories_and_keys(kind, tmp_path):
    """Hugging Face directories whose small files link anywhere (out of the directory, to
    /proc, a FIFO, a directory ...) are refused by name or merged with nothing from outside;
    keys with control characters, bidirectional overrides, lone surrogates and non-ASCII
    text under ASCII, C-locale and UTF-8 streams give finished reports with nothing raw on
    the terminal, exact --json and an exact OUT."""
    proc = hf.run_child(kind, str(tmp_path), timeout=3 * 3600 if FUZZ else 600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["ok"] > 0, seen
    if kind == "hf_links":
        assert seen["refused"] > 0, seen
