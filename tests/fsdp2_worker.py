"""The per-rank body of the 2-process FSDP2 test (spawned by tests/test_fsdp2.py).

Phase ``save``: train a FSDP2-sharded TinyModel (its indexer never gets a
gradient), then save (a) each rank's model and flattened optimizer state with
``torch.save`` (one file per rank, as verl does) and (b) the same through DCP.
Phase ``resume``: in fresh processes, resume both ways with dsdmerge and check
every DTensor on every rank against what was saved.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import dsdmerge as dm
from dsdmerge.demo import TinyModel, make_optimizer
from dsdmerge.integrations import (
    load_checkpoint,
    load_dcp,
    read_metadata,
    resume_model,
    resume_optimizer,
)

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
WORLD = 2


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)  # same initial weights on every rank
    model = TinyModel()
    mesh = init_device_mesh("cpu", (WORLD,))
    for module in (model.embed, model.indexer, model.proj, model.head):
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim, schedule = make_optimizer(model)
    return model, optim, schedule


def train(model: torch.nn.Module, optim: torch.optim.Optimizer, schedule: Any, steps: int) -> None:
    gen = torch.Generator().manual_seed(1234 + dist.get_rank())  # different data per rank
    for _ in range(steps):
        tokens = torch.randint(0, 16, (4, 6), generator=gen)
        model(tokens).logsumexp(-1).mean().backward()
        optim.step()
        optim.zero_grad()
        if schedule is not None:
            schedule.step()


def local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


def same_local(saved: dict[str, Any], now: dict[str, Any], keys: list[str]) -> None:
    for key in keys:
        a, b = saved[key], now[key]
        if isinstance(a, torch.Tensor):
            assert type(a) is type(b), f"{key}: {type(a).__name__} vs {type(b).__name__}"
            assert torch.equal(local(a), local(b)), f"rank {dist.get_rank()}: {key} differs"
            if hasattr(a, "placements"):
                assert a.placements == b.placements, key
        else:
            assert a == b, f"{key}: {a!r} vs {b!r}"


def phase_save(out: Path) -> dict[str, Any]:
    rank = dist.get_rank()
    model, optim, schedule = build()
    train(model, optim, schedule, steps=3)
    model_sd = get_model_state_dict(model)
    optim_sd = get_optimizer_state_dict(model, optim, options=FLAT)
    assert not any(k.startswith("state.indexer.") for k in optim_sd), "indexer got a gradient"
    torch.save(model_sd, out / f"model_world_size_{WORLD}_rank_{rank}.pt")
    torch.save(optim_sd, out / f"optim_world_size_{WORLD}_rank_{rank}.pt")
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(out / "dcp"))
    return {"keys": len(optim_sd), "lr": optim.param_groups[0]["lr"]}


def phase_resume(out: Path) -> dict[str, Any]:
    rank = dist.get_rank()
    saved_model = load_checkpoint(out / f"model_world_size_{WORLD}_rank_{rank}.pt")
    saved_optim = load_checkpoint(out / f"optim_world_size_{WORLD}_rank_{rank}.pt")
    state_keys = [k for k in saved_optim if k.startswith("state.")]
    lr = saved_optim["param_groups.proj.weight.lr"]
    report: dict[str, Any] = {}

    # torch alone: the flattened-DSD indexer crash, on FSDP2 too
    model, optim, _ = build()
    try:
        set_optimizer_state_dict(model, optim, dict(saved_optim), options=FLAT)
        report["torch_alone"] = "loaded"
    except TypeError as err:
        report["torch_alone"] = f"TypeError: {err}"

    # a look before loading: the metadata view of this rank's file (DTensors, global shapes)
    model, optim, schedule = build()
    view = read_metadata(out / f"optim_world_size_{WORLD}_rank_{rank}.pt")
    assert list(view) == list(saved_optim)
    look = dm.diff(view, get_optimizer_state_dict(model, optim, options=FLAT))
    assert {k.split(".")[1] for k in look.missing} == {"indexer"}
    assert not look.unexpected
    assert not look.mismatched

    def resume_and_check(
        model: Any, optim: Any, schedule: Any, model_sd: Any, optim_sd: Any
    ) -> Any:
        """Resume both strictly (the indexer may be missing), compare, train a step; the diff."""
        resume_model(model, model_sd, policy="strict")
        diff = resume_optimizer(
            model, optim, optim_sd, options=FLAT, policy="strict", allow_missing="state.indexer.*"
        )
        same_local(saved_model, get_model_state_dict(model), list(saved_model))
        same_local(saved_optim, get_optimizer_state_dict(model, optim, options=FLAT), state_keys)
        assert [g["lr"] for g in optim.param_groups] == [lr, lr]
        train(model, optim, schedule, steps=1)
        return diff

    # verl style: this rank's own files
    diff = resume_and_check(
        model,
        optim,
        schedule,
        load_checkpoint(out / f"model_world_size_{WORLD}_rank_{rank}.pt"),
        load_checkpoint(out / f"optim_world_size_{WORLD}_rank_{rank}.pt"),
    )
    report["verl_missing"] = len(diff.missing)

    # torchtitan style: DCP, checked against the policy first, loaded in place
    model, optim, schedule = build()
    target = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optim, options=FLAT),
    }
    loaded, diff = load_dcp(
        out / "dcp", target, policy="strict", allow_missing="optim.state.indexer.*"
    )
    resume_and_check(model, optim, schedule, loaded["model"], loaded["optim"])
    report["dcp_missing"] = len(diff.missing)
    return report


def run(rank: int, port: int, phase: str, out: str) -> None:
    """Entry point for ``torch.multiprocessing.start_processes``: one rank of one phase."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # two ranks on a shared 2-core machine
    start = time.monotonic()
    result: dict[str, Any]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=40),
    )
    try:
        body = phase_save if phase == "save" else phase_resume
        ready = time.monotonic()
        result = {"ok": True, **body(Path(out))}
        result["seconds"] = {"init": ready - start, "body": time.monotonic() - ready}
        result["started_at"] = time.time()
        dist.barrier()  # neither rank tears down while the other may still talk to it
    except BaseException:
        result = {"ok": False, "error": traceback.format_exc()}
        raise
    finally:
        Path(out, f"{phase}_rank_{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()
    # The rank's work is done and reported. Leave without interpreter finalization: FSDP2's
    # device mesh keeps the gloo group alive past destroy_process_group, and destroying its
    # C++ worker threads during finalization can abort (SIGABRT, "terminate called without an
    # active exception"; seen once in ~10 CI runs, pytorch/pytorch#179291 describes the race).
    # That is torch teardown, not the behaviour under test, so it must not decide the result.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
