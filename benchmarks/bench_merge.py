"""Merge cost on large key sets, measured against the dict-union floor and the peers.

    python benchmarks/bench_merge.py            # 10^3..10^6 synthetic keys + DeepSeek-V3 scale
    python benchmarks/bench_merge.py --huge     # also 10^7 synthetic keys (~10 GB RAM, minutes)
    python benchmarks/bench_merge.py --quick    # CI smoke run: small sizes, well under a minute
    python benchmarks/bench_merge.py --huge --docs     # rewrite docs/benchmarks.md's results

Every baseline runs in the same process on the same data, interleaved with dsdmerge (one run
of every case per round, medians over the rounds), so the ratios are fair even on a noisy
machine. See benchmarks/README.md for what each column means.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import statistics
import sys
import time
import tracemalloc
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    _flatten_optim_state_dict,
    _StateDictInfo,
    _unflatten_optim_state_dict,
)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
if str(HERE.parent) not in sys.path:  # run from a checkout without installing
    sys.path.insert(1, str(HERE.parent))

import _data  # noqa: E402

import dsdmerge as dm  # noqa: E402

Case = Callable[[], Any]
# a case is a thunk, or (setup, fn): setup() runs untimed before each timed fn(*setup())
Cases = dict[str, Case | tuple[Callable[[], tuple[Any, ...]], Callable[..., Any]]]


# --------------------------------------------------------------------------------------
# measuring


MIN_SAMPLE_S = 0.02  # a sample is at least this much work (several calls of a fast case)


def measure(cases: Cases, rounds: int, *, warmup: bool) -> dict[str, float]:
    """Median seconds per call of each case; the cases run interleaved, one sample per round.

    With ``warmup``, an untimed first round (first calls pay for imports and caches) also
    picks how many calls make one sample (``MIN_SAMPLE_S`` of work, so that a scheduler
    tick on a busy machine does not swamp a sub-millisecond call). Results stay alive until
    the sample's clock stops, so freeing them is not charged to anyone. The collector runs
    before every sample (so no case pays for garbage or a full collection another case
    made due) and stays on during it; the benchmark data itself is frozen out of it
    (``gc.freeze``) so that those collections are cheap.
    """
    times: dict[str, list[float]] = {name: [] for name in cases}
    calls = dict.fromkeys(cases, 1)
    gc.collect()
    gc.freeze()
    try:
        for i in range(-1 if warmup else 0, rounds):
            for name, case in cases.items():
                setup, fn = case if isinstance(case, tuple) else (_no_args, case)
                arg_sets = [setup() for _ in range(calls[name])]
                gc.collect()
                start = time.perf_counter()
                outs = [fn(*args) for args in arg_sets]
                elapsed = (time.perf_counter() - start) / len(arg_sets)
                del outs, arg_sets
                if i < 0:
                    calls[name] = max(1, min(1000, int(MIN_SAMPLE_S / max(elapsed, 1e-7))))
                else:
                    times[name].append(elapsed)
    finally:
        gc.unfreeze()
    return {name: statistics.median(ts) for name, ts in times.items()}


def _no_args() -> tuple[Any, ...]:
    return ()


def peak_memory(fn: Callable[[], Any]) -> int:
    """Peak bytes ``fn`` allocates beyond what existed before it (tracemalloc; result included)."""
    gc.collect(1)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    out = fn()
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    del out
    return peak


def leaves(tree: Any) -> Iterator[Any]:
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
        else:
            yield node


def new_tensors(result: Any, *inputs: Any) -> int:
    """How many tensors of ``result`` are not objects of the inputs (copies would be)."""
    known = {id(x) for tree in inputs for x in leaves(tree) if isinstance(x, torch.Tensor)}
    return sum(1 for x in leaves(result) if isinstance(x, torch.Tensor) and id(x) not in known)


def quiet(fn: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn()

    return run


# --------------------------------------------------------------------------------------
# peers


def verl_backfill(ckpt: dict[str, Any], fresh: dict[str, Any]) -> dict[str, Any]:
    """verl's fix: list the missing keys (to log a count and examples), then the union."""
    missing = [k for k in fresh if k not in ckpt]
    if missing:
        _ = (len(missing), missing[:5])
    return {**fresh, **ckpt}


def torch_flatten_case(osd: dict[str, Any]) -> tuple[Callable[[], tuple[Any, ...]], Case]:
    """torch's flatten on a fresh shallow copy each time (it pops ``params``); copy untimed."""

    def setup() -> tuple[Any, ...]:
        return ({"state": osd["state"], "param_groups": [dict(g) for g in osd["param_groups"]]},)

    return setup, _flatten_optim_state_dict


class TorchUnflatten:
    """torch's ``_unflatten_optim_state_dict`` with an AdamW over meta parameters."""

    def __init__(self, p: _data.Pair) -> None:
        params = {
            fqn: torch.nn.Parameter(torch.empty(0, device=_data.META))
            for g in p.nested_r["param_groups"]
            for fqn in g["params"]
        }
        groups = [
            {**g, "params": [params[f] for f in g["params"]]} for g in p.nested_r["param_groups"]
        ]
        self.optim = torch.optim.AdamW(groups)
        for fqn, entry in p.nested_r["state"].items():  # a fresh optimizer has state everywhere
            self.optim.state[params[fqn]] = entry
        self.info = _StateDictInfo(fqn_param_mapping={t: {fqn} for fqn, t in params.items()})

    def __call__(self, flat: dict[str, Any]) -> Any:
        return _unflatten_optim_state_dict(self.optim, flat, self.info)


# --------------------------------------------------------------------------------------
# the two benchmarks


def scaling_cases(p: _data.Pair, peers: bool) -> Cases:
    c, r = p.flat_c, p.flat_r
    cases: Cases = {
        "floor": lambda: {**r, **c},
        "verl": lambda: verl_backfill(c, r),
        "merge": lambda: dm.merge(c, r),
        "diff": lambda: dm.diff(c, r),
    }
    if peers:
        merged = dm.merge(c, r)
        unflatten_torch = TorchUnflatten(p)
        cases |= {
            "flatten": lambda: dm.flatten(p.nested_c),
            "torch flatten": torch_flatten_case(p.nested_c),
            "unflatten": lambda: dm.unflatten(merged, like=p.nested_r),
            "torch unflatten": lambda: unflatten_torch(merged),
        }
    return cases


def scaling(sizes: list[int], rounds: int, peers_up_to: int) -> list[dict[str, Any]]:
    rows = []
    for n in sizes:
        t0 = time.perf_counter()
        p = _data.pair(_data.synthetic_params(n), with_int_ids=False)
        build = time.perf_counter() - t0
        keys = len(p.flat_c)
        rounds_here = rounds if n < 10**7 else max(3, rounds // 2)
        cases = scaling_cases(p, peers=n <= peers_up_to)
        med = measure(cases, rounds_here, warmup=keys < 10**6)
        rows.append({"keys": keys, "rounds": rounds_here, "build_s": build, "seconds": med})
        per = "  ".join(f"{k} {v / keys * 1e9:,.0f}" for k, v in med.items())
        print(f"  {keys:>10,} keys ({rounds_here} rounds), ns/key: {per}", flush=True)
        del p
        gc.collect()
    return rows


def deepseek(
    layers: int, experts: int, rounds: int, *, memory: bool, raw_torch: bool
) -> dict[str, Any]:
    t0 = time.perf_counter()
    p = _data.pair(_data.deepseek_v3_params(layers, experts))
    build = time.perf_counter() - t0
    c, r = p.flat_c, p.flat_r
    merged = dm.merge(c, r)
    merged_int = dm.flatten(dm.merge(p.int_c, p.int_r))
    strict = dm.STRICT  # conflicts checked: the most work a policy asks for
    unflatten_torch = TorchUnflatten(p)

    # what the benchmark claims about its data, checked on every run (CI too)
    d = dm.diff(c, r)
    assert len(d.missing) == 3 * layers, d
    assert not d.unexpected, d
    assert not d.mismatched, d
    assert merged.keys() == {**r, **c}.keys()
    assert dm.diff(p.nested_c, p.nested_r) == d
    assert len(dm.diff(p.int_c, p.int_r).missing) == len(d.missing)
    # the checkpoint as DDP saved it (every fqn behind "module."): rename restores it exactly
    c_ddp = dm.rename(c, {"^": "module."})
    assert dm.rename(c_ddp, "ddp") == c
    # diff suggests that rename, every fqn paired with its missing twin
    [ddp] = dm.diff(c_ddp, r).renames
    assert (ddp.preset, ddp.keys) == ("ddp", len(c)), ddp
    refactor = {r"\.attn\.wq\.": ".attn.q_proj."}  # one projection renamed in every layer
    # a new parameter (the output head, not in the checkpoint at all): its param_groups.* keys
    # are backfilled from its group's checkpoint values, which the groups must be found for
    new = ("state.head.weight.", "param_groups.head.weight.")
    c_new = {k: v for k, v in c.items() if not k.startswith(new)}
    assert sum(k.startswith(new[1]) for k in dm.diff(c_new, r).missing) == 11
    assert sum(".attn.q_proj." in k for k in dm.rename(c, refactor)) == 14 * layers

    # a layout change: every layer's experts stacked into transformers v5's 3-D parameters
    # (w1 and w3 into gate_up_proj, w2 into down_proj), moments and hyperparameters included;
    # the whole checkpoint (a meta model state dict and the nested optimizer) and the flat one
    stack = ["stack_experts_w123"]
    model = {q.fqn: torch.empty(q.shape, device=_data.META) for q in p.params}
    checkpoint = {"model": model, "optim": p.nested_c}
    stacked = dm.convert(c, stack)
    assert sum(".ffn.experts." in k for k in stacked) == 2 * 14 * layers
    assert len(stacked) == len(c) - 3 * experts * 14 * layers + 2 * 14 * layers
    got = dm.convert(checkpoint, stack)
    gate_up = got["model"]["layers.0.ffn.experts.gate_up_proj"]
    assert tuple(gate_up.shape) == (experts, 2 * 2048, 7168), gate_up.shape
    assert got["optim"]["state"]["layers.0.ffn.experts.gate_up_proj"]["exp_avg"].shape == (
        gate_up.shape
    )
    del stacked, got

    cases: Cases = {
        "floor": lambda: {**r, **c},
        "verl": lambda: verl_backfill(c, r),
        "classify": lambda: dm.classify(c),
        "flatten (flat input)": lambda: dm.flatten(c),
        "flatten": lambda: dm.flatten(p.nested_c),
        "flatten (int ids)": lambda: dm.flatten(p.int_c),
        "torch flatten": torch_flatten_case(p.nested_c),
        "unflatten": lambda: dm.unflatten(merged, like=p.nested_r),
        "unflatten (int ids)": lambda: dm.unflatten(merged_int, like=p.int_r),
        "torch unflatten": lambda: unflatten_torch(merged),
        "diff": lambda: dm.diff(c, r),
        "merge": lambda: dm.merge(c, r),
        "merge (a new parameter)": lambda: dm.merge(c_new, r),
        "merge warn": quiet(lambda: dm.merge(c, r, policy="warn")),
        "merge strict": lambda: dm.merge(c, r, policy=strict, allow_missing="*.indexer.*"),
        "check strict": lambda: dm.check(c, r, policy=strict, allow_missing="*.indexer.*"),
        "nested diff": lambda: dm.diff(p.nested_c, p.nested_r),
        "nested merge": lambda: dm.merge(p.nested_c, p.nested_r),
        "nested merge (int ids)": lambda: dm.merge(p.int_c, p.int_r),
        # the least any rename of every key costs: a new dict of new key strings (prebuilt
        # strings would be cheaper; a rename has to make them)
        "floor (new keys)": lambda: dict(zip(map("m.".__add__, c), c.values(), strict=True)),
        "rename (ddp, every key)": lambda: dm.rename(c_ddp, "ddp"),
        "rename (wq -> q_proj)": lambda: dm.rename(c, refactor),
        "merge through rename (ddp)": lambda: dm.merge(c_ddp, r, rename="ddp"),
        "convert (stack experts, flat)": lambda: dm.convert(c, stack),
        "convert (stack experts, checkpoint)": lambda: dm.convert(checkpoint, stack),
        "diff suggesting a rename (ddp)": lambda: dm.diff(c_ddp, r),
    }
    med = measure(cases, rounds, warmup=len(c) < 10**6)
    out: dict[str, Any] = {
        "layers": layers,
        "experts": experts,
        "params": len(p.params),
        "keys": len(c),
        "reference_keys": len(r),
        "rounds": rounds,
        "build_s": build,
        "seconds": med,
    }
    out["copied_tensors"] = {
        "merge": new_tensors(dm.merge(c, r), c, r),
        "nested merge": new_tensors(dm.merge(p.nested_c, p.nested_r), p.nested_c, p.nested_r),
        "nested merge (int ids)": new_tensors(dm.merge(p.int_c, p.int_r), p.int_c, p.int_r),
        "flatten": new_tensors(dm.flatten(p.nested_c), p.nested_c),
        "unflatten": new_tensors(dm.unflatten(merged, like=p.nested_r), merged),
        "rename": new_tensors(dm.rename(c_ddp, "ddp"), c_ddp),
    }
    if memory:
        one_dict = sys.getsizeof({**r, **c})
        out["one_dict_bytes"] = one_dict
        out["peak_bytes"] = {
            "floor": peak_memory(lambda: {**r, **c}),
            "verl": peak_memory(lambda: verl_backfill(c, r)),
            "merge": peak_memory(lambda: dm.merge(c, r)),
            "diff": peak_memory(lambda: dm.diff(c, r)),
            "nested merge": peak_memory(lambda: dm.merge(p.nested_c, p.nested_r)),
            "flatten": peak_memory(lambda: dm.flatten(p.nested_c)),
        }
    if raw_torch:  # torch's own load path on the checkpoint as saved: O(missing x keys)
        start = time.perf_counter()
        broken = unflatten_torch(c)
        out["torch_unflatten_raw_s"] = time.perf_counter() - start
        fqn = next(f for f, e in broken["state"].items() if "exp_avg" in e and e["exp_avg"] == {})
        out["torch_unflatten_raw_broken"] = fqn
    return out


# --------------------------------------------------------------------------------------
# report


def _ratio(a: str, b: str) -> Callable[[dict[str, float]], float]:
    return lambda s: s[a] / s[b]


TARGETS = [
    # (name, value function, comparison, bound, what); the policy and resume rows first
    ("merge strict / floor", _ratio("merge strict", "floor"), "<=", 1.6, "strict policy"),
    ("merge warn / floor", _ratio("merge warn", "floor"), "<=", 1.6, "warn policy"),
    ("check strict / floor", _ratio("check strict", "floor"), "<=", 1.6, "check, strict"),
    ("merge / floor", _ratio("merge", "floor"), "<=", 1.4, "merge, default policy"),
    (
        "merge (a new parameter) / floor",
        _ratio("merge (a new parameter)", "floor"),
        "<=",
        1.4,
        "merge that backfills a new parameter's hyperparameters",
    ),
    ("diff / floor", _ratio("diff", "floor"), "<=", 1.4, "diff"),
    ("nested merge / floor", _ratio("nested merge", "floor"), "<=", 1.05, "nested merge"),
    ("unflatten / torch", _ratio("unflatten", "torch unflatten"), "<=", 1.5, "unflatten vs torch"),
    ("flatten / torch", _ratio("flatten", "torch flatten"), "<=", 0.8, "flatten vs torch"),
    ("verl / merge", _ratio("verl", "merge"), ">=", 1.0, "verl-style backfill vs merge"),
    (
        "rename / floor",
        _ratio("rename (ddp, every key)", "floor"),
        "<=",
        2.0,
        "rename of every fqn vs the floor",
    ),
    ("nested / flat merge", _ratio("nested merge", "merge"), "<=", 0.6, "nested vs flat merge"),
    (
        "diff suggesting a rename / floor",
        _ratio("diff suggesting a rename (ddp)", "floor"),
        "<=",
        40.0,
        "diff of a DDP checkpoint: every key unexpected, the rename found and checked key by key "
        "(linear in the keys)",
    ),
]


def ok(value: float, op: str, bound: float) -> bool:
    return value <= bound if op == "<=" else value >= bound


def fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if seconds < 10 else f"{seconds:,.1f} s"


def report(result: dict[str, Any]) -> str:
    ds = result["deepseek"]
    s = ds["seconds"]
    keys = ds["keys"]
    lines = [
        f"DeepSeek-V3 scale: {ds['params']:,} params, {keys:,} flat checkpoint keys "
        f"({ds['reference_keys']:,} in the reference), median of {ds['rounds']} rounds.",
        "",
        "| operation | median | keys/s | / floor |",
        "|---|---:|---:|---:|",
    ]
    for name, sec in s.items():
        rate = keys / sec / 1e6
        lines.append(f"| {name} | {fmt_s(sec)} | {rate:,.2f} M | {sec / s['floor']:.2f} |")
    lines += ["", "| target | measured | bound | met |", "|---|---:|---:|:-:|"]
    for name, fn, op, bound, _ in TARGETS:
        v = fn(s)
        lines.append(f"| {name} | {v:.2f} | {op} {bound} | {'yes' if ok(v, op, bound) else 'NO'} |")
    lin = linearity(result["scaling"])
    if lin is not None:
        big, small, ratio, _ = lin
        lines.append(
            f"| merge time/key at {big:,} vs {small:,} keys | {ratio:.2f} | <= 2.0 | "
            f"{'yes' if ratio <= 2.0 else 'NO'} |"
        )
    if "peak_bytes" in ds:
        one = ds["one_dict_bytes"]
        pk = ds["peak_bytes"]
        lines.append(
            f"| merge peak extra memory / one dict | {pk['merge'] / one:.2f} | <= 1.5 | "
            f"{'yes' if pk['merge'] <= 1.5 * one else 'NO'} |"
        )
    copied = sum(ds["copied_tensors"].values())
    met = "yes" if not copied else "NO"
    lines.append(f"| tensors copied (all results) | {copied} | = 0 | {met} |")
    if lin is not None:
        lines.append("")
        lines.append(
            f"Time per key at {lin[0]:,} keys over time per key at {lin[1]:,} keys: merge "
            f"{lin[2]:.2f}, the floor itself {lin[3]:.2f}."
        )
    if "peak_bytes" in ds:
        one = ds["one_dict_bytes"]
        lines += [
            "",
            f"Peak extra memory (tracemalloc, result included), one dict of the key set = "
            f"{one / 2**20:.1f} MiB:",
            "",
            "| operation | peak | / one dict |",
            "|---|---:|---:|",
        ]
        for name, b in ds["peak_bytes"].items():
            lines.append(f"| {name} | {b / 2**20:.1f} MiB | {b / one:.2f} |")
    if "torch_unflatten_raw_s" in ds:
        lines += [
            "",
            f"torch's `_unflatten_optim_state_dict` on the checkpoint as saved (the flattened-DSD "
            f"load path) takes {fmt_s(ds['torch_unflatten_raw_s'])} (it scans every key for each "
            f"missing one) and returns `{{}}` for the indexer's state "
            f"(`{ds['torch_unflatten_raw_broken']}`), which `Adam.__setstate__` then crashes on.",
        ]
    lines += ["", scaling_table(result["scaling"])]
    return "\n".join(lines)


def scaling_table(rows: list[dict[str, Any]]) -> str:
    names = list(dict.fromkeys(k for row in rows for k in row["seconds"]))
    lines = [
        "Synthetic flat AdamW key sets, nanoseconds per key (median):",
        "",
        "| keys | " + " | ".join(names) + " | merge / floor | verl / merge |",
        "|---:|" + "---:|" * (len(names) + 2),
    ]
    for row in rows:
        s, n = row["seconds"], row["keys"]
        cells = [f"{s[k] / n * 1e9:,.0f}" if k in s else "-" for k in names]
        lines.append(
            f"| {n:,} | " + " | ".join(cells) + f" | {s['merge'] / s['floor']:.2f} | "
            f"{s['verl'] / s['merge']:.2f} |"
        )
    return "\n".join(lines)


def linearity(rows: list[dict[str, Any]]) -> tuple[int, int, float, float] | None:
    small = next((r for r in rows if 5_000 <= r["keys"] <= 20_000), None)
    big = max(rows, key=lambda r: r["keys"], default=None)
    if small is None or big is None or big["keys"] < 100 * small["keys"]:
        return None

    def per_key(row: dict[str, Any], name: str) -> float:
        return float(row["seconds"][name] / row["keys"])

    return (
        big["keys"],
        small["keys"],
        per_key(big, "merge") / per_key(small, "merge"),
        per_key(big, "floor") / per_key(small, "floor"),
    )


def plot(rows: list[dict[str, Any]], path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install -e '.[bench]')"
    names = list(dict.fromkeys(k for row in rows for k in row["seconds"]))
    fig, ax = plt.subplots(figsize=(8, 5))
    for name in names:
        pts = [
            (r["keys"], r["seconds"][name] / r["keys"] * 1e9) for r in rows if name in r["seconds"]
        ]
        style = "--" if name in ("floor", "verl") or name.startswith("torch") else "-"
        ax.plot(*zip(*pts, strict=True), style, marker="o", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("flat keys")
    ax.set_ylabel("time per key (ns, median)")
    ax.set_title("dsdmerge on synthetic AdamW key sets (dashed: baselines)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot written to {path}"


def update_page(path: Path, text: str) -> None:
    start, end = "<!-- bench:start -->", "<!-- bench:end -->"
    readme = path.read_text()
    if start not in readme:
        raise SystemExit(f"{path} lacks the {start} ... {end} markers")
    body = re.sub(
        re.escape(start) + ".*?" + re.escape(end),
        lambda _: f"{start}\n{text}\n{end}",
        readme,
        flags=re.DOTALL,
    )
    path.write_text(body)


# --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CI smoke run: small sizes, 3 rounds")
    ap.add_argument("--huge", action="store_true", help="also 10^7 synthetic keys (~10 GB RAM)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per case (default 7, quick 3)")
    ap.add_argument("--no-memory", action="store_true", help="skip the tracemalloc runs")
    ap.add_argument("--json", type=Path, help="write all results as JSON here")
    ap.add_argument("--plot", type=Path, help="scaling plot PNG (default docs/assets/scaling.png)")
    ap.add_argument(
        "--docs", action="store_true", help="rewrite the results table of docs/benchmarks.md"
    )
    ap.add_argument(
        "--no-resume", action="store_true", help="skip the end-to-end resume (bench_resume.py)"
    )
    args = ap.parse_args(argv)

    rounds = args.rounds or (3 if args.quick else 7)
    if args.quick:
        sizes = [10**3, 10**4, 10**5]
        layers, experts = 2, 256
    else:
        sizes = [10**3, 10**4, 10**5, 10**6] + ([10**7] if args.huge else [])
        layers, experts = 61, 256
    started = time.perf_counter()
    load = os.getloadavg()
    print(
        f"dsdmerge {dm.__version__}, torch {torch.__version__}, "
        f"Python {platform.python_version()}, {os.cpu_count()} CPUs, load average {load[0]:.1f}",
        flush=True,
    )
    print("scaling (synthetic flat AdamW key sets):", flush=True)
    peers_up_to = 10**4 if args.quick else 10**6
    result: dict[str, Any] = {"scaling": scaling(sizes, rounds, peers_up_to)}
    print(f"DeepSeek-V3 scale ({layers} layers x {experts} experts):", flush=True)
    result["deepseek"] = deepseek(
        layers, experts, rounds, memory=not args.no_memory, raw_torch=True
    )
    result["env"] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "load_average_start": load[0],
        "load_average_end": os.getloadavg()[0],
        "wall_s": time.perf_counter() - started,
        "argv": sys.argv[1:] if argv is None else argv,
    }
    text = report(result)
    if not args.no_resume:  # the end-to-end optimizer resume, real tensors (bench_resume.py)
        import bench_resume

        print("end-to-end resume (bench_resume.py):", flush=True)
        result["resume"] = bench_resume.run(quick=args.quick)
        text += "\n\n" + bench_resume.report(result["resume"])
    result["env"]["wall_s"] = time.perf_counter() - started
    env = result["env"]
    text += (
        f"\n\nMeasured with `python benchmarks/bench_merge.py {' '.join(env['argv'])}`: "
        f"Python {env['python']}, torch {env['torch']}, {env['cpus']} CPUs, load average "
        f"{env['load_average_start']:.1f} at start and {env['load_average_end']:.1f} at end."
    )
    print()
    print(text)
    if args.plot or not args.quick:
        print(plot(result["scaling"], args.plot or HERE.parent / "docs" / "assets" / "scaling.png"))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    if args.docs:
        update_page(HERE.parent / "docs" / "benchmarks.md", text)
        print("docs/benchmarks.md updated")
    if args.quick:  # the safe .metadata reader's smoke run too (full run: bench_read.py)
        import bench_read

        print()
        print(bench_read.report(bench_read.run(quick=True)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
