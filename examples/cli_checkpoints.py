"""Write the two checkpoints the README's command-line walkthrough runs on.

``step-1000.pt``: the flattened AdamW state (``flatten_optimizer_state_dict=True``) of a
6-layer MoE model (8 experts per layer, attention, a sparse-attention indexer whose
forward only returns indices, so it never gets a gradient, and a 24-row head), trained
a few steps with a learning rate the scheduler has since decayed to 5e-5.

``fresh.pt``: what a fresh optimizer of the model as it is now holds (the reference):
layers 3 and 5 grew to 12 experts, the head to 32 rows; made with
``dsdmerge reference``'s function (DSD's zero-gradient step, lr 1e-3).

Run: ``python examples/cli_checkpoints.py [DIRECTORY]`` (default: the current directory).
Deterministic: the same files, byte for byte in their keys, shapes and values' text.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from dsdmerge.integrations.reference import reference_state_dict

DIM = 16


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, DIM, bias=False)
        self.w2 = nn.Linear(DIM, DIM, bias=False)
        self.w3 = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(x)) * self.w3(x))


class Layer(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.attn = nn.ModuleDict(
            {w: nn.Linear(DIM, DIM, bias=False) for w in ("wq", "wk", "wv", "wo")}
        )
        self.indexer = nn.Linear(DIM, 4)  # top-k indices only: no gradient ever
        self.experts = nn.ModuleList(Expert() for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _ = self.indexer(x).detach().topk(2).indices
        q, k, v = self.attn["wq"](x), self.attn["wk"](x), self.attn["wv"](x)
        x = x + self.attn["wo"](torch.softmax(q @ k.T, -1) @ v)
        return x + sum(e(x) for e in self.experts)


class MoE(nn.Module):
    def __init__(self, experts: dict[int, int] | None = None, head: int = 24) -> None:
        super().__init__()
        experts = experts or {}
        self.layers = nn.ModuleList(Layer(experts.get(i, 8)) for i in range(6))
        self.head = nn.Linear(DIM, head, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def main(directory: Path) -> None:
    torch.manual_seed(0)
    model = MoE()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        for group in optimizer.param_groups:  # the scheduler's decay
            group["lr"] = 5e-5 if step == 2 else 1e-3
        model(torch.randn(4, DIM)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    torch.save(
        get_optimizer_state_dict(model, optimizer, options=options), directory / "step-1000.pt"
    )

    torch.manual_seed(1)
    grown = MoE({3: 12, 5: 12}, head=32)
    fresh = reference_state_dict(
        {"optim": torch.optim.AdamW(grown.parameters(), lr=1e-3), "model": grown},
        optimizer_layout="flat",
    )
    torch.save(fresh["optim"], directory / "fresh.pt")
    print(f"wrote {directory / 'step-1000.pt'} and {directory / 'fresh.pt'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path.cwd())
