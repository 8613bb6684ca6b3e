"""Every python code block of the user documentation in docs/ runs as shown."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
BLOCKS = [
    pytest.param(code, id=f"{path.name}:{text[: m.start()].count(chr(10)) + 1}")
    for path in sorted((ROOT / "docs").glob("*.md"))
    for text in [path.read_text()]
    for m in BLOCK.finditer(text)
    for code in [m.group(1)]
]


@pytest.mark.parametrize("code", BLOCKS)
def test_docs_python_block_runs(code, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
