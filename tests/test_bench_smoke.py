"""The benchmark harness runs (on a toy size): CI runs it in --quick mode, never for timings."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_merge.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_merge", BENCH)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_merge"] = module
    spec.loader.exec_module(module)
    module.MIN_SAMPLE_S = 0.0  # one call per sample: this checks the harness, not timings
    yield module
    sys.modules.pop("bench_merge", None)


def test_the_benchmark_measures_every_case_and_reports_the_targets(bench):
    result = {
        "scaling": bench.scaling([300, 3000], rounds=1, peers_up_to=3000),
        "deepseek": bench.deepseek(1, 4, rounds=1, memory=True, raw_torch=True),
    }
    ds = result["deepseek"]
    assert ds["params"] == 1 * (4 * 3 + 7) + 3
    assert not any(ds["copied_tensors"].values())
    assert ds["seconds"].keys() >= {
        "floor",
        "verl",
        "merge",
        "diff",
        "flatten",
        "torch flatten",
        "convert (stack experts, flat)",
        "convert (stack experts, checkpoint)",
    }
    text = bench.report(result)
    for name, *_ in bench.TARGETS:
        assert f"| {name} |" in text
    assert "nanoseconds per key" in text


def test_the_read_benchmark_compares_the_safe_reader_with_pickle_load():
    spec = importlib.util.spec_from_file_location("bench_read", BENCH.parent / "bench_read.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.run(quick=True)
    assert result["keys"] == 21_736
    assert result["seconds"].keys() == {
        "torch pickle.load",
        "dsdmerge load_metadata",
        "dsdmerge read_metadata",
    }
    assert "| safe read / torch pickle.load |" in module.report(result)
    assert "| whole view / torch pickle.load |" in module.report(result)
