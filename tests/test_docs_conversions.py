"""Every python and bash block of docs/conversions.md runs as shown and prints what it says.

The blocks run in order in one temporary working directory (files a python block writes
are there for the bash block after it); each python block in a fresh namespace, each bash
block with ``bash -e``. Output is compared with what follows a block: a fenced block
without a language, or a line ``prints `...` ``, or ``prints nothing``. A block marked
``<!-- docs-test: fragment ... -->`` is left to tests/test_docs.py (it sets up a transcript).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "conversions.md"
BLOCK = re.compile(
    r"^```(?P<lang>python|bash)\n(?P<code>.*?)^```\n(?P<after>.*?)(?=^```(?:python|bash)\n|\Z)",
    re.M | re.S,
)
SHOWN = re.compile(
    r"\A\s*(?:prints\n\n```\n(?P<fenced>.*?)```"
    r"|prints `(?P<inline>.*?)`"
    r"|(?P<nothing>prints nothing))",
    re.S,
)


def blocks() -> list[tuple[int, str, str, str | None]]:
    text = DOC.read_text(encoding="utf-8")
    out = []
    for m in BLOCK.finditer(text):
        if text[: m.start()].rstrip().endswith("-->") and text[: m.start()].rstrip().rsplit(
            "<!-- docs-test:", 1
        )[-1].lstrip().startswith("fragment"):
            continue  # set-up for a transcript, which tests/test_docs.py checks
        shown = SHOWN.match(m["after"])
        if shown is None:
            expected = None
        elif shown["nothing"]:
            expected = ""
        else:
            expected = shown["fenced"] if shown["fenced"] is not None else shown["inline"] + "\n"
        out.append((text[: m.start()].count("\n") + 1, m["lang"], m["code"], expected))
    return out


def test_the_document_has_blocks_and_says_what_each_prints():
    found = blocks()
    assert len(found) >= 7  # the CLI session is a transcript: tests/test_docs.py runs it
    assert {lang for _, lang, _, _ in found} == {"python"}  # (the CLI: the transcript)
    assert all(expected is not None for *_, expected in found)


def test_every_block_runs_in_order_and_prints_what_the_document_says(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env["PYTHONPATH"] = str(DOC.parent.parent)
    for line, lang, code, expected in blocks():
        if lang == "python":
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(code, f"{DOC.name}:{line}", "exec"), {"__name__": "__doc_block__"})
            got = out.getvalue()
        else:
            done = subprocess.run(
                ["bash", "-e", "-c", code], capture_output=True, text=True, env=env, timeout=300
            )
            assert done.returncode == 0, (line, done.stdout, done.stderr)
            got = done.stdout
        assert got == expected, f"{DOC.name}:{line}"
