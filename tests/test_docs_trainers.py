"""Every python block of docs/hooks.md and docs/trainers/*.md runs as shown.

The markers are the docs' (``<!-- docs-test: ... -->`` right above a block):
``continues`` (the namespace the block above left, on the same page), ``fragment`` (only
compiled), ``requires=MODULE,...`` (skipped where one of them cannot be imported). Each
page runs in a temporary working directory of its own.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [
    page
    for page in [ROOT / "docs" / "hooks.md", *sorted((ROOT / "docs" / "trainers").glob("*.md"))]
    if "```python" in page.read_text(encoding="utf-8")
]
BLOCK = re.compile(
    r"(?:^<!-- docs-test: (?P<marker>[^\n]*?) -->\n)?^```(?P<lang>[\w-]*)\n(?P<code>.*?)^```$",
    re.M | re.S,
)


def blocks(page: Path) -> list[tuple[int, str, list[str], tuple[str, ...]]]:
    text = page.read_text(encoding="utf-8")
    out = []
    for m in BLOCK.finditer(text):
        if m["lang"] != "python":
            continue
        words = (m["marker"] or "").split(" (")[0].split()
        requires = tuple(
            name for w in words if w.startswith("requires=") for name in w[9:].split(",")
        )
        out.append((text[: m.start("code")].count("\n"), m["code"], words, requires))
    return out


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_block_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    namespace: dict = {}
    for line, code, words, requires in blocks(page):
        compiled = compile(code, f"{page.relative_to(ROOT)}:{line}", "exec")
        if "fragment" in words:
            continue
        missing = [m for m in requires if importlib.util.find_spec(m) is None]
        if missing:
            pytest.skip(f"{page.name}:{line} needs {', '.join(missing)}, not installed")
        if "continues" not in words:
            namespace = {"__name__": f"docs_{page.stem}_{line}"}
        exec(compiled, namespace)
    assert os.getcwd() == str(tmp_path)
