"""Third-party optimizer state through dsdmerge, exactly: heavyball, PSGD Kron.

What the real packages keep that torch's own optimizers do not: heavyball's own top-level
key (read back by a load pre-hook), its per-parameter state nested under int view indices
(``{0: {...}}``), an entry without values (``{0: {}}``) for a parameter that never got a
gradient, sets; Kron's random draws in its first step. Each test compares with the
uninterrupted run of the resume story, bit for bit.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import story
import torch
import torch.distributed.checkpoint as dcp
from story import N_STEPS
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

import dsdmerge as dm
from dsdmerge.integrations import load_checkpoint, load_dcp, resume_optimizer


@pytest.fixture(scope="module")
def stories(tmp_path_factory):
    return story.Stories(tmp_path_factory.mktemp("third"))


def names_of(run: story.Run) -> list[str]:
    by_id = {id(p): n for n, p in run.model.named_parameters()}
    return [by_id[id(p)] for g in run.optim.param_groups for p in g["params"]]


def resumed(spec, st, optim_sd, how, **kwargs):
    loaded = story.load(st.files["int"])
    run = story.build(spec)
    run.model.load_state_dict(loaded["model"])
    how(run, optim_sd, **kwargs)
    run.sched.load_state_dict(loaded["sched"])
    story.after_save(run)
    story.step(run, N_STEPS)
    return run


def via_resume(run, optim_sd, **kwargs):
    resume_optimizer(run.model, run.optim, optim_sd, **kwargs)


@pytest.mark.parametrize("name", ["SFAdamW", "AdamW", "SOAP"])
def test_heavyball_dm_merge_as_fresh(name, stories, monkeypatch):
    """int ids: ``dm.merge(ckpt, optimizer.state_dict(), fresh="as_fresh")``, then torch's
    loader, resumes exactly; the never-gradient indexer's ``{0: {}}`` stays as it is. (Not
    over DSD's ``get_optimizer_state_dict``: its zero-gradient step at lr 0 turns every
    parameter of a schedule-free heavyball optimizer into NaN, before anything is merged;
    see docs/resume.md.)"""
    spec = story.BY_ID[f"heavyball.{name}"]
    story.require(spec, monkeypatch)
    st = stories.get(spec)

    def merge(run, optim_sd):
        if not spec.train_eval:  # DSD's reference: its zero-gradient step, on the live one
            get_optimizer_state_dict(run.model, run.optim)
        run.optim.load_state_dict(dm.merge(optim_sd, run.optim.state_dict(), fresh="as_fresh"))

    run = resumed(spec, st, story.load(st.files["int"])["optim"], merge)
    diffs = story.run_differences(st.final, run)
    assert not diffs, diffs[:5]


def test_dm_merge_as_fresh_keeps_an_entry_without_values_as_it_is():
    """schedulefree's ``train()`` makes ``{}`` for every parameter, heavyball ``{0: {}}`` for
    one that never got a gradient: no state, so ``fresh="as_fresh"`` backfills nothing into
    it (it gave the parameter DSD's zero-gradient state)."""
    w = torch.zeros(2)
    fresh = {"step": torch.tensor(1.0), "exp_avg": w}
    ref = {
        "state": {"a": {0: dict(fresh)}, "b": {0: dict(fresh)}},
        "param_groups": [{"lr": 0.1, "params": ["a", "b"]}],
    }
    ckpt = {
        "state": {"a": {0: {"step": torch.tensor(5.0), "exp_avg": w + 1}}, "b": {0: {}}},
        "param_groups": [{"lr": 0.1, "params": ["a", "b"]}],
    }
    merged = dm.merge(ckpt, ref, fresh="as_fresh")
    assert merged["state"]["b"] == {0: {}}
    assert merged["state"]["a"][0]["step"] is ckpt["state"]["a"][0]["step"]


@pytest.mark.parametrize("name", ["SFAdamW", "AdamW", "SOAP"])
def test_heavyball_nested_with_its_own_key_resumes_exactly(name, stories, monkeypatch):
    """A nested (fqn-keyed) checkpoint that keeps heavyball's own top-level key (``rekey``
    of the int file: it kept nothing but state and param_groups before) resumes exactly; the
    SOAP preconditioner schedule lives in that key (``inner_group``)."""
    spec = story.BY_ID[f"heavyball.{name}"]
    story.require(spec, monkeypatch)
    st = stories.get(spec)
    run0 = story.build(spec)
    fqn = dm.rekey(story.load(st.files["int"])["optim"], names_of(run0))
    assert "heavyball" in fqn
    run = resumed(spec, st, fqn, via_resume, policy="strict", allow_missing="state.indexer.*")
    diffs = story.run_differences(st.final, run)
    assert not diffs, diffs[:5]


@pytest.mark.parametrize("name", ["SFAdamW", "AdamW", "SOAP"])
@pytest.mark.parametrize("reader", ["load_checkpoint", "load_dcp"])
def test_heavyball_through_dcp_resumes_exactly(name, reader, stories, monkeypatch, tmp_path):
    """``optimizer.state_dict()`` through ``dcp.save``: DCP spells every int key as a string,
    the view indices inside each parameter's state too (``{'0': {...}}``), and places its
    sets beside the state dict's own entries. Read back either way, it resumes exactly."""
    spec = story.BY_ID[f"heavyball.{name}"]
    story.require(spec, monkeypatch)
    st = stories.get(spec)
    saved = story.load(st.files["int"])["optim"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"optim": saved}, checkpoint_id=str(tmp_path / "ckpt"))

    def how(run, _):
        if reader == "load_checkpoint":
            optim_sd = load_checkpoint(tmp_path / "ckpt")["optim"]
        else:
            optim_sd = load_dcp(tmp_path / "ckpt", {"optim": copy.deepcopy(saved)})[0]["optim"]
        resume_optimizer(run.model, run.optim, optim_sd)

    run = resumed(spec, st, None, how)
    diffs = story.run_differences(st.final, run)
    assert not diffs, diffs[:5]


def test_a_resume_draws_nothing_from_the_callers_random_numbers(stories, monkeypatch):
    """The optimizer's own fresh state comes from a step on a throwaway twin; PSGD Kron draws
    random numbers in it. The caller's generators are as they were: the run after the resume
    draws exactly what it would have."""
    spec = story.BY_ID["pytorch_optimizer.Kron"]
    story.require(spec, monkeypatch)
    st = stories.get(spec)
    loaded = story.load(st.files["nested"])
    run = story.build(spec)
    run.model.load_state_dict(loaded["model"])
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    resume_optimizer(run.model, run.optim, loaded["optim"])
    assert torch.equal(torch.get_rng_state(), before)
