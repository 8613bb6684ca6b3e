"""DeepSpeed 0.19 on CPU (gloo, one rank): the client optimizer of a ZeRO-0 engine resumed
through the hooks (docs/trainers/deepspeed.md), ZeRO-1 refused.

``engine.save_checkpoint`` writes ``mp_rank_00_model_states.pt`` (``module``: the model's
state dict; ``optimizer``: the client optimizer's ``state_dict()``, int ids);
``engine.load_checkpoint`` loads the module strictly and the optimizer by position.
ZeRO-1/2 keep one flat fp32 partition per param group instead
(``zero_pp_rank_*_optim_states.pt``): no per-parameter state to map.

The runs happen in tests/deepspeed_worker.py, a process of its own (DeepSpeed initialises
torch.distributed); here they are compared with the pure-torch oracle.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

import torch
from frameworks import (
    NAMES,
    SCENARIOS,
    Net,
    adamw,
    assert_same_model,
    assert_same_optimizer,
    equal,
    free_port,
    oracle,
)

import dsdmerge as dm
from dsdmerge.integrations import install_load_hook, resume_optimizer

WORKER = Path(__file__).resolve().parent / "deepspeed_worker.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("deepspeed")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(out), str(free_port())],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, json.loads((out / "outcomes.json").read_text())


def load(path):
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_zero0_client_optimizer_through_the_hooks(scenario, runs):
    out, _ = runs
    old = load(out / f"{scenario}-old.pt")
    want = oracle(scenario, old, zero_grads=True)  # DeepSpeed gives every parameter a gradient
    for (want_model, want_optim), step in zip(want, (4, 6), strict=True):
        got_model, got_optim = load(out / f"{scenario}-{step}.pt")
        assert_same_model(got_model, want_model)
        assert_same_optimizer(got_optim, want_optim)


ALONE = {
    "new_head": "crash: RuntimeError",  # strict module load: missing keys
    "unfreeze": "crash: ValueError",  # group sizes
    "swap_frozen": "loaded",  # silently: a's moments are b's
    "grow_vocab": "crash: RuntimeError",  # size mismatch
    "rename": "crash: RuntimeError",  # missing and unexpected keys
    "reorder": "loaded",  # silently: a's and b's moments swapped
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_zero0_alone(scenario, runs):
    out, outcomes = runs
    assert outcomes[scenario].startswith(ALONE[scenario]), outcomes[scenario]
    if ALONE[scenario] != "loaded":
        return
    _, old_optim = load(out / f"{scenario}-old.pt")
    got = load(out / f"{scenario}-alone.pt")
    old_names, names = old_optim["param_groups"][0][NAMES], got["param_groups"][0][NAMES]
    old_b = old_optim["state"][old_names.index("b.weight")]
    assert equal(got["state"][names.index("a.weight")], old_b)  # b's state, on a


def test_zero1_flat_partitions_are_refused_saying_what_to_do(runs):
    out, outcomes = runs
    assert outcomes["zero1"].startswith("refused: LayoutError"), outcomes["zero1"]
    assert "universal" in outcomes["zero1"]
    # the file as DeepSpeed wrote it, handed to dsdmerge directly: never accepted
    (shard,) = (out / "zero1" / "2").glob("zero_pp_rank_*_optim_states.pt")
    zero = torch.load(shard, weights_only=False)["optimizer_state_dict"]
    assert zero["zero_stage"] == 1
    model = Net()
    optimizer = adamw(model)
    hook = install_load_hook(optimizer, model)
    for passed in (zero, {"optimizer_state_dict": zero}):
        with pytest.raises(dm.DSDMergeError, match="universal"):
            optimizer.load_state_dict(passed)
    hook.remove()
    # its base optimizer state: one flat partition per group; refused, never loaded
    with pytest.raises(dm.DSDMergeError):
        resume_optimizer(model, optimizer, zero["base_optimizer_state"])
    assert not optimizer.state
