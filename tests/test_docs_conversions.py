"""Every python block of docs/conversions.md runs as shown and prints what the text says.

Each block runs in a fresh namespace. Its output is compared with what follows it: a
fenced block without a language, or a line ``prints `...` ``.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "conversions.md"
BLOCK = re.compile(r"^```python\n(?P<code>.*?)^```\n(?P<after>.*?)(?=^```python|\Z)", re.M | re.S)
SHOWN = re.compile(r"\A\s*(?:prints\n\n```\n(?P<fenced>.*?)```|prints `(?P<inline>.*?)`)", re.S)


def blocks() -> list[tuple[int, str, str | None]]:
    text = DOC.read_text(encoding="utf-8")
    out = []
    for m in BLOCK.finditer(text):
        shown = SHOWN.match(m["after"])
        expected = None if shown is None else (shown["fenced"] or shown["inline"] + "\n")
        out.append((text[: m.start()].count("\n") + 1, m["code"], expected))
    return out


def test_the_document_has_blocks_and_says_what_each_prints():
    found = blocks()
    assert len(found) >= 5
    assert all(expected is not None for _, _, expected in found)


@pytest.mark.parametrize(("line", "code", "expected"), blocks(), ids=lambda v: str(v)[:20])
def test_each_block_runs_and_prints_what_the_document_says(line, code, expected):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"{DOC.name}:{line}", "exec"), {"__name__": "__doc_block__"})
    assert out.getvalue() == expected
