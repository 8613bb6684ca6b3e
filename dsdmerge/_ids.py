"""One spelling of a param id: the int ids a DCP round trip turned into strings, made int again.

``optimizer.state_dict()`` keys ``state`` by int param ids and lists the same ints
in each group's ``params``. A DCP round trip (``dcp.save`` then ``dcp.load`` or
:func:`~dsdmerge.integrations.load_checkpoint`) turns the ``state`` keys into
strings (``'0'``) while the ``params`` lists stay ints, so the same parameter is
spelled two ways: compared with a live ``optimizer.state_dict()``, every trained
entry would look unexpected and every parameter missing, and torch's own
``Optimizer.load_state_dict`` would keep the strings as junk keys.

The rule, applied to every nested optimizer state dict (also inside a whole
checkpoint such as ``{"model": ..., "optim": ...}``) by :func:`normalise_ids`: when
every param id its groups list is an int, a ``state`` key that is exactly the
decimal spelling of one of them (``str(pid)``) becomes that int. Anything else is
left as it is (fqn-keyed state dicts, whose ids are strings, are never touched;
a ``ParameterList`` model's fqns ``'0'``, ``'1'`` stay strings). A state dict that
holds both spellings of one id cannot be read either way and is refused, naming
the keys.

Every public verb that compares or converts optimizer state (:func:`~dsdmerge.diff`,
:func:`~dsdmerge.merge`, :func:`~dsdmerge.check`, :func:`~dsdmerge.rekey` and the
resume helpers) applies it to its inputs first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dsdmerge.errors import LayoutError
from dsdmerge.layout import PARAM_GROUPS, PARAMS, STATE, is_optimizer_state_dict

__all__: list[str] = []

# Whole checkpoints nest optimizer state dicts a few levels down, in small wrapper dicts
# ({"optim": ..., "model": ...}; Lightning's optimizer_states list is a leaf here). Only such
# small dicts are walked into, so a model state dict's million tensors are never scanned.
_DEPTH = 8
_WRAPPER_KEYS = 64


def normalise_ids(tree: Mapping[Any, Any], /, *, what: str = "the state dict") -> Mapping[Any, Any]:
    """``tree`` with every nested optimizer state dict's string ids made int (see the module).

    Returns ``tree`` itself when nothing needs a change; otherwise new containers on
    the path to each changed ``state``, every leaf shared. Does not modify its input.

    Raises:
        LayoutError: A ``state`` holds an int id and its string spelling both.

    Example:
        >>> from dsdmerge._ids import normalise_ids
        >>> osd = {"state": {"0": {"step": 3}}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}
        >>> normalise_ids(osd)["state"]
        {0: {'step': 3}}
    """
    if not isinstance(tree, Mapping):  # the caller refuses it, with its own message
        return tree
    return _walk(tree, what, "", 0)


def _walk(node: Mapping[Any, Any], what: str, where: str, depth: int) -> Mapping[Any, Any]:
    if is_optimizer_state_dict(node):
        return _fixed(node, what, where)
    if depth >= _DEPTH or len(node) > _WRAPPER_KEYS:
        return node
    changed: dict[Any, Any] | None = None
    for k, v in node.items():
        if not isinstance(v, Mapping):
            continue
        new = _walk(v, what, f"{where}{k}.", depth + 1)
        if new is not v:
            if changed is None:
                changed = {}
            changed[k] = new
    if changed is None:
        return node
    return {k: changed.get(k, v) for k, v in node.items()}


def _fixed(osd: Mapping[Any, Any], what: str, where: str) -> Mapping[Any, Any]:
    state = osd[STATE]
    if not any(type(k) is str for k in state):
        return osd
    ids: set[int] = set()
    for group in osd[PARAM_GROUPS]:
        params = group.get(PARAMS) if isinstance(group, Mapping) else None
        if not isinstance(params, (list, tuple)):
            continue
        for pid in params:
            if type(pid) is not int:
                return osd  # fqn-keyed (or mixed): the strings are names, not spelled ids
            ids.add(pid)
    if not ids:
        return osd
    spelled = {str(pid): pid for pid in ids}
    renamed = [k for k in state if type(k) is str and k in spelled]
    if not renamed:
        return osd
    both = [k for k in renamed if spelled[k] in state]
    if both:
        pairs = ", ".join(f"{spelled[k]!r} and {k!r}" for k in both[:10])
        more = f" and {len(both) - 10} more" if len(both) > 10 else ""
        raise LayoutError(
            f"{what}'s {where}{STATE} holds both an int param id and its string spelling as keys "
            f"({pairs}{more}): which entry is the parameter's cannot be told. A DCP round trip "
            "spells ids as strings; keep one spelling of each id (the int, as "
            "optimizer.state_dict() writes it)."
        )
    fixed = {(spelled[k] if type(k) is str and k in spelled else k): v for k, v in state.items()}
    return {**osd, STATE: fixed}
