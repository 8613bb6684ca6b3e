"""Trainers' protocols, reproduced where the framework is not a package the tests install:
an optimizer container, a load hook.

(torchtitan's real ``OptimizersContainer`` and ``CheckpointManager`` are tested in
tests/test_frameworks_torchtitan.py.)

* VeOmni's ``MultiOptimizer``: an ``Optimizer`` subclass that never calls
  ``Optimizer.__init__`` (no param_groups, no state) and holds ``.optimizers_dict``.
* verl's ``_backfill_optimizer_state(self, state_dict) -> dict`` between ``torch.load``
  and ``optimizer.load_state_dict``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import Snapshot
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

import dsdmerge as dm
from dsdmerge.integrations import backfill_optimizer_state, resume_optimizer

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class Part(nn.Module):
    """A model part whose indexer never gets a gradient (its forward only ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.indexer = nn.Linear(4, 4)
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top = self.indexer(x).detach().argmax(-1, keepdim=True)
        return self.proj(x) * (1 + top)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Part()
        self.b = Part()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class VeOmniMulti(torch.optim.Optimizer, Stateful):
    """VeOmni's MultiOptimizer protocol: never calls Optimizer.__init__."""

    def __init__(self, model: nn.Module, optimizers: dict) -> None:
        self.model = model
        self.optimizers_dict = optimizers
        self.key_names = list(optimizers)

    def step(self):  # type: ignore[override]
        for o in self.optimizers_dict.values():
            o.step()

    def zero_grad(self):  # type: ignore[override]
        for o in self.optimizers_dict.values():
            o.zero_grad()

    def state_dict(self):  # type: ignore[override]
        merged = {}
        for name in self.key_names:
            merged.update(
                get_optimizer_state_dict(self.model, self.optimizers_dict[name], options=FLAT)
            )
        return merged

    def load_state_dict(self, state_dict):  # type: ignore[override]
        for name in self.key_names:
            set_optimizer_state_dict(
                self.model, self.optimizers_dict[name], optim_state_dict=state_dict, options=FLAT
            )


def train(model, optim, steps=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(8, 4, generator=g)).square().mean().backward()
        optim.step()
        optim.zero_grad()


def veomni(model):
    a = torch.optim.AdamW(model.a.parameters(), lr=0.01)
    b = torch.optim.AdamW(model.b.parameters(), lr=0.02)
    return VeOmniMulti(model, {"a": a, "b": b})


def leaves_of(container):
    return (
        container.optimizers
        if hasattr(container, "optimizers")
        else list(container.optimizers_dict.values())
    )


CONTAINERS = {"veomni": veomni}


@pytest.fixture(params=sorted(CONTAINERS))
def trained(request):
    torch.manual_seed(0)
    model = Model()
    optim = CONTAINERS[request.param](model)
    train(model, optim)
    model_sd = {k: v.clone() for k, v in model.state_dict().items()}
    optim_sd = copy.deepcopy(optim.state_dict())  # flattened DSD, as both save it (a copy)
    # the uninterrupted run, one more step
    train(model, optim, steps=1, seed=1)
    final = {k: v.clone() for k, v in model.state_dict().items()}
    return request.param, model_sd, optim_sd, final


def fresh(kind, model_sd):
    torch.manual_seed(1)  # other initial weights: the checkpoint must win
    model = Model()
    model.load_state_dict(model_sd)
    return model, CONTAINERS[kind](model)


def test_resume_optimizer_takes_a_container_and_resumes_bit_for_bit(trained):
    kind, model_sd, optim_sd, final = trained
    model, optim = fresh(kind, model_sd)
    diff = resume_optimizer(
        model, optim, optim_sd, options=FLAT, policy="strict", allow_missing="state.*indexer.*"
    )
    assert set(diff.missing) == {
        f"state.{p}.indexer.{w}.{s}"
        for p in "ab"
        for w in ("weight", "bias")
        for s in ("step", "exp_avg", "exp_avg_sq")
    }
    for leaf in leaves_of(optim):  # the indexers start fresh: no state at all
        assert not any(p in leaf.state for p in (model.a.indexer.weight, model.b.indexer.weight))
    train(model, optim, steps=1, seed=1)
    assert all(torch.equal(v, final[k]) for k, v in model.state_dict().items())


def test_a_refused_container_resume_changes_nothing(trained):
    kind, model_sd, optim_sd, _ = trained
    model, optim = fresh(kind, model_sd)
    snap = Snapshot(
        {"model": dict(model.named_parameters()), "optim": [o.state for o in leaves_of(optim)]}
    )
    lrs = [[g["lr"] for g in o.param_groups] for o in leaves_of(optim)]
    with pytest.raises(dm.MergeError, match="indexer"):
        resume_optimizer(model, optim, optim_sd, policy="strict")  # the indexer is not allowed
    assert snap.unchanged()
    assert all(not o.state for o in leaves_of(optim))  # no zero-gradient step was taken
    assert [[g["lr"] for g in o.param_groups] for o in leaves_of(optim)] == lrs


def test_an_unknown_container_is_refused_before_anything_changes():
    class Opaque(torch.optim.Optimizer):
        def __init__(self, inner):
            self.inner = inner  # not a name dsdmerge knows

    model = Model()
    optim = Opaque([torch.optim.SGD(model.parameters())])
    with pytest.raises(dm.StateDictTypeError, match="pass them instead"):
        resume_optimizer(model, optim, {"state": {}, "param_groups": []})


# -- verl's hook ------------------------------------------------------------------------


class Manager:
    """verl's FSDPCheckpointManager load path, reduced to its protocol."""

    def __init__(self, model, optimizer, allow=("state.*indexer*",)) -> None:
        self.model = model
        self.optimizer = optimizer
        self.allow = list(allow)

    def _backfill_optimizer_state(self, state_dict: dict) -> dict:
        container = hasattr(self.optimizer, "optimizers_dict")
        return backfill_optimizer_state(
            self.optimizer,
            state_dict,
            model=self.model,
            policy="strict",
            allow_missing=self.allow,
            fresh="reference" if container else "as_fresh",
        )

    def load(self, path) -> None:
        optimizer_state_dict = torch.load(path, weights_only=True)
        optimizer_state_dict = self._backfill_optimizer_state(optimizer_state_dict)
        self.optimizer.load_state_dict(optimizer_state_dict)


@pytest.mark.parametrize("layout", ["int", "flat"])
def test_verl_hook_with_a_plain_optimizer(tmp_path, layout):
    torch.manual_seed(0)
    model = Part()
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    train(model, optim)
    saved = (
        optim.state_dict()
        if layout == "int"
        else get_optimizer_state_dict(model, optim, options=FLAT)
    )
    torch.save(saved, tmp_path / "optim.pt")
    model_sd = {k: v.clone() for k, v in model.state_dict().items()}
    train(model, optim, steps=1, seed=1)
    final = {k: v.clone() for k, v in model.state_dict().items()}

    model2 = Part()
    model2.load_state_dict(model_sd)
    optim2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    # int ids are positions: the indexer's weight and bias are params 0 and 1
    allow = ["state.0.*", "state.1.*"] if layout == "int" else ["state.*indexer*"]
    Manager(model2, optim2, allow).load(tmp_path / "optim.pt")
    assert optim2.param_groups[0]["lr"] == 0.01
    assert model2.indexer.weight not in optim2.state  # fresh
    train(model2, optim2, steps=1, seed=1)
    assert all(torch.equal(v, final[k]) for k, v in model2.state_dict().items())


def test_verl_hook_with_veomni_multioptimizer(tmp_path):
    torch.manual_seed(0)
    model = Model()
    optim = veomni(model)
    train(model, optim)
    torch.save(optim.state_dict(), tmp_path / "optim.pt")
    model2 = Model()
    model2.load_state_dict(model.state_dict())
    optim2 = veomni(model2)
    Manager(model2, optim2).load(tmp_path / "optim.pt")  # torch alone crashes here
    for name, leaf in optim2.optimizers_dict.items():
        assert leaf.param_groups[0]["lr"] == optim.optimizers_dict[name].param_groups[0]["lr"]
        part = getattr(model2, name)
        assert torch.equal(
            leaf.state[part.proj.weight]["exp_avg"],
            optim.optimizers_dict[name].state[getattr(model, name).proj.weight]["exp_avg"],
        )
    # the default (as fresh) cannot go through DSD's flattened load: said before anything
    with pytest.raises(dm.InvalidPolicyError, match="fresh='reference'"):
        backfill_optimizer_state(optim2, torch.load(tmp_path / "optim.pt"), model=model2)


# -- untouched on error, every path ------------------------------------------------------


def _snapshot(model, optims):
    return Snapshot(
        {
            "params": dict(model.named_parameters()),
            "state": [dict(o.state) for o in optims],
            "groups": [o.param_groups for o in optims],
        }
    )


def test_a_refused_hook_changes_nothing():
    torch.manual_seed(0)
    model = Part()
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    train(model, optim)
    saved = copy.deepcopy(get_optimizer_state_dict(model, optim, options=FLAT))
    model2 = Part()
    optim2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    snap = _snapshot(model2, [optim2])
    with pytest.raises(dm.MergeError, match="indexer"):
        backfill_optimizer_state(optim2, saved, model=model2, policy="strict")
    assert snap.unchanged()
    assert not optim2.state


class FailsWithoutGraph(torch.optim.SGD):
    """An optimizer whose step needs more than gradients (SophiaH's Hessian-vector product)."""

    def step(self, closure=None):  # type: ignore[override]
        raise RuntimeError("element 0 of tensors does not require grad")


def test_fresh_reference_whose_zero_gradient_step_fails_changes_nothing():
    model = Part()
    optim = FailsWithoutGraph(model.parameters(), lr=0.1, momentum=0.9)
    loaded = {"state": {}, "param_groups": [{**optim.state_dict()["param_groups"][0]}]}
    snap = _snapshot(model, [optim])
    with pytest.raises(dm.DSDMergeError, match="fresh='as_fresh'"):
        resume_optimizer(model, optim, loaded, fresh="reference")
    assert snap.unchanged()
    assert all(p.grad is None for p in model.parameters())
    assert optim.param_groups[0]["lr"] == 0.1
    resume_optimizer(model, optim, loaded)  # the default takes no step at all


def test_a_dcp_round_trip_of_int_ids_resumes_instead_of_resetting():
    torch.manual_seed(0)
    model = Part()
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    train(model, optim)
    saved = copy.deepcopy(optim.state_dict())
    # what a DCP round trip of optimizer.state_dict() gives back: state keys as strings
    loaded = {**saved, "state": {str(k): v for k, v in saved["state"].items()}}
    optim2 = torch.optim.AdamW(model.parameters(), lr=0.5)
    diff = resume_optimizer(model, optim2, loaded)
    assert not diff.unexpected
    state = optim2.state_dict()["state"]
    assert sorted(state) == sorted(saved["state"])
    assert all(torch.equal(state[k]["exp_avg"], v["exp_avg"]) for k, v in saved["state"].items())
