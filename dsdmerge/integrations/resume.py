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
``fresh="as_fresh"`` (the default) leaves a parameter without checkpointed state
without state, so the optimizer initialises it lazily on its next step, exactly
as an optimizer that never saw a checkpoint would (bit for bit).
``fresh="reference"`` gives it what DSD's zero-gradient step would (Adam:
``step == 1``, and with L2 ``weight_decay`` non-zero moments), computed on a
throwaway copy of the optimizer (one copy of the parameters, briefly). A
parameter with *some* state in the checkpoint keeps all of it, and gets the
fields it lacks from the live optimizer (or, with ``"reference"``, from that step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from dsdmerge._core import copy_tree, merge_under, reshaped, verdict
from dsdmerge.convert import convert_checkpoint
from dsdmerge.diff import KeyDiff
from dsdmerge.errors import LayoutError, MergeError, StateDictTypeError
from dsdmerge.flatten import flatten, unflatten
from dsdmerge.integrations._dcp_surgery import load_changed
from dsdmerge.integrations._optim import (
    Slots,
    _inner,
    init_state,
    leaf_optimizers,
    uses_fsdp1,
)
from dsdmerge.integrations.checkpoints import Trust, read_dcp_metadata, run_dcp_load
from dsdmerge.layout import (
    PARAM_GROUPS,
    PARAMS,
    STATE,
    Layout,
    classify,
    is_optimizer_state_dict,
    require_mapping,
)
from dsdmerge.merge import Fresh
from dsdmerge.policy import InvalidPolicyError, Policy, PolicyName, resolve_policy
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

_FRESH: tuple[Fresh, ...] = ("reference", "as_fresh")
_PARAM_NAMES = "param_names"


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
            Pass what you passed to :func:`resume_model`. Other than ``"raise"``,
            the shapes of the optimizer's state come from DSD's zero-gradient step
            on a throwaway copy of it (the rows a resize adds start from that
            state: zero moments for Adam).

    Returns:
        The :class:`~dsdmerge.KeyDiff` of ``loaded`` against what the optimizers accept.

    Raises:
        MergeError: The policy rejects a difference (nothing was loaded).
        LayoutError: ``loaded`` is malformed, or int-keyed with several optimizers.
        StateDictTypeError: ``loaded`` is not a mapping, or no optimizer was given.
        InvalidPolicyError: Bad ``policy``, allow-lists or ``fresh``.

    Example:
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
    plan = _plan(
        model,
        optimizers,
        loaded,
        policy,
        allow_missing,
        allow_unexpected,
        fresh,
        stacklevel=3,
        rename=rename,
        convert=convert,
        on_shape_mismatch=on_shape_mismatch,
    )
    _load(plan, model, options)
    return plan.diff


def backfill_optimizer_state(
    loaded: Mapping[Any, Any],
    optimizer: torch.optim.Optimizer,
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
            return backfill_optimizer_state(state_dict, self.optimizer, model=self.model,
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

    Args:
        loaded: The optimizer state dict read from the checkpoint.
        optimizer: The live optimizer (or container) that will load the result.
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

    Example:
        >>> import torch
        >>> from dsdmerge.integrations import backfill_optimizer_state
        >>> model = torch.nn.Linear(2, 1)
        >>> optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> saved = {"state": {0: {"momentum_buffer": torch.ones(1, 2)}},
        ...          "param_groups": [{**optim.param_groups[0], "lr": 0.5, "params": [0, 1]}]}
        >>> sd = backfill_optimizer_state(saved, optim)
        >>> optim.load_state_dict(sd)
        >>> optim.param_groups[0]["lr"], sorted(optim.state_dict()["state"])
        (0.5, [0])
    """
    container = _inner(optimizer) is not None
    if container and fresh == "as_fresh":
        raise InvalidPolicyError(
            f"{type(optimizer).__name__} loads through DSD's flattened set_optimizer_state_dict, "
            "which gives every parameter optimizer state, so parameters cannot start fresh "
            "that way: pass fresh='reference' (DSD's zero-gradient state), or load with "
            "resume_optimizer(model, optimizer, loaded), which starts them fresh."
        )
    plan = _plan(
        model,
        optimizer,
        loaded,
        policy,
        allow_missing,
        allow_unexpected,
        fresh,
        stacklevel=3,
        rename=rename,
        convert=convert,
        on_shape_mismatch=on_shape_mismatch,
    )
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


def _plan(
    model: Any,
    optimizers: Any,
    loaded: Mapping[Any, Any],
    policy: PolicyName | Policy,
    allow_missing: str | Iterable[str],
    allow_unexpected: str | Iterable[str],
    fresh: str,
    *,
    stacklevel: int,  # as for warnings.warn, counted from here (1: _plan)
    rename: Rules | None = None,
    convert: Conversions | None = None,
    on_shape_mismatch: OnShapeMismatch = "raise",
) -> _Plan:
    require_mapping(loaded, "loaded")
    if fresh not in _FRESH:
        raise InvalidPolicyError(f"fresh must be 'as_fresh' or 'reference', got {fresh!r}")
    pol = resolve_policy(policy, allow_missing=allow_missing, allow_unexpected=allow_unexpected)
    pol = dataclasses.replace(pol, drop_unexpected=False)  # nothing a parameter has is dropped
    opts = leaf_optimizers(optimizers)
    checkpoint = _nested(loaded)
    if _id_keyed(checkpoint) and model is not None and (rename is not None or len(opts) > 1):
        checkpoint = _fqn_keyed_by_param_names(checkpoint)
    if rename is not None:
        if _id_keyed(checkpoint):
            raise LayoutError(
                "rename= renames fqns, and loaded is keyed by int param ids without torch's "
                "param_names: key it by the old model's names first, with "
                "dsdmerge.rekey(loaded, old_model.named_parameters())"
            )
        checkpoint = dm_rename(checkpoint, rename, unmatched=pol.unmatched_rename)
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
    if keyed == "id":
        try:
            checkpoint = _to_live_ids(checkpoint, slots)
        except MergeError:
            if model is None or not _has_param_names(checkpoint):
                raise
            # positions cannot map across the change, but torch saved the names: map by fqn
            checkpoint = _fqn_keyed_by_param_names(checkpoint)
            slots = Slots.of(opts, model, keyed="fqn")
    checkpoint = _without_param_names(checkpoint)
    # DSD's fresh state (on a throwaway copy) where it is asked for, or where the shape of
    # every state field must be known to resize it (a grown embedding's moments)
    init = init_state(slots) if fresh == "reference" or on_shape_mismatch != "raise" else None
    reference = _without_param_names(slots.reference(checkpoint, init=init))
    merged = merge_under(
        checkpoint, reference, pol, stacklevel=stacklevel, on_shape_mismatch=on_shape_mismatch
    )
    state = merged.state_dict
    keep: set[Any] | None = None
    if fresh == "as_fresh":
        c_state = checkpoint[STATE]
        live = slots.live_state()
        keep = {k for k in slots.every_key() if k in c_state or k in live}
    return _Plan(slots, slots.load_dicts(state, keep=keep), merged.diff)


def _load(plan: _Plan, model: Any, options: StateDictOptions | None) -> None:
    """Load each optimizer's part (the verdict has been given)."""
    if _needs_dsd(model, options):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        opts = dataclasses.replace(
            options or StateDictOptions(), flatten_optimizer_state_dict=False, strict=False
        )
        for o, sd in zip(plan.slots.optims, _fqn_keyed_each(plan), strict=True):
            set_optimizer_state_dict(model, o.optimizer, sd, options=opts)
        return
    for o, sd in zip(plan.slots.optims, plan.dicts, strict=True):
        o.optimizer.load_state_dict(sd)


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
        groups.extend({k: v for k, v in g.items() if k != _PARAM_NAMES} for g in sd[PARAM_GROUPS])
    return {STATE: state, PARAM_GROUPS: groups}


# --------------------------------------------------------------------------------------
# the checkpoint, as the merge sees it


def _nested(loaded: Mapping[Any, Any]) -> dict[Any, Any]:
    """``loaded`` as a nested optimizer state dict (a flattened one unflattened by DSD's rules)."""
    if classify(loaded) is Layout.FLAT:
        nested = unflatten(loaded)
        if not is_optimizer_state_dict(nested):
            raise LayoutError(
                "loaded is flat but not a flattened optimizer state dict (its keys are not all "
                "'state.<fqn>.<name>' / 'param_groups.<fqn>.<hyperparameter>'); pass the "
                "optimizer's state dict, not a whole checkpoint"
            )
        return nested
    if not is_optimizer_state_dict(loaded):
        raise LayoutError(
            "loaded is not an optimizer state dict: it has no 'state' mapping and "
            "'param_groups' list; pass the optimizer's part of the checkpoint"
        )
    return _normalise_ids(loaded)


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


def _normalise_ids(osd: Mapping[Any, Any]) -> dict[Any, Any]:
    """Int param ids whose state keys became strings (a DCP round trip: ``'0'``) made int again.

    Only when every param id in the groups is an int and the string is exactly the
    decimal spelling of one of them; anything else is left as it is.
    """
    ids = _group_ids(osd)
    state = osd[STATE]
    if not ids or not all(type(pid) is int for pid in ids):
        return dict(osd)
    known = {str(pid): pid for pid in ids}
    if not any(type(k) is str and k in known for k in state):
        return dict(osd)
    if any(type(k) is str and k in known and known[k] in state for k in state):
        raise LayoutError(
            "the optimizer state has both an int param id and its string spelling as keys; "
            "which one is meant cannot be told"
        )
    fixed = {(known[k] if type(k) is str and k in known else k): v for k, v in state.items()}
    return {**osd, STATE: fixed}


def _has_param_names(osd: Mapping[Any, Any]) -> bool:
    """Whether every param group carries torch's ``param_names`` (torch >= 2.5), one per param."""
    groups = [g for g in osd[PARAM_GROUPS] if isinstance(g, Mapping)]
    return bool(groups) and all(
        isinstance(g.get(_PARAM_NAMES), (list, tuple))
        and len(g[_PARAM_NAMES]) == len(g.get(PARAMS, ()))
        for g in groups
    )


def _fqn_keyed_by_param_names(osd: Mapping[Any, Any]) -> dict[Any, Any]:
    """An int-keyed optimizer state dict keyed by the ``param_names`` torch saved, if any."""
    if not _has_param_names(osd):
        return dict(osd)
    return rekey(osd)


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
            "optimizer.state_dict() (int ids) maps parameters by position, so it cannot be "
            "resumed across that change. Rekey it to fqns with dsdmerge.rekey (or save "
            "get_optimizer_state_dict next time)."
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
    if not any(isinstance(g, Mapping) and _PARAM_NAMES in g for g in groups):
        return dict(osd)
    return {
        **osd,
        PARAM_GROUPS: [
            {k: v for k, v in g.items() if k != _PARAM_NAMES} if isinstance(g, Mapping) else g
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

    Example:
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
    pol = resolve_policy(policy, allow_missing=allow_missing, allow_unexpected=allow_unexpected)
    # what has no parameter to go to is left out: a strict load would reject it
    pol = dataclasses.replace(pol, drop_unexpected=True)
    opts = dataclasses.replace(options or StateDictOptions(), strict=True)
    reference = get_model_state_dict(model, options=opts)
    merged = merge_under(
        loaded,
        reference,
        pol,
        stacklevel=2,
        rename=rename,
        convert=convert,
        on_shape_mismatch=on_shape_mismatch,
    )
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
    """Load a DCP checkpoint into ``state_dict``'s tensors, after checking it under a policy.

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

    Example:
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
    pol = resolve_policy(policy, allow_missing=allow_missing, allow_unexpected=allow_unexpected)
    view, metadata = read_dcp_metadata(where, trusted=trusted, storage_reader=storage_reader)
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
        diff = verdict(view, expanded, pol, stacklevel=2)
        target = copy_tree(expanded)
        if diff.mismatched:
            shape = {m.key for m in diff.mismatched if reshaped(m)}
            _prune_tensors(target, expanded, shape)
        skipped = run_dcp_load(
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
    for key, obj in stateful.items():
        # what was not read keeps its current value, as in dcp.load's partial load
        obj.load_state_dict(_filled(copy_tree(target.get(key, {})), expanded[key]))
    return DCPLoad(target, diff)


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
    """Remove the entry at ``path`` and the dicts it leaves empty (list items are kept)."""
    chain: list[Any] = [root]
    node: Any = root
    for part in path[:-1]:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return
        chain.append(node)
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
