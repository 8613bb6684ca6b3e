from __future__ import annotations

import subprocess
import sys


def test_dsdmerge_demo_runs_and_tells_the_story():
    proc = subprocess.run(
        [sys.executable, "-m", "dsdmerge", "demo"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "torch alone: set_optimizer_state_dict failed: TypeError" in out
    assert "missing from the checkpoint" in out
    assert "trained state identical to the checkpoint" in out
