"""Every python and bash block of the user docs (``docs/*.md``) runs as shown.

Each block runs in a fresh namespace (python) or shell (bash), in a temporary working
directory; a block must hold its own imports.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
BLOCK = re.compile(r"^```(?P<lang>python|bash)\n(?P<code>.*?)^```$", re.M | re.S)


def blocks() -> list[tuple[str, str, str]]:
    out = []
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text(encoding="utf-8")
        for m in BLOCK.finditer(text):
            line = text[: m.start("code")].count("\n")
            out.append((f"{page.name}:{line}", m["lang"], m["code"]))
    return out


@pytest.mark.parametrize(("where", "lang", "code"), blocks(), ids=[b[0] for b in blocks()])
def test_block_runs(where: str, lang: str, code: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    if lang == "python":
        exec(compile(code, where, "exec"), {"__name__": "__docs__"})
    else:
        out = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", code],
            capture_output=True,
            text=True,
            timeout=300,
            env={"PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"},
        )
        assert out.returncode == 0, (where, out.stdout[-2000:], out.stderr[-2000:])


def test_there_are_docs() -> None:
    assert blocks(), "docs/*.md hold no runnable block"
