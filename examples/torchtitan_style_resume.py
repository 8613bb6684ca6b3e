"""torchtitan-style resume: one DCP directory, checked against the policy before loading.

torchtitan saves ``{"model": ..., "optimizer": ..., "train_state": ...}`` with
``torch.distributed.checkpoint``, the optimizer state flattened. Here the model has a
sparse-attention indexer that never gets a gradient (so its optimizer state is missing
from the checkpoint) and a new head added since the checkpoint. ``load_dcp`` reads the
metadata only, applies the policy (the indexer's state and the new head may be missing,
nothing else), and only then loads, in place, with a partial load scoped to what the
policy accepted; ``resume_model`` / ``resume_optimizer`` then backfill what is missing,
with the checkpoint's scheduled learning rate for the new head.

Run: ``python examples/torchtitan_style_resume.py``.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

import dsdmerge as dm
from dsdmerge.demo import TinyModel, make_optimizer
from dsdmerge.integrations import load_dcp, read_metadata, resume_model, resume_optimizer

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
warnings.filterwarnings("ignore", message=".*assuming the intent is to")  # single process


class WithNewHead(TinyModel):
    """The model after the checkpoint: one more output head."""

    def __init__(self) -> None:
        super().__init__()
        self.aux_head = nn.Linear(8, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens) + self.aux_head(self.embed(tokens))


def train(model, optim, schedule, steps: int) -> None:
    for _ in range(steps):
        model(torch.randint(0, 16, (4, 6))).logsumexp(-1).mean().backward()
        optim.step()
        optim.zero_grad()
        schedule.step()


def states(model, optim, step: int) -> dict:
    return {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optim, options=FLAT),
        "train_state": {"step": step},
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "step-5"
        torch.manual_seed(0)
        model = TinyModel()
        optim, schedule = make_optimizer(model)
        train(model, optim, schedule, steps=5)
        dcp.save(states(model, optim, step=5), checkpoint_id=str(path))
        saved_lr = optim.param_groups[0]["lr"]

        model = WithNewHead()  # a fresh process would start here
        optim, schedule = make_optimizer(model)
        target = states(model, optim, step=0)
        print(dm.diff(read_metadata(path), target))  # look first: metadata only
        loaded, _ = load_dcp(
            path,
            target,
            policy="strict",
            allow_missing=[
                "model.aux_head.*",
                "optimizer.*.aux_head.*",
                "optimizer.state.indexer.*",
            ],
        )
    resume_model(model, loaded["model"], policy="strict", allow_missing="aux_head.*")
    resume_optimizer(
        model,
        optim,
        loaded["optimizer"],
        options=FLAT,
        policy="strict",
        allow_missing=["*.aux_head.*", "state.indexer.*"],
    )
    step = loaded["train_state"]["step"]
    assert [g["lr"] for g in optim.param_groups] == [saved_lr, saved_lr]
    train(model, optim, schedule, steps=2)
    print(f"resumed at step {step}: lr {saved_lr:.2e} kept (aux_head included), 2 more steps")


if __name__ == "__main__":
    main()
