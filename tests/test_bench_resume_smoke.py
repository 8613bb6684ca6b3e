"""The resume benchmark runs (on a toy size) and reports its ratio: a harness check, not timings."""

from __future__ import annotations

import gc
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_resume.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_resume", BENCH)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_resume"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("bench_resume", None)


def test_the_resume_benchmark_times_every_path_checks_them_and_reports_the_ratio(bench):
    import dsdmerge.integrations.resume as resume

    before = dict(vars(resume))
    slots_before = dict(vars(resume.Slots))
    result = bench.run(quick=True, rounds=1)
    # the probes were removed: the library is as it was
    assert {k: v for k, v in vars(resume).items() if k in before} == before
    assert dict(vars(resume.Slots)) == slots_before
    assert bench.PROBE.on_gc not in gc.callbacks
    assert [row["params"] for row in result["scaling"]] == bench.QUICK_SIZES
    main = result["main"]
    assert main["params"] == bench.QUICK_MAIN
    assert main["keys"] == 14 * bench.QUICK_MAIN
    assert main["missing"][bench.HELPER] == 2 * 14  # the new head's weight and bias
    assert main["seconds"].keys() == set(bench.PATHS)
    for shares in main["seconds"].values():
        assert shares["load"] > 0
        assert shares["total"] >= shares["excl_load"] > 0
    # the checks ran: the checkpoint's state is what was loaded, and one more step gave the
    # new head state on every path (its first step with fresh="as_fresh")
    assert main["check"]["params_checked_against_checkpoint"] == bench.QUICK_MAIN
    assert main["check"]["head_step_after_one_more_step"] == {
        bench.HELPER: 1.0,
        bench.HELPER_REF: 2.0,
        bench.BY_HAND: 2.0,
    }
    assert result["probed"]  # the helper's internals could be wrapped
    text = bench.report(result)
    assert "| resume_optimizer / by hand, excl. torch.load |" in text
    assert "| resume_optimizer / by hand, incl. torch.load |" in text
    assert "µs/param" in text
