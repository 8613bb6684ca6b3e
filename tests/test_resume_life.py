"""The life of a run after a resume: the next save works, wrong shapes are refused, fresh is fresh.

Each test resumes the way a trainer does and then goes on: takes the next checkpoint save
(``get_optimizer_state_dict`` in both layouts, ``optimizer.state_dict()``), resumes it again,
steps, and compares with an uninterrupted run or a by-hand oracle written here, bit for bit.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
import warnings

import pytest
import story
import torch
from conftest import Snapshot
from story import FLAT, N_STEPS
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    _init_optim_state,
    get_optimizer_state_dict,
)

import dsdmerge as dm
from dsdmerge.integrations import backfill_optimizer_state, resume_optimizer


class Net(nn.Module):
    def __init__(self, *, vocab: int = 10, aux: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 4)
        self.body = nn.Linear(4, 4)
        if aux:
            self.aux = nn.Linear(4, 2)  # a head dropped later

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.body(self.embed(ids))
        return x + self.aux(x).sum(-1, keepdim=True) if hasattr(self, "aux") else x


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: int, *, start: int = 0) -> None:
    for i in range(start, start + steps):
        g = torch.Generator().manual_seed(i)
        model(torch.randint(0, 10, (6,), generator=g)).square().mean().backward()
        optim.step()
        optim.zero_grad(set_to_none=True)


def saved_run(*, named: bool = False):
    """Net trained 3 AdamW steps; ``named``: built from named_parameters() (param_names)."""
    torch.manual_seed(0)
    model = Net()
    optim = torch.optim.AdamW(model.named_parameters() if named else model.parameters(), lr=0.01)
    train(model, optim, 3)
    return model, optim


def no_junk_keys(optim: torch.optim.Optimizer) -> None:
    """``optimizer.state`` holds only the optimizer's own parameters (no names as keys)."""
    params = {id(p) for g in optim.param_groups for p in g["params"]}
    junk = [k for k in optim.state if id(k) not in params]
    assert not junk, f"optimizer.state holds keys that are no parameters of it: {junk}"


# --------------------------------------------------------------------------------------
# the next save after a parameter left the optimizer


@pytest.mark.parametrize("how", ["removed", "frozen"])
@pytest.mark.parametrize("layout", ["flat", "nested", "int-named"])
@pytest.mark.parametrize("policy", ["default", "strict"])
def test_state_of_a_parameter_no_longer_optimized_is_left_out(how, layout, policy):
    model, optim = saved_run(named=layout == "int-named")
    if layout == "int-named":  # torch >= 2.6 names them when built from named_parameters()
        sd = copy.deepcopy(optim.state_dict())
    else:
        sd = copy.deepcopy(
            get_optimizer_state_dict(model, optim, options=FLAT if layout == "flat" else None)
        )
    if how == "removed":
        new = Net(aux=False)
        new.load_state_dict(
            {k: v for k, v in model.state_dict().items() if not k.startswith("aux")}
        )
        opt2 = torch.optim.AdamW(new.parameters(), lr=0.5)
    else:
        new = Net()
        new.load_state_dict(model.state_dict())
        new.aux.requires_grad_(False)
        opt2 = torch.optim.AdamW([p for p in new.parameters() if p.requires_grad], lr=0.5)
    kwargs = {"options": FLAT} if layout == "flat" else {}
    if policy == "strict":
        kwargs.update(policy="strict", allow_unexpected="*aux*")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dm.DSDMergeWarning)
        diff = resume_optimizer(new, opt2, sd, **kwargs)
    assert any("aux" in k for k in diff.unexpected), diff
    no_junk_keys(opt2)
    # the next save, in every layout, works and holds exactly the surviving parameters
    for options in (None, FLAT):
        get_optimizer_state_dict(new, opt2, options=options)
    nxt = copy.deepcopy(opt2.state_dict())
    assert all(type(k) is int for k in nxt["state"])
    assert len(nxt["state"]) == 3  # embed.weight, body.*: their trained state kept
    train(new, opt2, 1, start=3)
    # and it resumes again, strictly, into fresh objects, bit for bit
    nxt = copy.deepcopy(get_optimizer_state_dict(new, opt2))
    again = copy.deepcopy(new)
    opt3 = torch.optim.AdamW(
        [p for p in again.parameters() if p.requires_grad]
        if how == "frozen"
        else again.parameters(),
        lr=0.5,
    )
    resume_optimizer(again, opt3, nxt, policy="strict")
    story_diffs = story.tree_differences(opt2.state_dict(), opt3.state_dict())
    assert not story_diffs, story_diffs
    train(new, opt2, 1, start=4)
    train(again, opt3, 1, start=4)
    for (n, p), q in zip(new.named_parameters(), again.parameters(), strict=True):
        assert torch.equal(p, q), n


# --------------------------------------------------------------------------------------
# wrong-shaped state


def vocab_checkpoint(layout: str):
    torch.manual_seed(0)
    small = Net(vocab=10)
    optim = torch.optim.AdamW(small.parameters(), lr=0.01)
    train(small, optim, 3)
    if layout == "int":
        return small, copy.deepcopy(optim.state_dict())
    return small, copy.deepcopy(
        get_optimizer_state_dict(small, optim, options=FLAT if layout == "flat" else None)
    )


@pytest.mark.parametrize("layout", ["flat", "nested", "int"])
@pytest.mark.parametrize("policy", ["default", "warn", "strict"])
def test_wrong_shaped_state_is_refused_when_the_optimizer_has_none_yet(layout, policy):
    """exp_avg of shape (10, 4) for a (14, 4) embedding: refused under every policy, naming it;
    nothing loaded. ``resize`` keeps the trained rows."""
    _, sd = vocab_checkpoint(layout)
    big = Net(vocab=14)
    optim = torch.optim.AdamW(big.parameters(), lr=0.5)
    assert not optim.state  # the reference has no state to compare with
    snap = Snapshot({"state": optim.state, "groups": optim.param_groups, "sd": sd})
    options = FLAT if layout == "flat" else None
    key = "state.0.exp_avg" if layout == "int" else "state.embed.weight.exp_avg"
    with pytest.raises(dm.MergeError, match="shape") as info:
        resume_optimizer(big, optim, sd, options=options, policy=policy)
    assert snap.unchanged()
    if layout == "int":  # ids are positions: refused before the merge, saying so
        assert "position(s) 0 (exp_avg float32[10, 4] for float32[14, 4]" in str(info.value)
    else:
        assert key in {m.key for m in info.value.diff.mismatched}
    with pytest.raises(dm.MergeError, match="shape"):
        backfill_optimizer_state(optim, sd, model=big, policy=policy)
    assert snap.unchanged()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dm.DSDMergeWarning)
        diff = resume_optimizer(
            big, optim, sd, options=options, policy=policy, on_shape_mismatch="resize"
        )
    assert key in {r.key for r in diff.resized}
    state = optim.state[big.embed.weight]
    assert state["exp_avg"].shape == (14, 4)
    assert not state["exp_avg"][10:].any()  # the new rows start as a new optimizer's
    train(big, optim, 1)  # and training goes on


FUSED = textwrap.dedent(
    """
    import copy, sys, torch
    from torch import nn
    from dsdmerge.integrations import resume_optimizer
    import dsdmerge as dm
    torch.manual_seed(0)
    small = nn.Embedding(10, 4)
    opt = torch.optim.AdamW(small.parameters(), lr=0.01, fused=True)
    small(torch.arange(10)).sum().backward(); opt.step()
    sd = copy.deepcopy(opt.state_dict())
    big = nn.Embedding(14, 4)
    opt2 = torch.optim.AdamW(big.parameters(), lr=0.01, fused=True)
    try:
        resume_optimizer(big, opt2, sd, policy=sys.argv[1])
    except dm.MergeError as err:
        print("REFUSED", "exp_avg" in str(err))
        sys.exit(0)
    big(torch.arange(14)).sum().backward()
    opt2.step()  # a segfault before the shapes were checked
    print("STEPPED")
    """
)


@pytest.mark.parametrize("policy", ["default", "strict"])
def test_fused_adamw_wrong_shaped_state_is_refused_not_a_segfault(policy):
    out = subprocess.run(
        [sys.executable, "-c", FUSED, policy], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.split() == ["REFUSED", "True"], out.stdout


# --------------------------------------------------------------------------------------
# fresh means fresh, whatever the live optimizer holds


def adam_l2(groups):
    return torch.optim.Adam(groups, weight_decay=0.1)


LIVE_STATE_SPECS = [
    story.Spec(id="torch.Adam-L2", make=adam_l2, cls="Adam", weight_decay=0.1),
    story.BY_ID["torch.AdamW"],
    story.BY_ID["torch.SGD-momentum"],
    story.BY_ID["torch.RMSprop"],
    story.BY_ID["torch.Adagrad"],  # its accumulators exist from construction on: kept
]


@pytest.fixture(scope="module")
def live_stories(tmp_path_factory):
    cache: dict[str, story.Story] = {}

    def get(spec):
        if spec.id not in cache:
            cache[spec.id] = story.make_story(spec, tmp_path_factory.mktemp(spec.id))
        return cache[spec.id]

    return get


@pytest.mark.parametrize("layout", ["nested", "flat", "int"])
@pytest.mark.parametrize("spec", LIVE_STATE_SPECS, ids=str)
def test_as_fresh_after_the_zero_gradient_step_of_the_live_optimizer(spec, layout, live_stories):
    """torchtitan's OptimizersContainer.state_dict() takes DSD's zero-gradient step before a
    trainer resumes: the never-gradient indexer then holds step-1 state. With as_fresh its
    first real step is still that of the uninterrupted run, bit for bit."""
    st = live_stories(spec)
    loaded = story.load(st.files[layout])
    run = story.build(spec)
    run.model.load_state_dict(loaded["model"])
    _init_optim_state(run.optim)  # what torchtitan's state_dict() runs first
    indexer = list(run.model.indexer.parameters())
    assert all(p in run.optim.state and run.optim.state[p] for p in indexer)
    resume_optimizer(
        run.model,
        run.optim,
        loaded["optim"],
        options=FLAT if layout == "flat" else None,
        policy="strict",
        allow_missing=["state.indexer.*", *(f"state.{i}.*" for i in st.indexer_ids)],
    )
    run.sched.load_state_dict(loaded["sched"])
    story.step(run, N_STEPS, wake=True)
    diffs = story.run_differences(st.final_wake, run)
    assert not diffs, diffs[:10]


# --------------------------------------------------------------------------------------
# all or nothing across optimizers


def two_optimizers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    optims = [torch.optim.Adam(m.parameters(), lr=0.01) for m in model]
    for _ in range(2):
        model(torch.randn(4, 3)).square().mean().backward()
        for o in optims:
            o.step()
            o.zero_grad()
    return model, optims


def test_a_value_torch_rejects_in_the_second_optimizer_changes_neither():
    model, optims = two_optimizers()
    sd = copy.deepcopy(get_optimizer_state_dict(model, optims))
    sd["state"]["1.weight"]["step"] = "3"  # passes the merge; torch's load raises ValueError
    new = copy.deepcopy(model)
    fresh = [torch.optim.Adam(m.parameters(), lr=0.5) for m in new]
    train_fresh = [(o, copy.deepcopy(o.state_dict())) for o in fresh]
    snap = Snapshot({"state": [o.state for o in fresh], "groups": [o.param_groups for o in fresh]})
    with pytest.raises(dm.MergeError, match=r"optimizer 1 \(Adam\)\.load_state_dict rejects"):
        resume_optimizer(new, fresh, sd, policy="strict")
    assert snap.unchanged()
    for o, before in train_fresh:
        assert o.state_dict() == before


def test_a_value_torch_rejects_leaves_one_optimizer_holding_its_own_objects():
    model, optims = two_optimizers()
    sd = copy.deepcopy(get_optimizer_state_dict(model[0], optims[0]))
    sd["state"]["weight"]["step"] = "three"  # passes the merge; Adam's __setstate__ raises
    new = copy.deepcopy(model[0])
    fresh = torch.optim.Adam(new.parameters(), lr=0.5)
    new(torch.randn(4, 3)).sum().backward()
    fresh.step()  # it holds state of its own
    state, groups = fresh.state, fresh.param_groups
    snap = Snapshot({"state": state, "groups": groups})
    with pytest.raises(dm.MergeError, match=r"Adam\.load_state_dict rejects") as info:
        resume_optimizer(new, fresh, sd)
    assert isinstance(info.value.__cause__, ValueError)
    assert fresh.state is state  # the very objects
    assert fresh.param_groups is groups
    assert snap.unchanged()


class FailsOnRealLoad(torch.optim.Adam):
    """An optimizer whose load hook fails on real parameters only (not on a dry run)."""

    def __init__(self, params, **kw) -> None:
        super().__init__(params, **kw)
        self.register_load_state_dict_pre_hook(FailsOnRealLoad._check)

    @staticmethod
    def _check(optimizer, state_dict):
        if any(p.device.type != "meta" for g in optimizer.param_groups for p in g["params"]):
            raise RuntimeError("storage unavailable")


def test_a_load_that_still_fails_gives_the_first_optimizer_its_state_back():
    model, optims = two_optimizers()
    sd = copy.deepcopy(get_optimizer_state_dict(model, optims))
    new = copy.deepcopy(model)
    first = torch.optim.Adam(new[0].parameters(), lr=0.5)
    new(torch.randn(4, 3)).sum().backward()
    first.step()  # it holds state of its own before the resume
    second = FailsOnRealLoad(new[1].parameters(), lr=0.5)
    before = copy.deepcopy(first.state_dict())
    with pytest.raises(dm.MergeError, match="have their state from before again") as info:
        resume_optimizer(new, [first, second], sd)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert not story.tree_differences(before, first.state_dict())
    assert not second.state


# --------------------------------------------------------------------------------------
# int ids without names: mapped by position only when positions still fit


class Two(nn.Module):
    def __init__(self, *, swapped: bool = False, extra: bool = False) -> None:
        super().__init__()
        if swapped:
            self.big = nn.Linear(4, 8)
            self.small = nn.Linear(4, 4)
        else:
            self.small = nn.Linear(4, 4)
            self.big = nn.Linear(4, 8)
        if extra:
            self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.big(self.small(x))


def two_checkpoint():
    torch.manual_seed(0)
    model = Two()
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    return model, copy.deepcopy(optim.state_dict())


@pytest.mark.parametrize("on_shape_mismatch", ["raise", "resize"])
def test_reordered_parameters_of_an_int_id_checkpoint_are_refused(on_shape_mismatch):
    """Same group size, positions now name other parameters: the state at position 0 is the
    old small.weight's (4, 4) and fits position 2 (the new small.weight) exactly. Refused,
    saying what to pass, even when resizing was asked for; nothing changes."""
    _, sd = two_checkpoint()
    new = Two(swapped=True)
    optim = torch.optim.Adam(new.parameters(), lr=0.5)
    snap = Snapshot({"state": optim.state, "groups": optim.param_groups})
    with pytest.raises(dm.MergeError, match=r"old_model\.named_parameters\(\)") as info:
        resume_optimizer(new, optim, sd, on_shape_mismatch=on_shape_mismatch)
    assert "no longer in the order" in str(info.value)
    assert snap.unchanged()


def test_a_grown_group_of_an_int_id_checkpoint_says_what_to_pass():
    _, sd = two_checkpoint()
    new = Two(extra=True)
    optim = torch.optim.Adam(new.parameters(), lr=0.5)
    with pytest.raises(dm.MergeError, match=r"old_model\.named_parameters\(\)"):
        resume_optimizer(new, optim, sd)
    # with the old model's names it resumes by name
    old = Two()
    diff = resume_optimizer(new, optim, dm.rekey(sd, old.named_parameters()))
    assert {k.split(".")[1] for k in diff.missing} == {"head"}


def test_an_int_id_checkpoint_whose_sizes_changed_says_resize_or_names():
    _, sd = vocab_checkpoint("int")
    big = Net(vocab=14)
    optim = torch.optim.AdamW(big.parameters(), lr=0.5)
    with pytest.raises(dm.MergeError, match="on_shape_mismatch='resize'") as info:
        resume_optimizer(big, optim, sd)
    assert "named_parameters" in str(info.value)
    diff = resume_optimizer(big, optim, sd, on_shape_mismatch="resize")
    assert diff.resized


# --------------------------------------------------------------------------------------
# optimizer-level entries are carried, and only they


def test_only_the_optimizers_own_entries_are_carried():
    """MADGRAD-style ``state['k']`` (no parameter's) is carried; a removed parameter's state,
    spelled by its fqn, is not."""
    model, optim = saved_run()
    sd = copy.deepcopy(get_optimizer_state_dict(model, optim))
    sd["state"]["k"] = torch.tensor(7)
    new = Net(aux=False)
    opt2 = torch.optim.AdamW(new.parameters(), lr=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dm.DSDMergeWarning)
        resume_optimizer(new, opt2, sd)
    keys = [k for k in opt2.state if not isinstance(k, torch.Tensor)]
    assert keys == ["k"]
    assert opt2.state["k"] is sd["state"]["k"]


# --------------------------------------------------------------------------------------
# nothing of a parameter's state is dropped, at any depth


def test_a_field_deep_in_a_parameters_state_is_kept_when_the_live_entry_lacks_it():
    """heavyball keeps ``step`` in one view's entry (``{0: {"step": ..., ...}}``), the first
    parameter's of its group: after a model change the live optimizer's entry for that
    parameter may lack it. The checkpoint's field is loaded, not dropped as unexpected."""
    from optimizers import ShampooLike

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optim = ShampooLike(model.parameters())
    model(torch.randn(4, 3)).square().mean().backward()
    optim.step()
    sd = copy.deepcopy(get_optimizer_state_dict(model, optim))
    sd["state"]["weight"]["precond"]["counter"] = torch.tensor(7.0)  # only the checkpoint's
    new = copy.deepcopy(model)
    opt2 = ShampooLike(new.parameters())
    new(torch.randn(4, 3)).square().mean().backward()
    opt2.step()  # the live entry: {"step", "precond": {"left", "right"}}
    diff = resume_optimizer(new, opt2, sd, policy="strict")
    assert not diff.unexpected
    assert torch.equal(opt2.state[new.weight]["precond"]["counter"], torch.tensor(7.0))


def test_int_ids_with_param_names_map_by_name_when_positions_moved():
    """torch >= 2.6 saves param_names for an optimizer built from named_parameters(). A model
    change that keeps every group's size (``l2`` removed, ``extra`` added) moves which
    parameter sits at each position: the names decide, never the positions."""

    class Before(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1 = nn.Linear(3, 3)
            self.l2 = nn.Linear(3, 3)

    class After(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.extra = nn.Linear(3, 3)  # registered first: position 0, where l1 was
            self.l1 = nn.Linear(3, 3)

    torch.manual_seed(0)
    old = Before()
    optim = torch.optim.Adam(old.named_parameters(), lr=0.01)
    (old.l1(torch.ones(3)).sum() + old.l2(torch.ones(3)).sum()).backward()
    optim.step()
    sd = copy.deepcopy(optim.state_dict())
    new = After()
    opt2 = torch.optim.Adam(new.named_parameters(), lr=0.01)
    diff = resume_optimizer(new, opt2, sd)
    assert any(".l2." in k for k in diff.unexpected), diff
    assert torch.equal(opt2.state[new.l1.weight]["exp_avg"], sd["state"][0]["exp_avg"])
    assert new.extra.weight not in opt2.state  # fresh, not l1's moments
