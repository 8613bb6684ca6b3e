"""Hooks that make a trainer's own save and load calls go through dsdmerge.

Trainers (Hugging Face ``Trainer``, accelerate, Lightning, DeepSpeed) save
``optimizer.state_dict()`` and load it back with ``optimizer.load_state_dict``
themselves, keyed by int ids: positions in the param groups. Once the model
changes, positions no longer say which parameter is which. Three hooks, each
registered with torch's own hook API, so that the trainer's code stays as it is:

* :func:`record_param_names` (save side): every later ``optimizer.state_dict()``
  carries ``param_names`` in each param group, the parameters' fqns as DSD spells
  them, so that every later checkpoint can be mapped to parameters by name.
* :func:`install_load_hook` (load side): whatever the trainer passes to
  ``optimizer.load_state_dict`` is keyed by name and merged over what the
  optimizer accepts first (:func:`~dsdmerge.integrations.backfill_optimizer_state`),
  under a policy; the report is kept on the hook (``hook.diff``) and logged once.
* :func:`install_model_load_hook`: the same for ``model.load_state_dict`` (a new
  head keeps its initialisation, a grown vocabulary keeps its trained rows, a
  strict or non-strict load skips nothing the policy did not accept).

The rule: an int-keyed checkpoint is mapped to parameters **by name** when it
carries names (``param_names``, or ``names=`` given), and by position only when
the caller says positions are right (``by_position=True``) or there is no state to
misplace. A checkpoint without names is refused, never guessed: two same-shape
parameters that changed places (a layer frozen instead of another, modules
registered in another order) would silently take each other's moments.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from dsdmerge._options import Fresh, MergeOptions
from dsdmerge._pipeline import run
from dsdmerge.errors import LayoutError, StateDictTypeError
from dsdmerge.integrations._optim import param_fqns
from dsdmerge.integrations.resume import plan_resume
from dsdmerge.layout import PARAM_GROUPS, PARAM_NAMES, PARAMS, STATE, require_mapping
from dsdmerge.policy import Policy, PolicyName
from dsdmerge.rekey import rekey
from dsdmerge.resize import OnShapeMismatch

if TYPE_CHECKING:
    import torch
    from torch.utils.hooks import RemovableHandle

    from dsdmerge.diff import KeyDiff
    from dsdmerge.rename import Rules

__all__ = [
    "LoadHook",
    "ModelLoadHook",
    "install_load_hook",
    "install_model_load_hook",
    "record_param_names",
]

_log = logging.getLogger("dsdmerge")
# attributes under which optimizer wrappers keep the torch optimizer they wrap:
# accelerate's AcceleratedOptimizer (.optimizer), Lightning's LightningOptimizer (._optimizer)
_WRAPPED = ("optimizer", "_optimizer")
_ZERO_KEYS = ("base_optimizer_state", "single_partition_of_fp32_groups", "zero_stage")
_UNIVERSAL = (
    "DeepSpeed ZeRO-1/2 keep one flat fp32 partition per param group, not per-parameter "
    "state, so its optimizer state cannot be mapped to parameters: convert the checkpoint to "
    "DeepSpeed's universal format (python -m deepspeed.checkpoint.ds_to_universal --input_folder "
    "<ckpt>/<tag> --output_folder <ckpt>/<tag>_universal) and resume with "
    '"checkpoint": {"load_universal": true} in the DeepSpeed config, or train with ZeRO-0 '
    "(whose client optimizer this hook handles)"
)


# --------------------------------------------------------------------------------------
# the torch optimizer behind a wrapper


def _torch_optimizer(optimizer: object, what: str = "optimizer") -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` that holds the param groups, behind known wrappers."""
    import torch

    obj = optimizer
    for _ in range(8):
        own = vars(obj).get("param_groups") if hasattr(obj, "__dict__") else None
        if isinstance(obj, torch.optim.Optimizer) and isinstance(own, list):
            return obj
        inner = next(
            (
                vars(obj)[a]
                for a in _WRAPPED
                if hasattr(obj, "__dict__") and isinstance(vars(obj).get(a), torch.optim.Optimizer)
            ),
            None,
        )
        if inner is None:
            break
        obj = inner
    raise StateDictTypeError(
        f"{what} is a {type(optimizer).__name__}, which holds no torch.optim.Optimizer param "
        "groups of its own nor under .optimizer / ._optimizer; pass the torch optimizer (for a "
        "container of several, call this once per optimizer it holds)"
    )


def _names_of(
    optimizer: torch.optim.Optimizer, fqn_of: Mapping[int, str]
) -> list[list[str] | None]:
    """Per param group, the fqns of its parameters (``None`` where one is not the model's)."""
    out: list[list[str] | None] = []
    for group in optimizer.param_groups:
        names = [fqn_of.get(id(p)) for p in group[PARAMS]]
        out.append(None if None in names else [n for n in names if n is not None])
    return out


def _foreign(optimizer: torch.optim.Optimizer, fqn_of: Mapping[int, str]) -> str | None:
    """A description of the first parameter of ``optimizer`` the model does not have."""
    for gi, group in enumerate(optimizer.param_groups):
        for j, p in enumerate(group[PARAMS]):
            if id(p) not in fqn_of:
                return f"parameter {j} of param group {gi} (shape {tuple(p.shape)})"
    return None


# --------------------------------------------------------------------------------------
# save side


_RECORDED: weakref.WeakKeyDictionary[Any, tuple[RemovableHandle, _RecordNames]] = (
    weakref.WeakKeyDictionary()
)
_RECORDED_LOCK = threading.Lock()


class _RecordNames:
    """The ``state_dict`` post-hook of :func:`record_param_names`."""

    def __init__(self, model: torch.nn.Module | Sequence[torch.nn.Module]) -> None:
        self.model = model
        self.fqn_of = param_fqns(model)
        self.warned = False

    def __deepcopy__(self, memo: dict[int, Any]) -> _RecordNames:
        return self  # holds no state of its own; a copied optimizer names its params alike

    def __call__(
        self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
    ) -> dict[str, Any] | None:
        groups = state_dict.get(PARAM_GROUPS)
        if not isinstance(groups, list) or len(groups) != len(optimizer.param_groups):
            return None
        if all(isinstance(g, Mapping) and PARAM_NAMES in g for g in groups):
            return None  # torch wrote them (an optimizer built from named parameters)
        names = _names_of(optimizer, self.fqn_of)
        if None in names:  # the model changed after registration: look again, once
            self.fqn_of = param_fqns(self.model)
            names = _names_of(optimizer, self.fqn_of)
        if None in names and not self.warned:
            self.warned = True
            _log.warning(
                "dsdmerge.record_param_names: %s of %s is not a parameter of the model, so "
                "its param group is saved without param_names (a checkpoint of it cannot be "
                "mapped to parameters by name)",
                _foreign(optimizer, self.fqn_of),
                type(optimizer).__name__,
            )
        out = []
        for group, found in zip(groups, names, strict=True):
            if found is None or not isinstance(group, Mapping) or PARAM_NAMES in group:
                out.append(group)
            else:
                out.append({**group, PARAM_NAMES: found})
        return {**state_dict, PARAM_GROUPS: out}


def record_param_names(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module | Sequence[torch.nn.Module], /
) -> RemovableHandle:
    """Make every later ``optimizer.state_dict()`` carry ``param_names``: the fqns of its params.

    Registers a ``state_dict`` post-hook
    (``Optimizer.register_state_dict_post_hook``) that writes, into every param
    group of the saved state dict, the names of its parameters as DSD spells them
    (``module.`` of DDP and ``_orig_mod.`` of ``torch.compile`` left out), so that
    every checkpoint saved afterwards (Hugging Face ``Trainer``'s ``optimizer.pt``,
    accelerate's ``optimizer.bin``, Lightning's ``optimizer_states``) can be
    mapped to parameters by name (:func:`install_load_hook`, :func:`dsdmerge.rekey`).
    The optimizer itself is not changed: only what ``state_dict()`` returns.

    Idempotent: a second call for the same optimizer returns the first handle. A
    group that already has ``param_names`` (torch >= 2.6 writes them for an
    optimizer built from ``named_parameters()``) keeps them. An optimizer wrapper
    (accelerate's ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``) is
    unwrapped to the torch optimizer it holds.

    Args:
        optimizer: The torch optimizer (or a wrapper of one).
        model: The model (or model parts) whose parameters it optimizes.

    Returns:
        The hook's ``RemovableHandle`` (``handle.remove()`` stops recording).

    Raises:
        LayoutError: A parameter of the optimizer is not a parameter of the model.
        StateDictTypeError: ``optimizer`` is not a torch optimizer or a known wrapper.

    Examples:
        >>> import torch
        >>> from dsdmerge.integrations import record_param_names
        >>> model = torch.nn.Linear(2, 1)
        >>> optim = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> handle = record_param_names(optim, model)
        >>> optim.state_dict()["param_groups"][0]["param_names"]
        ['weight', 'bias']
        >>> record_param_names(optim, model) is handle
        True
        >>> handle.remove()
        >>> "param_names" in optim.state_dict()["param_groups"][0]
        False
    """
    opt = _torch_optimizer(optimizer)
    with _RECORDED_LOCK:
        known = _RECORDED.get(opt)
        if known is not None and _registered(known[0]):
            return known[0]
        hook = _RecordNames(model)
        where = _foreign(opt, hook.fqn_of)
        if where is not None:
            raise LayoutError(
                f"record_param_names: {where} of {type(opt).__name__} is not a parameter of "
                "the model passed in; pass the model the optimizer optimizes"
            )
        handle = opt.register_state_dict_post_hook(hook)
        _RECORDED[opt] = (handle, hook)
        return handle


def _registered(handle: RemovableHandle) -> bool:
    hooks = handle.hooks_dict_ref()
    return hooks is not None and handle.id in hooks


# --------------------------------------------------------------------------------------
# load side: the optimizer


@dataclasses.dataclass(frozen=True)
class _Options:
    merge: MergeOptions
    names: tuple[str, ...] | None
    by_position: bool


class LoadHook:
    """The ``Optimizer.load_state_dict`` pre-hook :func:`install_load_hook` registers.

    Attributes:
        optimizer: The torch optimizer it is registered on.
        diff: The :class:`~dsdmerge.KeyDiff` of the last state dict it merged
            (``None`` until one was).
        loads: How many state dicts it merged (pass-throughs not counted).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        options: _Options,
    ) -> None:
        self.optimizer = optimizer
        self.model = model
        self.diff: KeyDiff | None = None
        self.loads = 0
        self._options = options
        self._lock = threading.Lock()
        self._handle = optimizer.register_load_state_dict_pre_hook(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> LoadHook:
        return self  # a copied optimizer (a throwaway twin) never loads through it

    def remove(self) -> None:
        """Unregister the hook: later loads are torch's own again."""
        self._handle.remove()

    def __enter__(self) -> LoadHook:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"LoadHook({type(self.optimizer).__name__}, loads={self.loads}, diff={self.diff!r})"

    def __call__(
        self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Merge ``state_dict`` (torch's copy of what the trainer passed); ``None``: as is."""
        require_mapping(state_dict, "the state dict passed to load_state_dict")
        _refuse_zero(state_dict)
        fqn_of = param_fqns(self.model)
        where = _foreign(optimizer, fqn_of)
        if where is not None:
            zero = type(optimizer).__module__.startswith("deepspeed") or any(
                "deepspeed" in type(o).__module__ for o in (self.model, optimizer)
            )
            raise LayoutError(
                f"{where} of {type(optimizer).__name__} is not a parameter of the model, so "
                "the state being loaded cannot be mapped to parameters"
                + (f": {_UNIVERSAL}" if zero or _flat_groups(optimizer) else "")
            )
        if _own_empty(optimizer, state_dict):
            return None  # the optimizer's own empty state, reloaded (accelerate's prepare())
        opts = self._options
        keyed = _by_name(state_dict, opts, optimizer)
        plan = plan_resume(self.model, optimizer, keyed, opts.merge, stacklevel=6)
        (loadable,) = plan.dicts
        # the state of a parameter the optimizer no longer holds (reported as unexpected)
        # stays out: torch would keep it under its fqn in optimizer.state and save it forever.
        # Optimizer-level entries (MADGRAD's state['k']) are not mappings and are kept.
        live_ids = {pid for g in loadable[PARAM_GROUPS] for pid in g[PARAMS]}
        loadable[STATE] = {
            k: v for k, v in loadable[STATE].items() if k in live_ids or not isinstance(v, Mapping)
        }
        # param_names the live optimizer does not hold stay out (torch would store them)
        for group, live in zip(loadable[PARAM_GROUPS], optimizer.param_groups, strict=True):
            if PARAM_NAMES not in live:
                group.pop(PARAM_NAMES, None)
        with self._lock:
            self.diff = plan.diff
            self.loads += 1
        _log.info(
            "dsdmerge: %s.load_state_dict merged through install_load_hook: %s",
            type(optimizer).__name__,
            plan.diff,
        )
        return loadable


def install_load_hook(
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module | Sequence[torch.nn.Module],
    /,
    *,
    policy: PolicyName | Policy = "default",
    allow_missing: str | Iterable[str] = (),
    allow_unexpected: str | Iterable[str] = (),
    rename: Rules | None = None,
    on_shape_mismatch: OnShapeMismatch = "raise",
    fresh: Fresh = "as_fresh",
    names: Iterable[str] | Iterable[tuple[str, Any]] | None = None,
    by_position: bool = False,
) -> LoadHook:
    """Make ``optimizer.load_state_dict(sd)`` merge ``sd`` over what the optimizer accepts first.

    Registers a ``load_state_dict`` pre-hook
    (``Optimizer.register_load_state_dict_pre_hook``): whatever the trainer
    passes (Hugging Face ``Trainer``'s ``optimizer.pt``, accelerate's
    ``load_state``, Lightning's ``optimizer_states[i]``, DeepSpeed ZeRO-0's
    client optimizer state) goes through
    :func:`~dsdmerge.integrations.backfill_optimizer_state` under the policy
    before torch loads it: parameters are matched by name, the state of a
    parameter that no longer exists is left out, a new parameter starts fresh, a
    resized one keeps its trained slice (``on_shape_mismatch="resize"``), and a
    refusal raises from the trainer's load call before anything changed. The
    report is kept on the hook (``hook.diff``) and logged once per load (logger
    ``"dsdmerge"``, level INFO).

    An int-keyed state dict is mapped by the ``param_names`` in its groups (see
    :func:`record_param_names`), else by ``names``; a state dict without names
    whose state is not empty is refused unless ``by_position=True`` (positions
    are what ``Optimizer.load_state_dict`` uses: right only if the trainable
    parameters and their order did not change). The optimizer's own empty state,
    reloaded (accelerate's ``prepare()`` does), passes through untouched.

    Args:
        optimizer: The torch optimizer (or a wrapper of one: accelerate's,
            Lightning's) the trainer loads into.
        model: The model (or model parts) it optimizes.
        policy: ``"default"``, ``"warn"``, ``"strict"`` or a :class:`~dsdmerge.Policy`.
        allow_missing: Globs over flat keys the checkpoint may lack, e.g.
            ``"state.head.*"``.
        allow_unexpected: Globs over flat keys the optimizer may lack.
        rename: Rename rules for the checkpoint's fqns (see :func:`dsdmerge.rename`).
        on_shape_mismatch: ``"raise"``, ``"take_reference"`` or ``"resize"``.
        fresh: ``"as_fresh"`` (default) or ``"reference"`` (see
            :func:`~dsdmerge.integrations.resume_optimizer`).
        names: For checkpoints without ``param_names``: the old model's parameter
            names in the order its optimizer's groups listed them (as
            :func:`dsdmerge.rekey` takes them).
        by_position: Map a checkpoint without names by position, as torch does.

    Returns:
        The :class:`LoadHook` (``hook.diff``, ``hook.remove()``).

    Raises:
        InvalidPolicyError: Bad ``policy``, allow-lists or ``fresh``.
        LayoutError: A parameter of the optimizer is not a parameter of the model.
        StateDictTypeError: ``optimizer`` is not a torch optimizer or a known wrapper.

    Examples:
        >>> import torch
        >>> from dsdmerge.integrations import install_load_hook, record_param_names
        >>> old = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> optim = torch.optim.SGD(old.parameters(), lr=0.5, momentum=0.9)
        >>> _ = record_param_names(optim, old)
        >>> old(torch.ones(1, 2)).sum().backward(); optim.step()
        >>> saved = optim.state_dict()  # int ids, and the names
        >>> new = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))  # a new head
        >>> optim2 = torch.optim.SGD(new.parameters(), lr=0.1, momentum=0.9)
        >>> hook = install_load_hook(optim2, new, policy="strict", allow_missing="*.1.*")
        >>> optim2.load_state_dict(saved)  # torch alone: "doesn't match the size"
        >>> [k for k in hook.diff.missing if k.startswith("state.")]
        ['state.1.weight.momentum_buffer', 'state.1.bias.momentum_buffer']
        >>> optim2.param_groups[0]["lr"], len(optim2.state)  # the new head starts fresh
        (0.5, 2)
        >>> hook.remove()
    """
    opt = _torch_optimizer(optimizer)
    merge_options = MergeOptions.of(
        policy,
        allow_missing=allow_missing,
        allow_unexpected=allow_unexpected,
        rename=rename,
        on_shape_mismatch=on_shape_mismatch,
        fresh=fresh,
    )
    fqn_of = param_fqns(model)
    where = _foreign(opt, fqn_of)
    if where is not None:
        raise LayoutError(
            f"install_load_hook: {where} of {type(opt).__name__} is not a parameter of the "
            "model passed in; pass the model the optimizer optimizes"
        )
    listed = None if names is None else tuple(_plain_names(names))
    options = _Options(merge_options, listed, bool(by_position))
    return LoadHook(opt, model, options)


def _plain_names(names: Iterable[Any]) -> list[str]:
    out = []
    for item in names:
        name = item[0] if isinstance(item, tuple) and len(item) == 2 else item
        if type(name) is not str:
            raise StateDictTypeError(f"names: {name!r} is not a str")
        out.append(name)
    return out


def _groups(sd: Mapping[Any, Any]) -> list[Mapping[Any, Any]]:
    groups = sd.get(PARAM_GROUPS)
    if not isinstance(groups, (list, tuple)):
        return []
    return [g for g in groups if isinstance(g, Mapping)]


def _int_keyed(sd: Mapping[Any, Any]) -> bool:
    ids = [
        pid for g in _groups(sd) if isinstance(g.get(PARAMS), (list, tuple)) for pid in g[PARAMS]
    ]
    return bool(ids) and all(type(pid) is int for pid in ids)


def _has_names(sd: Mapping[Any, Any]) -> bool:
    groups = _groups(sd)
    return bool(groups) and all(
        isinstance(g.get(PARAM_NAMES), (list, tuple))
        and isinstance(g.get(PARAMS), (list, tuple))
        and len(g[PARAM_NAMES]) == len(g[PARAMS])
        for g in groups
    )


def _own_empty(optimizer: torch.optim.Optimizer, sd: Mapping[Any, Any]) -> bool:
    """Whether ``sd`` is an empty state laid out exactly as ``optimizer``'s own groups."""
    state = sd.get(STATE)
    if not isinstance(state, Mapping) or state or not _int_keyed(sd):
        return False
    groups = _groups(sd)
    if len(groups) != len(optimizer.param_groups):
        return False
    at = 0
    for group, live in zip(groups, optimizer.param_groups, strict=True):
        n = len(live[PARAMS])
        ids = group.get(PARAMS)
        if not isinstance(ids, (list, tuple)) or list(ids) != list(range(at, at + n)):
            return False
        if PARAM_NAMES in group and PARAM_NAMES in live and group[PARAM_NAMES] != live[PARAM_NAMES]:
            return False
        at += n
    return True


def _by_name(
    sd: Mapping[Any, Any], opts: _Options, optimizer: torch.optim.Optimizer
) -> Mapping[Any, Any]:
    """``sd`` keyed by fqns where it is int-keyed and names are known; refused without."""
    if not _int_keyed(sd):
        return sd  # fqn-keyed (DSD) or flattened: already by name
    # rekey returns state and param_groups: the optimizer's own top-level keys (heavyball's)
    # are carried over as torch would hand them to the optimizer
    extras = {k: v for k, v in sd.items() if k not in (STATE, PARAM_GROUPS)}
    if _has_names(sd):
        return {**extras, **rekey(sd)}
    if opts.names is not None:
        return {**extras, **rekey(sd, opts.names)}
    state = sd.get(STATE)
    if opts.by_position or not state:
        return sd
    live = [len(g[PARAMS]) for g in optimizer.param_groups]
    raise LayoutError(
        f"the optimizer state being loaded into {type(optimizer).__name__} is keyed by position "
        f"(int ids, {len(state)} parameter(s) with state; groups of sizes "
        f"{[len(g.get(PARAMS, ())) for g in _groups(sd)]}, the optimizer's {live}) and carries "
        "no param_names, so which parameter each entry belongs to cannot be checked: two "
        "same-shape parameters that changed places would silently take each other's state. "
        "Pass names= (the old model's parameter names, in the order its optimizer's param "
        "groups listed them) or by_position=True if the trainable parameters and their order "
        "are unchanged since it was saved; and call record_param_names(optimizer, model) so "
        "that later checkpoints carry names"
    )


def _refuse_zero(sd: Mapping[Any, Any]) -> None:
    """A DeepSpeed ZeRO-1/2 optimizer state (flat partitions) is refused, saying what to do."""
    inner = sd.get("optimizer_state_dict")
    for candidate in (sd, inner if isinstance(inner, Mapping) else {}):
        if any(k in candidate for k in _ZERO_KEYS):
            raise LayoutError(f"this is a DeepSpeed ZeRO optimizer state: {_UNIVERSAL}")


def _flat_groups(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every param group holds one 1-D tensor (flat partitions, as ZeRO makes them)."""
    return all(len(g[PARAMS]) == 1 and g[PARAMS][0].dim() == 1 for g in optimizer.param_groups)


# --------------------------------------------------------------------------------------
# load side: the model


class ModelLoadHook:
    """The ``Module.load_state_dict`` pre-hook :func:`install_model_load_hook` registers.

    Attributes:
        model: The module it is registered on.
        diff: The :class:`~dsdmerge.KeyDiff` of the last state dict it merged
            (``None`` until one was).
        loads: How many state dicts it merged.
    """

    def __init__(self, model: torch.nn.Module, options: MergeOptions) -> None:
        self.model = model
        self.diff: KeyDiff | None = None
        self.loads = 0
        policy = dataclasses.replace(options.policy, drop_unexpected=True)
        self._options = dataclasses.replace(options, policy=policy)
        self._lock = threading.Lock()
        self._handle = _register_module_pre_hook(model, self)

    def __deepcopy__(self, memo: dict[int, Any]) -> ModelLoadHook:
        return self

    def remove(self) -> None:
        """Unregister the hook: later loads are torch's own again."""
        self._handle.remove()

    def __enter__(self) -> ModelLoadHook:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"ModelLoadHook({type(self.model).__name__}, loads={self.loads}, diff={self.diff!r})"

    def __call__(
        self,
        module: torch.nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """Merge this module's keys of ``state_dict`` (torch's copy) in place."""
        # torch hands the hook its own copy of the dict the caller passed, and loads
        # whatever the hook leaves in it: the merged entries replace this module's keys
        mine = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
        reference = module.state_dict()
        merged = run(mine, reference, self._options, stacklevel=6)
        for key in [k for k in state_dict if k.startswith(prefix)]:
            del state_dict[key]
        state_dict.update((prefix + k, v) for k, v in merged.state_dict.items())
        with self._lock:
            self.diff = merged.diff
            self.loads += 1
        _log.info(
            "dsdmerge: %s.load_state_dict merged through install_model_load_hook: %s",
            type(module).__name__,
            merged.diff,
        )


def _register_module_pre_hook(model: torch.nn.Module, hook: Callable[..., None]) -> RemovableHandle:
    register = getattr(model, "register_load_state_dict_pre_hook", None)
    if register is not None:  # public since torch 2.5
        return register(hook)  # type: ignore[no-any-return]
    # torch 2.4 has only the private spelling of the same registration
    return model._register_load_state_dict_pre_hook(hook, with_module=True)  # type: ignore[no-untyped-call,no-any-return]


def install_model_load_hook(
    model: torch.nn.Module,
    /,
    *,
    policy: PolicyName | Policy = "default",
    allow_missing: str | Iterable[str] = (),
    allow_unexpected: str | Iterable[str] = (),
    rename: Rules | None = None,
    on_shape_mismatch: OnShapeMismatch = "raise",
) -> ModelLoadHook:
    """Make ``model.load_state_dict(sd)`` merge ``sd`` over the model's current state first.

    Registers a ``load_state_dict`` pre-hook on ``model``
    (``Module.register_load_state_dict_pre_hook``): whatever the trainer passes
    (Hugging Face ``Trainer``'s ``model.safetensors``, accelerate's
    ``load_state``, Lightning's ``state_dict``, DeepSpeed's ``module``) is merged
    under the policy before torch loads it, as :func:`~dsdmerge.integrations.resume_model`
    merges: keys the checkpoint lacks keep the model's current values (a new head
    keeps its initialisation), keys the model lacks are left out, a grown tensor
    keeps its trained slice (``on_shape_mismatch="resize"``), renames apply, and a
    refusal raises from the trainer's load call before any tensor was copied. So
    a non-strict load (``Trainer``'s) skips nothing the policy did not accept, and
    a strict one (Lightning's, accelerate's) accepts what the policy accepted.
    The report is kept on the hook (``hook.diff``) and logged once per load.

    Args:
        model: The module the trainer loads into.
        policy: ``"default"``, ``"warn"``, ``"strict"`` or a :class:`~dsdmerge.Policy`.
        allow_missing: Globs over keys the checkpoint may lack, e.g. ``"head.*"``.
        allow_unexpected: Globs over keys the model may lack.
        rename: Rename rules for the checkpoint's keys (see :func:`dsdmerge.rename`).
        on_shape_mismatch: ``"raise"``, ``"take_reference"`` or ``"resize"``.

    Returns:
        The :class:`ModelLoadHook` (``hook.diff``, ``hook.remove()``).

    Raises:
        InvalidPolicyError: Bad ``policy`` or allow-lists.
        StateDictTypeError: ``model`` is not a ``torch.nn.Module``.

    Examples:
        >>> import torch
        >>> from dsdmerge.integrations import install_model_load_hook
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> hook = install_model_load_hook(model, policy="strict", allow_missing="1.*")
        >>> old = {"0.weight": torch.ones(2, 2), "0.bias": torch.zeros(2)}
        >>> model.load_state_dict(old)  # strict, and the new head keeps its initialisation
        <All keys matched successfully>
        >>> hook.diff.missing
        ('1.weight', '1.bias')
        >>> hook.remove()
    """
    import torch

    if not isinstance(model, torch.nn.Module):
        raise StateDictTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    options = MergeOptions.of(
        policy,
        allow_missing=allow_missing,
        allow_unexpected=allow_unexpected,
        rename=rename,
        on_shape_mismatch=on_shape_mismatch,
    )
    return ModelLoadHook(model, options)
