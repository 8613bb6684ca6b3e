"""Acceptance: training goes on exactly after a layout conversion, for elementwise optimizers.

For each optimizer of ``convert_story.SPECS`` and each layout its state is saved in (DSD
flat, DSD nested by fqn, ``optimizer.state_dict()`` with int ids and ``param_names``):
train the split model ``N_STEPS`` steps, save model, optimizer and scheduler through
``torch.save`` and ``torch.load(weights_only=True)``, convert the whole checkpoint
(``dsdmerge.convert``: stacked experts, fused q/k/v and gate/up, a transposed head), load
it into a fresh fused model with torch's own loaders, and take one step on the split
model's gradients fused by hand. The fused model and every key of its optimizer's state
and param groups equal, bit for bit, the split model after that step fused by hand
(``torch.cat`` / ``torch.stack`` / ``.t()``, in the test). Then the fused run saves again
the same way, a fresh fused run resumes that (``resume_optimizer(policy="strict")``),
takes one more step, and equals the split run fused by hand again.
"""

from __future__ import annotations

import copy
import warnings

import convert_story as cs
import pytest
import story
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

import dsdmerge as dm
from dsdmerge.integrations import resume_optimizer

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
LAYOUTS = ("flat", "nested", "int")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def optim_state(run: cs.Run, layout: str):
    if layout == "flat":
        return get_optimizer_state_dict(run.model, run.optim, options=FLAT)
    if layout == "nested":
        return get_optimizer_state_dict(run.model, run.optim)
    return run.optim.state_dict()


def save_and_load(run: cs.Run, layout: str, path) -> dict:
    cs.before_save(run)
    torch.save(
        {
            "model": run.model.state_dict(),
            "optim": optim_state(run, layout),
            "sched": run.sched.state_dict(),
        },
        path,
    )
    cs.after_save(run)
    return torch.load(path, weights_only=True)


def compare(split: cs.Run, fused: cs.Run, what: str) -> None:
    """The fused run equals the split run fused by hand: params, every state key, groups."""
    split_params = {n: p.detach() for n, p in split.model.named_parameters()}
    want_params = cs.fuse_by_hand(split_params)
    got_params = {n: p.detach() for n, p in fused.model.named_parameters()}
    diffs = [f"param {d}" for d in story.tree_differences(want_params, got_params)]
    split_sd = copy.deepcopy(split.optim.state_dict())
    fused_sd = copy.deepcopy(fused.optim.state_dict())
    want_state = cs.fused_state_by_hand(cs.by_name(split_sd), split_params)
    diffs += [f"state {d}" for d in story.tree_differences(want_state, cs.by_name(fused_sd))]
    diffs += [
        f"param_groups {d}"
        for d in story.tree_differences(
            cs.expected_groups(split_sd, fused.model), cs.groups_without_params(fused_sd)
        )
    ]
    extra = {k: v for k, v in split_sd.items() if k not in ("state", "param_groups")}
    extra_fused = {k: v for k, v in fused_sd.items() if k not in ("state", "param_groups")}
    diffs += [f"top-level {d}" for d in story.tree_differences(extra, extra_fused)]
    diffs += [
        f"scheduler {d}"
        for d in story.tree_differences(split.sched.state_dict(), fused.sched.state_dict())
    ]
    assert not diffs, f"{what}: {len(diffs)} difference(s):\n  " + "\n  ".join(diffs[:20])


def load_converted(fused: cs.Run, ckpt: dict, layout: str, *, dsd: bool = False) -> None:
    """The converted checkpoint into a fresh fused run: the model strictly, the optimizer by
    ``Optimizer.load_state_dict`` (int ids) or under ``policy="strict"`` (DSD layouts: every
    key the fused optimizer holds, and no other; DSD's own flat loader drops the state of
    optimizers whose fresh state is empty, schedulefree's). ``dsd``: with DSD's
    ``set_optimizer_state_dict`` instead."""
    fused.model.load_state_dict(ckpt["model"])
    options = FLAT if layout == "flat" else None
    if layout == "int":
        fused.optim.load_state_dict(ckpt["optim"])
    elif dsd:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # DSD's single-process notes
            set_optimizer_state_dict(fused.model, fused.optim, ckpt["optim"], options=options)
    else:
        resume_optimizer(fused.model, fused.optim, ckpt["optim"], options=options, policy="strict")
    fused.sched.load_state_dict(ckpt["sched"])


def prepare(spec: cs.Spec, layout: str, monkeypatch) -> None:
    if spec.package is not None:
        pytest.importorskip(spec.package)
    if spec.before is not None:
        spec.before(monkeypatch)
    probe = cs.build(spec, fused=False)
    cs.step_split(probe, 0)
    try:
        saved = optim_state(probe, layout)
    except Exception as err:  # noqa: BLE001 - torch itself cannot save it: nothing to convert
        pytest.skip(
            f"{spec.id}: torch cannot save its {layout} layout: {type(err).__name__}: {err}"
        )
    if layout != "int" and set(probe.optim.state_dict()) - {"state", "param_groups"}:
        pytest.skip(f"{spec.id}: DSD's get_optimizer_state_dict drops its own top-level keys")
    del saved


def run_story(spec: cs.Spec, layout: str, tmp_path, *, dsd: bool = False) -> None:
    split = cs.build(spec, fused=False)
    for i in range(cs.N_STEPS):
        cs.step_split(split, i)
    loaded = save_and_load(split, layout, tmp_path / "split.pt")

    ckpt = dm.convert(loaded, cs.CONVERSIONS)

    fused = cs.build(spec, fused=True)
    load_converted(fused, ckpt, layout, dsd=dsd)
    cs.after_save(fused)
    grads = cs.step_split(split, cs.N_STEPS)
    cs.step_fused(fused, cs.N_STEPS, grads)
    compare(split, fused, f"{spec.id} {layout}: one step after the conversion")

    # the next save of the fused run, resumed again (strict), one more step; the split run
    # passes the same save point (schedulefree's eval()/train() round trip)
    again = save_and_load(fused, layout, tmp_path / "fused.pt")
    cs.before_save(split)
    cs.after_save(split)
    resumed = cs.build(spec, fused=True)
    resumed.model.load_state_dict(again["model"])
    resume_optimizer(
        resumed.model,
        resumed.optim,
        again["optim"],
        options=FLAT if layout == "flat" else None,
        policy="strict",
    )
    resumed.sched.load_state_dict(again["sched"])
    cs.after_save(resumed)
    grads = cs.step_split(split, cs.N_STEPS + 1)
    cs.step_fused(resumed, cs.N_STEPS + 1, grads)
    compare(split, resumed, f"{spec.id} {layout}: one step after resuming the fused run's save")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("spec", cs.SPECS, ids=str)
def test_training_continues_exactly_after_conversion(spec, layout, tmp_path, monkeypatch):
    prepare(spec, layout, monkeypatch)
    run_story(spec, layout, tmp_path)


@pytest.mark.parametrize("layout", ["flat", "nested"])
@pytest.mark.parametrize("name", ["Adam", "SGD-momentum"])
def test_dsd_loads_the_converted_optimizer_itself(name, layout, tmp_path, monkeypatch):
    """The converted DSD layouts load through torch's own set_optimizer_state_dict too."""
    spec = next(s for s in cs.SPECS if s.id == f"torch.{name}")
    prepare(spec, layout, monkeypatch)
    run_story(spec, layout, tmp_path, dsd=True)


def test_madgrad_continues_up_to_rounding(tmp_path, monkeypatch):
    """MADGRAD is elementwise but not position-invariant bit for bit on CPU: torch.pow's
    vectorized body and scalar tail round differently. The converted run stays within a
    few ulps of the split run fused by hand (and the conversion itself is exact)."""
    pytest.importorskip("pytorch_optimizer")
    spec = cs._third("pytorch_optimizer", "MADGRAD", foreach=False)
    split = cs.build(spec, fused=False)
    for i in range(cs.N_STEPS):
        cs.step_split(split, i)
    ckpt = dm.convert(save_and_load(split, "int", tmp_path / "split.pt"), cs.CONVERSIONS)
    fused = cs.build(spec, fused=True)
    load_converted(fused, ckpt, "int")
    # right after the conversion: exact
    want = cs.fuse_by_hand({n: p.detach() for n, p in split.model.named_parameters()})
    assert not story.tree_differences(want, dict(fused.model.named_parameters()))
    cs.step_fused(fused, cs.N_STEPS, cs.step_split(split, cs.N_STEPS))
    want = cs.fuse_by_hand({n: p.detach() for n, p in split.model.named_parameters()})
    worst = max(
        float(((p.detach() - want[n]).abs() / want[n].abs().clamp_min(1e-6)).max())
        for n, p in fused.model.named_parameters()
    )
    assert 0 < worst < 1e-5, worst  # not bit for bit, but only by rounding
