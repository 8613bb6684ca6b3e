"""verl-style resume: every rank saves its own files with torch.save and loads them back.

verl's FSDP checkpoint manager writes, per rank, the model state dict and the *flattened*
DSD optimizer state dict (``StateDictOptions(flatten_optimizer_state_dict=True)``). The
model here has a sparse-attention indexer whose forward only returns top-k indices, so it
never gets a gradient and AdamW never creates state for it: on resume, torch alone crashes
in ``set_optimizer_state_dict``. dsdmerge loads the files safely (``weights_only=True``,
memory-mapped) and resumes in one call per object, under a strict policy that accepts
exactly the known gap.

Run: ``python examples/verl_style_resume.py`` (one process; under torchrun every rank runs
the same code with its own rank).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from dsdmerge.demo import TinyModel, make_optimizer
from dsdmerge.integrations import load_checkpoint, resume_model, resume_optimizer

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
RANK = dist.get_rank() if dist.is_initialized() else 0
WORLD = dist.get_world_size() if dist.is_initialized() else 1


def train(model, optim, schedule, steps: int) -> None:
    for _ in range(steps):
        model(torch.randint(0, 16, (4, 6))).logsumexp(-1).mean().backward()
        optim.step()
        optim.zero_grad()
        schedule.step()


def save(ckpt: Path, model, optim, schedule) -> None:
    suffix = f"world_size_{WORLD}_rank_{RANK}.pt"
    torch.save(model.state_dict(), ckpt / f"model_{suffix}")
    torch.save(get_optimizer_state_dict(model, optim, options=FLAT), ckpt / f"optim_{suffix}")
    torch.save({"lr_scheduler": schedule.state_dict()}, ckpt / f"extra_state_{suffix}")


def resume(ckpt: Path, model, optim, schedule):
    suffix = f"world_size_{WORLD}_rank_{RANK}.pt"
    resume_model(model, load_checkpoint(ckpt / f"model_{suffix}"), policy="strict")
    diff = resume_optimizer(
        model,
        optim,
        load_checkpoint(ckpt / f"optim_{suffix}"),
        options=FLAT,
        policy="strict",
        allow_missing=["state.indexer.*"],  # the indexer never gets gradients: no state
    )
    schedule.load_state_dict(load_checkpoint(ckpt / f"extra_state_{suffix}")["lr_scheduler"])
    return diff


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp)
        torch.manual_seed(0)
        model = TinyModel()
        optim, schedule = make_optimizer(model)
        train(model, optim, schedule, steps=5)
        save(ckpt, model, optim, schedule)
        saved_lr = optim.param_groups[0]["lr"]

        model = TinyModel()  # a fresh process would start here
        optim, schedule = make_optimizer(model)
        diff = resume(ckpt, model, optim, schedule)
    assert [g["lr"] for g in optim.param_groups] == [saved_lr, saved_lr]
    print(diff)
    train(model, optim, schedule, steps=2)
    print(f"resumed rank {RANK}/{WORLD}: lr {saved_lr:.2e} kept, 2 more steps trained")


if __name__ == "__main__":
    main()
