"""Live optimizers as a resume sees them, without changing them.

Internal to :mod:`dsdmerge.integrations`. Three things live here:

* :func:`leaf_optimizers`: the real ``torch.optim.Optimizer`` objects behind what
  the caller passed: one optimizer, several, or a *container* (an ``Optimizer``
  subclass that holds several, such as torchtitan's ``OptimizersContainer``
  (``.optimizers``) or VeOmni's ``MultiOptimizer`` (``.optimizers_dict``)).
* :class:`Slots`: every parameter of those optimizers with the name a checkpoint
  uses for it (its fqn, or its int id in a plain ``optimizer.state_dict()``), and
  :meth:`Slots.reference`, the state dict the optimizers would accept, built from
  their own ``state_dict()`` and the checkpoint: **no optimizer step is taken and
  no parameter is touched**. (DSD's ``get_optimizer_state_dict`` takes a real
  step with zero gradients to build its reference; on a container that step runs
  at the real learning rate.)
* :meth:`Slots.load_dicts`: the merged state split back into one int-keyed
  ``optimizer.state_dict()`` per optimizer, in that optimizer's own parameter
  order, for ``Optimizer.load_state_dict``.

How the reference is built, per parameter that still exists:

* the checkpoint's state fields are all expected (``Optimizer.load_state_dict``
  keeps fields the optimizer would not create, such as a momentum buffer after
  ``momentum`` was set to 0), so they are in the reference, as the checkpoint's
  own values;
* fields the live optimizer already holds (it stepped before the resume, or
  created state on its own, as schedulefree's ``.train()`` does) are there with
  the live values; with ``fresh="reference"``, so are the fields DSD's
  zero-gradient step would create, computed on a throwaway copy of the optimizer;
* a parameter with no state anywhere gets *placeholder* fields named as the
  checkpoint names them for the other members of its param group, so that the
  report says which state is missing; placeholders are never loaded;
* a checkpoint field whose tensor does not have the shape (or dtype) the optimizer
  gives that field for that parameter is there with the optimizer's own tensor
  (:func:`expected_state`: the live state, else the optimizer's fresh state from a
  throwaway twin, see :mod:`dsdmerge.integrations._fresh`), so that the merge
  refuses, reports or resizes it as it does any tensor.

What is loaded (:meth:`Slots.load_dicts`): the merged state of the optimizers'
parameters, and besides only the optimizer-level entries the optimizers keep
themselves or the checkpoint holds as such (MADGRAD's ``state['k']``: a value that
is no mapping and no checkpoint group's member). The state of a parameter that is no
longer optimized (removed from the model, or frozen and left out of the optimizer)
is reported unexpected and never loaded under its name.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import chain
from typing import TYPE_CHECKING, Any, ClassVar

from dsdmerge._groups import most_common
from dsdmerge._ids import respelled_state
from dsdmerge._values import MISSING, short_repr
from dsdmerge.errors import DSDMergeError, LayoutError, StateDictTypeError
from dsdmerge.integrations._fresh import constructor_state, fresh_states, same_state
from dsdmerge.layout import PARAM_GROUPS, PARAM_NAMES, PARAMS, STATE

if TYPE_CHECKING:
    import torch

__all__: list[str] = []

# attributes under which optimizer containers keep their optimizers
_CONTAINER_ATTRS = ("optimizers", "optimizers_dict", "_optimizers")


class _Placeholder:
    """The value of a state field a parameter does not have yet (never loaded)."""

    __slots__ = ()
    _instance: ClassVar[_Placeholder | None] = None

    def __new__(cls) -> _Placeholder:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "<no state yet>"


PLACEHOLDER = _Placeholder()


# --------------------------------------------------------------------------------------
# which optimizers


def inner_optimizers(obj: object) -> list[Any] | None:
    """The optimizers a container holds, or ``None`` when ``obj`` is not a container."""
    import torch

    for attr in _CONTAINER_ATTRS:
        try:
            held = vars(obj).get(attr)
        except TypeError:  # no __dict__
            return None
        if isinstance(held, Mapping):
            held = list(held.values())
        if (
            isinstance(held, (list, tuple))
            and held
            and all(isinstance(o, torch.optim.Optimizer) for o in held)
        ):
            return list(held)
    return None


def leaf_optimizers(optimizers: object) -> tuple[torch.optim.Optimizer, ...]:
    """The real optimizers behind one optimizer, several, or a container of them.

    Raises:
        StateDictTypeError: Not optimizers, or an ``Optimizer`` subclass that holds
            no parameters of its own and no optimizers dsdmerge can find (the
            message says what to pass instead).
        LayoutError: One optimizer given twice, or a parameter in two optimizers.
    """
    import torch

    found: list[torch.optim.Optimizer] = []

    def visit(obj: object, where: str, depth: int) -> None:
        inner = inner_optimizers(obj) if depth < 8 else None
        if inner is not None:
            for i, o in enumerate(inner):
                visit(o, f"{where}[{i}]", depth + 1)
            return
        if not isinstance(obj, torch.optim.Optimizer):
            raise StateDictTypeError(
                f"{where} is a {type(obj).__name__}, not a torch.optim.Optimizer; pass an "
                "optimizer, a list of optimizers, or an optimizer container"
            )
        groups = vars(obj).get("param_groups")
        state = vars(obj).get("state")
        if not isinstance(groups, list) or not isinstance(state, Mapping):
            raise StateDictTypeError(
                f"{where} ({type(obj).__name__}) is a torch.optim.Optimizer without its own "
                "param_groups and state, and holds no optimizers under "
                f"{', '.join(repr(a) for a in _CONTAINER_ATTRS)}: if it wraps several "
                "optimizers, pass them instead, e.g. resume_optimizer(model, "
                "list(container.<optimizers>), loaded)"
            )
        found.append(obj)

    if isinstance(optimizers, torch.optim.Optimizer) or inner_optimizers(optimizers) is not None:
        visit(optimizers, "optimizers", 0)
    else:
        try:
            items = list(optimizers)  # type: ignore[call-overload]
        except TypeError:
            raise StateDictTypeError(
                f"optimizers must be a torch.optim.Optimizer or an iterable of them, got "
                f"{type(optimizers).__name__}"
            ) from None
        for i, o in enumerate(items):
            visit(o, f"optimizers[{i}]", 1)
    if not found:
        raise StateDictTypeError("no optimizers given: pass at least one torch.optim.Optimizer")
    if len({id(o) for o in found}) != len(found):
        raise LayoutError("the same optimizer was given twice")
    seen: dict[int, int] = {}
    for i, o in enumerate(found):
        for g in o.param_groups:
            for p in g[PARAMS]:
                if seen.setdefault(id(p), i) != i:
                    raise LayoutError(
                        f"a parameter of shape {tuple(p.shape)} is in two of the given "
                        f"optimizers ({seen[id(p)]} and {i}); each parameter must belong to one"
                    )
    return tuple(found)


# --------------------------------------------------------------------------------------
# parameter names


class FlatParameters(LayoutError):
    """A parameter that stands for several fqns (FSDP1 without ``use_orig_params``)."""


def param_fqns(model: torch.nn.Module | Sequence[torch.nn.Module]) -> dict[int, str]:
    """``id(parameter) -> fqn`` as DSD spells it (wrapper prefixes removed).

    Tied parameters take their first name, as ``named_parameters()`` and DSD do.
    Uses DSD's own ``_get_fqns`` so the names match what ``get_optimizer_state_dict``
    saved (DDP ``module.``, ``torch.compile``'s ``_orig_mod.``, activation
    checkpointing and FSDP wrappers).
    """
    # DSD's own name resolution (private: see dsdmerge._torch_api)
    from dsdmerge._torch_api import get_fqns

    parts = model_parts(model)
    out: dict[int, str] = {}
    for part in parts:
        plain = not any(map(_renames, part.modules()))
        for name, p in part.named_parameters():
            if plain and _CHECKPOINT_PREFIX not in name:  # no wrapper: the name is the fqn
                out.setdefault(id(p), name)
                continue
            fqns = get_fqns(part, name)
            if len(fqns) != 1:
                raise FlatParameters(
                    f"parameter {name!r} of the model stands for {len(fqns)} parameters (FSDP1's "
                    "flat parameters, use_orig_params=False), whose optimizer state only FSDP's "
                    "own collectives can map to fqns: wrap the model with use_orig_params=True (or "
                    "FSDP2's fully_shard), or merge by hand with dsdmerge.merge over "
                    "get_optimizer_state_dict and load with set_optimizer_state_dict"
                )
            out.setdefault(id(p), next(iter(fqns)))
    return out


_CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."


def model_parts(model: object) -> list[torch.nn.Module]:
    """A model, or a list of model parts, as a list of modules."""
    import torch

    parts = [model] if isinstance(model, torch.nn.Module) else list(model)  # type: ignore[call-overload]
    for i, part in enumerate(parts):
        if not isinstance(part, torch.nn.Module):
            raise StateDictTypeError(
                f"model{'' if len(parts) == 1 else f'[{i}]'} is a {type(part).__name__}, not a "
                "torch.nn.Module (or a list of model parts)"
            )
    return parts


def _renames(module: object) -> bool:
    """Whether ``module`` makes DSD's fqns differ from ``named_parameters()`` names."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    from dsdmerge._torch_api import optimized_module_class

    compiled = optimized_module_class()  # torch.compile's wrapper (private: torch._dynamo)
    wrappers = (DistributedDataParallel, FullyShardedDataParallel)
    return isinstance(module, wrappers + ((compiled,) if compiled else ())) or hasattr(
        module, "_fqn_modifiers"
    )


def uses_fsdp1(model: object) -> bool:
    """Whether any module of the model is an FSDP1 ``FullyShardedDataParallel``."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(
        isinstance(m, FullyShardedDataParallel)
        for part in model_parts(model)
        for m in part.modules()
    )


# --------------------------------------------------------------------------------------
# the slots


@dataclasses.dataclass
class _Optim:
    optimizer: torch.optim.Optimizer
    live: dict[Any, Any]  # its own state_dict(): int ids
    keys: list[list[Any]]  # per group, the slot key of each parameter
    ids: list[list[Any]]  # per group, the int id of each parameter in ``live``
    params: list[list[Any]]  # per group, the parameter itself


@dataclasses.dataclass
class Slots:
    """The parameters of some optimizers, named as a checkpoint names them.

    ``keyed="fqn"``: a parameter's name is its fqn in the model. ``keyed="id"``
    (one optimizer): its int id in the optimizer's own ``state_dict()``.
    """

    optims: list[_Optim]
    keyed: str

    @classmethod
    def of(
        cls,
        optimizers: tuple[torch.optim.Optimizer, ...],
        model: torch.nn.Module | Sequence[torch.nn.Module] | None,
        *,
        keyed: str,
    ) -> Slots:
        fqn_of = param_fqns(model) if keyed == "fqn" and model is not None else {}
        optims = []
        for n, opt in enumerate(optimizers):
            live = opt.state_dict()
            if not isinstance(live, Mapping) or not isinstance(live.get(PARAM_GROUPS), list):
                raise StateDictTypeError(
                    f"{type(opt).__name__}.state_dict() did not return an optimizer state dict"
                )
            keys: list[list[Any]] = []
            ids: list[list[Any]] = []
            for gi, (group, saved) in enumerate(
                zip(opt.param_groups, live[PARAM_GROUPS], strict=True)
            ):
                ids.append(list(saved[PARAMS]))
                if keyed == "id":
                    keys.append(list(saved[PARAMS]))
                    continue
                names = []
                for j, p in enumerate(group[PARAMS]):
                    fqn = fqn_of.get(id(p))
                    if fqn is None:
                        raise LayoutError(
                            f"parameter {j} of param group {gi} of optimizer {n} "
                            f"({type(opt).__name__}, shape {tuple(p.shape)}) is not a "
                            "parameter of the model passed in"
                        )
                    names.append(fqn)
                keys.append(names)
            params = [list(group[PARAMS]) for group in opt.param_groups]
            optims.append(_Optim(opt, dict(live), keys, ids, params))
        slots = cls(optims, keyed)
        every = [k for o in optims for g in o.keys for k in g]
        if len(set(every)) != len(every):
            dup = sorted({short_repr(k) for k in every if every.count(k) > 1})
            raise LayoutError(f"parameters listed twice across param groups: {', '.join(dup)}")
        return slots

    def every_key(self) -> Iterator[Any]:
        """Every parameter's slot key, group after group, optimizer after optimizer."""
        for o in self.optims:
            for g in o.keys:
                yield from g

    def live_state(self) -> dict[Any, Any]:
        """The live optimizers' per-parameter state, by slot key."""
        out: dict[Any, Any] = {}
        for o in self.optims:
            by_id = dict(zip(_chain(o.ids), _chain(o.keys), strict=True))
            for pid, entry in o.live[STATE].items():
                if pid in by_id:
                    out[by_id[pid]] = entry
        return out

    def live_extras(self) -> tuple[dict[Any, Any], dict[Any, Any]]:
        """``(optimizer-level state entries, top-level keys besides state/param_groups)``."""
        entries: dict[Any, Any] = {}
        extras: dict[Any, Any] = {}
        for o in self.optims:
            ids = set(_chain(o.ids))
            for pid, entry in o.live[STATE].items():
                if pid not in ids:
                    entries.setdefault(pid, entry)
            for k, v in o.live.items():
                if k not in (STATE, PARAM_GROUPS):
                    extras.setdefault(k, v)
        return entries, extras

    def reference(
        self,
        checkpoint: Mapping[Any, Any],
        *,
        init: Mapping[Any, Any] | None = None,
        overlays: Mapping[Any, list[Mismatched]] | None = None,
    ) -> dict[Any, Any]:
        """The state dict these optimizers accept, given the (nested) ``checkpoint``.

        See the module docstring. ``init``: per slot key, the state DSD's
        zero-gradient step would create (``fresh="reference"``). ``overlays``: per
        slot key, the checkpoint's state fields the optimizer shapes otherwise
        (:func:`field_mismatches` against its fresh state): the reference holds the
        optimizer's tensors there, so the merge compares them. Does not modify its
        inputs; checkpoint and live values are shared.
        """
        c_state = checkpoint.get(STATE)
        c_state = c_state if isinstance(c_state, Mapping) else {}
        c_groups = checkpoint.get(PARAM_GROUPS)
        c_groups = [
            g
            for g in (c_groups if isinstance(c_groups, (list, tuple)) else ())
            if isinstance(g, Mapping) and isinstance(g.get(PARAMS), (list, tuple))
        ]
        c_group_of: dict[Any, int] = {}
        for i, g in enumerate(c_groups):
            for pid in g[PARAMS]:
                if isinstance(pid, (int, str)):
                    c_group_of.setdefault(pid, i)
        live = self.live_state()
        state: dict[Any, Any] = {}
        groups: list[dict[str, Any]] = []
        for o in self.optims:
            for group_keys, saved in zip(o.keys, o.live[PARAM_GROUPS], strict=True):
                template = _template(c_state, group_keys)
                for key in group_keys:
                    ck = c_state.get(key, MISSING)
                    ck = ck if isinstance(ck, Mapping) else MISSING
                    base = live.get(key)
                    if not base and init is not None:
                        base = init.get(key)
                    if ck is not MISSING:
                        if base:  # every field of the checkpoint's, at any depth (heavyball
                            # keeps its step in one view's entry: {0: {"step": ...}})
                            state[key] = _union(ck, base, 0)
                        elif overlays and overlays.get(key):
                            state[key] = overlaid(ck, overlays[key])
                        else:
                            state[key] = ck
                    elif base:
                        state[key] = base
                    elif template is not None:
                        state[key] = template
                group = {k: v for k, v in saved.items() if k != PARAMS}
                # what the optimizer keeps in its groups as it steps (AdamP's and heavyball's
                # step counts) is expected of a parameter that still exists: torch keeps it
                home = most_common(list(map(c_group_of.get, group_keys)))
                if home is not None:
                    for k, v in c_groups[home].items():
                        if k != PARAMS and k not in group:
                            group[k] = v
                group[PARAMS] = list(group_keys)
                groups.append(group)
        entries, extras = self.live_extras()
        # optimizer-level state entries (not a parameter's) are carried as torch carries them
        c_groups = checkpoint.get(PARAM_GROUPS)
        c_members = {
            pid
            for g in (c_groups if isinstance(c_groups, (list, tuple)) else ())
            if isinstance(g, Mapping) and isinstance(g.get(PARAMS), (list, tuple))
            for pid in g[PARAMS]
            if isinstance(pid, (int, str))
        }
        for pid, entry in c_state.items():
            if pid not in state and pid not in c_members and not isinstance(entry, Mapping):
                entries.setdefault(pid, entry)
        state.update((k, v) for k, v in entries.items() if k not in state)
        for k, v in checkpoint.items():
            if k not in (STATE, PARAM_GROUPS):
                extras[k] = _union(v, extras[k], 0) if k in extras else v
        return {**extras, STATE: state, PARAM_GROUPS: groups}

    def entry_keys(self, reference: Mapping[Any, Any]) -> frozenset[Any]:
        """The optimizer-level state keys of a :meth:`reference` (MADGRAD's ``state['k']``)."""
        slot_keys = set(self.every_key())
        return frozenset(k for k in reference[STATE] if k not in slot_keys)

    def load_dicts(
        self, merged: Mapping[Any, Any], *, keep: set[Any] | None, entry_keys: frozenset[Any]
    ) -> list[dict[Any, Any]]:
        """One ``optimizer.state_dict()``-shaped dict per optimizer, from the merged state.

        ``merged`` follows :meth:`reference`'s structure (its param groups in the
        same order). ``keep``: the slot keys whose state may be loaded (``None``:
        all); placeholders are never loaded. ``entry_keys``: the optimizer-level
        entries that may be loaded besides (:meth:`entry_keys` of the reference).
        ``param_names`` come from the live optimizer (the names of the model you
        have now).
        """
        state = merged[STATE]
        groups = merged[PARAM_GROUPS]
        out = []
        at = 0
        extras = {k: v for k, v in merged.items() if k not in (STATE, PARAM_GROUPS)}
        slot_keys = set(self.every_key())
        # only what the optimizers themselves keep besides their parameters' state: state of a
        # parameter no longer optimized (removed, or frozen and left out) is not loaded under
        # its name (DSD's next get_optimizer_state_dict would raise KeyError on it)
        entries = {
            k: v
            for k, v in state.items()
            if k not in slot_keys and k in entry_keys and _loadable(v)
        }
        for o in self.optims:
            o_state: dict[Any, Any] = {}
            o_groups = []
            for keys, ids, saved in zip(o.keys, o.ids, o.live[PARAM_GROUPS], strict=True):
                group = {k: v for k, v in groups[at].items() if k != PARAMS}
                at += 1
                group.pop(PARAM_NAMES, None)
                if PARAM_NAMES in saved:
                    group[PARAM_NAMES] = saved[PARAM_NAMES]
                group[PARAMS] = Members(ids)
                o_groups.append(group)
                for key, pid in zip(keys, ids, strict=True):
                    entry = state.get(key, MISSING)
                    if entry is MISSING or (keep is not None and key not in keep):
                        continue
                    if _loadable(entry):
                        o_state[pid] = entry
            own_extras = {k: v for k, v in extras.items() if k in o.live}
            if len(self.optims) == 1:
                own_extras = extras
                o_state.update(entries)
            else:
                ids_here = {pid for pid in o.live[STATE] if pid not in set(_chain(o.ids))}
                o_state.update((k, v) for k, v in entries.items() if k in ids_here)
            out.append({**own_extras, STATE: o_state, PARAM_GROUPS: o_groups})
        return out


class Members(list[Any]):
    """A param group's ``params`` list whose ``in`` takes constant time.

    ``Optimizer.load_state_dict`` asks, for every state tensor it loads, which group
    lists its param id (``param_id in group["params"]``): a scan of the list, so a
    resume costs time quadratic in the number of parameters (5 s at 20k params in
    one group). This list answers from a set; it is a list in every other respect.
    """

    __slots__ = ("_set",)

    def __init__(self, items: Iterable[Any] = ()) -> None:
        super().__init__(items)
        try:
            self._set: frozenset[Any] | None = frozenset(self)
        except TypeError:  # an unhashable id: plain scans
            self._set = None

    def __contains__(self, item: object) -> bool:
        if self._set is None:
            return super().__contains__(item)
        try:
            return item in self._set
        except TypeError:
            return super().__contains__(item)

    def __reduce__(self) -> Any:  # copies and pickles are plain lists
        return (list, (list(self),))


def _chain(lists: Iterable[list[Any]]) -> Iterator[Any]:
    for items in lists:
        yield from items


def _union(checkpoint: Any, live: Any, depth: int) -> Any:
    """The live value, with what the checkpoint's has besides (mappings, recursively).

    An optimizer's own top-level keys grow as it trains (heavyball's ``inner_group``):
    what the checkpoint holds there is expected, as torch hands it to the optimizer.
    """
    if not isinstance(checkpoint, Mapping) or not isinstance(live, Mapping) or depth > 32:
        return live
    out = dict(checkpoint)
    for k, v in live.items():
        out[k] = _union(checkpoint[k], v, depth + 1) if k in checkpoint else v
    return out


def _template(c_state: Mapping[Any, Any], members: list[Any]) -> dict[Any, Any] | None:
    """Placeholder state named like the checkpoint state of the first member that has some.

    Only when at least half the members of the group have state in the checkpoint:
    then a member without any is missing it (a parameter that never got a
    gradient). An optimizer that keeps state for a few parameters only (LBFGS: the
    first) gets no placeholders.
    """
    entries = [c_state.get(key) for key in members]
    have = [e for e in entries if isinstance(e, Mapping) and e]
    if not have or 2 * len(have) < len(members):
        return None
    return _placeholders(have[0], 0)


def _placeholders(entry: Mapping[Any, Any], depth: int) -> dict[Any, Any]:
    return {
        name: _placeholders(v, depth + 1) if isinstance(v, Mapping) and depth < 8 else PLACEHOLDER
        for name, v in entry.items()
    }


def _loadable(value: Any) -> bool:
    """Whether ``value`` holds no placeholder (which must never reach an optimizer)."""
    if value is PLACEHOLDER:
        return False
    if isinstance(value, Mapping):
        stack = [iter(value.values())]
        while stack:
            for v in stack[-1]:
                if v is PLACEHOLDER:
                    return False
                if isinstance(v, Mapping) and len(stack) < 64:
                    stack.append(iter(v.values()))
                    break
            else:
                stack.pop()
    return True


# --------------------------------------------------------------------------------------
# the optimizer's own fresh state, on throwaway twins (see dsdmerge.integrations._fresh)


def init_state(slots: Slots) -> dict[Any, Any]:
    """The state DSD's ``_init_optim_state`` would create, per slot key, from throwaway copies.

    Each optimizer's twin (:func:`~dsdmerge.integrations._fresh.twin`, real copies of
    the parameters) takes DSD's step (zero gradients for the parameters that require
    one, ``lr`` 0) when DSD would (no state yet and no parameter holding a gradient).
    The live optimizer and the model are never touched; the cost is one copy of the
    parameters and the fresh state.

    Raises:
        DSDMergeError: The optimizer's step failed on the copy.
    """
    out: dict[Any, Any] = {}
    for o in slots.optims:
        opt = o.optimizer
        params = [p for g in o.params for p in g]
        if opt.state or any(p.grad is not None for p in params):
            continue  # DSD takes no step then: its reference is the live state
        try:
            fresh = fresh_states(opt, kind="copy", every_param=False)
        except Exception as err:  # any failure of a third-party step
            raise DSDMergeError(
                f"fresh='reference' needs DSD's zero-gradient step, and "
                f"{type(opt).__name__}.step() failed on a copy of the optimizer: "
                f"{type(err).__name__}: {short_repr(str(err))}. Nothing was changed. Use "
                "fresh='as_fresh' (parameters without checkpointed state start fresh)."
            ) from err
        for key, p in zip(_chain(o.keys), _chain(o.params), strict=True):
            if id(p) in fresh:
                out[key] = fresh[id(p)]
    return out


def made_with_the_optimizer(slots: Slots, live: Mapping[Any, Any], keys: Iterable[Any]) -> set[Any]:
    """Which of ``keys`` hold live state a new optimizer has too (its constructor made it).

    A new optimizer that never saw the checkpoint holds what its constructor makes
    (Adagrad's accumulators) and nothing else: not what DSD's zero-gradient step made
    (torchtitan's ``OptimizersContainer.state_dict()`` and DSD's
    ``get_optimizer_state_dict`` take one on an optimizer without state), not what steps
    taken before the resume made. Asked of the optimizer's class itself: a new instance
    built from the live groups' hyperparameters on meta stand-ins (no memory). Where that
    cannot be built, the live state counts as made by a zero-gradient step when it is
    exactly what one gives a copy of the optimizer now (tensors drawn at random, as
    Kron's, compared by shape), and is kept otherwise.
    """
    wanted = set(keys)
    out: set[Any] = set()
    for o in slots.optims:
        mine = [
            (key, p)
            for key, p in zip(_chain(o.keys), _chain(o.params), strict=True)
            if key in wanted
        ]
        if not mine:
            continue
        made = constructor_state(o.optimizer)
        if made is not None:
            out.update(key for key, p in mine if id(p) in made)
            continue
        try:  # twice, with two seeds: what differs is drawn at random (Kron), not compared
            fresh = fresh_states(o.optimizer, kind="copy", every_param=False, seed=0)
            again = fresh_states(o.optimizer, kind="copy", every_param=False, seed=1)
        except Exception:  # noqa: BLE001 - unknown: the live state is kept, as before
            out.update(key for key, _ in mine)
            continue
        out.update(
            key
            for key, p in mine
            if not (id(p) in fresh and same_state(live[key], fresh[id(p)], drawn=again.get(id(p))))
        )
    return out


@dataclasses.dataclass
class Expected:
    """What the optimizers themselves give each parameter's state, where it was asked for.

    Attributes:
        states: Slot key to the state the optimizer's zero-gradient step gives the
            parameter on a twin (meta tensors, or real ones for keys in ``real``).
        real: The slot keys whose ``states`` hold real values (a copy twin's).
        unknown: One line per optimizer whose fresh state could not be computed.
        checked: The slot keys whose checkpoint tensors have the shape and dtype of
            the same fields in ``states`` (checked here: nothing to overlay).
    """

    states: dict[Any, Any]
    real: frozenset[Any]
    unknown: tuple[str, ...]
    checked: frozenset[Any] = frozenset()


def expected_state(slots: Slots, c_state: Mapping[Any, Any], keys: Iterable[Any]) -> Expected:
    """The optimizers' own fresh state for the parameters ``keys`` (their checkpoint state).

    A meta twin first (no memory); a copy twin when the meta step fails, when it finds
    a field whose shape or dtype differs from the checkpoint's ``c_state`` (confirmed
    on real values, which a resize needs), or when it gives some parameters state but
    not one that has checkpoint state. See :mod:`dsdmerge.integrations._fresh`.
    """
    wanted = set(keys)
    states: dict[Any, Any] = {}
    real: set[Any] = set()
    unknown: list[str] = []
    checked: set[Any] = set()
    for o in slots.optims:
        mine = [
            (key, p)
            for key, p in zip(_chain(o.keys), _chain(o.params), strict=True)
            if key in wanted
        ]
        if not mine:
            continue
        result: dict[int, Any] | None
        try:
            result = fresh_states(o.optimizer, kind="meta", every_param=True)
        except Exception:  # noqa: BLE001 - a step that cannot run on meta tensors: a copy
            result = None
        fitting: set[Any] = set()
        confirm = result is None or _differs(c_state, mine, result, fitting)
        is_real = False
        if confirm:
            try:
                result = fresh_states(o.optimizer, kind="copy", every_param=True)
                is_real = True
            except Exception as err:  # noqa: BLE001 - the meta answer, or none
                if result is None:
                    unknown.append(
                        f"{type(o.optimizer).__name__}: its step failed on a copy "
                        f"({type(err).__name__}: {short_repr(str(err))})"
                    )
                    continue
        assert result is not None
        result_of: dict[Any, Any] = {}
        for key, p in mine:
            if id(p) in result:
                states[key] = result_of[key] = result[id(p)]
                if is_real:
                    real.add(key)
        # tensor fields the checkpoint has that a zero-gradient step does not make (LBFGS
        # makes its direction and history only from a gradient that is not zero): their
        # shapes from a step with gradients of ones (values unknown: not "real")
        lacking = [
            (key, p)
            for key, p in mine
            if not (key in states and c_state[key].keys() <= states[key].keys())
            and _tensor_fields(c_state[key]) - set(states.get(key, {}))
        ]
        if lacking:
            probed = _probe(o.optimizer)
            for key, p in lacking:
                extra = {
                    k: v
                    for k, v in probed.get(id(p), {}).items()
                    if k in _tensor_fields(c_state[key]) and k not in states.get(key, {})
                }
                if extra:
                    states[key] = {**states.get(key, {}), **extra}
                    real.discard(key)
        for key, _ in mine:
            if key in states:
                states[key] = _with_siblings(c_state[key], states[key])
        if not confirm:
            checked.update(k for k in fitting if states.get(k) is result_of.get(k))
    return Expected(states, frozenset(real), tuple(unknown), frozenset(checked))


def _differs(
    c_state: Mapping[Any, Any],
    mine: list[tuple[Any, Any]],
    result: Mapping[int, Any],
    fitting: set[Any],
) -> bool:
    """Whether a meta step's ``result`` leaves out a parameter or shapes a field otherwise.

    ``mine``: the slot key and parameter of each checkpoint entry of ``c_state`` asked
    about. The keys whose tensors all have the shape and dtype of the fields the step
    made are added to ``fitting``.
    """
    if result and any(id(p) not in result for _, p in mine):
        return True
    own = {key: result[id(p)] for key, p in mine if id(p) in result}
    # the parameters of one kind share one fresh entry (one stand-in each, see _fresh.twin)
    by_entry: dict[int, list[Any]] = {}
    for key, fresh in own.items():
        by_entry.setdefault(id(fresh), []).append(key)
    rest: list[Any] = []
    for keys in by_entry.values():
        if _all_alike([c_state[k] for k in keys], own[keys[0]]):
            fitting.update(keys)
        else:
            rest += keys
    spelled = respelled_state({key: c_state[key] for key in rest}, own)
    differs = False
    for key in rest:
        if field_mismatches(spelled[key], own[key]):
            differs = True
        else:
            fitting.add(key)
    return differs


def _all_alike(entries: list[Any], fresh: Any) -> bool:
    """Whether every entry is a dict of ``fresh``'s fields, in its order, alike its tensors.

    Alike: equal shapes, the same dtype (see :func:`_alike`). In C-level passes over all
    the entries (a few list comparisons), not a walk per entry; False sends them to
    :func:`field_mismatches` one by one.
    """
    if type(fresh) is not dict or not set(map(type, entries)) <= {dict}:
        return False
    names = tuple(fresh)
    if list(map(tuple, entries)).count(names) != len(entries):
        return False
    values = list(chain.from_iterable(map(dict.values, entries)))
    own = list(fresh.values())
    try:
        return list(map(_SHAPE, values)) == list(map(_SHAPE, own)) * len(entries) and list(
            map(_DTYPE, values)
        ) == list(map(_DTYPE, own)) * len(entries)
    except AttributeError:  # a value that is no tensor
        return False


_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")


def _with_siblings(checkpoint: Mapping[Any, Any], fresh: Mapping[Any, Any]) -> Mapping[Any, Any]:
    """``fresh`` with a stand-in for each checkpoint tensor field no step made at all.

    A field an optimizer makes only later (SophiaH's ``hessian``, every few steps) or no
    more (a momentum buffer after ``momentum`` was set to 0) is sized like a sibling: it
    takes the fresh tensor of the field that has its shape and dtype in the checkpoint
    (``hessian`` is shaped like ``momentum``). A field with no such sibling stays
    unchecked.
    """
    import torch

    if checkpoint.keys() <= fresh.keys():
        return fresh
    by_shape: dict[tuple[Any, ...], Any] = {}
    for k, v in checkpoint.items():
        f = fresh.get(k)
        if isinstance(v, torch.Tensor) and isinstance(f, torch.Tensor) and v.dim() > 0:
            by_shape.setdefault((tuple(v.shape), v.dtype), f)
    extra = {
        k: by_shape[(tuple(v.shape), v.dtype)]
        for k, v in checkpoint.items()
        if k not in fresh and isinstance(v, torch.Tensor) and (tuple(v.shape), v.dtype) in by_shape
    }
    return {**fresh, **extra} if extra else fresh


def _tensor_fields(entry: Mapping[Any, Any]) -> set[Any]:
    import torch

    return {k for k, v in entry.items() if isinstance(v, torch.Tensor)}


def _probe(optimizer: torch.optim.Optimizer) -> dict[int, Any]:
    """:func:`fresh_states` with gradients of ones (meta first, then a copy; ``{}`` if neither)."""
    for kind in ("meta", "copy"):
        try:
            return fresh_states(optimizer, kind=kind, every_param=True, probe=True)
        except Exception:  # noqa: BLE001 - no probe: those fields stay unchecked
            continue
    return {}


@dataclasses.dataclass(frozen=True)
class Mismatched:
    """A state field whose tensor's shape or dtype differs from what its optimizer gives it.

    Attributes:
        path: Where in the parameter's state entry (mapping keys, list positions).
        in_list: Whether the path goes through a list (PSGD's factor lists).
        checkpoint: The checkpoint's tensor.
        fresh: The optimizer's own (fresh or live) tensor for that field.
    """

    path: tuple[Any, ...]
    in_list: bool
    checkpoint: Any
    fresh: Any

    @property
    def reshaped(self) -> bool:
        """Whether the shapes differ (a 0-d against a 1-element tensor does not)."""
        c, f = tuple(self.checkpoint.shape), tuple(self.fresh.shape)
        return c != f and not (_numel(c) == 1 == _numel(f))


def field_mismatches(
    checkpoint: Any, fresh: Any, path: tuple[Any, ...] = (), *, in_list: bool = False
) -> list[Mismatched]:
    """The tensor fields of one parameter's state whose shape or dtype differ from ``fresh``.

    Fields both have, compared through mappings and lists (PSGD's factor lists); a 0-d
    against a 1-element tensor holds one value either way and is not a difference.
    """
    if len(path) > 16 or _alike(checkpoint, fresh):
        return []
    if isinstance(checkpoint, Mapping) and isinstance(fresh, Mapping):
        out: list[Mismatched] = []
        for k, v in checkpoint.items():
            if k in fresh:
                out.extend(field_mismatches(v, fresh[k], (*path, k), in_list=in_list))
        return out
    if isinstance(checkpoint, (list, tuple)) and isinstance(fresh, (list, tuple)):
        if len(checkpoint) != len(fresh):
            return []
        out = []
        for i, (c, f) in enumerate(zip(checkpoint, fresh, strict=True)):
            out.extend(field_mismatches(c, f, (*path, i), in_list=True))
        return out
    c_shape = _shape(checkpoint)
    f_shape = _shape(fresh)
    if c_shape is None or f_shape is None:
        return []
    if (c_shape != f_shape and not (_numel(c_shape) == 1 == _numel(f_shape))) or (
        checkpoint.dtype != fresh.dtype
    ):
        return [Mismatched(path, in_list, checkpoint, fresh)]
    return []


def _alike(checkpoint: Any, fresh: Any) -> bool:
    """Whether ``checkpoint`` is a dict whose every field ``fresh`` (a dict) has, alike.

    Alike: with an equal ``shape`` and the same ``dtype`` (tensors both, in practice:
    nothing else carries a torch dtype). The common entry, told in one generator frame
    instead of a call per field; anything else (a field ``fresh`` lacks, a non-tensor,
    a nested container, a difference) is False and :func:`field_mismatches` walks it.
    """
    if type(checkpoint) is not dict or type(fresh) is not dict:
        return False
    try:
        return all(
            v.shape == fresh[k].shape and v.dtype is fresh[k].dtype for k, v in checkpoint.items()
        )
    except (AttributeError, KeyError):
        return False


def overlaid(entry: Mapping[Any, Any], fields: Iterable[Mismatched]) -> dict[Any, Any]:
    """``entry`` with each field's fresh tensor in place of the checkpoint's (new containers)."""
    out = dict(entry)
    for m in fields:
        node = out
        for part in m.path[:-1]:
            child = dict(node[part])
            node[part] = child
            node = child
        node[m.path[-1]] = m.fresh
    return out


def _shape(value: Any) -> tuple[int, ...] | None:
    import torch

    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    return None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
