"""Telling flat state dicts from nested ones.

A state dict is *flat* when every value is a leaf (a tensor, a Python scalar, a
tuple, ...): model state dicts, safetensors dicts and the optimizer dicts that
``get_optimizer_state_dict(..., StateDictOptions(flatten_optimizer_state_dict=True))``
returns. It is *nested* when it holds mappings: ``optimizer.state_dict()``, the
fqn-keyed dicts of ``get_optimizer_state_dict``, and whole-checkpoint dicts such
as ``{"model": {...}, "optim": {...}}``.

Optimizers are told by their shape, never by a key's spelling alone. Nested: a
``"state"`` mapping next to a ``"param_groups"`` list (:func:`is_optimizer_state_dict`).
Flat: a *section* ``P`` (``""`` or a prefix ending in a dot) is a flattened
optimizer when some ``P + "param_groups.<fqn>.<name>"`` value is a hyperparameter,
not a tensor (every ``torch.optim`` group holds Python scalars and flags; a tensor
``lr`` may stand among them), and ``P`` does not lie inside another section's
``state.`` or ``param_groups.`` keys (:func:`is_optimizer_section`). A model whose
modules are named ``param_groups`` or ``state`` holds only tensors there, so it is
a model.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from itertools import compress, repeat
from typing import Any

from dsdmerge._text import short_repr
from dsdmerge._values import is_tensor_like
from dsdmerge.errors import LayoutError, StateDictTypeError

__all__ = ["Layout", "classify", "is_optimizer_state_dict"]

STATE = "state"
PARAM_GROUPS = "param_groups"
PARAMS = "params"
PARAM_NAMES = "param_names"  # torch >= 2.6 saves each group's parameter names
STATE_PREFIX = "state."
PG_PREFIX = "param_groups."


class Layout(str, enum.Enum):
    """The two layouts a state dict can have.

    Examples:
        >>> import dsdmerge as dm
        >>> dm.Layout.FLAT == "flat", str(dm.Layout.NESTED)
        (True, 'nested')
    """

    NESTED = "nested"
    FLAT = "flat"

    def __str__(self) -> str:
        return self.value

    def __format__(self, format_spec: str) -> str:
        return self.value.__format__(format_spec)


def require_mapping(obj: object, what: str) -> Mapping[Any, Any]:
    """Return ``obj`` if it is a mapping, else raise :class:`StateDictTypeError`."""
    if not isinstance(obj, Mapping):
        raise StateDictTypeError(
            f"{what} must be a mapping (a state dict), got {type(obj).__name__}. "
            "Pass the dict that torch's state_dict()/get_optimizer_state_dict() returned."
        )
    return obj


def is_optimizer_state_dict(obj: object, /) -> bool:
    """Tell whether ``obj`` is shaped like a nested optimizer state dict.

    That is a mapping with a ``"state"`` mapping and a ``"param_groups"`` list, as
    ``torch.optim.Optimizer.state_dict()`` and ``get_optimizer_state_dict`` return.
    Does not modify its input.

    Args:
        obj: Any object.

    Returns:
        ``True`` for an optimizer-shaped mapping, else ``False``.

    Examples:
        >>> import dsdmerge as dm
        >>> dm.is_optimizer_state_dict({"state": {}, "param_groups": []})
        True
        >>> dm.is_optimizer_state_dict({"state.w.step": 1})
        False
    """
    if not isinstance(obj, Mapping):
        return False
    state = obj.get(STATE)
    groups = obj.get(PARAM_GROUPS)
    return isinstance(state, Mapping) and isinstance(groups, (list, tuple))


def classify(sd: Mapping[Any, Any], /) -> Layout:
    """Classify a state dict as :attr:`Layout.FLAT` or :attr:`Layout.NESTED`.

    A mapping whose values are all leaves is flat (an empty mapping too). A
    mapping holding a mapping is nested. Lists and tuples are leaves, except the
    ``param_groups`` list of an optimizer state dict, which always sits next to
    a ``"state"`` mapping. Does not modify
    its input.

    Args:
        sd: The state dict.

    Returns:
        Its layout.

    Raises:
        StateDictTypeError: ``sd`` is not a mapping.
        LayoutError: ``sd`` mixes nested optimizer sections (``"state"``,
            ``"param_groups"``) with flattened optimizer keys (``"state.<fqn>..."``).

    Examples:
        >>> import dsdmerge as dm
        >>> dm.classify({"state.w.step": 1, "param_groups.w.lr": 0.1})
        <Layout.FLAT: 'flat'>
        >>> dm.classify({"state": {0: {"step": 1}}, "param_groups": [{"lr": 0.1, "params": [0]}]})
        <Layout.NESTED: 'nested'>
    """
    require_mapping(sd, "the state dict")
    # One C-level pass over the value types; the per-type checks run once per distinct type.
    return layout_of(sd, value_types(sd))


def value_types(sd: Mapping[Any, Any]) -> set[type]:
    """The distinct types of the values of ``sd`` (one C-level pass)."""
    return set(map(type, sd.values()))


def layout_of(sd: Mapping[Any, Any], types: set[type] | frozenset[type]) -> Layout:
    """:func:`classify` given ``types``, the :func:`value_types` of ``sd``."""
    if not sd or not any(issubclass(tp, Mapping) for tp in types):
        return Layout.FLAT
    check_not_mixed(sd, "")
    return Layout.NESTED


def check_not_mixed(sd: Mapping[Any, Any], path: str) -> None:
    """Raise :class:`LayoutError` for a nested optimizer next to flattened optimizer keys.

    Only an optimizer state dict (a ``"state"`` mapping and a ``"param_groups"``
    list) is checked: a ``"state"`` mapping alone is any other mapping. Other keys
    beside ``state`` and ``param_groups`` are allowed: an optimizer may keep its own
    there (``Optimizer.load_state_dict`` hands them to its load hooks).
    """
    if not is_optimizer_state_dict(sd):
        return
    sections = [STATE, PARAM_GROUPS]
    where = f" at {path!r}" if path else ""
    flat_keys = sorted(
        k for k in sd if type(k) is str and (k.startswith(STATE_PREFIX) or k.startswith(PG_PREFIX))
    )
    if flat_keys:
        shown = ", ".join(repr(k) for k in flat_keys[:5])
        more = f" and {len(flat_keys) - 5} more" if len(flat_keys) > 5 else ""
        raise LayoutError(
            f"mixed optimizer layouts{where}: nested section {sections[0]!r} next to "
            f"flattened keys {shown}{more}. A state dict is either nested "
            "(get_optimizer_state_dict) or flattened (flatten_optimizer_state_dict=True); "
            "convert one side with dsdmerge.flatten() or dsdmerge.unflatten()."
        )


def lists_param(osd: Mapping[Any, Any], pid: Any) -> bool:
    """Whether a param group of the optimizer state dict ``osd`` lists ``pid`` (int/str ids)."""
    if type(pid) not in (int, str):
        return False
    groups = osd.get(PARAM_GROUPS)
    for group in groups if isinstance(groups, (list, tuple)) else ():
        params = group.get(PARAMS) if isinstance(group, Mapping) else None
        if isinstance(params, (list, tuple)) and any(
            type(p) is type(pid) and p == pid for p in params
        ):
            return True
    return False


def group_items(group: object, where: str) -> list[tuple[str, Any]]:
    """Validate one param group and return its ``(hyperparameter, value)`` pairs.

    A param group is a mapping with a ``params`` list (or tuple) of param ids; its
    other entries are hyperparameters, named by str, whose values are leaves (torch's
    flattened format holds one value per hyperparameter and cannot spell a mapping).
    """
    if not isinstance(group, Mapping) or not isinstance(group.get(PARAMS), (list, tuple)):
        raise LayoutError(
            f"{where} must be a mapping with a 'params' list, got "
            f"{type(group).__name__ if not isinstance(group, Mapping) else 'a mapping without one'}"
        )
    items = []
    for name, v in group.items():
        if name == PARAMS:
            continue
        if type(name) is not str:
            raise StateDictTypeError(
                f"{where}: hyperparameter name {short_repr(name)} is not a str"
            )
        if isinstance(v, Mapping):
            raise LayoutError(
                f"{where}[{name!r}] is a mapping; torch's flattened format holds one "
                "value per hyperparameter and cannot spell it."
            )
        items.append((name, v))
    return items


# --------------------------------------------------------------------------------------
# flattened optimizers, by their shape


def holds_hyperparameters(flat: Mapping[Any, Any], prefix: str) -> bool:
    """Whether some ``prefix + "param_groups.<fqn>.<name>"`` value of ``flat`` is no tensor.

    Keys as :func:`~dsdmerge._table.parse_groups` reads them (a dot after a non-empty fqn).
    """
    head = prefix + PG_PREFIX
    n = len(head)
    try:  # the keys under the head picked in a C-level pass (str keys: flat state dicts')
        pairs: Iterable[tuple[Any, Any]] = list(
            compress(flat.items(), map(str.startswith, flat, repeat(head)))
        )
    except TypeError:  # a key that is no str
        pairs = ((k, v) for k, v in flat.items() if type(k) is str and k.startswith(head))
    for k, v in pairs:
        if not is_tensor_like(type(v)):
            fqn, dot, _ = k[n:].rpartition(".")
            if dot and fqn:
                return True
    return False


def section_prefixes(key: str) -> list[str]:
    """Every ``P`` (empty or ending in a dot) such that ``key`` is ``P + "param_groups." + ...``."""
    out = []
    at = key.find(PG_PREFIX)
    while at >= 0:
        if at == 0 or key[at - 1] == ".":
            out.append(key[:at])
        at = key.find(PG_PREFIX, at + 1)
    return out


def _containers(prefix: str) -> list[str]:
    """The ``Q`` such that ``prefix`` starts with ``Q + "state."`` or ``Q + "param_groups."``."""
    out = []
    for part in (STATE_PREFIX, PG_PREFIX):
        at = prefix.find(part)
        while at >= 0:
            if at == 0 or prefix[at - 1] == ".":
                out.append(prefix[:at])
            at = prefix.find(part, at + 1)
    return out


def is_optimizer_section(
    flat: Mapping[Any, Any],
    prefix: str,
    holds: Callable[[str], bool] | None = None,
) -> bool:
    """Whether ``prefix`` is a flattened optimizer's section of ``flat`` (see the module docstring).

    ``holds(P)``, if given, says whether ``P``'s ``param_groups.*`` values hold a
    hyperparameter (default: :func:`holds_hyperparameters` of ``flat``).

    Examples:
        >>> import torch
        >>> from dsdmerge.layout import is_optimizer_section
        >>> is_optimizer_section({"param_groups.w.lr": 0.1}, "")
        True
        >>> is_optimizer_section({"param_groups.0.weight": torch.zeros(2)}, "")  # a model
        False
    """
    test = (lambda p: holds_hyperparameters(flat, p)) if holds is None else holds
    return test(prefix) and not any(
        is_optimizer_section(flat, q, test) for q in _containers(prefix)
    )


def in_section(
    flat: Mapping[Any, Any], key: str, holds: Callable[[str], bool] | None = None
) -> bool:
    """Whether ``key`` is a flattened optimizer's (under a section's state or param groups).

    ``P + "state." + ...`` or ``P + "param_groups." + ...`` of a section ``P``
    (:func:`is_optimizer_section`; ``holds`` as there).
    """
    return any(is_optimizer_section(flat, q, holds) for q in _containers(key))


def optimizer_sections(
    flat: Mapping[Any, Any], /, candidates: Iterable[str] | None = None
) -> list[str]:
    """The flattened optimizers' sections of ``flat``, in order of first appearance.

    ``candidates``: the prefixes to try (default: every one its keys spell).
    """
    if candidates is None:
        found: dict[str, None] = {}
        for key in flat:
            if type(key) is str and PG_PREFIX in key:
                found.update(dict.fromkeys(section_prefixes(key)))
        candidates = found
    memo: dict[str, bool] = {}

    def holds(p: str) -> bool:
        if p not in memo:
            memo[p] = holds_hyperparameters(flat, p)
        return memo[p]

    return [p for p in dict.fromkeys(candidates) if is_optimizer_section(flat, p, holds)]
