"""verl-style resume: every rank saves its own files with torch.save, and loads them through a hook.

verl's FSDP checkpoint manager writes, per rank, the model state dict and the optimizer's
``state_dict()``; on load it calls ``optimizer.load_state_dict(self._backfill_optimizer_state(
torch.load(path)))``. Here the optimizer state is the *flattened* DSD form
(``StateDictOptions(flatten_optimizer_state_dict=True)``), as an optimizer container such as
VeOmni's ``MultiOptimizer`` saves it. The model has a sparse-attention indexer whose forward
only returns top-k indices, so it never gets a gradient and AdamW never creates state for it:
torch alone crashes in ``set_optimizer_state_dict``. With dsdmerge the hook is one call
(``backfill_optimizer_state``), under a strict policy that accepts exactly the known gap; the
indexer starts fresh, as in an optimizer that never saw the checkpoint.

Run: ``python examples/verl_style_resume.py`` (one process), or
``torchrun --nproc-per-node 2 examples/verl_style_resume.py`` (each rank saves and resumes its
own files; the process group is gloo, on CPU).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from dsdmerge.demo import TinyModel, make_optimizer
from dsdmerge.integrations import backfill_optimizer_state, load_checkpoint, resume_model

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)

if "RANK" in os.environ and not dist.is_initialized():  # started by torchrun
    dist.init_process_group("gloo")
RANK = dist.get_rank() if dist.is_initialized() else 0
WORLD = dist.get_world_size() if dist.is_initialized() else 1


class CheckpointManager:
    """The load path of verl's checkpoint manager, reduced to its protocol."""

    def __init__(self, model, optimizer, lr_scheduler) -> None:
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler

    def _backfill_optimizer_state(self, state_dict: dict) -> dict:
        # the one line: the dict to load, merged over what the optimizer accepts and checked
        return backfill_optimizer_state(
            self.optimizer,
            state_dict,
            model=self.model,
            policy="strict",
            allow_missing=["state.indexer.*"],  # the indexer never gets gradients: no state
        )

    def save_checkpoint(self, path: Path) -> None:
        suffix = f"world_size_{WORLD}_rank_{RANK}.pt"
        torch.save(self.model.state_dict(), path / f"model_{suffix}")
        optim_sd = get_optimizer_state_dict(self.model, self.optimizer, options=FLAT)
        torch.save(optim_sd, path / f"optim_{suffix}")
        torch.save({"lr_scheduler": self.lr_scheduler.state_dict()}, path / f"extra_{suffix}")

    def load_checkpoint(self, path: Path) -> None:
        suffix = f"world_size_{WORLD}_rank_{RANK}.pt"
        resume_model(self.model, load_checkpoint(path / f"model_{suffix}"), policy="strict")
        optimizer_state_dict = load_checkpoint(path / f"optim_{suffix}")  # weights_only=True
        optimizer_state_dict = self._backfill_optimizer_state(optimizer_state_dict)
        self.optimizer.load_state_dict(optimizer_state_dict)
        extra = load_checkpoint(path / f"extra_{suffix}")
        self.lr_scheduler.load_state_dict(extra["lr_scheduler"])


def train(model, optim, schedule, steps: int) -> None:
    for _ in range(steps):
        model(torch.randint(0, 16, (4, 6))).logsumexp(-1).mean().backward()
        optim.step()
        optim.zero_grad()
        schedule.step()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp)
        torch.manual_seed(RANK)
        model = TinyModel()
        optim, schedule = make_optimizer(model)
        train(model, optim, schedule, steps=5)
        CheckpointManager(model, optim, schedule).save_checkpoint(ckpt)
        saved_lr = optim.param_groups[0]["lr"]

        model = TinyModel()  # a fresh process would start here
        optim, schedule = make_optimizer(model)
        CheckpointManager(model, optim, schedule).load_checkpoint(ckpt)
    assert [g["lr"] for g in optim.param_groups] == [saved_lr, saved_lr]
    assert model.indexer.proj.weight not in optim.state  # fresh: no state until its first step
    train(model, optim, schedule, steps=2)
    print(f"resumed rank {RANK}/{WORLD}: lr {saved_lr:.2e} kept, 2 more steps trained")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
