"""One call per resume: merge a loaded checkpoint over what you have now, then load it.

The calls a trainer makes where it used to call ``set_optimizer_state_dict`` /
``model.load_state_dict`` / ``dcp.load``:

* :func:`resume_optimizer`: merges a loaded optimizer state dict (flattened or
  nested DSD, or a plain ``optimizer.state_dict()``) over the state the live
  optimizers accept, applies the policy, and loads the result into each optimizer
  with its own ``Optimizer.load_state_dict``; returns the
  :class:`~dsdmerge.KeyDiff`.
* :func:`backfill_optimizer_state`: the same merge for a trainer's own load hook
  (verl's ``_backfill_optimizer_state(self, state_dict) -> dict``): it returns the
  dict to pass to ``optimizer.load_state_dict`` instead of loading it.
* :func:`resume_model`: the same for a model state dict, loaded strictly.
* :func:`load_dcp`: a DCP directory loaded like ``dcp.load``, but only after its
  metadata was checked against the state dict under the policy, partially only
  when the policy accepted exactly what is missing, and without running pickled
  code.

Nothing changes before the verdict
----------------------------------
The reference the checkpoint is merged over is built from the optimizers' own
``state_dict()`` and the checkpoint (see :mod:`dsdmerge.integrations._optim`):
no optimizer step is taken and no parameter is touched, so a refused resume
leaves the model and the optimizers exactly as they were. (DSD's
``get_optimizer_state_dict`` takes a real ``step()`` with zero gradients to build
its reference; on an optimizer container that step runs at the real learning rate.)

Fresh state, explicit
---------------------
``fresh="as_fresh"`` (the default) gives a parameter without checkpointed state the
state a new optimizer has: none (the optimizer initialises it lazily on its next
step, exactly as an optimizer that never saw a checkpoint would, bit for bit), or
what the optimizer's constructor makes (Adagrad's accumulators), whatever the live
optimizer holds (torchtitan's ``state_dict()`` takes a zero-gradient step first: that
step's state is not kept). ``fresh="reference"`` gives it what DSD's zero-gradient
step would (Adam: ``step == 1``, and with L2 ``weight_decay`` non-zero moments),
computed on a throwaway copy of the optimizer (one copy of the parameters, briefly).
A parameter with *some* state in the checkpoint keeps all of it, and gets the fields
it lacks from the live optimizer (or, with ``"reference"``, from that step).

Only the optimizer's own state
------------------------------
Loaded: the state of every parameter the optimizers optimize, and the entries they
keep besides (MADGRAD's ``state['k']``). The state of a parameter no longer optimized
(removed, or frozen and left out of the optimizer) is reported unexpected and left
out: under its fqn it would break the next ``get_optimizer_state_dict``. Every state
tensor loaded is checked against the shape and dtype the optimizer gives that field
for that parameter: its live state, else its own zero-gradient step on a throwaway
twin (:mod:`dsdmerge.integrations._fresh`: on meta tensors, no memory; on a copy of
the parameters only when that step cannot run on meta tensors or finds a difference),
and refused, reported or resized as the merge does any tensor.

All or nothing
--------------
Everything is decided before anything is loaded. An optimizer that loads with torch's
own code (its class's ``load_state_dict`` and ``__setstate__`` are torch's, no load
hooks) is loaded directly: torch's load changes nothing but the optimizer's ``state``
and ``param_groups`` attributes, which it replaces rather than edits, so a load that
fails is undone exactly by putting the old objects back. Every other optimizer's part
is first loaded into a meta twin, where torch's own checks and the optimizer's load
hooks run: what they would reject is refused before any optimizer changes. If a load
still fails, the optimizers loaded before it get their state back, and a
:class:`~dsdmerge.MergeError` says so.

Int ids
-------
A plain ``optimizer.state_dict()`` names parameters by position. With torch's
``param_names`` the names decide wherever positions moved; without them, a change
positions cannot map (group sizes differ, or the state at a position does not fit the
parameter there) is refused, saying to pass the old model's names
(``dsdmerge.rekey(loaded, old_model.named_parameters())``); dsdmerge never guesses.
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from dsdmerge._gc import gc_paused
from dsdmerge._ids import normalise_ids, respelled_state
from dsdmerge._options import Fresh, MergeOptions
from dsdmerge._pipeline import run, verdict
from dsdmerge._trees import copy_tree, holds_value
from dsdmerge._values import short_repr
from dsdmerge._verdict import reshaped
from dsdmerge.convert import convert_checkpoint
from dsdmerge.diff import KeyDiff
from dsdmerge.errors import DSDMergeWarning, LayoutError, MergeError, StateDictTypeError
from dsdmerge.flatten import flatten, unflatten
from dsdmerge.integrations._dcp import dcp_load_into, read_dcp_view
from dsdmerge.integrations._dcp_surgery import load_changed
from dsdmerge.integrations._fresh import twin
from dsdmerge.integrations._optim import (
    Expected,
    Mismatched,
    Slots,
    expected_state,
    field_mismatches,
    init_state,
    inner_optimizers,
    leaf_optimizers,
    made_with_the_optimizer,
    param_fqns,
    uses_fsdp1,
)
from dsdmerge.integrations._trust import Trust
from dsdmerge.layout import (
    PARAM_GROUPS,
    PARAM_NAMES,
    PARAMS,
    STATE,
    Layout,
    classify,
    is_optimizer_state_dict,
    require_mapping,
)
from dsdmerge.policy import InvalidPolicyError, Policy, PolicyName
from dsdmerge.rekey import rekey
from dsdmerge.rename import rename as dm_rename
from dsdmerge.resize import OnShapeMismatch

if TYPE_CHECKING:
    import os

    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from dsdmerge.convert import Conversions
    from dsdmerge.rename import Rules

__all__ = [
    "DCPLoad",
    "Fresh",
    "backfill_optimizer_state",
    "load_dcp",
    "resume_model",
    "resume_optimizer",
]


def resume_optimizer(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    loaded: Mapping[Any, Any],
    /,
    *,
    options: StateDictOptions | None = None,
    policy: PolicyName | Policy = "default",
    allow_missing: str | Iterable[str] = (),
    allow_unexpected: str | Iterable[str] = (),
    fresh: Fresh = "as_fresh",
    rename: Rules | None = None,
    convert: Conversions | None = None,
    on_shape_mismatch: OnShapeMismatch = "raise",
) -> KeyDiff:
    """Load a checkpoint's optimizer state into ``optimizers``, merged over what they accept.

    ``loaded`` may be flattened (``flatten_optimizer_state_dict=True``) or nested
    DSD state (fqn-keyed), or a plain ``optimizer.state_dict()`` (int ids; one
    optimizer). ``optimizers`` may be one optimizer, several (they share one
    fqn-keyed state dict, as DSD builds it), or a container holding several
    (torchtitan's ``OptimizersContainer``, VeOmni's ``MultiOptimizer``).

    Every checkpoint value of a parameter that still exists is kept, state fields
    the optimizer would not create included (``Optimizer.load_state_dict`` keeps
    them too), as are optimizer-level entries and extra top-level keys; only the
    state of parameters that no longer exist is left out, and reported as
    unexpected. A backfilled hyperparameter takes its param group's checkpoint
    value. The policy decides before anything changes: a refusal leaves the model
    and the optimizers exactly as they were (no optimizer step is taken to build
    the reference). Each optimizer then loads its part with its own
    ``Optimizer.load_state_dict``, or with DSD's ``set_optimizer_state_dict``
    when ``options`` ask for full state dicts or the model has FSDP1 modules. As
    with ``Optimizer.load_state_dict``, the optimizers take the checkpoint's
    tensors as their state. Does not modify ``loaded``.

    Args:
        model: The model the optimizers optimize (or a list of model parts).
        optimizers: One optimizer, several, or an optimizer container.
        loaded: The optimizer state dict read from the checkpoint.
        options: The ``StateDictOptions`` it was saved with (``None``: defaults);
            they matter for the load only (full state dicts, broadcast).
        policy: ``"default"``, ``"warn"``, ``"strict"`` or a :class:`~dsdmerge.Policy`.
        allow_missing: Globs over flat keys the checkpoint may lack, e.g.
            ``"state.indexer.*"``.
        allow_unexpected: Globs over flat keys the optimizers may lack.
        fresh: ``"as_fresh"`` (default) leaves parameters without checkpointed
            state without state, to start exactly like a new optimizer;
            ``"reference"`` gives them DSD's zero-gradient state (``step == 1``).
        rename: Rename rules applied to the checkpoint's fqns first (see
            :func:`dsdmerge.rename`; a preset name such as ``"ddp"`` works). An
            int-keyed ``loaded`` is keyed by fqns first when its groups carry
            torch's ``param_names``; otherwise rekey it with :func:`dsdmerge.rekey`.
        convert: Layout conversions applied to the checkpoint next (see
            :func:`dsdmerge.convert`: records and preset names such as ``"qkv"``):
            moments, steps and hyperparameters of fused, split, stacked or
            transposed parameters carry over, so that training continues exactly
            (for elementwise optimizers). Int-keyed ``loaded`` needs ``param_names``.
        on_shape_mismatch: ``"raise"``, ``"take_reference"`` or ``"resize"``
            (the trained slice of each moment kept; see :func:`dsdmerge.merge`).
            Pass what you passed to :func:`resume_model`. Every state tensor is
            checked against the shape the optimizer gives that field (see the
            module); the rows a resize adds start from the optimizer's own fresh
            state (zero moments for Adam).

    Returns:
        The :class:`~dsdmerge.KeyDiff` of ``loaded`` against what the optimizers accept.

    Raises:
        MergeError: The policy rejects a difference, a state tensor does not fit its
            parameter, int ids cannot be mapped by position, or torch's own load
            rejects a value (nothing was loaded, or what was is undone).
        LayoutError: ``loaded`` is malformed, or int-keyed with several optimizers.
        StateDictTypeError: ``loaded`` is not a mapping, or no optimizer was given.
        InvalidPolicyError: Bad ``policy``, allow-lists or ``fresh``.

    Examples:
        >>> import torch, dsdmerge as dm
        >>> from dsdmerge.integrations import resume_optimizer
        >>> model = torch.nn.Linear(2, 2)
        >>> saved = {"state": {}, "param_groups": [{**torch.optim.SGD(model.parameters(),
        ...     lr=0.5).state_dict()["param_groups"][0], "params": ["weight", "bias"]}]}
        >>> optim = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> resume_optimizer(model, optim, saved)
        KeyDiff(missing=(), unexpected=(), mismatched=())
        >>> optim.param_groups[0]["lr"]
        0.5
    """
    merge_options = MergeOptions.of(
        policy,
        allow_missing=allow_missing,
        allow_unexpected=allow_unexpected,
        rename=rename,
        convert=convert,
        on_shape_mismatch=on_shape_mismatch,
        fresh=fresh,
    )
    plan = plan_resume(model, optimizers, loaded, merge_options, stacklevel=3)
    with gc_paused():  # torch's load makes a dict per parameter, none of them cyclic
        _load(plan, model, options)
    return plan.diff


def backfill_optimizer_state(
    optimizer: torch.optim.Optimizer,
    loaded: Mapping[Any, Any],
    /,
    *,
    model: torch.nn.Module | Sequence[torch.nn.Module] | None = None,
    policy: PolicyName | Policy = "default",
    allow_missing: str | Iterable[str] = (),
    allow_unexpected: str | Iterable[str] = (),
    fresh: Fresh = "as_fresh",
    rename: Rules | None = None,
    convert: Conversions | None = None,
    on_shape_mismatch: OnShapeMismatch = "raise",
) -> dict[Any, Any]:
    """The state dict to pass to ``optimizer.load_state_dict``: ``loaded``, merged and checked.

    For a trainer's load hook, between ``torch.load`` and
    ``optimizer.load_state_dict`` (verl's ``_backfill_optimizer_state(self,
    state_dict) -> dict``): the same merge and policy as
    :func:`resume_optimizer`, without loading anything::

        def _backfill_optimizer_state(self, state_dict):
            return backfill_optimizer_state(self.optimizer, state_dict, model=self.model,
                                            policy="strict", allow_missing=["state.*indexer*"])

    * A plain optimizer: the result is an int-keyed ``optimizer.state_dict()``
      in the optimizer's own parameter order, whatever ``loaded`` was
      (fqn-keyed state needs ``model``).
    * An optimizer container whose ``load_state_dict`` goes through DSD's
      flattened ``set_optimizer_state_dict`` (torchtitan's
      ``OptimizersContainer``, VeOmni's ``MultiOptimizer``): the result is that
      flattened form, complete, as DSD needs it; DSD then gives every parameter
      state, so only ``fresh="reference"`` can be honoured (the default raises,
      saying so; :func:`resume_optimizer` starts parameters fresh with containers
      too).

    Nothing changes before the verdict, and nothing is loaded. Does not modify
    its inputs.

    The arguments come in :func:`resume_optimizer`'s order: what loads, then what
    was loaded. The order of earlier releases, ``(loaded, optimizer)``, still works
    for one release, with a ``DeprecationWarning``.

    Args:
        optimizer: The live optimizer (or container) that will load the result.
        loaded: The optimizer state dict read from the checkpoint.
        model: The model (or model parts); needed for fqn-keyed state.
        policy: ``"default"``, ``"warn"``, ``"strict"`` or a :class:`~dsdmerge.Policy`.
        allow_missing: Globs over flat keys the checkpoint may lack.
        allow_unexpected: Globs over flat keys the optimizer may lack.
        fresh: ``"as_fresh"`` or ``"reference"`` (see :func:`resume_optimizer`).
        rename: Rename rules for the checkpoint's fqns (see :func:`resume_optimizer`).
        convert: Layout conversions applied next (see :func:`resume_optimizer`).
        on_shape_mismatch: ``"raise"``, ``"take_reference"`` or ``"resize"``.

    Returns:
        A new state dict for ``optimizer.load_state_dict``.

    Raises:
        MergeError: The policy rejects a difference.
        InvalidPolicyError: ``fresh="as_fresh"`` with a DSD-loading container.
        StateDictTypeError: Fqn-keyed ``loaded`` without ``model``.

    Examples:
        >>> import torch
        >>> from dsdmerge.integrations import backfill_optimizer_state
        >>> model = torch.nn.Linear(2, 1)
        >>> optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> saved = {"state": {0: {"momentum_buffer": torch.ones(1, 2)}},
        ...          "param_groups": [{**optim.param_groups[0], "lr": 0.5, "params": [0, 1]}]}
        >>> sd = backfill_optimizer_state(optim, saved)
        >>> optim.load_state_dict(sd)
        >>> optim.param_groups[0]["lr"], sorted(optim.state_dict()["state"])
        (0.5, [0])
    """
    if isinstance(optimizer, Mapping) and not isinstance(loaded, Mapping):  # the old order
        warnings.warn(
            "backfill_optimizer_state(loaded, optimizer) is deprecated: pass "
            "backfill_optimizer_state(optimizer, loaded), resume_optimizer's order",
            DeprecationWarning,
            stacklevel=2,
        )
        optimizer, loaded = loaded, optimizer
    merge_options = MergeOptions.of(
        policy,
        allow_missing=allow_missing,
        allow_unexpected=allow_unexpected,
        rename=rename,
        convert=convert,
        on_shape_mismatch=on_shape_mismatch,
        fresh=fresh,
    )
    container = inner_optimizers(optimizer) is not None
    if container and fresh == "as_fresh":
        raise InvalidPolicyError(
            f"{type(optimizer).__name__} loads through DSD's flattened set_optimizer_state_dict, "
            "which gives every parameter optimizer state, so parameters cannot start fresh "
            "that way: pass fresh='reference' (DSD's zero-gradient state), or load with "
            "resume_optimizer(model, optimizer, loaded), which starts them fresh."
        )
    plan = plan_resume(model, optimizer, loaded, merge_options, stacklevel=3)
    if container:
        return flatten(_fqn_keyed(plan))
    if len(plan.dicts) != 1:
        raise LayoutError(
            f"{len(plan.dicts)} optimizers were found behind {type(optimizer).__name__}, whose "
            "load_state_dict dsdmerge does not know how to feed; use resume_optimizer"
        )
    return plan.dicts[0]


# --------------------------------------------------------------------------------------
# the plan: everything decided before anything changes


@dataclasses.dataclass
class _Plan:
    slots: Slots
    dicts: list[dict[Any, Any]]  # one optimizer.state_dict() per leaf optimizer
    diff: KeyDiff


def plan_resume(
    model: Any,
    optimizers: Any,
    loaded: Mapping[Any, Any],
    options: MergeOptions,
    *,
    stacklevel: int,  # as for warnings.warn, counted from here (1: plan_resume)
) -> _Plan:
    """Everything a resume decides before anything changes: the state dicts to load.

    The cyclic collector is paused meanwhile: the plan builds a few containers per
    parameter, none of them cyclic (see :mod:`dsdmerge._gc`; a twin's copies of the
    parameters are freed as soon as its step is read, see
    :func:`~dsdmerge.integrations._fresh.fresh_states`).

    Raises as the resume helpers say (nothing changed).
    """
    with gc_paused():
        return _planned(model, optimizers, loaded, options, stacklevel=stacklevel + 1)


def _planned(
    model: Any,
    optimizers: Any,
    loaded: Mapping[Any, Any],
    options: MergeOptions,
    *,
    stacklevel: int,
) -> _Plan:
    """:func:`plan_resume`, with the collector paused."""
    require_mapping(loaded, "loaded")
    rename, convert = options.rename, options.convert
    on_shape_mismatch, fresh = options.on_shape_mismatch, options.fresh
    # what the reference lacks is the state of parameters no longer optimized (every field of a
    # parameter that is, and the optimizer-level entries, are in it): left out, and reported
    pol = dataclasses.replace(options.policy, drop_unexpected=True)
    opts = leaf_optimizers(optimizers)
    checkpoint = _nested(loaded)
    if (
        _id_keyed(checkpoint)
        and model is not None
        and (rename is not None or len(opts) > 1 or _names_moved(checkpoint, opts, model))
    ):
        # torch saved the names, and positions no longer name the same parameters (or the
        # checkpoint is renamed, or split across optimizers): by name, never by position
        checkpoint = _fqn_keyed_by_param_names(checkpoint)
    if rename is not None:
        if _id_keyed(checkpoint):
            raise LayoutError(
                "rename= renames fqns, and loaded is keyed by int param ids without torch's "
                "param_names: key it by the old model's names first, with "
                "dsdmerge.rekey(loaded, old_model.named_parameters())"
            )
        # compiled rules are rules too (compile_rules passes them through)
        rules = cast("Rules", rename)
        checkpoint = dm_rename(checkpoint, rules, unmatched=pol.unmatched_rename)
    if convert is not None:
        checkpoint = convert_checkpoint(checkpoint, convert, stacklevel=stacklevel + 1)
    keyed = "id" if _id_keyed(checkpoint) else "fqn"
    if keyed == "fqn" and model is None:
        raise StateDictTypeError(
            "loaded is keyed by fqns (get_optimizer_state_dict): pass model= so that they can "
            "be matched to the optimizer's parameters"
        )
    if keyed == "id" and len(opts) != 1:
        raise LayoutError(
            f"loaded is a plain optimizer.state_dict() (int param ids), which holds one "
            f"optimizer, but {len(opts)} optimizers were given; resume each with its own "
            "state dict, or save fqn-keyed state with get_optimizer_state_dict."
        )
    slots = Slots.of(opts, model, keyed=keyed)
    by_position = False  # int ids mapped by position, without names to check them by
    if keyed == "id":
        try:
            checkpoint = _to_live_ids(checkpoint, slots)
            by_position = not _has_param_names(checkpoint)
        except MergeError:
            if model is None or not _has_param_names(checkpoint):
                raise
            # positions cannot map across the change, but torch saved the names: map by fqn
            checkpoint = _fqn_keyed_by_param_names(checkpoint)
            slots = Slots.of(opts, model, keyed="fqn")
    checkpoint = _without_param_names(checkpoint)
    c_state = checkpoint[STATE]
    live = slots.live_state()
    # DSD's fresh state (on a throwaway copy) where it is asked for
    init = init_state(slots) if fresh == "reference" else None
    # every state tensor loaded is checked against the shape and dtype its optimizer gives
    # that field: the live state where there is some, else the optimizer's own fresh state
    # (a meta twin; see dsdmerge.integrations._fresh)
    valued = [k for k in slots.every_key() if holds_value(c_state.get(k))]
    fresh_for = [k for k in valued if not live.get(k) and not (init and init.get(k))]
    expected = expected_state(slots, c_state, fresh_for) if fresh_for else None
    # a DCP round trip spells the int keys inside a parameter's state as strings too
    # (heavyball nests it under view indices 0, 1): read as the optimizer's own keys
    own = {**(expected.states if expected else {}), **{k: v for k, v in live.items() if v}}
    respelled = respelled_state(c_state, own)
    if respelled is not c_state:
        c_state = respelled
        checkpoint = {**checkpoint, STATE: c_state}
    if expected is not None and expected.unknown:
        warnings.warn(
            DSDMergeWarning(
                "dsdmerge: the shapes of the optimizer state loaded could not be checked against "
                "the optimizer's own for "
                + "; ".join(expected.unknown)
                + ". If the model changed shape, check the loaded state before stepping."
            ),
            stacklevel=stacklevel,
        )
    known = {
        **(expected.states if expected else {}),
        **{k: v for k, v in (init or {}).items() if v},
        **{k: v for k, v in live.items() if v},
    }
    if by_position:
        _refuse_misaligned(c_state, slots, known, on_shape_mismatch)
    overlays = _overlays(c_state, expected, known, pol, on_shape_mismatch)
    reference = _without_param_names(slots.reference(checkpoint, init=init, overlays=overlays))
    # renamed and converted above; the fresh state is left out below
    merge_options = dataclasses.replace(
        options, policy=pol, rename=None, convert=None, fresh="reference"
    )
    merged = run(checkpoint, reference, merge_options, stacklevel=stacklevel)
    keep: set[Any] | None = None
    state = merged.state_dict
    if fresh == "as_fresh":
        # the state an optimizer that never saw the checkpoint has: not what a zero-gradient
        # step made (torchtitan's state_dict() takes one first), but what it makes itself
        # (Adagrad's accumulators, made with the optimizer). An entry without values is no
        # state (schedulefree's train() makes {}, heavyball {0: {}}): loaded as it is, with
        # nothing backfilled into it.
        keep = set(valued)
        held = [k for k in slots.every_key() if k not in keep and live.get(k)]
        if held:
            keep.update(made_with_the_optimizer(slots, live, held))
        hollow = {
            k: c_state[k]
            for k in slots.every_key()
            if k not in keep and isinstance(c_state.get(k), Mapping)
        }
        if hollow:
            state = {**state, STATE: {**state[STATE], **hollow}}
            keep.update(hollow)
    dicts = slots.load_dicts(state, keep=keep, entry_keys=slots.entry_keys(reference))
    return _Plan(slots, dicts, merged.diff)


def _overlays(
    c_state: Mapping[Any, Any],
    expected: Expected | None,
    known: Mapping[Any, Any],
    pol: Policy,
    on_shape_mismatch: OnShapeMismatch,
) -> dict[Any, list[Mismatched]]:
    """Per slot key, the checkpoint's state fields whose tensors the optimizer shapes otherwise.

    ``known``: per slot key, the state the optimizer gives the parameter (its live state,
    DSD's, or the twin's of ``expected``). Where it came from the twin, the differing
    fields go into the reference (the optimizer's own values there), so that the merge
    reports, refuses or resizes them as it does any tensor (the live and DSD's state are
    in the reference already). Fields inside lists (PSGD's factor lists), which the merge
    takes as opaque values, cannot be resized and are refused here, whatever their source.

    Raises:
        MergeError: A list field differs, or a differing field would be resized or taken
            from the reference but the optimizer's fresh state is known only on meta
            tensors (its step failed on a real copy).
    """
    out: dict[Any, list[Mismatched]] = {}
    in_lists: list[str] = []
    no_values: list[str] = []
    needs_values = on_shape_mismatch != "raise" or pol.shape != "raise"
    twin_states = expected.states if expected else {}
    checked = expected.checked if expected else frozenset()
    for key, fresh in known.items():
        entry = c_state.get(key)
        from_twin = key in twin_states and twin_states[key] is fresh
        if not isinstance(entry, Mapping) or (from_twin and key in checked):
            continue
        found = field_mismatches(entry, fresh)
        for m in found:
            where = ".".join(map(str, (STATE, key, *m.path)))
            text = (
                f"{where} ({_tensor_text(m.checkpoint)} in the checkpoint, "
                f"{_tensor_text(m.fresh)} fresh)"
            )
            if m.in_list and m.reshaped:
                in_lists.append(text)
            elif (
                from_twin
                and needs_values
                and expected
                and key not in expected.real
                and (m.reshaped)
            ):
                no_values.append(text)
        fields = [m for m in found if not m.in_list]
        if fields and from_twin:
            out[key] = fields
    problems = []
    if in_lists:
        problems.append(
            f"{len(in_lists)} optimizer state tensor(s) inside lists do not have the shape "
            f"their optimizer gives them: {', '.join(in_lists[:10])}; torch's optimizers load "
            "state without checking its shape, and the next step would fail or broadcast it. "
            "Tensors in lists cannot be resized."
        )
    if no_values:
        problems.append(
            f"{len(no_values)} optimizer state tensor(s) do not have the shape their optimizer "
            f"gives them: {', '.join(no_values[:10])}, and the optimizer's fresh values for them "
            "are not known (its step failed on a copy of it), so they cannot be resized or "
            "taken fresh."
        )
    if problems:
        text = "\n".join(f"  - {t}" for t in problems)
        raise MergeError(f"cannot resume:\n{text}", problems=tuple(problems))
    return out


def _tensor_text(t: Any) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def _refuse_misaligned(
    c_state: Mapping[Any, Any],
    slots: Slots,
    known: Mapping[Any, Any],
    on_shape_mismatch: OnShapeMismatch,
) -> None:
    """Refuse int ids mapped by position whose state does not fit the parameter there.

    A plain ``optimizer.state_dict()`` without ``param_names`` says which parameter is
    which only by position. When the state at a position does not have the shapes the
    optimizer gives the parameter now at that position, either the parameter was
    resized (``on_shape_mismatch="resize"`` says so) or the positions no longer name
    the same parameters (added, removed, reordered, frozen ones left out). The latter
    is certain when that state fits another position's parameter exactly; then, or
    when no resize was asked for, this refuses rather than guess.

    Raises:
        MergeError: Saying what to pass (the old model's names) or, when only sizes
            changed, ``on_shape_mismatch="resize"``.
    """
    (o,) = slots.optims
    order = list(itertools.chain.from_iterable(o.keys))
    bad: list[str] = []
    shifted: list[str] = []
    for key in order:
        entry = c_state.get(key)
        if not isinstance(entry, Mapping) or not entry or key not in known:
            continue
        reshaped_ = [m for m in field_mismatches(entry, known[key]) if m.reshaped]
        if not reshaped_:
            continue
        fields = ", ".join(
            f"{'.'.join(map(str, m.path))} {_tensor_text(m.checkpoint)} for {_tensor_text(m.fresh)}"
            for m in reshaped_[:3]
        )
        bad.append(f"{key} ({fields})")
        fits = [
            other
            for other in order
            if other != key and other in known and _fits(entry, known[other])
        ]
        if fits:
            shifted.append(f"{key} fits {fits[0]}")
    if not bad or (on_shape_mismatch != "raise" and not shifted):
        return
    what = (
        f"the state saved at position(s) {', '.join(shifted[:10])} exactly, "
        "so the parameters are no longer in the order the checkpoint was saved in"
        if shifted
        else "if parameters were added, removed, reordered or frozen, positions name other "
        "parameters now; if only sizes changed (a grown vocabulary), pass "
        "on_shape_mismatch='resize'"
    )
    text = (
        f"loaded is a plain optimizer.state_dict() (int param ids, no param_names), which says "
        f"which parameter is which only by position, and the state at position(s) "
        f"{', '.join(bad[:10])} does not have the shapes the optimizer gives the parameter "
        f"there now: {what}. dsdmerge does not guess: key the checkpoint by the names of the "
        "model it was saved from, dsdmerge.rekey(loaded, old_model.named_parameters()) (in the "
        "order its optimizer listed them), or save param_names with it (an optimizer built "
        "from model.named_parameters())."
    )
    raise MergeError(f"cannot resume: {text}", problems=(text,))


def _fits(entry: Mapping[Any, Any], fresh: Any) -> bool:
    """Whether a state entry has tensors in common with ``fresh`` and all of their shapes."""
    if field_mismatches(entry, fresh):
        return False
    return any(
        hasattr(entry.get(k), "shape") and hasattr(v, "shape")
        for k, v in (fresh.items() if isinstance(fresh, Mapping) else ())
        if tuple(getattr(v, "shape", ())) != ()
    )


def _load(plan: _Plan, model: Any, options: StateDictOptions | None) -> None:
    """Load each optimizer's part (the verdict has been given), all or none.

    A part whose load can be undone exactly (:func:`_undoable`) is loaded as it is; every
    other part is first loaded into a meta twin of its optimizer (no memory; torch's own
    checks and the optimizer's load hooks run there): what they reject is refused before
    any optimizer changes. If a real load still fails, the optimizers loaded so far get
    back the state they had.

    Raises:
        MergeError: torch (or the optimizer's load hooks) rejects a part.
    """
    dsd = _needs_dsd(model, options)
    # DSD's load may step the optimizer first (its state edited in place): not undoable
    undoable = [not dsd and _undoable(o.optimizer) for o in plan.slots.optims]
    for n, (o, sd) in enumerate(zip(plan.slots.optims, plan.dicts, strict=True)):
        if undoable[n]:
            continue  # a dry run would cost as much as the load and find nothing more
        try:
            tw, _ = twin(o.optimizer, kind="meta")
        except Exception:  # noqa: BLE001 - no twin, no dry run: the real load is undone
            continue
        try:
            tw.load_state_dict(sd)
        except Exception as err:
            raise _rejected(plan, n, o.optimizer, err, "nothing was loaded") from err
    parts = _fqn_keyed_each(plan) if dsd else plan.dicts
    done: list[tuple[Any, dict[str, Any] | None]] = []
    for n, (o, sd) in enumerate(zip(plan.slots.optims, parts, strict=True)):
        done.append((o, dict(vars(o.optimizer)) if undoable[n] else None))
        try:
            if dsd:
                _dsd_load(model, o.optimizer, sd, options)
            else:
                o.optimizer.load_state_dict(sd)
        except Exception as err:
            undone = _restore(done[:-1])
            _restore(done[-1:])  # torch changes nothing before its checks; a hook may have
            raise _rejected(plan, n, o.optimizer, err, undone) from err


def _undoable(optimizer: Any) -> bool:
    """Whether a failed ``optimizer.load_state_dict`` is undone by restoring its attributes.

    So it is when the load is torch's own: ``Optimizer.load_state_dict`` checks the
    groups, builds a new ``state`` and new param groups (the old ones are not edited)
    and hands them to ``__setstate__``, which torch's optimizers implement by replacing
    the two attributes (and converting the new entries' steps); only a load hook, a
    ``load_state_dict`` or a ``__setstate__`` of another package can change more.
    """
    import torch

    cls = type(optimizer)
    own = cls.load_state_dict is torch.optim.Optimizer.load_state_dict and getattr(
        cls.__setstate__, "__module__", ""
    ).startswith("torch.optim.")
    hooks = (
        getattr(optimizer, "_optimizer_load_state_dict_pre_hooks", None),
        getattr(optimizer, "_optimizer_load_state_dict_post_hooks", None),
    )
    return own and all(h is not None and not h for h in hooks)


def _dsd_load(model: Any, optimizer: Any, sd: Any, options: StateDictOptions | None) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    opts = dataclasses.replace(
        options or StateDictOptions(), flatten_optimizer_state_dict=False, strict=False
    )
    set_optimizer_state_dict(model, optimizer, sd, options=opts)


def _restore(done: list[tuple[Any, dict[str, Any] | None]]) -> str:
    """Give the optimizers in ``done`` back the state they had before; say how it went.

    ``done``: each optimizer's slot with its attributes from before a load that
    :func:`_undoable` says they undo (it gets back the very objects it held), or
    ``None``: it loads its ``state_dict()`` from before.
    """
    if not done:
        return "no optimizer was changed"
    failed = []
    for o, attrs in done:
        try:
            if attrs is not None:
                vars(o.optimizer).clear()
                vars(o.optimizer).update(attrs)
            else:
                o.optimizer.load_state_dict(o.live)
        except Exception as err:  # noqa: BLE001 - reported, the first error is the cause
            failed.append(f"{type(o.optimizer).__name__} ({type(err).__name__}: {err})")
    if failed:
        return (
            "the optimizers loaded before it could not all be given back their state: "
            + ", ".join(failed)
        )
    return "the optimizers loaded before it have their state from before again"


def _rejected(plan: _Plan, n: int, optimizer: Any, err: BaseException, what: str) -> MergeError:
    which = (
        f"optimizer {n} ({type(optimizer).__name__})"
        if len(plan.dicts) > 1
        else (type(optimizer).__name__)
    )
    text = (
        f"{which}.load_state_dict rejects the merged state: {type(err).__name__}: "
        f"{short_repr(str(err))}; {what}. The checkpoint holds a value torch cannot load "
        "(a state entry of the wrong type, such as a string step): check it with "
        "dsdmerge.diff(loaded, reference, values=True)."
    )
    return MergeError(f"cannot resume: {text}", diff=plan.diff, problems=(text,))


def _needs_dsd(model: Any, options: StateDictOptions | None) -> bool:
    """Whether loading must go through DSD: full state dicts to shard, or FSDP1 modules."""
    if options is not None and (options.full_state_dict or options.broadcast_from_rank0):
        return True
    return model is not None and uses_fsdp1(model)


def _fqn_keyed_each(plan: _Plan) -> list[dict[Any, Any]]:
    """Each optimizer's load dict with its int ids replaced by slot keys (fqns)."""
    out = []
    for o, sd in zip(plan.slots.optims, plan.dicts, strict=True):
        to_key: dict[Any, Any] = {}
        for ids, keys in zip(o.ids, o.keys, strict=True):
            to_key.update(zip(ids, keys, strict=True))
        out.append(
            {
                **{k: v for k, v in sd.items() if k not in (STATE, PARAM_GROUPS)},
                STATE: {to_key.get(k, k): v for k, v in sd[STATE].items()},
                PARAM_GROUPS: [
                    {**g, PARAMS: [to_key[i] for i in g[PARAMS]]} for g in sd[PARAM_GROUPS]
                ],
            }
        )
    return out


def _fqn_keyed(plan: _Plan) -> dict[Any, Any]:
    """All optimizers' load dicts as one fqn-keyed DSD state dict."""
    state: dict[Any, Any] = {}
    groups: list[Any] = []
    for sd in _fqn_keyed_each(plan):
        state.update(sd[STATE])
        groups.extend({k: v for k, v in g.items() if k != PARAM_NAMES} for g in sd[PARAM_GROUPS])
    return {STATE: state, PARAM_GROUPS: groups}


# --------------------------------------------------------------------------------------
# the checkpoint, as the merge sees it


def _nested(loaded: Mapping[Any, Any]) -> dict[Any, Any]:
    """``loaded`` as a nested optimizer state dict (a flattened one unflattened by DSD's rules).

    A DCP round trip drops empty containers: an optimizer without state comes back as
    ``{"param_groups": [...]}`` and is read with an empty ``state``.
    """
    if (
        STATE not in loaded
        and isinstance(loaded.get(PARAM_GROUPS), list)
        and all(isinstance(g, Mapping) and PARAMS in g for g in loaded[PARAM_GROUPS])
    ):
        loaded = {**loaded, STATE: {}}
    if classify(loaded) is Layout.FLAT:
        nested = unflatten(loaded)
        if not is_optimizer_state_dict(nested):
            raise LayoutError(
                "loaded is flat but not a flattened optimizer state dict (its keys are not all "
                "'state.<fqn>.<name>' / 'param_groups.<fqn>.<hyperparameter>'); pass the "
                "optimizer's state dict, not a whole checkpoint"
            )
        return dict(normalise_ids(nested, what="loaded"))
    if not is_optimizer_state_dict(loaded):
        raise LayoutError(
            "loaded is not an optimizer state dict: it has no 'state' mapping and "
            "'param_groups' list; pass the optimizer's part of the checkpoint"
        )
    return dict(normalise_ids(loaded, what="loaded"))


def _group_ids(osd: Mapping[Any, Any]) -> list[Any]:
    ids: list[Any] = []
    for group in osd[PARAM_GROUPS]:
        if isinstance(group, Mapping) and isinstance(group.get(PARAMS), (list, tuple)):
            ids.extend(group[PARAMS])
    return ids


def _id_keyed(osd: Mapping[Any, Any]) -> bool:
    """Whether the param groups list int ids (``optimizer.state_dict()``), not fqns."""
    ids = _group_ids(osd)
    return bool(ids) and all(type(pid) is int for pid in ids)


def _has_param_names(osd: Mapping[Any, Any]) -> bool:
    """Whether every param group carries torch's ``param_names`` (torch >= 2.5), one per param."""
    groups = [g for g in osd[PARAM_GROUPS] if isinstance(g, Mapping)]
    return bool(groups) and all(
        isinstance(g.get(PARAM_NAMES), (list, tuple))
        and len(g[PARAM_NAMES]) == len(g.get(PARAMS, ()))
        for g in groups
    )


def _fqn_keyed_by_param_names(osd: Mapping[Any, Any]) -> dict[Any, Any]:
    """An int-keyed optimizer state dict keyed by the ``param_names`` torch saved, if any."""
    if not _has_param_names(osd):
        return dict(osd)
    return rekey(osd)


def _names_moved(osd: Mapping[Any, Any], opts: Sequence[Any], model: Any) -> bool:
    """Whether torch's ``param_names`` say that positions now name other parameters."""
    if not _has_param_names(osd) or len(opts) != 1:
        return False
    fqn_of = param_fqns(model)
    live = [[_unwrapped(fqn_of.get(id(p), "")) for p in g[PARAMS]] for g in opts[0].param_groups]
    saved = [[_unwrapped(str(n)) for n in g[PARAM_NAMES]] for g in osd[PARAM_GROUPS]]
    return live != saved


_WRAPPER_SEGMENTS = (
    "module.",
    "_orig_mod.",
    "_fsdp_wrapped_module.",
    "_checkpoint_wrapped_module.",
)


def _unwrapped(name: str) -> str:
    """A parameter name without the segments wrappers add (DDP, torch.compile, FSDP1, AC).

    Names saved from a wrapped model still name the same parameters.
    """
    for seg in _WRAPPER_SEGMENTS:
        name = name.replace(seg, "")
    return name


def _to_live_ids(checkpoint: Mapping[Any, Any], slots: Slots) -> dict[Any, Any]:
    """An int-keyed checkpoint with its ids mapped to the live optimizer's, by position.

    ``Optimizer.load_state_dict`` maps params by position: group counts and sizes
    must agree (a ``MergeError`` otherwise, before anything changes).
    """
    (o,) = slots.optims
    c_groups = checkpoint[PARAM_GROUPS]
    sizes = [len(g[PARAMS]) for g in c_groups]
    live_sizes = [len(ids) for ids in o.ids]
    if sizes != live_sizes:
        text = (
            f"the checkpoint has {len(sizes)} param group(s) of sizes {sizes} but the "
            f"optimizer has {len(live_sizes)} of sizes {live_sizes}; a plain "
            "optimizer.state_dict() (int ids, no param_names) says which parameter is which "
            "only by position, so it cannot be resumed across that change, and dsdmerge does "
            "not guess. Key it by the names of the model it was saved from: "
            "dsdmerge.rekey(loaded, old_model.named_parameters()) (in the order its optimizer "
            "listed them), then resume that (or save param_names with it: an optimizer built "
            "from model.named_parameters())."
        )
        raise MergeError(f"cannot resume: {text}", problems=(text,))
    mapping: dict[Any, Any] = {}
    for g, ids in zip(c_groups, o.ids, strict=True):
        for old, new in zip(g[PARAMS], ids, strict=True):
            mapping.setdefault(old, new)
    state = {mapping.get(k, k): v for k, v in checkpoint[STATE].items()}
    groups = [{**g, PARAMS: [mapping[p] for p in g[PARAMS]]} for g in c_groups]
    return {**checkpoint, STATE: state, PARAM_GROUPS: groups}


def _without_param_names(osd: Mapping[Any, Any]) -> dict[Any, Any]:
    """``param_names`` (torch's bookkeeping in groups, >= 2.5) left out: not a difference.

    The live optimizer's names are put back when loading.
    """
    groups = osd[PARAM_GROUPS]
    if not any(isinstance(g, Mapping) and PARAM_NAMES in g for g in groups):
        return dict(osd)
    return {
        **osd,
        PARAM_GROUPS: [
            {k: v for k, v in g.items() if k != PARAM_NAMES} if isinstance(g, Mapping) else g
            for g in groups
        ],
    }


def resume_model(
    model: torch.nn.Module,
    loaded: Mapping[str, Any],
    /,
    *,
    options: StateDictOptions | None = None,
    policy: PolicyName | Policy = "default",
    allow_missing: str | Iterable[str] = (),
    allow_unexpected: str | Iterable[str] = (),
    rename: Rules | None = None,
    convert: Conversions | None = None,
    on_shape_mismatch: OnShapeMismatch = "raise",
) -> KeyDiff:
    """Load a checkpoint's model state dict into ``model``, merged over its current state.

    The reference is ``get_model_state_dict(model, options=options)``: keys the
    checkpoint lacks keep the model's current values (a new head keeps its
    initialisation), unexpected keys are left out, and the merged state dict is
    loaded with ``set_model_state_dict`` *strictly*, so nothing is skipped that
    the policy did not accept. A shape mismatch the policy lets through keeps
    the model's tensor. Does not modify ``loaded``.

    Args:
        model: The model to load into.
        loaded: The model state dict read from the checkpoint.
        options: ``StateDictOptions`` for ``get/set_model_state_dict`` (``None``:
            defaults); ``strict`` is always on.
        policy: ``"default"``, ``"warn"``, ``"strict"`` or a :class:`~dsdmerge.Policy`.
        allow_missing: Globs over keys the checkpoint may lack, e.g. ``"head.*"``.
        allow_unexpected: Globs over keys the model may lack.
        rename: Rename rules applied to the checkpoint's keys first (see
            :func:`dsdmerge.rename`; ``"ddp"``, ``"compile"``, ... presets work).
        convert: Layout conversions applied next (see :func:`dsdmerge.convert`;
            ``"qkv"``, ``"stack_experts"``, ... presets work).
        on_shape_mismatch: ``"raise"``, ``"take_reference"`` or ``"resize"`` (a
            grown vocabulary keeps its trained rows; see :func:`dsdmerge.merge`).

    Returns:
        The :class:`~dsdmerge.KeyDiff` of ``loaded`` against the model's state dict.

    Raises:
        MergeError: The policy rejects a difference (nothing was loaded).
        LayoutError: ``loaded`` is nested (pass the model's own state dict).
        StateDictTypeError: ``loaded`` is not a mapping.

    Examples:
        >>> import torch
        >>> from dsdmerge.integrations import resume_model
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> old = {"0.weight": torch.ones(2, 2), "0.bias": torch.zeros(2)}
        >>> resume_model(model, old, policy="strict", allow_missing="1.*").missing
        ('1.weight', '1.bias')
        >>> model[0].weight.sum().item()
        4.0
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    require_mapping(loaded, "loaded")
    merge_options = MergeOptions.of(
        policy,
        allow_missing=allow_missing,
        allow_unexpected=allow_unexpected,
        rename=rename,
        convert=convert,
        on_shape_mismatch=on_shape_mismatch,
    )
    # what has no parameter to go to is left out: a strict load would reject it
    merge_options = dataclasses.replace(
        merge_options, policy=dataclasses.replace(merge_options.policy, drop_unexpected=True)
    )
    opts = dataclasses.replace(options or StateDictOptions(), strict=True)
    reference = get_model_state_dict(model, options=opts)
    merged = run(loaded, reference, merge_options, stacklevel=2)
    set_model_state_dict(model, merged.state_dict, options=opts)
    return merged.diff


class DCPLoad(NamedTuple):
    """The result of :func:`load_dcp`.

    Attributes:
        state_dict: What was read from the checkpoint, in the structure of the
            state dict passed in: every key both have, none of the missing ones.
        diff: The :class:`~dsdmerge.KeyDiff` of the checkpoint's metadata
            against the state dict passed in.
    """

    state_dict: dict[str, Any]
    diff: KeyDiff


def load_dcp(
    path: str | os.PathLike[str],
    state_dict: Mapping[str, Any],
    /,
    *,
    policy: PolicyName | Policy = "default",
    allow_missing: str | Iterable[str] = (),
    allow_unexpected: str | Iterable[str] = (),
    trusted: Trust = False,
    process_group: Any = None,
    storage_reader: Any = None,
    rename: Rules | None = None,
    convert: Conversions | None = None,
    on_shape_mismatch: OnShapeMismatch = "raise",
) -> DCPLoad:
    r"""Load a DCP checkpoint into ``state_dict``'s tensors, after checking it under a policy.

    1. Reads the checkpoint's ``.metadata`` only (safely, see
       :func:`~dsdmerge.integrations.read_metadata`) and applies the policy to
       its difference from ``state_dict`` with :func:`dsdmerge.check`: a
       rejected difference raises before any tensor is read.
    2. Loads with ``dcp.load``, with ``allow_partial_load`` only when the policy
       accepted missing keys, so what is skipped is exactly what was accepted.
       Unexpected keys are never read; tensors whose shape differs (when the
       policy lets that through) are not read either.

    As with ``dcp.load``, tensors are loaded *in place* into the tensors of
    ``state_dict`` (pass state dicts from ``get_model_state_dict`` /
    ``get_optimizer_state_dict`` to load straight into sharded DTensors); its
    containers are not modified. Non-tensor values load with
    ``weights_only=True`` unless ``trusted``. Collective when
    ``torch.distributed`` is initialised (every rank calls it), like ``dcp.load``.
    Then hand the parts of the result to :func:`resume_model` and
    :func:`resume_optimizer`, which backfill what is missing.

    With ``rename=``, ``convert=`` or ``on_shape_mismatch="resize"``, the metadata is
    renamed and converted first (as :func:`dsdmerge.check` does it) and the policy
    decides on that. Keys that load unchanged are read in place as above; renamed,
    converted and resized ones are read under their old names into new buffers,
    converted, and copied into ``state_dict``'s tensors (a resized one: the
    overlapping slice, the rest keeps its values; listed in ``diff.resized``). Keys
    that end up unexpected are never read, and a refused call reads nothing and
    changes nothing. These keys must be plain tensors (not DTensors) stored under
    their flat name (a model, or a flattened optimizer state dict).

    Values that are ``Stateful`` (anything with ``state_dict()`` and
    ``load_state_dict()``: a trainer's model, optimizer, lr-scheduler or
    train-state wrappers, e.g. torchtitan's ``CheckpointManager._states_to_load()``)
    are treated as ``dcp.load`` treats them: their ``state_dict()`` is what is
    checked and loaded into, and each then gets ``load_state_dict()`` with what was
    read, keys the checkpoint lacks keeping their current values.

    Args:
        path: The checkpoint directory.
        state_dict: The state dict to load into, e.g. ``{"model":
            get_model_state_dict(model), "optim": get_optimizer_state_dict(...)}``,
            or ``{"model": ModelWrapper, "optimizer": optimizers, ...}``.
        policy: ``"default"``, ``"warn"``, ``"strict"`` or a :class:`~dsdmerge.Policy`.
        allow_missing: Globs over flat keys (as :func:`dsdmerge.flatten` spells
            ``state_dict``) the checkpoint may lack.
        allow_unexpected: Globs over flat keys ``state_dict`` may lack.
        trusted: ``False``, a list of ``"module.Name"`` globals to allow (in bytes
            entries, and as storage classes of ``.metadata``), or ``True``: unpickle
            without restriction (only for trusted checkpoints); as for
            :func:`~dsdmerge.integrations.read_metadata`.
        process_group: Passed to ``dcp.load``.
        storage_reader: A DCP ``StorageReader`` that reads the data (a directory
            another storage writer wrote, e.g. OLMo-core's); ``.metadata`` is still
            read safely (see :func:`~dsdmerge.integrations.load_checkpoint`).
        rename: Rename rules applied to the checkpoint's keys first (see
            :func:`dsdmerge.rename`), e.g. ``{r"^layers\.": "blocks."}``.
        convert: Layout conversions applied next (see :func:`dsdmerge.convert`).
        on_shape_mismatch: ``"raise"`` (as the policy says), ``"take_reference"``
            (keep ``state_dict``'s tensor, read nothing) or ``"resize"`` (a grown
            vocabulary keeps its trained rows and moments).

    Returns:
        ``DCPLoad(state_dict, diff)``: the values read, in ``state_dict``'s
        structure without the keys the checkpoint lacks, and the diff.

    Raises:
        MergeError: The policy rejects a difference (nothing was read).
        LayoutError: A renamed, converted or resized key is not stored under its
            flat name (nothing was read).
        StateDictTypeError: One goes into a tensor that is not a plain tensor.
        CheckpointReadError: The checkpoint cannot be read.
        UnsafeCheckpointError: Its metadata or a bytes entry would run code.

    Examples:
        >>> import tempfile, warnings, torch
        >>> import torch.distributed.checkpoint as dcp
        >>> from dsdmerge.integrations import load_dcp
        >>> with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     _ = dcp.save({"w": torch.ones(2), "step": 3}, checkpoint_id=tmp)
        ...     target = {"w": torch.zeros(2), "step": 0, "new": torch.zeros(1)}
        ...     loaded, diff = load_dcp(tmp, target, policy="strict", allow_missing="new")
        >>> loaded, diff.missing, target["w"]
        ({'w': tensor([1., 1.]), 'step': 3}, ('new',), tensor([1., 1.]))
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.stateful import Stateful

    require_mapping(state_dict, "state_dict")
    where = str(path)
    merge_options = MergeOptions.of(
        policy,
        allow_missing=allow_missing,
        allow_unexpected=allow_unexpected,
        rename=rename,
        convert=convert,
        on_shape_mismatch=on_shape_mismatch,
    )
    pol = merge_options.policy
    view, metadata = read_dcp_view(where, trusted=trusted, storage_reader=storage_reader)
    # Stateful values (a trainer's model / optimizer / lr_scheduler wrappers) stand for their
    # state_dict(), as in dcp.load, so the check sees their keys, not one opaque leaf each
    stateful = {k: v for k, v in state_dict.items() if isinstance(v, Stateful)}
    expanded = {k: (v.state_dict() if k in stateful else v) for k, v in state_dict.items()}
    no_dist = not (dist.is_available() and dist.is_initialized())
    if rename is not None or convert is not None or on_shape_mismatch != "raise":
        target, diff = load_changed(
            where,
            view,
            metadata,
            expanded,
            pol,
            rename=rename,
            convert=convert,
            on_shape_mismatch=on_shape_mismatch,
            trusted=trusted,
            no_dist=no_dist,
            process_group=process_group,
            storage_reader=storage_reader,
            stacklevel=3,
        )
    else:
        # the policy's verdict before any data is read (warnings point at our caller)
        diff = verdict(view, expanded, merge_options, stacklevel=2)
        target = copy_tree(expanded)
        if diff.mismatched:
            shape = {m.key for m in diff.mismatched if reshaped(m)}
            _prune_tensors(target, expanded, shape)
        skipped = dcp_load_into(
            where,
            target,
            metadata,
            trusted=trusted,
            allow_partial_load=bool(diff.missing),
            no_dist=no_dist,
            process_group=process_group,
            storage_reader=storage_reader,
        )
        for path_ in skipped:
            _prune(target, path_)
    _fold_spellings(target)
    for key, obj in stateful.items():
        # what was not read keeps its current value, as in dcp.load's partial load
        obj.load_state_dict(_filled(copy_tree(target.get(key, {})), expanded[key]))
    return DCPLoad(target, diff)


def _fold_spellings(tree: dict[Any, Any]) -> None:
    """Fold a ``'0'`` entry into the ``0`` entry next to it (in place, in ``load_dcp``'s own copy).

    DCP places a bytes entry (heavyball's ``is_initialized`` set) by its path with every
    key spelled as a string, next to the state dict's own int-keyed dict
    (``{0: {"exp_avg": ..., "is_initialized": <the state dict's>}, "0": {"is_initialized":
    <the checkpoint's>}}``): one entry, spelled two ways; what was read wins.
    """
    stack = [tree]
    while stack:
        node = stack.pop()
        for k in [k for k in node if type(k) is str and k.isdecimal() and k.isascii()]:
            other = node.get(int(k)) if str(int(k)) == k else None
            mine = node[k]
            if isinstance(other, dict) and isinstance(mine, dict):
                other.update(mine)
                del node[k]
        stack.extend(v for v in node.values() if isinstance(v, dict))


def _filled(dest: Any, src: Any) -> Any:
    """``dest`` (a new tree) with the entries it lacks taken from ``src``, recursively."""
    if not isinstance(dest, dict) or not isinstance(src, Mapping):
        return dest
    stack = [(dest, src)]
    while stack:
        d, s_ = stack.pop()
        for k, v in s_.items():
            if k not in d:
                d[k] = v
            elif isinstance(d[k], dict) and isinstance(v, Mapping):
                stack.append((d[k], v))
    return dest


# --------------------------------------------------------------------------------------
# helpers


def _leaf_paths(tree: Any) -> list[tuple[tuple[Any, ...], Any]]:
    """``(path, leaf)`` for every leaf under dicts and lists (as DCP walks them)."""
    out: list[tuple[tuple[Any, ...], Any]] = []
    stack: list[tuple[tuple[Any, ...], Any]] = [((), tree)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, Mapping):
            stack.extend(((*path, k), v) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend(((*path, i), v) for i, v in enumerate(node))
        else:
            out.append((path, node))
    return out


def _prune_tensors(target: dict[str, Any], original: Mapping[str, Any], keys: set[str]) -> None:
    """Remove from ``target`` the leaves that are, in ``original``, the values of flat ``keys``."""
    flat = flatten(original)
    ids = {id(flat[k]) for k in keys if k in flat}
    for path, leaf in _leaf_paths(target):
        if id(leaf) in ids:
            _prune(target, path)


def _prune(root: dict[str, Any], path: tuple[Any, ...]) -> None:
    """Remove the entry at ``path`` and the dicts it leaves empty.

    An item of a list of values (PSGD's factor lists ``Q.0``, ``Q.1``) takes the whole
    list with it: a list only partly read is not the checkpoint's. Keys inside a list's
    dicts (``param_groups.<i>.<name>``) go one by one, the list stays.
    """
    chain: list[Any] = [root]
    node: Any = root
    for part in path[:-1]:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return
        chain.append(node)
    while len(chain) > 1 and isinstance(chain[-1], list):
        chain.pop()  # the list itself goes, from the dict that holds it
        path = path[: len(chain)]
    parent = chain[-1]
    if not isinstance(parent, dict) or path[-1] not in parent:
        return
    del parent[path[-1]]
    for depth in range(len(chain) - 1, 0, -1):
        node = chain[depth]
        holder = chain[depth - 1]
        if isinstance(node, dict) and not node and isinstance(holder, dict):
            del holder[path[depth - 1]]
        else:
            break
