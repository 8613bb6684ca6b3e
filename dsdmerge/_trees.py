"""Nested state dicts as trees: the flat keys they spell, and copies with new containers.

What it means, before how:

* :func:`flatten`: every leaf of a nested state dict, under the flat key torch spells
  for it. An optimizer state dict (a ``"state"`` mapping and a ``"param_groups"``
  list) flattens as torch's ``_flatten_optim_state_dict`` does: one
  ``state.<id>.<name>`` key per state value (nested state further with dots) and one
  ``param_groups.<id>.<hyperparameter>`` key per parameter and hyperparameter; int
  ids in decimal; keys beside ``state`` and ``param_groups`` as dotted paths. Every
  other mapping flattens to dotted paths. Inside an optimizer state dict there is no
  other optimizer state dict (a mapping there is a plain mapping). Two paths that
  spell one key, and cycles, are refused.
* :func:`flat_keys`: the flat keys one nested value spells where it sits (what a
  merge reports missing or unexpected when a whole sub-tree is on one side only).
* :func:`copy_tree`: new containers, shared leaves (what a merge puts into its result).

How: explicit stacks (nesting depth is bounded by memory, not by the recursion
limit); an optimizer's keys are made a block of parameters at a time and inserted
while still in cache; collisions are found by counting what was written and, only
then, flattening again into a dict that refuses overwrites.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from itertools import chain, cycle
from typing import Any

from dsdmerge._values import key_str
from dsdmerge.errors import LayoutError
from dsdmerge.layout import (
    PARAM_GROUPS,
    PARAMS,
    PG_PREFIX,
    STATE,
    STATE_PREFIX,
    Layout,
    check_not_mixed,
    classify,
    group_items,
    is_optimizer_state_dict,
    lists_param,
    require_mapping,
)

__all__ = [
    "copy_group",
    "copy_tree",
    "flat_keys",
    "flatten",
    "flatten_into",
    "flatten_tree",
    "holds_value",
]


class _Unique(dict[str, Any]):
    """A dict that refuses to overwrite: used to name a collision once one is known."""

    def __setitem__(self, key: str, value: Any) -> None:
        if key in self:
            hint = (
                " (a parameter listed in two param_groups?)"
                if PG_PREFIX in key
                else " (a key containing a dot, or an int and a str key with the same digits?)"
            )
            raise LayoutError(
                f"two entries flatten to the same key {key!r}{hint}. Flattening would "
                "silently overwrite one of them; rename the keys or keep this state dict nested."
            )
        super().__setitem__(key, value)

    def update(self, pairs: Iterable[tuple[str, Any]], /) -> None:  # type: ignore[override]
        """Item by item, so that :meth:`__setitem__` sees every key (dict.update would not)."""
        for key, value in pairs:
            self[key] = value


def flatten(sd: Mapping[Any, Any], /) -> dict[str, Any]:
    """Flatten a state dict to ``{flat_key: leaf}``.

    Optimizer state dicts (a ``"state"`` mapping and a ``"param_groups"`` list)
    flatten exactly as torch's ``_flatten_optim_state_dict`` does: one
    ``state.<id>.<name>`` key per state value (nested state flattens further
    with dots) and one ``param_groups.<id>.<hyperparameter>`` key per
    parameter and hyperparameter; int ids become decimal strings. Other
    mappings flatten to dotted paths. A flat state dict comes back as a new dict
    with the same items. Does not modify its input; leaves are shared, never
    copied.

    Args:
        sd: A nested or flat state dict.

    Returns:
        A new flat dict.

    Raises:
        StateDictTypeError: ``sd`` is not a mapping, or holds a key that is not
            ``str`` or ``int``.
        LayoutError: Two paths flatten to the same key, a structure is cyclic, or
            an optimizer state dict is malformed.

    Examples:
        >>> import dsdmerge as dm
        >>> osd = {"state": {0: {"step": 3}}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}
        >>> dm.flatten(osd)
        {'state.0.step': 3, 'param_groups.0.lr': 0.1, 'param_groups.1.lr': 0.1}
        >>> dm.flatten({"model": {"w": 1}, "epoch": 2})
        {'model.w': 1, 'epoch': 2}
    """
    require_mapping(sd, "the state dict")
    if classify(sd) is Layout.FLAT and set(map(type, sd)) <= {str}:
        return dict(sd)
    out: dict[str, Any] = {}
    written = flatten_into(out, sd, "")
    if written != len(out):  # something was overwritten: run again, refusing overwrites
        flatten_into(_Unique(), sd, "")
    return out


def flatten_into(out: dict[str, Any], root: Mapping[Any, Any], prefix: str) -> int:
    """Write the leaves of ``root`` into ``out`` under ``prefix``; return how many were written."""
    if is_optimizer_state_dict(root):
        return _flatten_optimizer(out, root, prefix, {id(root)})
    return flatten_tree(out, root, prefix, {id(root)}, optimizers=True)


def flatten_tree(
    out: dict[str, Any],
    root: Mapping[Any, Any],
    prefix: str,
    on_path: set[int],
    *,
    optimizers: bool,
) -> int:
    """Flatten a generic mapping to dotted paths (iteratively, refusing cycles)."""
    written = 0
    stack: list[tuple[str, Any, Mapping[Any, Any]]] = [(prefix, iter(root.items()), root)]
    while stack:
        pfx, items, node = stack[-1]
        for k, v in items:
            key = pfx + (k if type(k) is str else key_str(k, pfx[:-1]))
            if isinstance(v, Mapping):
                if id(v) in on_path:
                    raise LayoutError(f"cycle: the mapping at {key!r} contains itself")
                if optimizers and is_optimizer_state_dict(v):
                    on_path.add(id(v))
                    written += _flatten_optimizer(out, v, key + ".", on_path)
                    on_path.discard(id(v))
                    continue
                on_path.add(id(v))
                stack.append((key + ".", iter(v.items()), v))
                break
            out[key] = v
            written += 1
        else:
            stack.pop()
            if node is not root:
                on_path.discard(id(node))
    return written


def _flatten_optimizer(
    out: dict[str, Any], osd: Mapping[Any, Any], prefix: str, on_path: set[int]
) -> int:
    """Flatten one optimizer state dict the way torch's ``_flatten_optim_state_dict`` does."""
    check_not_mixed(osd, prefix[:-1])
    written = _flat_state(out, osd[STATE], prefix)
    if written < 0:
        written = _state_one_by_one(out, osd, prefix, on_path)
    group_prefix = prefix + PG_PREFIX
    for index, group in enumerate(osd[PARAM_GROUPS]):
        where = f"{prefix}{PARAM_GROUPS}[{index}]"
        hyper = group_items(group, where)
        params = group[PARAMS]
        # (an f-string spells int and str ids as key_str does; key_str for the others, or raise:
        # also in a group that writes no keys, as unflatten, diff and merge refuse them there)
        spelled = params
        if not set(map(type, params)) <= {int, str}:
            spelled = [key_str(pid, where) for pid in params]
        if not hyper or not params:
            continue
        # one key per parameter and hyperparameter, parameter by parameter, as torch
        # (a block of keys at a time: each key is hashed into ``out`` while still in cache)
        names, values = zip(*hyper, strict=True)
        for start in range(0, len(spelled), _BLOCK):
            bases = [f"{group_prefix}{s}." for s in spelled[start : start + _BLOCK]]
            out.update(zip([base + name for base in bases for name in names], cycle(values)))
        written += len(params) * len(hyper)
    # keys an optimizer keeps beside state and param_groups: dotted paths, like any mapping
    for k, v in osd.items():
        if k in (STATE, PARAM_GROUPS):
            continue
        key = prefix + (k if type(k) is str else key_str(k, prefix[:-1]))
        written += _put(out, key, v, on_path)
    return written


_BLOCK = 1024  # parameters whose keys are made and inserted at a time


def _flat_state(out: dict[str, Any], state: Mapping[Any, Any], prefix: str) -> int:
    """Write the ``state.*`` keys in C-level passes; -1 (having written nothing) if unusual.

    Usual: param ids are str or int, every entry is a dict with str state names, and
    no state value is a mapping. Anything else goes :func:`_state_one_by_one`.
    """
    entries = list(state.values())
    if not entries:
        return 0
    if (
        not set(map(type, state)) <= {int, str}
        or set(map(type, entries)) != {dict}
        or set(map(type, chain.from_iterable(entries))) != {str}
        or any(
            issubclass(tp, Mapping)
            for tp in set(map(type, chain.from_iterable(map(dict.values, entries))))
        )
    ):
        return -1
    state_prefix = prefix + STATE_PREFIX
    pids = list(state)
    for start in range(0, len(pids), _BLOCK):
        block = entries[start : start + _BLOCK]
        keys = [
            f"{state_prefix}{pid}.{name}"
            for pid, entry in zip(pids[start : start + _BLOCK], block, strict=True)
            for name in entry
        ]
        out.update(zip(keys, chain.from_iterable(map(dict.values, block))))  # noqa: B905
    return sum(map(len, entries))


def _state_one_by_one(
    out: dict[str, Any], osd: Mapping[Any, Any], prefix: str, on_path: set[int]
) -> int:
    """The ``state.*`` keys of one optimizer, any entry shape (nested state, odd types)."""
    state = osd[STATE]
    written = 0
    state_prefix = prefix + STATE_PREFIX
    for pid, entry in state.items():
        pkey = state_prefix + key_str(pid, prefix + STATE) + "."
        if not isinstance(entry, Mapping):  # an optimizer-level entry (MADGRAD's state['k'])
            if lists_param(osd, pid):
                raise LayoutError(
                    f"{pkey[:-1]!r}: the optimizer state of a parameter must be a mapping of "
                    f"state names to values, got {type(entry).__name__}"
                )
            out[pkey[:-1]] = entry
            written += 1
            continue
        for name, v in entry.items():
            key = pkey + (name if type(name) is str else key_str(name, pkey[:-1]))
            written += _put(out, key, v, on_path)  # nested state (Shampoo-like): dotted paths
    return written


def _put(out: dict[str, Any], key: str, v: Any, on_path: set[int]) -> int:
    """Write a leaf at ``key``, or a mapping's leaves under it; return how many were written.

    Inside an optimizer a mapping is a plain mapping (as merge, diff and unflatten see
    it), flattened to dotted paths as torch does; a cycle is refused.
    """
    if not isinstance(v, Mapping):
        out[key] = v
        return 1
    if id(v) in on_path:
        raise LayoutError(f"cycle: the mapping at {key!r} contains itself")
    on_path.add(id(v))
    written = flatten_tree(out, v, key + ".", on_path, optimizers=False)
    on_path.discard(id(v))
    return written


# --------------------------------------------------------------------------------------
# flat keys of a sub-tree, and copies


def flat_keys(value: Any, key: str, *, in_optimizer: bool = False) -> list[str]:
    """The flat keys a nested value at ``key`` spells (one key for a leaf).

    ``in_optimizer``: the value is inside an optimizer state dict (a parameter's state,
    a key beside state and param_groups), where :func:`flatten` sees no optimizer.
    """
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        if in_optimizer:
            flatten_tree(out, value, key + ".", {id(value)}, optimizers=False)
        else:
            flatten_into(out, value, key + ".")
        return list(out)
    return [key]


def copy_tree(value: Any, *, in_optimizer: bool = False) -> Any:
    """New containers (mappings, optimizers' param_groups and params lists), shared leaves.

    A ``param_groups`` list is a container only in an optimizer state dict; elsewhere
    it is a leaf like any list, and shared. Inside an optimizer state dict (and with
    ``in_optimizer``) there is no other optimizer state dict, as :func:`flatten` sees it.
    """
    if not isinstance(value, Mapping):
        return value
    root: dict[Any, Any] = {}
    optimizer = not in_optimizer and is_optimizer_state_dict(value)
    stack: list[tuple[Any, dict[Any, Any], bool, bool]] = [
        (iter(value.items()), root, optimizer, in_optimizer or optimizer)
    ]
    while stack:
        items, dest, optimizer, inside = stack[-1]
        for k, v in items:
            if isinstance(v, Mapping):
                child: dict[Any, Any] = {}
                dest[k] = child
                is_optimizer = not inside and is_optimizer_state_dict(v)
                stack.append((iter(v.items()), child, is_optimizer, inside or is_optimizer))
                break
            if optimizer and k == PARAM_GROUPS:
                dest[k] = [copy_group(g) for g in v]
            else:
                dest[k] = v
        else:
            stack.pop()
    return root


def copy_group(group: Any) -> Any:
    """A param group with a new mapping and a new ``params`` list (values shared)."""
    if not isinstance(group, Mapping):
        return group
    out = dict(group)
    if isinstance(out.get(PARAMS), (list, tuple)):
        out[PARAMS] = list(out[PARAMS])
    return out


def holds_value(entry: Any) -> bool:
    """Whether a mapping holds a value (not a mapping) anywhere (``{}``, ``{0: {}}``: none).

    An optimizer state entry without values is no state (schedulefree's ``train()``
    makes ``{}``, heavyball ``{0: {}}``). Walks at most 64 levels deep.
    """
    if not isinstance(entry, Mapping):
        return False
    stack = [entry]
    while stack:
        node = stack.pop()
        for v in node.values():
            if not isinstance(v, Mapping):
                return True
            if len(stack) < 64:
                stack.append(v)
    return False
