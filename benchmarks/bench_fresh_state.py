"""What the optimizer's own fresh state costs a resume: the meta twin against the copy twin.

    python benchmarks/bench_fresh_state.py           # a 1.1B Llama-shaped model (meta twin) and
                                                      # a 124M one (both twins), ~1 minute
    python benchmarks/bench_fresh_state.py --quick   # CI smoke run: a 2-layer model, seconds

``resume_optimizer`` checks every loaded optimizer state tensor against the shape and dtype the
optimizer gives that field, which it learns from the optimizer's own zero-gradient step on a
throwaway twin (``dsdmerge.integrations._fresh``). This measures both kinds of twin with AdamW
(foreach, the default) over a Llama-shaped model (embedding, per layer four attention and three
MLP projections and two norms, final norm, head):

* ``meta``: the stand-in parameters are meta tensors. Time only (it holds no tensor memory); the
  model itself may be on the meta device, so it runs at 1.1B parameters anywhere.
* ``copy``: the stand-ins are real clones. Time, and the bytes the twin holds at its peak (its
  parameters and its fresh state, counted tensor by tensor), and the process's peak RSS growth.

Medians over the rounds (meta 5, copy 3; quick: 3 and 2), one thread per measurement as in a
trainer's resume on one rank. The live optimizer and model are checked to be unchanged.
"""

from __future__ import annotations

import argparse
import gc
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(HERE.parent))

from dsdmerge.integrations._fresh import fresh_states  # noqa: E402

CONFIGS = {
    # name: (vocab, hidden, layers, ffn)
    "llama-1.1B": (32000, 2048, 22, 5632),  # TinyLlama's shape
    "llama-124M": (32000, 768, 12, 2048),
    "tiny": (512, 64, 2, 128),
}


class Block(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden, bias=False) for _ in range(4))
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)
        self.norm1 = nn.RMSNorm(hidden)
        self.norm2 = nn.RMSNorm(hidden)


class Llama(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, ffn: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(hidden, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)


def build(name: str, device: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    with torch.device(device):
        model = Llama(*CONFIGS[name])
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if p.dim() <= 1]
    optim = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=3e-4
    )
    return model, optim


def nbytes(tree: object) -> int:
    total = 0
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            total += node.numel() * node.element_size()
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return total


def time_twin(optim: torch.optim.Optimizer, kind: str, rounds: int) -> tuple[float, int]:
    times = []
    held = 0
    for _ in range(rounds):
        gc.collect()
        t0 = time.perf_counter()
        fresh = fresh_states(optim, kind=kind, every_param=True)  # type: ignore[arg-type]
        times.append(time.perf_counter() - t0)
        if kind == "copy":
            held = nbytes([g["params"] for g in optim.param_groups]) + nbytes(fresh)
        assert len(fresh) == sum(len(g["params"]) for g in optim.param_groups)
        del fresh
    return statistics.median(times), held


def max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    big, small = ("tiny", "tiny") if args.quick else ("llama-1.1B", "llama-124M")
    meta_rounds, copy_rounds = (3, 2) if args.quick else (5, 3)

    model, optim = build(big, "meta")
    n = sum(p.numel() for p in model.parameters())
    count = sum(1 for _ in model.parameters())
    t, _ = time_twin(optim, "meta", meta_rounds)
    print(f"{big}: {n / 1e9:.2f}B parameters in {count} tensors")
    print(f"  meta twin: {t * 1e3:8.1f} ms, no tensor memory")

    model, optim = build(small, "cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    n = sum(p.numel() for p in model.parameters())
    count = sum(1 for _ in model.parameters())
    print(f"{small}: {n / 1e6:.0f}M parameters in {count} tensors (real, CPU)")
    t, _ = time_twin(optim, "meta", meta_rounds)
    print(f"  meta twin: {t * 1e3:8.1f} ms, no tensor memory")
    rss0 = max_rss()
    t, held = time_twin(optim, "copy", copy_rounds)
    rss = max_rss() - rss0
    print(
        f"  copy twin: {t * 1e3:8.1f} ms, holds {held / 2**20:,.0f} MiB at its peak "
        f"({held / (n * 4):.1f}x the parameters' bytes; peak RSS grew {rss / 2**20:,.0f} MiB)"
    )
    assert not optim.state, "the live optimizer was changed"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


if __name__ == "__main__":
    main()
