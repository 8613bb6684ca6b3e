"""Acceptance: the whole resume story against every torch.optim optimizer and third-party ones.

For each optimizer (``story.SPECS``) and each saved
layout (DSD flat, DSD nested fqn-keyed, ``optimizer.state_dict()`` with int ids): train
``N_STEPS`` with a never-gradient ``indexer`` first in both param groups and a per-group
``LambdaLR``, save through ``torch.save`` / ``torch.load(weights_only=True)``, resume a
fresh model/optimizer/scheduler with ``resume_optimizer``, take one step and compare bit
for bit with an uninterrupted run. The rule: what torch round-trips, dsdmerge round-trips.
A plain-torch control (``Optimizer.load_state_dict`` of the int-id file) decides what
torch round-trips; where it does not, the optimizer's stories are skipped, naming it.

Variants: resuming after a forward/backward, a config change (torch keeps the state
fields the new config lacks), the indexer's first real step (fresh means fresh, Adam
with L2 weight decay included), a grown model under ``policy="strict"`` with allow-lists,
and "untouched on error" for refused calls.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import story
import torch
from conftest import Snapshot
from story import FLAT, LAYOUTS, N_STEPS, SPECS, Run, Spec, Stories, Story

import dsdmerge as dm
from dsdmerge.integrations import resume_model, resume_optimizer

# how resume_optimizer is called: the default policy; strict with the indexer allowed; warn
# with everything allowed (what its own hint says to do: pass allow_unexpected=...)
MODES = ("default", "strict", "warn")


def spec_param(spec: Spec, *rest: Any) -> Any:
    return pytest.param(spec, *rest, id="-".join([spec.id, *map(str, rest)]))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: intra-op threads only contend (5x slower on a loaded 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def stories(tmp_path_factory: pytest.TempPathFactory) -> Stories:
    return Stories(tmp_path_factory.mktemp("stories"))


def prepare(spec: Spec, layout: str, stories: Stories, monkeypatch) -> Story:
    """Skip what cannot be tested (package absent, torch itself cannot); return the story."""
    story.require(spec, monkeypatch)
    reason = stories.control(spec, layout)
    if reason is not None:
        pytest.skip(f"torch itself does not round-trip it: {reason}")
    st = stories.get(spec)
    if layout not in st.files:
        pytest.skip(
            f"{spec.id}: torch's get_optimizer_state_dict cannot save the {layout} layout: "
            f"{st.save_errors[layout]}"
        )
    return st


def indexer_globs(st: Story, layout: str) -> list[str]:
    """allow_missing globs for the indexer's state: by fqn, or by int id."""
    if layout == "int":
        return [f"state.{i}.*" for i in st.indexer_ids]
    # DSD's get_optimizer_state_dict keeps only state and param_groups: an optimizer's own
    # top-level keys (heavyball's) are missing from such a checkpoint, and reported
    extras = [k for k in st.saved if k not in ("state", "param_groups")]
    return ["state.indexer.*", *(f"{k}.*" for k in extras)]


def options_for(layout: str):
    return FLAT if layout == "flat" else None


def resume_kwargs(st: Story, layout: str, mode: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"options": options_for(layout)}
    if mode == "strict":
        kwargs.update(policy="strict", allow_missing=indexer_globs(st, layout))
    elif mode == "warn":
        kwargs.update(policy="warn", allow_missing=indexer_globs(st, layout), allow_unexpected="*")
    return kwargs


def resume(
    spec: Spec,
    st: Story,
    layout: str,
    mode: str = "default",
    *,
    grads_first: bool = False,
) -> tuple[Run, dm.KeyDiff, dict[str, Any]]:
    """A fresh run resumed from the story's ``layout`` file; returns it, the diff, the file."""
    loaded = story.load(st.files[layout])
    run = story.build(spec)
    run.model.load_state_dict(loaded["model"])
    if grads_first:  # a forward/backward before the optimizer is resumed
        story.backward(run, N_STEPS)
    with warnings.catch_warnings():
        # warn mode: what it reports is not this test's business (what it keeps is)
        warnings.simplefilter("ignore" if mode == "warn" else "error", dm.DSDMergeWarning)
        diff = resume_optimizer(
            run.model, run.optim, loaded["optim"], **resume_kwargs(st, layout, mode)
        )
    run.sched.load_state_dict(loaded["sched"])
    return run, diff, loaded


def go_on(
    spec: Spec,
    run: Run,
    stories: Stories,
    what: str,
    *,
    model_kwargs: dict[str, Any] | None = None,
    model_sd: Any = None,
) -> None:
    """The second generation: after a resume and its first step, the run goes on.

    The next save in every layout torch itself round-trips for this optimizer (through
    ``torch.save`` / ``torch.load(weights_only=True)``), each resumed with ``policy="strict"``
    into objects built from scratch (the only allow-list: the never-gradient indexer, and the
    top-level keys DSD does not save); each resumed run equals the saving run bit for bit
    (every parameter, every optimizer key, every group's hyperparameters, the scheduler),
    and after one more step of both, still.
    """
    kwargs = model_kwargs or {}
    story.before_save(run)
    files, errors = story.save(run, stories.root / f"next-{stories.serial()}")
    story.after_save(run)
    # every layout torch could save before the resume, it saves after it
    broken = {k: v for k, v in errors.items() if k in stories.get(spec).files}
    assert not broken, f"{what}: the next save fails: {broken}"
    at_save = story.snapshot_run(run)
    resumed: dict[str, Run] = {}
    for layout, path in files.items():
        if stories.control(spec, layout) is not None:
            continue  # torch itself does not round-trip this layout (the first story skips it)
        loaded = story.load(path)
        fresh = story.build(spec, **kwargs)
        fresh.model.load_state_dict(loaded["model"] if model_sd is None else model_sd(loaded))
        extras = [k for k in at_save["optim"] if k not in ("state", "param_groups")]
        allow = ["state.indexer.*", *(f"state.{i}.*" for i in indexer_ids(fresh))]
        if layout != "int":
            allow += [f"{k}.*" for k in extras]
        with warnings.catch_warnings():
            warnings.simplefilter("error", dm.DSDMergeWarning)
            resume_optimizer(
                fresh.model,
                fresh.optim,
                loaded["optim"],
                options=options_for(layout),
                policy="strict",
                allow_missing=allow,
            )
        fresh.sched.load_state_dict(loaded["sched"])
        story.after_save(fresh)
        fail_with(
            story.run_differences(at_save, fresh),
            f"{what}, second generation from its {layout} save: resumed vs the saving run",
        )
        resumed[layout] = fresh
    for r in (run, *resumed.values()):
        story.step(r, N_STEPS + 1)
    ahead = story.snapshot_run(run)
    for layout, fresh in resumed.items():
        fail_with(
            story.run_differences(ahead, fresh),
            f"{what}, second generation from its {layout} save: one more step of both",
        )


def indexer_ids(run: Run) -> list[int]:
    indexer = {id(p) for p in run.model.indexer.parameters()}
    params = [p for g in run.optim.param_groups for p in g["params"]]
    return [i for i, p in enumerate(params) if id(p) in indexer]


def fail_with(diffs: list[str], what: str) -> None:
    if diffs:
        shown = "\n  ".join(diffs[:25])
        more = f"\n  ... and {len(diffs) - 25} more" if len(diffs) > 25 else ""
        pytest.fail(f"{what}: {len(diffs)} difference(s):\n  {shown}{more}")


# --------------------------------------------------------------------------------------
# coverage


def test_every_torch_optimizer_is_covered():
    covered = {s.cls for s in story.TORCH_SPECS}
    present = story.torch_optimizer_classes()
    new = sorted(present - covered)
    assert not new, (
        f"torch.optim has optimizers the resume story does not cover: {new}; add a Spec "
        "for each to story.TORCH_SPECS (say how it is built and driven)"
    )
    assert not covered - present, f"specs for optimizers torch.optim lacks: {covered - present}"


# --------------------------------------------------------------------------------------
# the plain-torch control


@pytest.mark.parametrize(
    ("spec", "kind"), [spec_param(s, kind) for s in SPECS for kind in ("int", "dsd")]
)
def test_plain_torch_round_trips(spec, kind, stories, monkeypatch):
    """Optimizer.load_state_dict of the int-id file resumes bit for bit (or the spec is skipped:
    then every story of this optimizer is skipped with the same reason). ``dsd``: the same
    without the top-level keys DSD's get_optimizer_state_dict does not save."""
    story.require(spec, monkeypatch)
    reason = stories.control(spec, "int" if kind == "int" else "flat")
    if reason is not None:
        pytest.skip(reason)
    # the control compared something: the optimizer had trained state to lose
    assert any(stories.get(spec).saved["state"].values()) or spec.id == "torch.SGD", spec.id


# --------------------------------------------------------------------------------------
# the story


@pytest.mark.parametrize(
    ("spec", "layout", "mode"),
    [spec_param(s, layout, mode) for s in SPECS for layout in LAYOUTS for mode in MODES],
)
def test_story(spec, layout, mode, stories, monkeypatch):
    st = prepare(spec, layout, stories, monkeypatch)
    run, _, _ = resume(spec, st, layout, mode)
    # right after the resume: every trained value is there, bit for bit, nothing else
    # (the indexer has no state, exactly as at save time), every group's hyperparameters
    fail_with(
        story.tree_differences(
            story.without_empty_entries(st.saved),
            story.without_empty_entries(run.optim.state_dict()),
        ),
        f"{spec.id} {layout} {mode}: resumed optimizer state vs saved, before the next step "
        f"(the indexer is ids {st.indexer_ids}; ids are positions over the groups' params)",
    )
    story.after_save(run)
    story.step(run, N_STEPS)
    fail_with(
        story.run_differences(st.final, run),
        f"{spec.id} {layout} {mode}: one step after the resume vs the uninterrupted run",
    )
    if mode == "default":  # the modes load the same state (checked above): one goes on
        go_on(spec, run, stories, f"{spec.id} {layout}")


@pytest.mark.parametrize(
    ("spec", "layout"), [spec_param(s, layout) for s in SPECS for layout in LAYOUTS]
)
def test_story_explicit_as_fresh(spec, layout, stories, monkeypatch):
    """``fresh="as_fresh"`` spelled out gives the same as the default."""
    st = prepare(spec, layout, stories, monkeypatch)
    loaded = story.load(st.files[layout])
    run = story.build(spec)
    run.model.load_state_dict(loaded["model"])
    resume_optimizer(
        run.model,
        run.optim,
        loaded["optim"],
        options=options_for(layout),
        policy="strict",
        allow_missing=indexer_globs(st, layout),
        fresh="as_fresh",
    )
    run.sched.load_state_dict(loaded["sched"])
    story.after_save(run)
    story.step(run, N_STEPS)
    fail_with(story.run_differences(st.final, run), f"{spec.id} {layout} as_fresh")


# --------------------------------------------------------------------------------------
# variants


@pytest.mark.parametrize(
    ("spec", "layout"), [spec_param(s, layout) for s in SPECS for layout in LAYOUTS]
)
def test_resume_after_forward_backward(spec, layout, stories, monkeypatch):
    """Params already hold ``.grad`` when resume_optimizer is called (DSD's init step skips)."""
    if spec.train_eval:
        pytest.skip(
            f"{spec.id}: .train() must follow the optimizer load and the gradients must "
            "follow .train(), so a backward before the resume is not this optimizer's protocol"
        )
    st = prepare(spec, layout, stories, monkeypatch)
    run, _, _ = resume(spec, st, layout, grads_first=True)
    grads = {n: p.grad for n, p in run.model.named_parameters()}
    assert any(g is not None for g in grads.values())
    fail_with(
        story.tree_differences(
            story.without_empty_entries(st.saved),
            story.without_empty_entries(run.optim.state_dict()),
        ),
        f"{spec.id} {layout}: resumed (after a forward/backward) vs saved, before the step",
    )
    story.step(run, N_STEPS, have_grads=True)
    fail_with(
        story.run_differences(st.final, run),
        f"{spec.id} {layout}: resumed after a forward/backward, one step, vs uninterrupted",
    )
    go_on(spec, run, stories, f"{spec.id} {layout} after a forward/backward")


@pytest.mark.parametrize(
    ("spec", "layout"), [spec_param(s, layout) for s in SPECS for layout in LAYOUTS]
)
def test_indexer_first_real_step_is_fresh(spec, layout, stories, monkeypatch):
    """Fresh means fresh: the never-gradient indexer's first real step after the resume equals
    that of the uninterrupted run (whose indexer never had state), bit for bit."""
    st = prepare(spec, layout, stories, monkeypatch)
    run, _, _ = resume(spec, st, layout)
    story.after_save(run)
    story.step(run, N_STEPS, wake=True)
    fail_with(
        story.run_differences(st.final_wake, run),
        f"{spec.id} {layout}: the indexer's first real step after the resume vs uninterrupted",
    )
    go_on(spec, run, stories, f"{spec.id} {layout} after the indexer's first step")


ADAM_L2 = Spec(
    id="torch.Adam-L2",
    make=lambda groups: torch.optim.Adam(groups),
    cls="Adam",
    weight_decay=0.1,  # L2: DSD's zero-gradient init step gives it grad = wd * param
)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
def test_adam_l2_never_gradient_param_first_step_equals_never_checkpointed(
    layout, mode, stories, monkeypatch
):
    """Adam with L2 weight_decay: the indexer's first real step after a resume equals that of an
    optimizer that never saw a checkpoint (DSD's init step would give it step 1 and moments)."""
    st = prepare(ADAM_L2, layout, stories, monkeypatch)
    run, _, _ = resume(ADAM_L2, st, layout, mode)
    indexer = dict(run.model.indexer.named_parameters())
    assert not any(p in run.optim.state and run.optim.state[p] for p in indexer.values()), (
        "the never-gradient indexer has optimizer state after the resume: "
        + repr({n: sorted(run.optim.state[p]) for n, p in indexer.items() if p in run.optim.state})
    )
    # an optimizer that never saw a checkpoint, on the same weights, with the same lrs
    never = story.build(ADAM_L2)
    never.model.load_state_dict(run.model.state_dict())
    for group, resumed in zip(never.optim.param_groups, run.optim.param_groups, strict=True):
        group["lr"] = resumed["lr"]
    for r in (run, never):
        story.step(r, N_STEPS, wake=True)
    for name, p in indexer.items():
        q = never.model.get_parameter(f"indexer.{name}")
        assert torch.equal(p, q), f"indexer.{name} after its first real step"
        fail_with(
            story.tree_differences(never.optim.state[q], run.optim.state[p]),
            f"indexer.{name} state after its first real step vs a never-checkpointed Adam",
        )
    fail_with(
        story.run_differences(st.final_wake, run),
        f"Adam-L2 {layout} {mode}: the whole run vs uninterrupted",
    )


CONFIG_CHANGES = {
    # checkpoint spec, new optimizer, the state field the new config lacks
    "sgd-momentum-to-none": (
        story.BY_ID["torch.SGD-momentum"],
        lambda groups: torch.optim.SGD(groups, momentum=0.0),
        "momentum_buffer",
    ),
    "adam-amsgrad-to-none": (
        story.BY_ID["torch.Adam-amsgrad"],
        lambda groups: torch.optim.Adam(groups, amsgrad=False),
        "max_exp_avg_sq",
    ),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("change", sorted(CONFIG_CHANGES))
def test_config_change_keeps_what_torch_keeps(change, layout, stories, monkeypatch):
    """Optimizer.load_state_dict keeps state fields the new optimizer lacks (and restores the
    checkpoint's hyperparameters): resume_optimizer must give the very same optimizer."""
    saved_spec, make_new, field = CONFIG_CHANGES[change]
    new_spec = Spec(id=f"{saved_spec.id}-changed", make=make_new, cls=saved_spec.cls)
    st = prepare(saved_spec, layout, stories, monkeypatch)

    def fresh_new() -> tuple[Run, dict[str, Any]]:
        loaded = story.load(st.files[layout])
        run = story.build(new_spec)
        run.model.load_state_dict(loaded["model"])
        return run, loaded

    expected, _ = fresh_new()  # what torch itself does with the same checkpoint
    torch_loaded = story.load(st.files["int"])
    expected.optim.load_state_dict(torch_loaded["optim"])
    expected.sched.load_state_dict(torch_loaded["sched"])
    assert any(field in s for s in expected.optim.state.values()), f"torch keeps {field}"

    run, loaded = fresh_new()
    resume_optimizer(run.model, run.optim, loaded["optim"], options=options_for(layout))
    run.sched.load_state_dict(loaded["sched"])
    fail_with(
        story.tree_differences(expected.optim.state_dict(), run.optim.state_dict()),
        f"{change} {layout}: resumed vs Optimizer.load_state_dict, before the next step",
    )
    for r in (expected, run):
        story.step(r, N_STEPS)
    fail_with(
        story.run_differences(story.snapshot_run(expected), run),
        f"{change} {layout}: one step after the resume vs torch's own load",
    )


GROWN_SPECS = [
    story.BY_ID[i]
    for i in (
        "torch.Adam",
        "torch.AdamW",
        "torch.SGD-momentum",
        "torch.RMSprop",
        "torch.Adagrad",  # creates state for every param in __init__
        "torch.Rprop",
    )
]


@pytest.mark.parametrize(
    ("spec", "layout"),
    [spec_param(s, layout) for s in GROWN_SPECS for layout in ("flat", "nested")],
)
def test_grown_model_under_strict_with_allow_lists(spec, layout, stories, monkeypatch):
    """A checkpoint of a model with an ``old`` module, resumed into one that lost ``old`` and
    gained an ``adapter`` registered first (its params lead both groups)."""
    prepare(spec, layout, stories, monkeypatch)
    st = stories.get(spec, old=True)
    loaded = story.load(st.files[layout])
    run = story.build(spec, adapter=True)
    assert next(iter(run.model.named_parameters()))[0] == "adapter.weight"
    model_diff = resume_model(
        run.model,
        loaded["model"],
        policy="strict",
        allow_missing="adapter.*",
        allow_unexpected="old.*",
    )
    assert set(model_diff.missing) == {"adapter.weight", "adapter.bias"}
    assert set(model_diff.unexpected) == {"old.weight", "old.bias"}
    never = story.build(spec, adapter=True)  # what a never-checkpointed optimizer holds
    never.model.load_state_dict(run.model.state_dict())

    diff = resume_optimizer(
        run.model,
        run.optim,
        loaded["optim"],
        options=options_for(layout),
        policy="strict",
        allow_missing=["state.indexer.*", "*.adapter.*"],
        allow_unexpected="*.old.*",
    )
    run.sched.load_state_dict(loaded["sched"])
    assert any(".old." in k for k in diff.unexpected), diff
    assert any(".adapter." in k for k in diff.missing), diff

    # every check before the next step, all reported together
    problems: list[str] = []
    # every group: the checkpoint's scheduled hyperparameters (lr included), not the fresh ones
    for i, (group, saved) in enumerate(
        zip(run.optim.param_groups, st.saved["param_groups"], strict=True)
    ):
        if group["lr"] == never.optim.param_groups[i]["lr"] != saved["lr"]:
            problems.append(f"param_groups[{i}]: the fresh lr {group['lr']}, not the scheduled one")
        problems += [
            f"param_groups[{i}] vs the checkpoint: {d}"
            for d in story.tree_differences(
                {k: v for k, v in saved.items() if k != "params"},
                {k: v for k, v in group.items() if k != "params"},
            )
        ]
    # the new params: exactly the state a never-checkpointed optimizer gives them
    for name in ("adapter.weight", "adapter.bias"):
        problems += [
            f"{name} vs a never-checkpointed optimizer: {d}"
            for d in story.tree_differences(
                dict(never.optim.state.get(never.model.get_parameter(name), {})),
                dict(run.optim.state.get(run.model.get_parameter(name), {})),
            )
        ]
    # surviving params: trained state bit-identical, the never-gradient indexer still without
    # state; the removed one's state not loaded anywhere
    resumed = {k: v for k, v in story.state_by_fqn(run).items() if v}
    survivors = {k: v for k, v in st.saved_by_fqn.items() if not k.startswith("old.")}
    problems += [
        f"surviving params' state vs the checkpoint: {d}"
        for d in story.tree_differences(
            survivors, {k: v for k, v in resumed.items() if not k.startswith("adapter.")}
        )
    ]
    fail_with(problems, f"{spec.id} {layout} grown model, after the resume")
    # the new params' first step is that of a never-checkpointed optimizer (same lrs)
    for group, resumed_group in zip(never.optim.param_groups, run.optim.param_groups, strict=True):
        group["lr"] = resumed_group["lr"]
    for r in (run, never):
        story.step(r, N_STEPS)
    for name in ("adapter.weight", "adapter.bias"):
        p, q = run.model.get_parameter(name), never.model.get_parameter(name)
        assert torch.equal(p, q), f"{name} after its first step"
        fail_with(
            story.tree_differences(dict(never.optim.state[q]), dict(run.optim.state[p])),
            f"{spec.id} {layout} grown: {name} state after its first step",
        )


# --------------------------------------------------------------------------------------
# untouched on error


def live_state(run: Run, loaded: Any) -> Snapshot:
    """Every parameter, gradient and buffer, the optimizer's state and groups, the input."""
    return Snapshot(
        {
            "params": dict(run.model.named_parameters()),
            "grads": {n: p.grad for n, p in run.model.named_parameters()},
            "buffers": dict(run.model.named_buffers()),
            "state": run.optim.state,
            "param_groups": run.optim.param_groups,
            "defaults": run.optim.defaults,
            "loaded": loaded,
        }
    )


def refused(run: Run, loaded: Any, **kwargs: Any) -> dm.DSDMergeError:
    snap = live_state(run, loaded)
    with pytest.raises(dm.DSDMergeError) as info:
        resume_optimizer(run.model, run.optim, loaded, **kwargs)
    assert snap.unchanged(), "a refused resume_optimizer changed the model, optimizer or input"
    return info.value


@pytest.mark.parametrize(
    ("spec", "layout"), [spec_param(s, layout) for s in SPECS for layout in LAYOUTS]
)
def test_refused_resume_of_a_shrunk_model_changes_nothing(spec, layout, stories, monkeypatch):
    """A checkpoint with state for a module the model no longer has, under ``strict`` with
    nothing allowed: refused with a DSDMergeError, and nothing changed before the verdict."""
    prepare(spec, layout, stories, monkeypatch)
    st = stories.get(spec, old=True)
    assert layout in st.files, st.save_errors
    loaded = story.load(st.files[layout])
    run = story.build(spec)
    run.model.load_state_dict({k: v for k, v in loaded["model"].items() if not k.startswith("old")})
    err = refused(run, loaded["optim"], options=options_for(layout), policy="strict")
    assert isinstance(err, (dm.MergeError, dm.LayoutError)), type(err)


@pytest.mark.parametrize(
    ("spec", "layout", "mode"),
    [spec_param(s, layout, mode) for s in SPECS for layout in ("flat", "nested") for mode in MODES],
)
def test_shrunk_model_resumes_and_goes_on(spec, layout, mode, stories, monkeypatch):
    """A checkpoint with state for a module the model no longer has: that state is left out
    (reported unexpected), the optimizer holds only its own parameters' state, the next save
    works in every layout and resumes again strictly, bit for bit. (With int ids the removed
    module shifts the positions: refused, see test_refused_resume_of_a_shrunk_model.)"""
    prepare(spec, layout, stories, monkeypatch)
    st = stories.get(spec, old=True)
    loaded = story.load(st.files[layout])
    run = story.build(spec)
    run.model.load_state_dict({k: v for k, v in loaded["model"].items() if not k.startswith("old")})
    kwargs: dict[str, Any] = {"options": options_for(layout)}
    if mode == "strict":
        kwargs.update(
            policy="strict", allow_missing=indexer_globs(st, layout), allow_unexpected="*.old.*"
        )
    elif mode == "warn":
        kwargs.update(policy="warn", allow_missing=indexer_globs(st, layout))
    if spec.id in SPANS_EVERY_PARAM:  # its state no longer fits: refused, naming it
        err = refused(run, loaded["optim"], **kwargs)
        assert "prev_flat_grad" in str(err), err
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dm.DSDMergeWarning)
        diff = resume_optimizer(run.model, run.optim, loaded["optim"], **kwargs)
    run.sched.load_state_dict(loaded["sched"])
    params = {id(p) for g in run.optim.param_groups for p in g["params"]}
    junk = [k for k in run.optim.state if id(k) not in params]
    assert not junk, f"optimizer.state holds keys that are none of its parameters: {junk}"
    if any(v for k, v in st.saved_by_fqn.items() if k.startswith("old.")):
        assert any(".old." in k for k in diff.unexpected), diff
    # the survivors' state is the checkpoint's, bit for bit
    fail_with(
        story.tree_differences(
            {k: v for k, v in st.saved_by_fqn.items() if not k.startswith("old.") and v},
            {k: v for k, v in story.state_by_fqn(run).items() if v},
        ),
        f"{spec.id} {layout} {mode} shrunk: surviving state vs the checkpoint",
    )
    story.after_save(run)
    story.step(run, N_STEPS)
    if mode == "default":  # the modes load the same state (checked above): one goes on
        go_on(spec, run, stories, f"{spec.id} {layout} shrunk")


# optimizers whose state spans every parameter (LBFGS: one flat direction and history), so
# that it cannot fit a model with parameters fewer
SPANS_EVERY_PARAM = {"torch.LBFGS"}


@pytest.mark.parametrize("grads", ["no-grads", "grads"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_refused_missing_indexer_changes_nothing(layout, grads, stories, monkeypatch):
    """strict without the indexer's allow-list refuses Adam's checkpoint naming the indexer,
    whether or not the params already hold gradients, and changes nothing."""
    spec = story.BY_ID["torch.Adam"]
    st = prepare(spec, layout, stories, monkeypatch)
    loaded = story.load(st.files[layout])
    run = story.build(spec)
    run.model.load_state_dict(loaded["model"])
    if grads == "grads":
        story.backward(run, N_STEPS)
    err = refused(run, loaded["optim"], options=options_for(layout), policy="strict")
    assert isinstance(err, dm.MergeError)
    assert err.diff is not None
    ids = {str(i) for i in st.indexer_ids}
    assert err.diff.missing
    assert all(
        k.split(".")[1] in ({"indexer"} if layout != "int" else ids) for k in err.diff.missing
    ), err.diff.missing


def test_refused_int_ids_into_a_grown_model_changes_nothing(stories, monkeypatch):
    """int ids cannot be mapped onto a model with more params in a group (torch's load would
    reject the group sizes): refused before anything changes."""
    spec = story.BY_ID["torch.Adam"]
    st = prepare(spec, "int", stories, monkeypatch)
    loaded = story.load(st.files["int"])
    run = story.build(spec, adapter=True)
    run.model.load_state_dict(loaded["model"], strict=False)
    refused(run, loaded["optim"], policy="strict", allow_missing="*")


def test_the_comparison_sees_a_lost_state_field_and_a_wrong_lr(stories, monkeypatch):
    """The harness can fail: plain torch fed a checkpoint without one momentum buffer, or with
    one group's lr changed, does not match the uninterrupted run, and the report names it (the
    scheduler then overwrites the lr, but that group's params moved differently)."""
    spec = story.BY_ID["torch.SGD-momentum"]
    st = prepare(spec, "int", stories, monkeypatch)
    for damage, expected in (("buffer", "momentum_buffer"), ("lr", "['proj.bias']")):
        loaded = story.load(st.files["int"])
        if damage == "buffer":
            del loaded["optim"]["state"][2]["momentum_buffer"]
        else:
            loaded["optim"]["param_groups"][1]["lr"] *= 2
        run = story.build(spec)
        run.model.load_state_dict(loaded["model"])
        run.optim.load_state_dict(loaded["optim"])
        run.sched.load_state_dict(loaded["sched"])
        story.step(run, N_STEPS)
        diffs = story.run_differences(st.final, run)
        assert any(expected in d for d in diffs), (damage, diffs)


def test_stories_are_deterministic():
    """Two uninterrupted runs agree bit for bit: a difference in a story is the resume's."""
    spec = story.BY_ID["torch.Adam"]
    fail_with(
        story.tree_differences(story.uninterrupted(spec), story.uninterrupted(spec)),
        "two uninterrupted runs",
    )
