"""The life of a run: a stateful property test of train, save, change, resume, again and again.

A ``hypothesis.stateful.RuleBasedStateMachine`` per optimizer of the zoo (every
``torch.optim`` optimizer but SparseAdam, whose sparse-gradient model the story covers, and
the third-party test extras). Its rules:

* **train** k steps (the ``never`` module never gets a gradient; frozen ones neither);
* **save** in one layout: DSD flat, DSD nested, ``optimizer.state_dict()``, DCP, always
  through ``torch.save`` / ``dcp.save`` and read back with
  :func:`dsdmerge.integrations.load_checkpoint` (weights-only);
* **change** the model or optimizer for the next resume: add a module registered first (its
  parameters lead their groups), remove one, freeze one (left out of the optimizer),
  unfreeze it, rename one, grow the vocabulary, move a parameter to another group, give a
  module a group of its own, change a group's hyperparameters, split one optimizer into a
  container of two (or join them);
* **resume** a saved checkpoint into objects built for the changed config, through
  ``resume_optimizer``, ``backfill_optimizer_state`` + ``load_state_dict``, ``dm.merge`` +
  DSD's ``set_optimizer_state_dict``, or ``load_dcp`` (DCP saves), under ``default``,
  ``warn`` and ``strict`` (with the allow-lists the change needs, or none), with the live
  optimizer fresh, after a forward/backward, or after DSD's zero-gradient step (what
  torchtitan's ``state_dict()`` does first).

Invariants, after every rule: the live run equals a **pure-torch oracle** (``life.oracle``:
the checkpoint mapped by module uid by hand, every parameter, every state entry, every
group's hyperparameters, loaded with ``Optimizer.load_state_dict``), and the oracle steps
along; ``optimizer.state`` holds no key the oracle's does not. After every resume: the next
save works in the layouts torch round-trips and resumes strictly, bit for bit, into objects
built from scratch; a refused resume (``MergeError`` / ``LayoutError``) changed nothing: the
model, the optimizers, the files. Refusals that must happen (strict without allow-lists
over a model change, positions that cannot map, groups whose checkpoint members disagree
under strict, state that cannot be resized) are asserted too.

What is left out, and why (the cases the machine never draws; each names its entry):

* ``LIMITS``: flows torch's own API cannot resume exactly (also in docs/resume.md);
* ``ENGINE``: what the merge engine does not do right yet (``dm.merge``'s own rules, being
  fixed on their own branch);
* int ids without ``param_names`` across a change that keeps every group's size but changes
  its members: positions then name other parameters of the same shapes, which nothing can
  detect (refused where shapes tell, see ``test_resume_life``);
* structural changes with an optimizer whose state spans every parameter (LBFGS), two
  optimizers with a Hessian estimate each (SophiaH), and splitting an optimizer that keeps
  optimizer-level entries (MADGRAD's ``state['k']``: which of the two owns it is not defined).

Profiles (tests/conftest.py): ``ci`` and ``dev`` run 12 examples of up to 20 rules per
optimizer (about 8,000 rules, a minute alone); ``fuzz`` 25 (10,000 rules or more:
``HYPOTHESIS_PROFILE=fuzz python -m pytest -s tests/test_life_of_a_run.py`` prints how many).
``LIFE_EXAMPLES=N`` sets the examples per optimizer, ``LIFE_NO_SHRINK=1`` reports the first
failure as found.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any

import life
import pytest
import story
import torch
import torch.distributed.checkpoint as dcp
from conftest import Snapshot
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from life import Config, Key, Mod, Record, Refused, Run
from story import FLAT, Spec
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _init_optim_state,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

import dsdmerge as dm
from dsdmerge.integrations import (
    backfill_optimizer_state,
    load_checkpoint,
    load_dcp,
    resume_model,
    resume_optimizer,
)

SPECS = [s for s in story.SPECS if s.id != "torch.SparseAdam"]
logging.getLogger("c10d-NullHandler-dcp_logger").setLevel(logging.WARNING)  # DCP logs each call
LAYOUTS = ("flat", "nested", "int", "dcp")
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "dev")
# examples per optimizer and steps per example: 40 optimizers x 12 x 20 in CI (8k rules run,
# about a minute alone); fuzz: 40 x 25 x 20 (16k rules at most, 10k+)
EXAMPLES, STEPS = {"fuzz": (25, 20)}.get(PROFILE, (12, 20))
EXAMPLES = int(os.environ.get("LIFE_EXAMPLES", EXAMPLES))  # for a longer look at one optimizer
STEP_COUNT = [0]  # rules run in all (the report says how many steps the fuzz run took)
STATS: dict[str, int] = {}
NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)


def count(event: str) -> None:
    STATS[event] = STATS.get(event, 0) + 1


@dataclasses.dataclass
class Saved:
    rec: Record
    layout: str
    path: Path
    step: int
    files: dict[str, tuple[int, int]]  # name -> (size, mtime_ns): a refusal must not touch them


class Controls:
    """Per optimizer and layout, whether torch itself round-trips it (else it is not drawn)."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="life-controls-"))
        self.stories = story.Stories(self.root)

    def ok(self, spec: Spec, layout: str) -> bool:
        kind = "int" if layout == "int" else "nested"
        if self.stories.control(spec, kind) is not None:
            return False
        return kind in self.stories.get(spec).files and (
            layout != "flat" or "flat" in self.stories.get(spec).files
        )


CONTROLS = Controls()

# Flows that cannot resume exactly, by design of torch's own API (also in docs/resume.md).
LIMITS = {
    "dsd-reference-schedule-free": (
        "DSD's get_optimizer_state_dict on a heavyball schedule-free optimizer without state "
        "(SFAdamW in train mode) takes its zero-gradient step at lr 0, and that step turns "
        "every parameter into NaN (0/0 in the schedule's weights): dm.merge's DSD reference "
        "cannot be built; resume_optimizer never steps the live optimizer"
    ),
    "dsd-empty-state-container": (
        "DSD's set_optimizer_state_dict with several optimizers assigns param groups to "
        "optimizers through their state: a state dict without state (every parameter fresh) "
        "raises 'loaded state dict has a different number of parameter groups' in torch "
        "itself; resume_optimizer loads each optimizer's part with its own load_state_dict"
    ),
    "save-before-first-step": (
        "an optimizer that keeps a step counter in its param groups (pytorch-optimizer's SOAP, "
        "SophiaH, Lamb, ScheduleFreeRAdam) saved before its first step (so without the "
        "counter), resumed into an optimizer that took DSD's zero-gradient step (torchtitan's "
        "state_dict(), or DSD's reference for dm.merge): the counter that step made is a key "
        "the checkpoint lacks and is backfilled like any hyperparameter, so the first step "
        "counts as the second. (Per-parameter state that step made is left out.)"
    ),
    "dcp-empty-target": (
        "load_dcp (like dcp.load) reads only what the state dict passed in holds: DSD's "
        "get_optimizer_state_dict of an optimizer whose parameters already hold gradients has "
        "no state (its init step is skipped), so the checkpoint's optimizer state is "
        "unexpected and not read (the default policy says nothing; strict refuses); so are the "
        "hyperparameters an optimizer adds to its groups as it steps (Prodigy's d_hat), which "
        "a new optimizer's state dict lacks. Build the target before the first backward and "
        "from a trained optimizer, or use load_checkpoint + resume_optimizer"
    ),
}

# What the merge engine does not do right yet, found by this machine; the machine does not
# draw these cases until it does (the engine is being fixed on its own branch).
ENGINE = {
    "group-ties": (
        "a live group whose members come from two checkpoint groups in equal numbers, with "
        "different hyperparameters: which group's values the merged group takes is the "
        "engine's tie rule (being settled: the first member's in the reference's order)"
    ),
    "merge-list-tensors": (
        "dm.merge takes a list in optimizer state (PSGD's and SOAP's factor lists) as one "
        "opaque value: tensors in it are not checked against the reference's, so a grown "
        "parameter's wrong-shaped factors are kept (resume_optimizer refuses them)"
    ),
    "dcp-groups": (
        "DCP stores param groups by position (optim.param_groups.<i>.<hp>): load_dcp into an "
        "optimizer whose groups differ from the checkpoint's fails in DCP's planner "
        "(CheckpointReadError) or in the metadata view (LayoutError), after a verdict that saw "
        "no difference; load_checkpoint + resume_optimizer resumes it"
    ),
    "merge-empty-reference": (
        "dm.merge compares optimizer state only with the reference's: DSD's reference is empty "
        "when a parameter already holds a gradient or schedulefree's train() made empty "
        "entries (its init step is skipped), and a "
        "wrong-shaped checkpoint tensor is then kept under the default policy (it is "
        "'unexpected'), as are a DCP round trip's string keys inside state entries (no entry "
        "of the reference says they were ints); resume_optimizer checks against the "
        "optimizer's own fresh state"
    ),
    "merge-param-names": (
        "dm.merge keeps a DSD checkpoint's param_names lists in the merged groups (they are "
        "merged like hyperparameters): after a model change torch then loads the old model's "
        "names (a list of the wrong length); resume_optimizer drops them and loads the live "
        "optimizer's"
    ),
}


class Life(RuleBasedStateMachine):
    spec: Spec  # set per optimizer by machine_for

    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="life-"))
        self.saves: list[Saved] = []
        self.step_no = 0
        self.next_uid = 10
        self.changed_since_save = False

    # ----------------------------------------------------------------------------------
    # start

    @initialize(named=st.booleans())
    def start(self, named: bool) -> None:
        torch_spec = self.spec.package is None
        config = life.initial_config(named=named and torch_spec)
        if not self.spec.model.get("bias", True):
            config = config.replace(
                mods=tuple(
                    dataclasses.replace(m, groups=tuple(g for g in m.groups if g[0] != "bias"))
                    for m in config.mods
                )
            )
        self.live = life.build(self.spec, config)
        self.oracle = life.build(self.spec, config)
        self.pending = config

    # ----------------------------------------------------------------------------------
    # train and save

    @rule(k=st.integers(1, 3))
    def train(self, k: int) -> None:
        count("rule train")
        for _ in range(k):
            for run in (self.live, self.oracle):
                life.train_step(run, self.step_no)
            self.step_no += 1

    @rule(layout=st.sampled_from(LAYOUTS))
    def save(self, layout: str) -> None:
        count("rule save")
        if not CONTROLS.ok(self.spec, layout) or (layout == "int" and self.live.config.split):
            return
        where = self.tmp / f"save-{len(self.saves)}-{layout}"
        rec = self.save_both(layout, where)
        if rec is None:
            return
        self.saves.append(Saved(rec, layout, where, self.step_no, file_stamps(where)))

    # ----------------------------------------------------------------------------------
    # changes for the next resume

    def structural(self) -> bool:
        return not self.spec.one_group

    CHANGES = (
        "add_module",
        "remove_module",
        "freeze",
        "unfreeze",
        "rename",
        "grow",
        "move_param",
        "own_group",
        "change_hyperparameter",
        "split",
    )

    @rule(kind=st.sampled_from(CHANGES), data=st.data())
    def change(self, kind: str, data: st.DataObject) -> None:
        """One change of the model or optimizer, for the next resume (where it applies)."""
        structural = kind not in ("change_hyperparameter", "unfreeze")
        if structural and not self.structural():
            return
        if kind == "remove_module" and len(self.linears()) <= 1:
            return
        if kind == "freeze" and not [
            m for m in self.pending.mods if m.kind != "embed" and not m.frozen
        ]:
            return
        if kind == "unfreeze" and not any(m.frozen for m in self.pending.mods):
            return
        if kind == "move_param" and not self.bias:
            return
        if kind == "split" and self.spec.create_graph:
            return  # two Hessian estimates cannot both go through one graph (SophiaH)
        before = self.pending
        method = getattr(self, f"_{kind}")
        if kind in ("add_module", "grow", "split"):
            method()
        elif kind == "change_hyperparameter":
            method(data.draw(st.sampled_from(life.GROUPS)), data.draw(st.sampled_from([0.5, 3.0])))
        else:
            method(data)
        if not all(group_members_of(self.pending, self.spec)):
            self.pending = before  # torch refuses an optimizer without parameters
            return
        count(f"change {kind}")

    def _add_module(self) -> None:
        uid = self.next_uid
        self.next_uid += 1
        groups = tuple(g for g in life.Mod(0, "", "linear").groups if self.bias or g[0] != "bias")
        mod = Mod(uid, f"m{uid}", "linear", groups=groups)
        self.pending = self.pending.replace(mods=(mod, *self.pending.mods))  # first in its groups

    def _remove_module(self, data: st.DataObject) -> None:
        uid = data.draw(st.sampled_from(self.linears() + self.nevers()))
        self.pending = self.pending.replace(
            mods=tuple(m for m in self.pending.mods if m.uid != uid)
        )

    def _freeze(self, data: st.DataObject) -> None:
        uid = data.draw(
            st.sampled_from(
                [m.uid for m in self.pending.mods if m.kind != "embed" and not m.frozen]
            )
        )
        self.pending = self.pending.with_mod(uid, frozen=True)

    def _unfreeze(self, data: st.DataObject) -> None:
        uid = data.draw(st.sampled_from([m.uid for m in self.pending.mods if m.frozen]))
        self.pending = self.pending.with_mod(uid, frozen=False)

    def _rename(self, data: st.DataObject) -> None:
        mod = data.draw(st.sampled_from(list(self.pending.mods)))
        self.pending = self.pending.with_mod(mod.uid, name=f"r{self.next_uid}")
        self.next_uid += 1

    def _grow(self) -> None:
        embed = next(m for m in self.pending.mods if m.kind == "embed")
        self.pending = self.pending.with_mod(embed.uid, rows=embed.rows + 2)

    def _move_param(self, data: st.DataObject) -> None:
        """A bias moves to the weights' group (its new group's hyperparameters apply)."""
        mod = data.draw(st.sampled_from([m for m in self.pending.mods if m.kind != "embed"]))
        groups = tuple((p, "decay" if p == "bias" else g) for p, g in mod.groups)
        self.pending = self.pending.with_mod(mod.uid, groups=groups)

    def _own_group(self, data: st.DataObject) -> None:
        """A module's weight gets a group of its own (with its own hyperparameters)."""
        mod = data.draw(st.sampled_from([m for m in self.pending.mods if m.kind != "embed"]))
        groups = tuple((p, "extra" if p == "weight" else g) for p, g in mod.groups)
        self.pending = self.pending.with_mod(mod.uid, groups=groups)

    def _change_hyperparameter(self, group: str, factor: float) -> None:
        hp = tuple(
            (g, lr * factor, wd * factor if wd else 0.05) if g == group else (g, lr, wd)
            for g, lr, wd in self.pending.hp
        )
        self.pending = self.pending.replace(hp=hp)

    def _split(self) -> None:
        if any(s.rec.entries and any(s.rec.entries) for s in self.saves):
            return  # which of two optimizers owns an optimizer-level entry is not defined
        self.pending = self.pending.replace(split=not self.pending.split)

    # ----------------------------------------------------------------------------------
    # resume

    @precondition(lambda self: bool(self.saves))
    @rule(
        data=st.data(),
        api=st.sampled_from(["resume", "backfill", "merge", "dcp"]),
        policy=st.sampled_from(["default", "warn", "strict", "strict-none"]),
        disturb=st.sampled_from(["none", "none", "grads", "zero-step"]),
        again=st.sampled_from(LAYOUTS),
    )
    def resume(self, data: st.DataObject, api: str, policy: str, disturb: str, again: str) -> None:
        count("rule resume")
        saved = data.draw(st.sampled_from(self.saves[-3:]))
        rec, config = saved.rec, self.pending
        if self.spec.package == "heavyball" and self.spec.train_eval and disturb == "zero-step":
            disturb = "none"  # LIMITS["dsd-reference-schedule-free"]: it makes NaN weights
        if saved.step == 0 or not rec.state:  # LIMITS["save-before-first-step"]
            disturb = "none" if disturb == "zero-step" else disturb
            api = "resume" if api in ("merge", "dcp") else api
        api = self.usable_api(api, saved, config, disturb)
        if api is None or self.undetectable(saved, config):
            count("resume skipped: undetectable by position")
            return
        new = life.build(self.spec, config)
        new = self.disturb(new, disturb)
        must_refuse, why = self.expected_refusal(saved, config, policy, api)
        try:
            expected = life.oracle(self.spec, rec, config, extras=saved.layout == "int")
        except Refused as err:
            must_refuse, why = True, str(err)
            expected = None
        # dm.merge's reference is DSD's (a zero-gradient step on the live optimizer): the user's
        try:  # DSD's state dict (dm.merge's reference, load_dcp's target): the user's step
            reference = (
                get_optimizer_state_dict(new.model, new.optims) if api in ("merge", "dcp") else None
            )
        except Exception:  # noqa: BLE001 - DSD's init step fails inside the optimizer (SophiaH)
            count("resume skipped: torch cannot build DSD's reference")
            return
        if api == "dcp" and not (
            group_keys_held(reference, rec) and state_held(reference, rec, config)
        ):
            api = "resume"  # LIMITS["dcp-empty-target"]: the target lacks what is to be read
        if tied_groups(rec, config, self.spec):
            count("resume skipped: ENGINE[group-ties]")
            return
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", dm.DSDMergeWarning)
                self.do_resume(new, saved, config, api, policy, reference)
        except (dm.MergeError, dm.LayoutError) as err:
            assert file_stamps(saved.path) == saved.files, "a refused resume changed the files"
            assert policy.startswith("strict") or must_refuse or self.fine_refusal(err), (  # noqa: PT017 - a rule, not a test: whichever way it goes is checked
                f"refused under {policy} ({api}, {saved.layout}): {err}"
            )
            count(f"refused {policy} {'expected' if must_refuse else 'unpredicted'}")
            if not must_refuse and os.environ.get("LIFE_VERBOSE"):
                print(f"\nunpredicted refusal ({api}, {saved.layout}, {policy}): {err}")
            return
        assert not must_refuse, f"{api} {saved.layout} {policy}: resumed, but must refuse: {why}"
        assert expected is not None
        try:
            life.after_save(new)
        except RuntimeError as err:
            raise AssertionError(
                f"the resumed optimizer fails ({api} from {saved.layout} under {policy}, disturb "
                f"{disturb}, saved at step {saved.step}): {err}\nresumed state: "
                + repr(
                    {
                        n: {f: tuple(v.shape) for f, v in o.state[p].items() if hasattr(v, "shape")}
                        for o in new.optims
                        for n, p in new.model.named_parameters()
                        if p in o.state
                    }
                )
            ) from err
        life.after_save(expected)
        for o in new.optims:  # the forward/backward's gradients: the oracle never had them
            o.zero_grad(set_to_none=True)
        check_equal(
            expected,
            new,
            f"{api} from {saved.layout} under {policy} (disturb {disturb}; saved at step "
            f"{saved.step}, with state for {sorted(rec.state)})",
        )
        no_junk(new, expected)
        self.live, self.oracle = new, expected
        count(f"resumed {api} {saved.layout} {policy}")
        self.second_generation(again)

    # resuming is what the machine is about: two more rules draw it (rules are drawn alike)
    resume_again = resume
    resume_once_more = resume

    def usable_api(self, api: str, saved: Saved, config: Config, disturb: str) -> str | None:
        if api == "merge" and self.grown(saved, config) and has_lists(saved.rec.state):
            api = "resume"  # ENGINE["merge-list-tensors"]
        if api == "merge" and config.split:
            api = "resume"  # LIMITS["dsd-empty-state-container"]
        if api == "merge" and disturb == "grads":
            api = "resume"  # ENGINE["merge-empty-reference"]
        if api == "merge" and self.spec.train_eval and self.grown(saved, config):
            api = "resume"  # ENGINE["merge-empty-reference"]: train() made {} entries
        if api == "merge" and self.spec.package == "heavyball" and self.spec.train_eval:
            api = "resume"  # LIMITS["dsd-reference-schedule-free"]
        if api == "merge" and (saved.rec.config.named or config.named):
            api = "resume"  # ENGINE["merge-param-names"]
        if api == "dcp" and saved.layout != "dcp":
            api = "resume"
        if api == "dcp" and (self.renamed(saved, config) or self.grown(saved, config)):
            api = "resume"  # load_dcp takes no rename and does not read reshaped tensors
        if api == "dcp" and group_members(saved.rec.config, self.spec) != group_members(
            config, self.spec
        ):
            api = "resume"  # ENGINE["dcp-groups"]
        if api == "dcp" and disturb == "grads":
            api = "resume"  # LIMITS["dcp-empty-target"]
        if api == "backfill" and config.split:
            api = "resume"  # a container loads through DSD's flat path: fresh='reference' only
        return api

    def undetectable(self, saved: Saved, config: Config) -> bool:
        """int ids without names, positions whose members changed but sizes did not."""
        if saved.layout != "int" or saved.rec.config.named:
            return False
        old = group_members(saved.rec.config, self.spec)
        new = group_members(config, self.spec)
        return [len(g) for g in old] == [len(g) for g in new] and old != new and not config.split

    def expected_refusal(
        self, saved: Saved, config: Config, policy: str, api: str
    ) -> tuple[bool, str]:
        rec = saved.rec
        old_keys = set(rec.model)
        new_keys = {k for k in model_keys(config, self.bias)}
        if policy == "strict-none" and old_keys != new_keys:
            return True, "strict without allow-lists over a model change"
        # ids are positions without names: resume_optimizer / backfill map them so (dm.merge is
        # given the old model's names by the test, as its refusal says to)
        by_position = api in ("resume", "backfill", "dcp") and not rec.config.named
        if by_position and saved.layout == "int":
            old_members = group_members(rec.config, self.spec)
            if old_members != group_members(config, self.spec) or config.split:
                return True, "int ids without names cannot map across the change"
        if policy.startswith("strict") and self.conflicting(rec, config):
            return True, "a group's checkpoint members disagree on a hyperparameter"
        return False, ""

    def fine_refusal(self, err: Exception) -> bool:
        return False

    def conflicting(self, rec: Record, config: Config) -> bool:
        """Whether a live group holds checkpoint members of groups whose hyperparameters differ."""
        for members in group_members(config, self.spec):
            homes = {rec.group[k] for k in members if k in rec.group}
            values = {
                repr(sorted(rec.hp[next(k for k in members if rec.group.get(k) == h)].items()))
                for h in homes
            }
            if len(values) > 1:
                return True
        return False

    def renamed(self, saved: Saved, config: Config) -> bool:
        return bool(rename_rules(saved.rec.config, config))

    def grown(self, saved: Saved, config: Config) -> bool:
        return any(
            saved.rec.model.get(k) is not None and saved.rec.model[k].shape != v
            for k, v in model_shapes(config, self.bias).items()
        )

    def disturb(self, new: Run, how: str) -> Run:
        """What the trainer did to the new objects before resuming (a new build if it failed)."""
        if how == "grads" and not self.spec.train_eval and not self.spec.closure:
            new.model(life.batch(self.step_no)).backward()
        elif how == "zero-step":  # torchtitan's state_dict() takes DSD's init step first
            try:
                for o in new.optims:
                    _init_optim_state(o)
            except Exception:  # noqa: BLE001 - DSD's own step fails inside it (SophiaH): a
                return life.build(self.spec, new.config)  # trainer could not get here
        return new

    def do_resume(
        self, new: Run, saved: Saved, config: Config, api: str, policy: str, reference: Any
    ) -> None:
        """The resume, call by call; a refused call must have changed nothing it was given."""
        rec = saved.rec
        rules = rename_rules(rec.config, config) or None
        optim_rules = rules if saved.layout != "int" or rec.config.named else None
        shape = "resize" if self.grown(saved, config) else "raise"
        pol = "strict" if policy.startswith("strict") else policy
        full = policy != "strict-none"
        m_missing, m_unexpected = model_allow(rec, config) if full else ([], [])
        o_missing, o_unexpected = (
            optim_allow(rec, config, self.spec, new, saved.layout) if full else ([], [])
        )
        options = FLAT if saved.layout == "flat" else None
        model_part = {"params": dict(new.model.named_parameters())}
        optim_part = {
            "state": [o.state for o in new.optims],
            "groups": [o.param_groups for o in new.optims],
        }
        if api == "dcp":  # loads in place, as dcp.load does: then the helpers backfill
            target = {"model": get_model_state_dict(new.model), "optim": reference}
            loaded, _ = refusing(
                [target, model_part, optim_part],
                load_dcp,
                saved.path,
                target,
                policy=pol,
                allow_missing=[f"model.{g}" for g in m_missing] + [f"optim.{g}" for g in o_missing],
                allow_unexpected=[f"model.{g}" for g in m_unexpected]
                + [f"optim.{g}" for g in o_unexpected],
            )
        else:
            loaded = load_checkpoint(saved.path)
        refusing(
            [model_part, loaded],
            resume_model,
            new.model,
            loaded["model"],
            policy=pol,
            allow_missing=m_missing,
            allow_unexpected=m_unexpected,
            rename=rules,
            on_shape_mismatch=shape,
        )
        optim_sd = loaded["optim"]
        if api in ("resume", "dcp"):
            refusing(
                [optim_part, model_part, optim_sd],
                resume_optimizer,
                new.model,
                new.optimizer,
                optim_sd,
                options=options,
                policy=pol,
                allow_missing=o_missing,
                allow_unexpected=o_unexpected,
                rename=optim_rules,
                on_shape_mismatch=shape,
            )
        elif api == "backfill":
            (o,) = new.optims
            sd = refusing(
                [optim_part, model_part, optim_sd],
                backfill_optimizer_state,
                o,
                optim_sd,
                model=new.model,
                policy=pol,
                allow_missing=o_missing,
                allow_unexpected=o_unexpected,
                rename=optim_rules,
                on_shape_mismatch=shape,
            )
            o.load_state_dict(sd)
        else:  # dm.merge over DSD's reference, then DSD's loader
            ckpt = optim_sd
            if saved.layout == "flat":
                ckpt = dm.unflatten(ckpt)
            elif saved.layout == "int":  # the old model's names, as the refusal says to pass
                ckpt = dm.rekey(ckpt, optimizer_order_names(rec.config, self.spec))
            merged = refusing(
                [optim_part, ckpt, reference],
                dm.merge,
                ckpt,
                reference,
                policy=pol,
                allow_missing=o_missing,
                allow_unexpected=o_unexpected,
                rename=rules,
                on_shape_mismatch=shape,
                fresh="as_fresh",
            )
            set_optimizer_state_dict(
                new.model, new.optims, merged, options=StateDictOptions(strict=False)
            )

    def second_generation(self, layout: str) -> None:
        """The next save in ``layout`` resumes strictly, bit for bit, into fresh objects."""
        if not CONTROLS.ok(self.spec, layout) or (layout == "int" and self.live.config.split):
            return
        where = self.tmp / f"next-{self.step_no}-{layout}"
        rec = self.save_both(layout, where)
        if rec is None:
            return
        fresh = life.build(self.spec, self.live.config)
        loaded = load_checkpoint(where)
        resume_model(fresh.model, loaded["model"], policy="strict")
        allow = [
            f"state.{self.live.fqn(k)}.*"
            for k, _ in life.iter_keys(fresh)
            if not has_tensors(rec.state.get(k))
        ]
        if layout == "int":  # ids are positions over the groups' params
            order = [k for g in group_members(self.live.config, self.spec) for k in g]
            allow += [
                f"state.{i}.*" for i, k in enumerate(order) if not has_tensors(rec.state.get(k))
            ]
        if layout != "int":
            allow += [f"{k}.*" for x in rec.extras for k in x]
        resume_optimizer(
            fresh.model,
            fresh.optimizer,
            loaded["optim"],
            options=FLAT if layout == "flat" else None,
            policy="strict",
            allow_missing=allow,
        )
        life.after_save(fresh)
        check_equal(self.live, fresh, f"second generation from a {layout} save")

    def save_both(self, layout: str, where: Path) -> Record | None:
        """Save the live run; the oracle goes through what saving does to a run.

        Returns the record of what was saved (taken at the save point: schedule-free
        optimizers are saved in ``eval()`` mode), or ``None`` when torch itself cannot save
        it now (DSD's init step fails inside SophiaH on an optimizer without state): the
        same happened to the oracle.
        """
        life.before_save(self.live)
        life.before_save(self.oracle)
        try:
            life.seed(9000 + self.step_no)  # DSD's init step may draw random numbers (Kron)
            try:
                save_run(self.live, layout, where)
            except Exception:  # noqa: BLE001 - torch's own save fails: nothing to resume
                failed = True
            else:
                failed = False
            if layout != "int":  # DSD's save takes a zero-gradient step on an optimizer without
                try:  # state: the oracle takes it too, failing where the live run's failed
                    life.seed(9000 + self.step_no)
                    get_optimizer_state_dict(self.oracle.model, self.oracle.optims)
                except Exception:  # noqa: BLE001
                    assert failed, "DSD fails on the oracle's optimizer but not on the live one"
            if failed:
                for run in (self.live, self.oracle):
                    for o in run.optims:
                        o.zero_grad(set_to_none=True)
                count(f"save {layout}: torch itself cannot")
                return None
            return life.record(self.live)
        finally:
            life.after_save(self.live)
            life.after_save(self.oracle)

    # ----------------------------------------------------------------------------------
    # invariants

    @invariant()
    def agrees_with_the_oracle(self) -> None:
        STEP_COUNT[0] += 1
        if hasattr(self, "live"):
            check_equal(self.oracle, self.live, "live run vs the pure-torch oracle")

    # ----------------------------------------------------------------------------------
    # helpers

    @property
    def bias(self) -> bool:
        return self.spec.model.get("bias", True)

    def linears(self) -> list[int]:
        return [m.uid for m in self.pending.mods if m.kind == "linear"]

    def nevers(self) -> list[int]:
        return [m.uid for m in self.pending.mods if m.kind == "never"]

    def teardown(self) -> None:
        import shutil

        shutil.rmtree(self.tmp, ignore_errors=True)


# --------------------------------------------------------------------------------------
# saving, keys and allow-lists


def save_run(run: Run, layout: str, where: Path) -> None:
    if layout == "dcp":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(
                {
                    "model": run.model.state_dict(),
                    "optim": get_optimizer_state_dict(run.model, run.optims),
                },
                checkpoint_id=str(where),
            )
        return
    if layout == "int":
        (o,) = run.optims
        optim_sd = o.state_dict()
    else:
        optim_sd = get_optimizer_state_dict(
            run.model, run.optims, options=FLAT if layout == "flat" else None
        )
    torch.save({"model": run.model.state_dict(), "optim": optim_sd}, where)


def refusing(targets: list[Any], fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``; if it refuses, nothing in ``targets`` changed."""
    snap = Snapshot(targets)
    try:
        return fn(*args, **kwargs)
    except dm.DSDMergeError as err:
        assert snap.unchanged(), f"a refused {fn.__name__} changed its inputs: {err}"  # noqa: PT017
        raise


def state_held(target: Any, rec: Record, config: Config) -> bool:
    """Whether DSD's state dict of the new optimizer has state for every parameter the
    checkpoint has state for (schedulefree's train() makes {} entries: DSD's init is skipped)."""
    names = {m.uid: m.name for m in config.mods}
    state = target["state"]
    return all(
        state.get(f"{names[k[0]]}.{k[1]}")
        for k in rec.state
        if k[0] in names and has_tensors(rec.state[k])
    )


def tied_groups(rec: Record, config: Config, spec: Spec) -> bool:
    """Whether a live group's members come from checkpoint groups in equal numbers, with
    different hyperparameters (which one's values apply is the engine's tie rule)."""
    for members in group_members(config, spec):
        counts: dict[Any, int] = {}
        for k in members:
            if k in rec.group:
                counts[rec.group[k]] = counts.get(rec.group[k], 0) + 1
        if len(counts) < 2:
            continue
        best = max(counts.values())
        top = [g for g, n in counts.items() if n == best]
        values = {
            repr(sorted(rec.hp[next(k for k in members if rec.group.get(k) == g)].items()))
            for g in top
        }
        if len(top) > 1 and len(values) > 1:
            return True
    return False


def group_keys_held(target: Any, rec: Record) -> bool:
    """Whether DSD's state dict of the new optimizer has every group key the checkpoint has."""
    held = {k for g in target["param_groups"] for k in g}
    return all(set(values) <= held for values in rec.hp.values())


def has_tensors(entry: Any) -> bool:
    """Whether a state entry holds a tensor anywhere (heavyball's ``{0: {}}`` holds none)."""
    stack = [entry]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            return True
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return False


def has_lists(state: dict[Key, Any]) -> bool:
    """Whether some parameter's state holds a list of tensors (PSGD's, SOAP's factors)."""
    stack = list(state.values())
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in node):
            return True
    return False


def file_stamps(where: Path) -> dict[str, tuple[int, int]]:
    paths = [where] if where.is_file() else sorted(p for p in where.rglob("*") if p.is_file())
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in paths}


def model_keys(config: Config, bias: bool) -> list[Key]:
    return list(model_shapes(config, bias))


def model_shapes(config: Config, bias: bool) -> dict[Key, tuple[int, ...]]:
    out: dict[Key, tuple[int, ...]] = {}
    for m in config.mods:
        if m.kind == "embed":
            out[(m.uid, "weight")] = (m.rows, life.D)
        else:
            out[(m.uid, "weight")] = (life.D, life.D)
            if bias:
                out[(m.uid, "bias")] = (life.D,)
    return out


def group_members(config: Config, spec: Spec) -> list[list[Key]]:
    """Per optimizer group (optimizers after one another), its members, by key."""
    net_keys = [(m, p) for m in config.mods for p, _ in m.groups]
    parts = [0, 1] if config.split else [None]
    out = []
    for part in parts:
        groups: dict[str, list[Key]] = {g: [] for g in life.GROUPS}
        for i, m in enumerate(config.mods):
            if m.frozen or (part is not None and i % 2 != part):
                continue
            for pname, g in m.groups:
                groups["decay" if spec.one_group else g].append((m.uid, pname))
        out += [v for g, v in groups.items() if v]
    del net_keys
    return out


def group_members_of(config: Config, spec: Spec) -> list[list[Key]]:
    """Per optimizer, all its members (an empty one: torch refuses to build it)."""
    parts = [0, 1] if config.split else [None]
    out = []
    for part in parts:
        out.append(
            [
                (m.uid, p)
                for i, m in enumerate(config.mods)
                if not m.frozen and (part is None or i % 2 == part)
                for p, _ in m.groups
            ]
        )
    return out


def optimizer_order_names(config: Config, spec: Spec) -> list[str]:
    names = {m.uid: m.name for m in config.mods}
    return [f"{names[k[0]]}.{k[1]}" for g in group_members(config, spec) for k in g]


def rename_rules(old: Config, new: Config) -> dict[str, str]:
    rules = {}
    for m in new.mods:
        was = old.mod(m.uid)
        if was is not None and was.name != m.name:
            rules[rf"^{re.escape(was.name)}\."] = f"{m.name}."
    return rules


def model_allow(rec: Record, config: Config) -> tuple[list[str], list[str]]:
    new = {m.uid: m.name for m in config.mods}
    old = {m.uid: m.name for m in rec.config.mods}
    missing = sorted(f"{new[u]}.*" for u in new if u not in old)
    unexpected = sorted(f"{old[u]}.*" for u in old if u not in new)
    return missing, unexpected


def optim_allow(
    rec: Record, config: Config, spec: Spec, new: Run, layout: str
) -> tuple[list[str], list[str]]:
    """The allow-lists the change needs, by fqn (and by int id where ids are positions)."""
    names_new = {m.uid: m.name for m in config.mods}
    names_old = {m.uid: m.name for m in rec.config.mods}
    optimized_new = [k for g in group_members(config, spec) for k in g]
    optimized_old = [k for g in group_members(rec.config, spec) for k in g]
    missing, unexpected = [], []
    for i, k in enumerate(optimized_new):
        if not has_tensors(rec.state.get(k)):
            fqn = f"{names_new[k[0]]}.{k[1]}"
            missing += [f"state.{fqn}.*", f"param_groups.{fqn}.*", f"state.{i}.*"]
    for k in optimized_old:
        if k not in optimized_new:
            fqn = f"{names_new.get(k[0], names_old[k[0]])}.{k[1]}"
            unexpected += [f"state.{fqn}.*", f"param_groups.{fqn}.*"]
    if layout != "int":
        missing += [
            f"{k}.*"
            for o in new.optims
            for k in o.state_dict()
            if k not in ("state", "param_groups")
        ]
    return missing, unexpected


# --------------------------------------------------------------------------------------
# comparing


def check_equal(expected: Run, actual: Run, what: str) -> None:
    diffs = [
        f"param {d}"
        for d in story.tree_differences(
            {n: p.detach() for n, p in expected.model.named_parameters()},
            {n: p.detach() for n, p in actual.model.named_parameters()},
        )
    ]
    assert len(expected.optims) == len(actual.optims), what
    for n, (e, a) in enumerate(zip(expected.optims, actual.optims, strict=True)):
        diffs += [
            f"optimizer {n} {d}"
            for d in story.tree_differences(
                story.without_empty_entries(e.state_dict()),
                story.without_empty_entries(a.state_dict()),
            )
        ]
    if diffs:
        shown = "\n  ".join(diffs[:20])
        raise AssertionError(f"{what}: {len(diffs)} difference(s):\n  {shown}")


def no_junk(run: Run, expected: Run) -> None:
    for o, e in zip(run.optims, expected.optims, strict=True):
        params = {id(p) for g in o.param_groups for p in g["params"]}
        own = {k for k in o.state if not (isinstance(k, torch.Tensor) and id(k) in params)}
        allowed = {k for k in e.state if not isinstance(k, torch.Tensor)}
        assert own <= allowed, (
            f"optimizer.state holds keys the optimizer would not: {own - allowed}"
        )


# --------------------------------------------------------------------------------------
# the tests


def machine_for(spec: Spec) -> type[Life]:
    return type(f"Life_{re.sub(r'[^A-Za-z0-9]', '_', spec.id)}", (Life,), {"spec": spec})


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_life_of_a_run(spec: Spec, monkeypatch: pytest.MonkeyPatch) -> None:
    story.require(spec, monkeypatch)
    run_state_machine_as_test(
        machine_for(spec),
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            # LIFE_NO_SHRINK=1: the first failure as found (a long look, faster)
            **({"phases": NO_SHRINK} if os.environ.get("LIFE_NO_SHRINK") else {}),
        ),
    )


def test_zz_the_machine_resumed() -> None:
    """What the machines did in this run (shown with -s): when they ran, they resumed,
    through every path, and refused what they must."""
    print(
        f"\nlife of a run: {STEP_COUNT[0]} steps; "
        + ", ".join(f"{k}: {v}" for k, v in sorted(STATS.items()))
    )
    if STEP_COUNT[0] > 1000:  # the whole zoo ran
        for api in ("resume", "backfill", "merge", "dcp"):
            assert any(k.startswith(f"resumed {api} ") for k in STATS), (api, STATS)
        assert any(k.startswith("refused") and "expected" in k for k in STATS), STATS
