"""One call per resume: merge a loaded checkpoint over a fresh reference and load it.

The calls a trainer makes where it used to call ``set_optimizer_state_dict`` /
``model.load_state_dict`` / ``dcp.load``:

* :func:`resume_optimizer`: builds the reference with torch's
  ``get_optimizer_state_dict`` (same ``StateDictOptions``), merges the loaded
  optimizer state dict over it under a policy, loads the result with
  ``set_optimizer_state_dict`` (or ``Optimizer.load_state_dict`` for a plain
  ``optimizer.state_dict()`` with int ids) and returns the
  :class:`~dsdmerge.KeyDiff`.
* :func:`resume_model`: the same for a model state dict, loaded strictly.
* :func:`load_dcp`: a DCP directory loaded like ``dcp.load``, but only after its
  metadata was checked against the state dict under the policy, partially only
  when the policy accepted exactly what is missing, and without running pickled
  code.

Fresh state, explicit
---------------------
A DSD reference comes from ``_init_optim_state``: one optimizer step with zero
gradients and ``lr=0``, so a backfilled Adam state has ``step == 1`` and zero
moments. ``fresh="reference"`` (the default, what verl does) backfills that.
``fresh="as_fresh"`` leaves a parameter whose whole state is absent from the
checkpoint without state, so the optimizer initialises it lazily on its next
step, exactly as a never-checkpointed optimizer would (bit for bit). A
parameter with *some* state in the checkpoint always gets the rest from the
reference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, cast

from dsdmerge._engine import copy_tree, run
from dsdmerge.diff import KeyDiff
from dsdmerge.errors import LayoutError, StateDictTypeError
from dsdmerge.flatten import split_param_key, unflatten
from dsdmerge.integrations.checkpoints import read_dcp_metadata, run_dcp_load
from dsdmerge.layout import (
    PARAM_GROUPS,
    PARAMS,
    STATE,
    STATE_PREFIX,
    Layout,
    classify,
    is_optimizer_state_dict,
    require_mapping,
)
from dsdmerge.merge import _apply, _merge
from dsdmerge.policy import InvalidPolicyError, Policy, resolve_policy

if TYPE_CHECKING:
    import os

    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions

__all__ = ["DCPLoad", "Fresh", "load_dcp", "resume_model", "resume_optimizer"]

Fresh = Literal["reference", "as_fresh"]
"""How a parameter without checkpointed optimizer state resumes (see the module docstring)."""

_FRESH: tuple[Fresh, ...] = ("reference", "as_fresh")


def resume_optimizer(
    model: torch.nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    loaded: Mapping[Any, Any],
    /,
    *,
    options: StateDictOptions | None = None,
    policy: str | Policy = "default",
    allow_missing: str | Iterable[str] = (),
    allow_unexpected: str | Iterable[str] = (),
    fresh: Fresh = "reference",
) -> KeyDiff:
    """Load a checkpoint's optimizer state into ``optimizers``, merged over their fresh state.

    Builds the reference with ``get_optimizer_state_dict(model, optimizers,
    options=options)``, merges ``loaded`` over it with :func:`dsdmerge.merge`
    (unexpected keys are left out: no parameter would take them), and loads
    the result with ``set_optimizer_state_dict``. ``loaded`` may be flattened
    (``flatten_optimizer_state_dict=True``) or nested, fqn-keyed (DSD), or a
    plain ``optimizer.state_dict()`` with int ids (then loaded with
    ``Optimizer.load_state_dict``, one optimizer only). Several optimizers on one
    model share one fqn-keyed state dict, as DSD builds it; each takes its own
    parameters' state and groups.

    The merged state is loaded in DSD's nested form whatever ``options``
    says about flattening (so torch's flattened-load crash on parameters without
    state cannot happen); the other options apply as given, except that
    ``strict`` is turned off for ``fresh="as_fresh"`` (parameters left without
    state on purpose). Does not modify ``loaded``; as with
    ``Optimizer.load_state_dict``, the optimizers take the checkpoint's tensors
    as their state (later steps update them in place).

    Args:
        model: The model the optimizers optimize.
        optimizers: One optimizer or several.
        loaded: The optimizer state dict read from the checkpoint.
        options: The ``StateDictOptions`` used to save it (``None``: defaults).
        policy: ``"default"``, ``"warn"``, ``"strict"`` or a :class:`~dsdmerge.Policy`.
        allow_missing: Globs over flat keys the checkpoint may lack, e.g.
            ``"state.indexer.*"``.
        allow_unexpected: Globs over flat keys the optimizers may lack.
        fresh: ``"reference"`` backfills parameters without checkpointed state
            from DSD's zero-gradient step (``step == 1``); ``"as_fresh"`` leaves
            them without state, to initialise exactly like a new optimizer.

    Returns:
        The :class:`~dsdmerge.KeyDiff` of ``loaded`` against the reference.

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
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.optim import Optimizer

    optims = (optimizers,) if isinstance(optimizers, Optimizer) else tuple(optimizers)
    if not optims or not all(isinstance(o, Optimizer) for o in optims):
        raise StateDictTypeError(
            "optimizers must be a torch.optim.Optimizer or a non-empty iterable of them"
        )
    require_mapping(loaded, "loaded")
    pol = _resume_policy(policy, allow_missing, allow_unexpected, fresh)
    if _int_keyed(loaded):
        return _resume_int_keyed(model, optims, loaded, pol, fresh)
    nested = dataclasses.replace(options or StateDictOptions(), flatten_optimizer_state_dict=False)
    reference = get_optimizer_state_dict(model, optims, options=nested)
    merged = _merge(loaded, reference, pol, (), (), stacklevel=4)
    state_dict = merged.state_dict
    if classify(state_dict) is Layout.FLAT:
        state_dict = unflatten(state_dict, like=reference)
    if fresh == "as_fresh":
        without = _params_without_state(loaded, cast(Mapping[Any, Any], reference[STATE]))
        if without:
            state_dict = {
                **state_dict,
                STATE: {k: v for k, v in state_dict[STATE].items() if k not in without},
            }
            nested = dataclasses.replace(nested, strict=False)
    set_optimizer_state_dict(model, optims, state_dict, options=nested)
    return merged.diff


def resume_model(
    model: torch.nn.Module,
    loaded: Mapping[str, Any],
    /,
    *,
    options: StateDictOptions | None = None,
    policy: str | Policy = "default",
    allow_missing: str | Iterable[str] = (),
    allow_unexpected: str | Iterable[str] = (),
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
    pol = _resume_policy(policy, allow_missing, allow_unexpected, "reference")
    opts = dataclasses.replace(options or StateDictOptions(), strict=True)
    reference = get_model_state_dict(model, options=opts)
    merged = _merge(loaded, reference, pol, (), (), stacklevel=4)
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
    policy: str | Policy = "default",
    allow_missing: str | Iterable[str] = (),
    allow_unexpected: str | Iterable[str] = (),
    trusted: bool = False,
    process_group: Any = None,
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

    Args:
        path: The checkpoint directory.
        state_dict: The state dict to load into, e.g. ``{"model":
            get_model_state_dict(model), "optim": get_optimizer_state_dict(...)}``.
        policy: ``"default"``, ``"warn"``, ``"strict"`` or a :class:`~dsdmerge.Policy`.
        allow_missing: Globs over flat keys (as :func:`dsdmerge.flatten` spells
            ``state_dict``) the checkpoint may lack.
        allow_unexpected: Globs over flat keys ``state_dict`` may lack.
        trusted: Unpickle without restriction (only for trusted checkpoints).
        process_group: Passed to ``dcp.load``.

    Returns:
        ``DCPLoad(state_dict, diff)``: the values read, in ``state_dict``'s
        structure without the keys the checkpoint lacks, and the diff.

    Raises:
        MergeError: The policy rejects a difference (nothing was read).
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

    require_mapping(state_dict, "state_dict")
    where = str(path)
    pol = resolve_policy(policy, allow_missing=allow_missing, allow_unexpected=allow_unexpected)
    view, metadata = read_dcp_metadata(where, trusted=trusted)
    # the policy's verdict before any data is read (warnings point at our caller)
    outcome = run(view, state_dict, merge=False, conflicts=pol.conflict != "ignore")
    diff = _apply(outcome, pol, stacklevel=3)[0]
    target = copy_tree(state_dict)
    if diff.mismatched:
        shape = {m.key for m in diff.mismatched if m.shape_differs}
        _prune_tensors(target, state_dict, shape)
    no_dist = not (dist.is_available() and dist.is_initialized())
    skipped = run_dcp_load(
        where,
        target,
        metadata,
        trusted=trusted,
        allow_partial_load=bool(diff.missing),
        no_dist=no_dist,
        process_group=process_group,
    )
    for path_ in skipped:
        _prune(target, path_)
    return DCPLoad(target, diff)


# --------------------------------------------------------------------------------------
# helpers


def _resume_policy(
    policy: str | Policy,
    allow_missing: str | Iterable[str],
    allow_unexpected: str | Iterable[str],
    fresh: str,
) -> Policy:
    if fresh not in _FRESH:
        raise InvalidPolicyError(f"fresh must be 'reference' or 'as_fresh', got {fresh!r}")
    pol = resolve_policy(policy, allow_missing=allow_missing, allow_unexpected=allow_unexpected)
    # what has no parameter to go to is left out: torch would ignore or reject it
    return dataclasses.replace(pol, drop_unexpected=True)


def _int_keyed(loaded: Mapping[Any, Any]) -> bool:
    if not is_optimizer_state_dict(loaded):
        return False
    ids = list(loaded[STATE])
    for group in loaded[PARAM_GROUPS]:
        if isinstance(group, Mapping) and isinstance(group.get(PARAMS), (list, tuple)):
            ids.extend(group[PARAMS])
    return bool(ids) and all(type(pid) is int for pid in ids)


def _resume_int_keyed(
    model: torch.nn.Module,
    optims: tuple[torch.optim.Optimizer, ...],
    loaded: Mapping[Any, Any],
    pol: Policy,
    fresh: Fresh,
) -> KeyDiff:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if len(optims) != 1:
        raise LayoutError(
            f"loaded is a plain optimizer.state_dict() (int param ids), which holds one "
            f"optimizer, but {len(optims)} optimizers were given; resume each with its own "
            "state dict, or save fqn-keyed state with get_optimizer_state_dict."
        )
    (optim,) = optims
    get_optimizer_state_dict(model, optim)  # DSD's zero-gradient step: the reference state
    reference = optim.state_dict()
    merged = _merge(loaded, reference, pol, (), (), stacklevel=5)
    state_dict = merged.state_dict
    if fresh == "as_fresh":
        have = loaded[STATE]
        state_dict = {
            **state_dict,
            STATE: {k: v for k, v in state_dict[STATE].items() if k in have},
        }
    optim.load_state_dict(state_dict)
    return merged.diff


def _params_without_state(loaded: Mapping[Any, Any], ref_state: Mapping[Any, Any]) -> set[Any]:
    """Reference params (fqns) of which ``loaded`` holds no optimizer state at all."""
    if is_optimizer_state_dict(loaded):
        have = set(cast(Mapping[Any, Any], loaded[STATE]))
    else:
        have = set()
        n = len(STATE_PREFIX)
        for key in loaded:
            if type(key) is str and key.startswith(STATE_PREFIX):
                found = split_param_key(key[n:], ref_state)
                if found is not None:
                    have.add(found[0])
    return {fqn for fqn in ref_state if fqn not in have}


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
    from dsdmerge.flatten import flatten

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
