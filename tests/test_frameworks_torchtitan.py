"""torchtitan 0.3 as it is now: its ``CheckpointManager`` and ``OptimizersContainer``, real
(``pip install --no-deps torchtitan`` plus tyro and spmd_types), resumed on a changed model
through the recipe of docs/trainers/torchtitan.md.

The container no longer goes through DSD: ``state_dict()`` and ``load_state_dict()`` first
run its own ``init_optim_state`` (a zero-gradient, zero-lr step when the optimizer has no
state), its flat keys are ``state.<fqn>.<name>`` / ``param_groups.<fqn>.<hyperparameter>``,
and its unflatten reads each group's hyperparameters from its first fqn. The manager hands
``dcp.load`` the model's keys (flattened to the top level) and ``Stateful`` wrappers.
"""

from __future__ import annotations

import copy
import warnings
from typing import ClassVar

import pytest

pytest.importorskip("torchtitan.components.checkpoint")

import torch
import torch.distributed.checkpoint as dcp
from conftest import Snapshot
from frameworks import (
    NAMES,
    Net,
    assert_same_model,
    assert_same_optimizer,
    batch,
    named_state,
    renamed,
    resume_twice,
    torch_steps,
    trained,
)
from torchtitan.components.checkpoint import MODEL, OPTIMIZER, CheckpointManager
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

import dsdmerge as dm
from dsdmerge.integrations import load_dcp, resume_optimizer

LR, WD = 0.05, 0.1


def container(model: torch.nn.Module) -> OptimizersContainer:
    cfg = OptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(
                pattern=".*",
                optimizer_name="AdamW",
                optimizer_kwargs={"lr": LR, "weight_decay": WD},
            )
        ],
        implementation="for-loop",
    )
    return OptimizersContainer(cfg, model_parts=[model])


class ResumingCheckpointManager(CheckpointManager):
    """The recipe: torchtitan's manager, with ``dcp_load`` going through dsdmerge."""

    dsdmerge_options: ClassVar[dict] = {}

    def dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized):
        if from_hf:
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        optimizers = state_dict.get(OPTIMIZER)
        states = dict(state_dict)
        if optimizers is not None:  # its flat form, as saved: checked and read as data
            states[OPTIMIZER] = optimizers.state_dict()
        loaded, self.dsdmerge_diff = load_dcp(checkpoint_id, states, **self.dsdmerge_options)
        self.states[MODEL].load_state_dict(loaded)  # the model's keys, read in place already
        if optimizers is not None:  # merged by fqn, and loaded into each optimizer
            # renamed and resized by load_dcp already: what it read is keyed as the model is
            done = ("allow_missing", "rename", "convert", "on_shape_mismatch")
            resume_optimizer(
                self.states[MODEL].model,
                optimizers,
                loaded[OPTIMIZER],
                **{k: v for k, v in self.dsdmerge_options.items() if k not in done},
                allow_missing=[
                    k.removeprefix(f"{OPTIMIZER}.")
                    for k in _list(self.dsdmerge_options.get("allow_missing", ()))
                ],
            )


def _list(globs):
    return [globs] if isinstance(globs, str) else list(globs)


class Run:
    """A model, torchtitan's optimizers, scheduler and checkpoint manager, on CPU."""

    def __init__(self, folder, *, recipe=None, **net) -> None:
        self.model = Net(**net)
        self.optimizers = container(self.model)
        self.schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
            optimizers=self.optimizers, training_steps=100
        )
        cls = CheckpointManager if recipe is None else ResumingCheckpointManager
        config = CheckpointManager.Config(enable=True, folder="ckpt", interval=1, keep_latest_k=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.manager = cls(
                config,
                dataloader=None,
                model_parts=[self.model],
                optimizers=self.optimizers,
                lr_schedulers=self.schedulers,
                states={},
                sd_adapter=None,
                base_folder=str(folder),
            )
        if recipe is not None:
            self.manager.dsdmerge_options = recipe

    def steps(self, start: int, n: int) -> None:
        for step in range(start, start + n):
            self.model(batch(step)).backward()
            self.optimizers.step()
            self.schedulers.step()
            self.optimizers.zero_grad()

    def save(self, step: int) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.manager.save(curr_step=step)

    def load(self, step: int) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.manager.load(step=step)

    def named(self):
        (leaf,) = self.optimizers.optimizers
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}, copy.deepcopy(
            leaf.state_dict()
        )


# name: (old model, new model, recipe)
SCENARIOS = {
    "new_head": ({}, {"head": True}, {"policy": "strict", "allow_missing": "*value.*"}),
    "unfreeze": ({"frozen": ("a",)}, {}, {"policy": "strict", "allow_missing": "*a.*"}),
    "swap_frozen": (
        {"frozen": ("a",)},
        {"frozen": ("b",)},
        {"policy": "strict", "allow_missing": "*a.*", "allow_unexpected": "*b.*"},
    ),
    "reorder": ({}, {"order": ("b", "a")}, {"policy": "strict"}),
    # the surgery load_dcp does while it reads (renamed keys read under their old names,
    # grown ones resized into the new tensors)
    "rename": ({}, {"mid": "mid"}, {"policy": "strict", "rename": {r"(?<![^.])b\.": "mid."}}),
    "grow_vocab": ({}, {"vocab": 24}, {"policy": "strict", "on_shape_mismatch": "resize"}),
}


def oracle(old, new_opts, lr_steps):
    """Pure torch: the old state transferred by name (the rename scenario's rule by hand;
    a grown tensor's leading rows, the rest as the new model and torchtitan's
    ``init_optim_state`` have it: zero moments); a parameter without checkpointed state
    starts fresh, as in a run that never saw the checkpoint (no state: its first step is
    torch's first step, not the ``step`` 1 and zero moments torchtitan's
    ``init_optim_state`` gives it before a load). Then the steps, at torchtitan's warmup
    lr."""
    old_model, old_optim = old
    new = renamed if new_opts.get("mid") == "mid" else str
    model = Net(**new_opts)
    with torch.no_grad():
        for k, v in old_model.items():
            model.state_dict()[new(k)][tuple(map(slice, v.shape))].copy_(v)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WD)
    names = {id(p): n for n, p in model.named_parameters()}
    (old_group,) = old_optim["param_groups"]
    by_name = {
        new(n): old_optim["state"][pid]
        for pid, n in zip(old_group["params"], old_group[NAMES], strict=True)
        if pid in old_optim["state"]
    }
    state = {}
    for i, p in enumerate(params):
        got = by_name.get(names[id(p)])
        if got is not None:
            zeros = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
            state[i] = {k: grown(v, zeros.get(k, v)) for k, v in got.items()}
    group = {k: v for k, v in old_group.items() if k != "params"}
    group[NAMES] = [names[id(p)] for p in params]
    optimizer.load_state_dict(
        {"state": state, "param_groups": [{**group, "params": list(range(len(params)))}]}
    )
    out = []
    for start in (2, 4):
        for step in range(start, start + 2):
            optimizer.param_groups[0]["lr"] = lr_steps[step]
            torch_steps(model, optimizer, step, 1)
            optimizer.param_groups[0]["lr"] = lr_steps[step + 1]  # the scheduler's step
        out.append(
            (
                {k: v.detach().clone() for k, v in model.state_dict().items()},
                named_state(model, optimizer),
            )
        )
    return out


def grown(old, like):
    """``old`` in a tensor like ``like``: its leading slice, ``like``'s values elsewhere."""
    if old.shape == like.shape:
        return old
    out = like.clone()
    out[tuple(map(slice, old.shape))] = old
    return out


@pytest.fixture(scope="module")
def lrs(tmp_path_factory):
    """The lr torchtitan's scheduler gives each step (warmup then decay)."""
    run = Run(tmp_path_factory.mktemp("lrs"))
    out = []
    for _ in range(8):
        out.append(run.optimizers.optimizers[0].param_groups[0]["lr"])
        run.schedulers.step()
    return out


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_checkpoint_manager_resumes_through_the_recipe(scenario, tmp_path, lrs):
    old_opts, new_opts, recipe = SCENARIOS[scenario]
    old = trained(Run(tmp_path / "old", **old_opts))
    want = oracle(old.named(), new_opts, lrs)

    def check(i, run, loaded):
        diff = run.manager.dsdmerge_diff
        if i == 1:  # its own save: every key by name, but a never-stepped head has no state
            assert not diff.unexpected
            assert {k.split(".")[2] for k in diff.missing} <= {"value"}
            return
        assert diff.unexpected == () or scenario == "swap_frozen"
        if scenario == "grow_vocab":  # the weight and both moments, read and resized
            assert {r.key for r in diff.resized} == {
                "embed.weight",
                *(f"{OPTIMIZER}.state.embed.weight.{m}" for m in ("exp_avg", "exp_avg_sq")),
            }

    never = {"allow_missing": "*value.*"} if scenario == "new_head" else {}
    resume_twice(
        lambda options: Run(tmp_path / "old", recipe=options, **new_opts),
        [recipe, {"policy": "strict", **never}],
        want,
        check=check,
    )


ALONE = {
    "new_head": "crash",
    "unfreeze": "crash",
    "swap_frozen": "crash",
    "reorder": "by name",
    "rename": "crash",
    "grow_vocab": "crash",
}
# what DCP raises (a CheckpointException, which is a BaseException)
CRASH = {"grow_vocab": "Size mismatch"}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_checkpoint_manager_alone(scenario, tmp_path):
    old_opts, new_opts, _ = SCENARIOS[scenario]
    old = trained(Run(tmp_path, **old_opts))
    new = Run(tmp_path, **new_opts)
    if ALONE[scenario] == "crash":
        # DCP's CheckpointException is a BaseException: "Missing key in checkpoint state_dict"
        with pytest.raises(BaseException, match=CRASH.get(scenario, "Missing key")):
            new.load(2)
        return
    new.load(2)  # fqn-keyed: another registration order is no change at all
    assert_same_optimizer(new.named()[1], old.named()[1])


# -- the optimizer container through resume_optimizer ------------------------------------


def test_resume_optimizer_takes_the_container_and_resumes_bit_for_bit():
    torch.manual_seed(0)
    model = Net(head=True)
    optimizers = container(model)
    torch_steps(model, optimizers, 0, 2)
    saved = copy.deepcopy(optimizers.state_dict())  # its flat form, no state for the head
    model_sd = {k: v.clone() for k, v in model.state_dict().items()}
    torch_steps(model, optimizers, 2, 1)
    final = {k: v.clone() for k, v in model.state_dict().items()}

    model2 = Net(head=True, seed=1)
    model2.load_state_dict(model_sd)
    optimizers2 = container(model2)
    diff = resume_optimizer(
        model2, optimizers2, saved, policy="strict", allow_missing="state.value.*"
    )
    assert set(diff.missing) == {
        f"state.value.{w}.{s}"
        for w in ("weight", "bias")
        for s in ("step", "exp_avg", "exp_avg_sq")
    }
    (leaf,) = optimizers2.optimizers
    assert model2.value.weight not in leaf.state  # fresh: no init_optim_state step was taken
    torch_steps(model2, optimizers2, 2, 1)
    assert_same_model(model2.state_dict(), final)


def test_a_refused_container_resume_changes_nothing():
    model = Net(head=True)
    optimizers = container(model)
    torch_steps(model, optimizers, 0, 2)
    saved = copy.deepcopy(optimizers.state_dict())
    model2 = Net(head=True, seed=1)
    optimizers2 = container(model2)
    (leaf,) = optimizers2.optimizers
    snap = Snapshot({"model": dict(model2.named_parameters()), "state": leaf.state})
    with pytest.raises(dm.MergeError, match="value"):
        resume_optimizer(model2, optimizers2, saved, policy="strict")
    assert snap.unchanged()
    assert not leaf.state  # no zero-gradient step was taken
    assert leaf.param_groups[0]["lr"] == LR


def test_load_dcp_takes_the_managers_stateful_wrappers(tmp_path):
    """``CheckpointManager._states_to_load()`` as ``dcp.load`` gets it, through ``load_dcp``."""
    old = trained(Run(tmp_path))
    new = Run(tmp_path, head=True)
    states = new.manager._states_to_load(model_only=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(BaseException, match="Missing key"):
            dcp.load(states, checkpoint_id=str(tmp_path / "ckpt/step-2"))
        _, diff = load_dcp(
            tmp_path / "ckpt/step-2", states, policy="strict", allow_missing="*value.*"
        )
    assert diff.unexpected == ()
    assert {k.split(".")[0] for k in diff.missing} == {"value", OPTIMIZER}
    assert_same_model(
        {k: v for k, v in new.model.state_dict().items() if not k.startswith("value.")},
        old.model.state_dict(),
    )


def test_the_containers_own_load_through_backfill_when_the_first_parameter_is_new():
    """torchtitan's unflatten reads a group's hyperparameters from its first fqn: a
    KeyError when that parameter is new. ``backfill_optimizer_state`` gives it the group's
    checkpoint values, so the container's own ``load_state_dict`` takes it."""
    model = Net(frozen=("embed",))
    optimizers = container(model)
    torch_steps(model, optimizers, 0, 2)
    optimizers.optimizers[0].param_groups[0]["lr"] = 0.01  # as a schedule left it
    saved = copy.deepcopy(optimizers.state_dict())

    model2 = Net()  # the embedding trains now, and it is the first parameter
    optimizers2 = container(model2)
    with pytest.raises(KeyError, match=r"embed\.weight"):
        optimizers2.load_state_dict(saved)  # alone
    optimizers2 = container(Net())
    model2 = optimizers2.model_parts[0]
    merged = dm.integrations.backfill_optimizer_state(
        optimizers2,
        saved,
        model=model2,
        policy="strict",
        allow_missing="*embed.*",
        fresh="reference",
    )
    optimizers2.load_state_dict(merged)
    (leaf,) = optimizers2.optimizers
    assert leaf.param_groups[0]["lr"] == 0.01  # the checkpoint's, not the fresh 0.05
    (old_leaf,) = optimizers.optimizers
    for name in ("a.weight", "out.bias"):
        got = leaf.state[dict(model2.named_parameters())[name]]
        want = old_leaf.state[dict(model.named_parameters())[name]]
        assert torch.equal(got["exp_avg_sq"], want["exp_avg_sq"])
