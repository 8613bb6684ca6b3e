"""Report cost at DeepSeek-V3 scale: ~661k flattened AdamW keys, thousands of differences.

Run: ``PYTHONPATH=. python benchmarks/bench_report.py`` (``--quick`` for a smaller key set).
Prints the time to diff the two flat metadata dicts, to render ``str(KeyDiff)`` and to
compress every key of the checkpoint (what ``dsdmerge inspect`` does).
"""

from __future__ import annotations

import argparse
import time

import torch

import dsdmerge as dm
from dsdmerge.report import compress

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


if __name__ == "__main__":
    main()
