"""The resume story, end to end, on a tiny model (what ``dsdmerge demo`` runs).

A model with a sparse-attention-like *indexer* whose forward only returns
top-k indices, so its parameters never get a gradient and AdamW never creates
state for them. The flattened DSD optimizer state is saved and reloaded; torch
alone fails to load it into a fresh optimizer, and :func:`dsdmerge.merge` makes
it load, keeping every trained value and the scheduled learning rate.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["TinyModel", "run_demo"]

BASE_LR = 1e-3


class Indexer(nn.Module):
    """Scores keys and returns the top-k indices: no gradient ever reaches it."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Indices of the two highest-scoring features."""
        indices: torch.Tensor = self.proj(x).topk(2, dim=-1).indices
        return indices


class TinyModel(nn.Module):
    """An embedding, an indexer that never gets gradients, a projection and a head."""

    def __init__(self, dim: int = 8, vocab: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.indexer = Indexer(dim)
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits; the indexer only chooses which features to keep."""
        x = self.embed(tokens)
        picked = self.proj(x).gather(-1, self.indexer(x))
        logits: torch.Tensor = self.head(picked.repeat_interleave(x.shape[-1] // 2, dim=-1))
        return logits


def make_optimizer(model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW with decay / no-decay groups and a decaying LR schedule."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    optim = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=BASE_LR,
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: 0.5**step)
    return optim, schedule


def run_demo(workdir: str | Path | None = None, *, steps: int = 5) -> list[str]:
    """Train, save, fail to resume with torch alone, resume with dsdmerge; return the story.

    Args:
        workdir: Where to write the checkpoint (a temporary directory if ``None``).
        steps: Training steps before the checkpoint.

    Returns:
        The lines of the story, for the caller to print.

    Examples:
        >>> from dsdmerge.demo import run_demo
        >>> any("resumed" in line for line in run_demo(steps=2))
        True
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    import dsdmerge as dm

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    lines: list[str] = []
    torch.manual_seed(0)
    model = TinyModel()
    optim, schedule = make_optimizer(model)
    for _ in range(steps):
        tokens = torch.randint(0, 16, (4, 6))
        model(tokens).logsumexp(-1).mean().backward()
        optim.step()
        optim.zero_grad()
        schedule.step()
    saved = get_optimizer_state_dict(model, optim, options=options)
    scheduled_lr = optim.param_groups[0]["lr"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(workdir or tmp) / "optim.pt"
        torch.save({"model": model.state_dict(), "optim": saved}, path)
        loaded = torch.load(path, weights_only=True)
    ckpt = loaded["optim"]
    n_state = sum(k.startswith("state.") for k in ckpt)
    lines.append(
        f"trained {steps} steps and saved {len(ckpt)} flattened optimizer keys "
        f"({n_state} state.*); the indexer never got a gradient, so it has no state.* keys"
    )

    fresh_model = TinyModel()
    fresh_model.load_state_dict(loaded["model"])
    optim2, _ = make_optimizer(fresh_model)
    try:
        set_optimizer_state_dict(fresh_model, optim2, ckpt, options=options)
        lines.append("torch alone: loaded (this torch no longer has the bug)")
    except Exception as err:  # noqa: BLE001 - we show whatever torch raises
        lines.append(f"torch alone: set_optimizer_state_dict failed: {type(err).__name__}: {err}")

    optim3, _ = make_optimizer(fresh_model)
    reference = get_optimizer_state_dict(fresh_model, optim3, options=options)
    merged, diff, _ = dm.merge_with_diff(
        ckpt, reference, policy="strict", allow_missing=["state.indexer.*"]
    )
    lines.append("dsdmerge: " + str(diff).replace("\n", "\n  "))
    set_optimizer_state_dict(fresh_model, optim3, merged, options=options)
    kept = [k for k in ckpt if merged[k] is ckpt[k]]
    resumed = get_optimizer_state_dict(fresh_model, optim3, options=options)
    resumed_flat: dict[str, Any] = dict(resumed)
    same = all(
        torch.equal(resumed_flat[k], v) for k, v in ckpt.items() if isinstance(v, torch.Tensor)
    )
    lr = optim3.param_groups[0]["lr"]
    lines.append(
        f"resumed: {len(kept)}/{len(ckpt)} checkpoint values kept by identity, trained state "
        f"{'identical to' if same else 'DIFFERENT from'} the checkpoint, lr {lr:.2e} "
        f"(scheduled {scheduled_lr:.2e}; a fresh optimizer would use {BASE_LR:.2e})"
    )
    return lines
