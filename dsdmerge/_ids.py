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

DCP spells the int keys *inside* a parameter's state as strings too (heavyball keeps
it under view indices ``0``, ``1``). Which of those were ints only the optimizer
knows, so :func:`one_spelling` reads them from the other side: in a parameter's
state entry (at any depth), a str key that is the decimal spelling of an int key
the reference's entry for that parameter has, where the checkpoint's entry has no
such int key and the reference's no such str key, becomes the int.

Every public verb that compares or converts optimizer state (:func:`~dsdmerge.diff`,
:func:`~dsdmerge.merge`, :func:`~dsdmerge.check` and the resume helpers:
:func:`one_spelling`; :func:`~dsdmerge.rekey`: :func:`normalise_ids`) applies it to
its inputs first.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import chain
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

    Examples:
        >>> from dsdmerge._ids import normalise_ids
        >>> osd = {"state": {"0": {"step": 3}}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}
        >>> normalise_ids(osd)["state"]
        {0: {'step': 3}}
    """
    if not isinstance(tree, Mapping):  # the caller refuses it, with its own message
        return tree
    return _walk(tree, what, "", 0)


def one_spelling(
    checkpoint: Mapping[Any, Any], reference: Mapping[Any, Any], /
) -> tuple[Mapping[Any, Any], Mapping[Any, Any]]:
    """Both sides with :func:`normalise_ids`; the checkpoint's state spelled as the reference's.

    See the module. Leaves shared; inputs not modified.

    Raises:
        LayoutError: A ``state`` holds an int id and its string spelling both.

    Examples:
        >>> from dsdmerge._ids import one_spelling
        >>> ref = {"state": {0: {0: {"step": 1}}}, "param_groups": [{"params": [0]}]}
        >>> ckpt = {"state": {"0": {"0": {"step": 5}}}, "param_groups": [{"params": [0]}]}
        >>> one_spelling(ckpt, ref)[0]["state"]
        {0: {0: {'step': 5}}}
    """
    if not isinstance(checkpoint, Mapping) or not isinstance(reference, Mapping):
        return checkpoint, reference
    checkpoint = normalise_ids(checkpoint, what="the checkpoint")
    reference = normalise_ids(reference, what="the reference")
    return _pair(checkpoint, reference, 0), reference


def respelled_state(state: Mapping[Any, Any], own: Mapping[Any, Any], /) -> Mapping[Any, Any]:
    """``state`` (an optimizer's ``state``) with each entry's keys spelled as in ``own``'s entry.

    ``own``: the same parameters' state as the optimizer keeps it (by the same keys).
    Returns ``state`` itself when nothing changes.
    """
    if _plain(state):
        return state
    changed: dict[Any, Any] = {}
    for key, entry in state.items():
        mine = own.get(key)
        if isinstance(entry, Mapping) and isinstance(mine, Mapping):
            new = _respell(entry, mine, 0)
            if new is not entry:
                changed[key] = new
    if not changed:
        return state
    return {k: changed.get(k, v) for k, v in state.items()}


def _plain(state: Mapping[Any, Any]) -> bool:
    """Whether no entry of ``state`` can need respelling, decided in C-level passes.

    True when every entry is a ``dict`` whose keys are strings that are not decimal
    (state field names: no key DCP respelled from an int) and whose values are not
    mappings (nothing nested to respell): :func:`_respell` would return every entry
    as it is. A per-entry walk costs ~4 us an entry (0.2 s for DeepSeek-V3's 47k
    parameters); this is ~10x less.
    """
    entries = list(state.values())
    if not set(map(type, entries)) <= {dict}:
        return False
    names: set[Any] = set().union(*entries)
    if not all(type(k) is str and not k.isdecimal() for k in names):
        return False
    kinds = set(map(type, chain.from_iterable(map(dict.values, entries))))
    return not any(issubclass(t, Mapping) for t in kinds)


def _optimizer(node: Mapping[Any, Any]) -> bool:
    """:func:`~dsdmerge.layout.is_optimizer_state_dict`, asked only of a dict with both sections.

    A flat state dict (no ``state`` key) is told in one lookup, without a call.
    """
    return STATE in node and PARAM_GROUPS in node and is_optimizer_state_dict(node)


def _pair(node: Mapping[Any, Any], ref: Mapping[Any, Any], depth: int) -> Mapping[Any, Any]:
    if _optimizer(node):
        if not _optimizer(ref):
            return node
        state = respelled_state(node[STATE], ref[STATE])
        return node if state is node[STATE] else {**node, STATE: state}
    if depth >= _DEPTH or len(node) > _WRAPPER_KEYS:
        return node
    changed: dict[Any, Any] = {}
    for k, v in node.items():
        other = ref.get(k)
        if isinstance(v, Mapping) and isinstance(other, Mapping):
            new = _pair(v, other, depth + 1)
            if new is not v:
                changed[k] = new
    return {k: changed.get(k, v) for k, v in node.items()} if changed else node


def _respell(entry: Mapping[Any, Any], own: Mapping[Any, Any], depth: int) -> Mapping[Any, Any]:
    if depth >= _DEPTH:
        return entry
    ints = {str(k): k for k in own if type(k) is int}
    out: dict[Any, Any] = {}
    changed = False
    for k, v in entry.items():
        new_k = k
        if type(k) is str and k in ints and k not in own and ints[k] not in entry:
            new_k = ints[k]
        sub = own.get(new_k)
        new_v = (
            _respell(v, sub, depth + 1)
            if isinstance(v, Mapping) and isinstance(sub, Mapping)
            else v
        )
        changed = changed or new_k is not k or new_v is not v
        out[new_k] = new_v
    return out if changed else entry


def _walk(node: Mapping[Any, Any], what: str, where: str, depth: int) -> Mapping[Any, Any]:
    if _optimizer(node):
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
