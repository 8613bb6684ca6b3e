"""Report cost at DeepSeek-V3 scale: ~661k flattened AdamW keys, thousands of differences.

Run: ``python benchmarks/bench_report.py`` (``--quick`` for a smaller key set).
Prints the time to diff the two flat metadata dicts, to render ``str(KeyDiff)`` and to
compress every key of the checkpoint (what ``dsdmerge inspect`` does); then ``compress`` of
the DeepSeek-V3-scale AdamW keys of ``_data.py`` (661,709) as flatten orders them, shuffled,
and as a dict, next to the floor ``dict.fromkeys(keys)``, and its time per key from 10^4 to
10^7 keys with random holes, shuffled, next to the floor on the same keys (linear: the ratio
stays flat while memory makes every per-key time grow).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
if str(HERE.parent) not in sys.path:  # run from a checkout without installing
    sys.path.insert(1, str(HERE.parent))

import _data  # noqa: E402

import dsdmerge as dm  # noqa: E402
from dsdmerge.report import compress  # noqa: E402

HPS = (
    "lr", "betas", "eps", "weight_decay", "amsgrad", "foreach", "maximize",
    "capturable", "differentiable", "fused", "decoupled_weight_decay",
)  # fmt: skip
STATE = ("exp_avg", "exp_avg_sq", "step")


def fqns(layers: int, experts: int, skip: dict[int, range]) -> list[str]:
    """Parameter fqns of a DeepSeek-V3-like model; ``skip[layer]`` are experts left out."""
    out = ["embed.weight", "norm.weight", "head.weight"]
    for layer in range(layers):
        p = f"layers.{layer}"
        out += [f"{p}.attn.{w}.weight" for w in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo")]
        out += [f"{p}.attn_norm.weight", f"{p}.ffn_norm.weight", f"{p}.mlp.gate.weight"]
        out += [
            f"{p}.mlp.experts.{e}.{w}.weight"
            for e in range(experts)
            if e not in skip.get(layer, ())
            for w in ("w1", "w2", "w3")
        ]
    return out


def flat_optim(names: list[str], meta: dm.TensorMeta) -> dict[str, object]:
    """A flattened AdamW state dict with metadata-only tensors."""
    sd: dict[str, object] = {}
    for n in names:
        for s in STATE:
            sd[f"state.{n}.{s}"] = meta
        for h in HPS:
            sd[f"param_groups.{n}.{h}"] = 0.0
    return sd


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    layers, experts = (8, 32) if args.quick else (61, 256)
    meta = dm.TensorMeta((7168, 2048), torch.bfloat16)
    # the checkpoint lacks half the experts of two layers, the reference lacks one old head
    ckpt = flat_optim(fqns(layers, experts, {3: range(128, 256), 5: range(0, 64)}), meta)
    ckpt.update({f"state.mtp.{i}.head.weight.exp_avg": meta for i in range(2)})
    ref = flat_optim(fqns(layers, experts, {}), meta)
    ref["state.layers.0.attn.wq_a.weight.exp_avg"] = dm.TensorMeta((7168, 1536), torch.float32)
    print(f"checkpoint {len(ckpt):,} keys, reference {len(ref):,} keys")

    t0 = time.perf_counter()
    d = dm.diff(ckpt, ref)
    t1 = time.perf_counter()
    text = str(d)
    t2 = time.perf_counter()
    patterns = compress(ckpt)
    t3 = time.perf_counter()
    print(text)
    print(
        f"differences: {len(d.missing):,} missing, {len(d.unexpected):,} unexpected, "
        f"{len(d.mismatched):,} mismatched"
    )
    print(f"diff {t1 - t0:.3f}s, render str(KeyDiff) {t2 - t1:.3f}s")
    print(f"compress all {len(ckpt):,} checkpoint keys: {len(patterns)} patterns, {t3 - t2:.3f}s")
    compress_cases(quick=args.quick)


def _median(fn: object, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _holes(n_params: int, rnd: random.Random) -> list[str]:
    """Flat AdamW keys (3 state + 11 hyperparameter keys per param), 30% of params missing."""
    out = []
    for i in range(n_params):
        if rnd.random() < 0.3:
            continue
        fqn = f"layers.{i // 768}.ffn.experts.{i // 3 % 256}.w{i % 3 + 1}.weight"
        out += [f"state.{fqn}.{s}" for s in STATE]
        out += [f"param_groups.{fqn}.{h}" for h in HPS]
    return out


def compress_cases(*, quick: bool) -> None:
    """compress() at DeepSeek-V3 scale (_data.py) in three input orders, and its scaling."""
    rounds = 3 if quick else 5
    params = _data.deepseek_v3_params(*((4, 16) if quick else ()))
    keys = list(_data.flat(_data.nested(params, checkpoint=True)))
    shuffled = keys[:]
    random.Random(0).shuffle(shuffled)
    print(f"\ncompress, {len(keys):,} flat AdamW keys (_data.py), median of {rounds}:")
    floor = _median(lambda: dict.fromkeys(keys), rounds)
    rows = [
        ("floor: dict.fromkeys(keys)", floor),
        ("compress(keys), flatten's order", _median(lambda: compress(keys, max_parts=16), rounds)),
        ("compress(shuffled keys)", _median(lambda: compress(shuffled, max_parts=16), rounds)),
        (
            "compress(dict), inspect's view",
            _median(lambda: compress(dict.fromkeys(keys), max_parts=16), rounds),
        ),
    ]
    for name, seconds in rows:
        print(f"  {name:<34} {seconds * 1e3:9.1f} ms  {seconds / floor:6.2f} x floor")
    print(
        "time per key, flat AdamW keys with 30% of params missing, shuffled (the floor, "
        "dict.fromkeys of the same list, shows what memory alone costs at each size):"
    )
    rnd = random.Random(0)
    for n_params in (1_000, 10_000, 100_000) if quick else (1_000, 10_000, 100_000, 1_000_000):
        sample = _holes(n_params, rnd)
        rnd.shuffle(sample)
        seconds = _median(lambda: compress(sample, max_parts=16), rounds)  # noqa: B023
        floor = _median(lambda: dict.fromkeys(sample), rounds)  # noqa: B023
        print(
            f"  {len(sample):>10,} keys  {seconds / len(sample) * 1e9:7.0f} ns/key  "
            f"(floor {floor / len(sample) * 1e9:4.0f} ns/key, {seconds / floor:5.2f} x floor)"
        )


if __name__ == "__main__":
    main()
