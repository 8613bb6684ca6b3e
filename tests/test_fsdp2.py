"""2-process FSDP2 (fully_shard) on gloo/CPU: save per rank and through DCP, resume fresh.

The bodies live in tests/fsdp2_worker.py; each phase runs in freshly spawned
processes with a free loopback port and a hard deadline.
"""

from __future__ import annotations

import json
import socket
import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed+gloo"
)

PHASE_DEADLINE = 60.0  # seconds; a phase takes ~4 s on 2 cores (each rank imports torch)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _report(out, phase: str, rank: int) -> str:
    path = out / f"{phase}_rank_{rank}.json"
    return path.read_text()[:2000] if path.exists() else "(none written)"


def run_phase(phase: str, out) -> list[dict]:
    from fsdp2_worker import WORLD, run

    # Fresh interpreters (spawn): nothing of this process (threads, CUDA/gloo state, imported
    # modules) leaks into the ranks; each imports torch itself.
    context = mp.start_processes(
        run,
        args=(free_port(), phase, str(out)),
        nprocs=WORLD,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + PHASE_DEADLINE
    try:
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail(f"FSDP2 phase {phase!r} did not finish within {PHASE_DEADLINE:.0f} s")
    except mp.ProcessExitedException as err:
        # Say what each rank reported before it died: a failure in the body and a crash in
        # torch's teardown call for different fixes.
        reports = {r: _report(out, phase, r) for r in range(WORLD)}
        pytest.fail(f"FSDP2 phase {phase!r}: {err}; rank reports: {reports}")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(5)
    results = [json.loads((out / f"{phase}_rank_{r}.json").read_text()) for r in range(WORLD)]
    for rank, result in enumerate(results):
        assert result["ok"], f"rank {rank}:\n{result.get('error')}"
    return results


def test_fsdp2_two_ranks_save_per_rank_and_dcp_resume_in_fresh_processes(tmp_path):
    saved = run_phase("save", tmp_path)
    assert saved[0]["lr"] == saved[1]["lr"] < 1e-3
    resumed = run_phase("resume", tmp_path)
    for result in resumed:
        assert result["torch_alone"].startswith("TypeError: float() argument")
        assert result["verl_missing"] == result["dcp_missing"] == 6  # the indexer's state
