"""Int param ids to fqns and back, for plain ``optimizer.state_dict()`` checkpoints.

``optimizer.state_dict()`` keys its ``state`` and ``params`` by int ids: the
position of each parameter in the optimizer's param groups. Once the model
changes (a new head, a removed block), positions no longer say which parameter
is which, and ``Optimizer.load_state_dict`` either refuses the checkpoint (group
sizes differ) or silently gives one parameter another's state. :func:`rekey`
turns the ids into the fqns of the model the checkpoint was saved from: the
fqn-keyed nested form ``get_optimizer_state_dict`` uses, which every
:func:`~dsdmerge.merge` feature handles by name. Given an fqn-keyed state dict,
it goes back to int ids (for ``Optimizer.load_state_dict`` of the new optimizer).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from itertools import chain
from typing import Any

from dsdmerge._ids import normalise_ids
from dsdmerge._values import short_repr
from dsdmerge.errors import LayoutError, StateDictTypeError
from dsdmerge.layout import PARAM_GROUPS, PARAM_NAMES, PARAMS, STATE, is_optimizer_state_dict
from dsdmerge.rename import copy_tree

__all__ = ["rekey"]


def rekey(
    optimizer_state_dict: Mapping[Any, Any],
    names: Iterable[str] | Iterable[tuple[str, Any]] | None = None,
    /,
) -> dict[str, Any]:
    """Key an optimizer state dict by fqns instead of int ids, or back.

    With int ids (``optimizer.state_dict()``), each id becomes the name at its
    position: ``names`` lists the old model's parameter names in the order the
    old optimizer's param groups list their parameters (group by group) — for an
    optimizer built from ``model.parameters()``, the order of
    ``model.named_parameters()``, which may be passed as is. With ``names=None``
    the ``param_names`` torch >= 2.5 stores in each param group are used. The
    result is the fqn-keyed nested form of ``get_optimizer_state_dict``.

    With fqns (that form), each fqn becomes its position in the param groups,
    group by group, as ``Optimizer.load_state_dict`` expects; ``names``, if
    given, must list exactly those fqns in that order (the new optimizer's
    parameter order), and a ``param_names`` entry is kept.

    State that belongs to no parameter (a key not listed in any group, such as
    MADGRAD's ``state['k']``) is kept under its key, and so are the optimizer's
    own top-level keys besides ``state`` and ``param_groups`` (heavyball's, timm
    Kron's ``rng_state``). Int ids a DCP round trip spelled as strings (``'0'``)
    are read as the ints. Nothing is dropped: a state key that would land on the
    name another key gets (``0`` next to ``'0'``, or next to the fqn ``0``
    becomes) is refused. Does not modify its input; new containers, shared leaves.

    Args:
        optimizer_state_dict: A nested optimizer state dict, int- or fqn-keyed.
        names: Parameter names in param-group order, or ``(name, param)`` pairs
            such as ``model.named_parameters()``; ``None``: from ``param_names``.

    Returns:
        The same state dict keyed the other way.

    Raises:
        LayoutError: Too few or too many names (naming both counts), a name
            listed twice, no ``names`` and no ``param_names``, names that do not
            match the groups' fqns, two state keys that would get one name
            (naming them), or not a nested optimizer state dict.
        StateDictTypeError: A name is not a str, or ids of both kinds are mixed.

    Examples:
        >>> import dsdmerge as dm
        >>> osd = {"state": {0: {"step": 3}},
        ...        "param_groups": [{"lr": 0.1, "params": [0, 1]}]}
        >>> fqn = dm.rekey(osd, ["embed.weight", "head.weight"])
        >>> fqn["state"], fqn["param_groups"][0]["params"]
        ({'embed.weight': {'step': 3}}, ['embed.weight', 'head.weight'])
        >>> dm.rekey(fqn) == osd
        True
    """
    if not is_optimizer_state_dict(optimizer_state_dict):
        raise LayoutError(
            "rekey takes a nested optimizer state dict ('state' and 'param_groups'), as "
            "optimizer.state_dict() or get_optimizer_state_dict returns; flatten it back with "
            "dsdmerge.unflatten first if it is flat"
        )
    optimizer_state_dict = normalise_ids(optimizer_state_dict, what="the optimizer state dict")
    groups = optimizer_state_dict[PARAM_GROUPS]
    for i, group in enumerate(groups):
        if not isinstance(group, Mapping) or not isinstance(group.get(PARAMS), (list, tuple)):
            raise LayoutError(f"param_groups[{i}] must be a mapping with a 'params' list")
    ids = list(chain.from_iterable(g[PARAMS] for g in groups))
    kinds = {type(pid) for pid in ids}
    if not ids:  # no parameter to rekey either way
        return _to_fqns(optimizer_state_dict, [], [] if names is None else names)
    if kinds <= {int}:
        return _to_fqns(optimizer_state_dict, ids, names)
    if kinds <= {str}:
        return _to_ids(optimizer_state_dict, ids, names)
    raise StateDictTypeError(
        f"param ids must be all ints (optimizer.state_dict()) or all fqns, got "
        f"{', '.join(sorted(k.__name__ for k in kinds))}"
    )


def _names(names: Iterable[Any]) -> list[str]:
    if isinstance(names, (str, bytes, Mapping)):
        raise StateDictTypeError(
            f"names must be a sequence of parameter names, got {type(names).__name__}"
        )
    out = []
    for item in names:
        name = item[0] if isinstance(item, tuple) and len(item) == 2 else item
        if type(name) is not str:
            raise StateDictTypeError(f"parameter name {short_repr(name)} is not a str")
        out.append(name)
    seen: set[str] = set()
    twice = sorted({n for n in out if n in seen or seen.add(n)})  # type: ignore[func-returns-value]
    if twice:
        raise LayoutError(f"rekey: names listed twice: {', '.join(map(repr, twice[:10]))}")
    return out


def _from_param_names(groups: list[Any]) -> list[str]:
    out: list[str] = []
    for i, group in enumerate(groups):
        names = group.get(PARAM_NAMES)
        if not isinstance(names, (list, tuple)) or len(names) != len(group[PARAMS]):
            raise LayoutError(
                f"rekey: param_groups[{i}] has no 'param_names' for its "
                f"{len(group[PARAMS])} params (torch >= 2.5 stores them when the optimizer is "
                "built from model.named_parameters()); pass names= (the old model's parameter "
                "names, in the order its optimizer's param groups list them)"
            )
        out.extend(names)
    return _names(out)


def _to_fqns(osd: Mapping[Any, Any], ids: list[int], names: Iterable[Any] | None) -> dict[str, Any]:
    groups = osd[PARAM_GROUPS]
    fqns = _from_param_names(groups) if names is None else _names(names)
    if len(fqns) != len(ids):
        raise LayoutError(
            f"rekey: {len(fqns)} name(s) for the {len(ids)} params the optimizer's param groups "
            f"list ({', '.join(str(len(g[PARAMS])) for g in groups)} per group); pass the names "
            "of the model the checkpoint was saved from, in the order its optimizer's param "
            "groups list them"
        )
    if len(set(ids)) != len(ids):
        raise LayoutError("rekey: a param id is listed twice in the param groups")
    by_id = dict(zip(ids, fqns, strict=True))
    state = _rekeyed_state(osd[STATE], lambda k: by_id.get(k, k) if type(k) is int else k)
    out_groups = []
    for group in groups:
        g = dict(group)
        g[PARAMS] = [by_id[pid] for pid in group[PARAMS]]
        out_groups.append(g)
    return _with_extras(osd, state, out_groups)


def _rekeyed_state(state: Mapping[Any, Any], new_key: Any) -> dict[Any, Any]:
    """``state`` under new keys, each value a new container; two keys on one name refused."""
    out: dict[Any, Any] = {}
    origin: dict[Any, Any] = {}
    clashes: list[str] = []
    for k, v in state.items():
        key = new_key(k)
        if key in out:
            clashes.append(f"{short_repr(origin[key])} and {short_repr(k)} both become {key!r}")
            continue
        origin[key] = k
        out[key] = copy_tree(v, STATE)
    if clashes:
        more = f" and {len(clashes) - 5} more" if len(clashes) > 5 else ""
        raise LayoutError(
            f"rekey: state keys would land on one name ({'; '.join(clashes[:5])}{more}), and one "
            "of them would be lost: a state key that is no param id (optimizer-level state, or a "
            "leftover) must not be spelled like a name a param id becomes. Remove the leftover "
            "entry, or rekey a state dict that holds one spelling of each parameter."
        )
    return out


def _with_extras(
    osd: Mapping[Any, Any], state: dict[Any, Any], groups: list[Any]
) -> dict[str, Any]:
    """The rekeyed state dict, with the optimizer's own top-level keys in their place."""
    out: dict[str, Any] = {}
    for k, v in osd.items():
        if k == STATE:
            out[STATE] = state
        elif k == PARAM_GROUPS:
            out[PARAM_GROUPS] = groups
        else:
            out[k] = v
    return out


def _to_ids(osd: Mapping[Any, Any], fqns: list[str], names: Iterable[Any] | None) -> dict[str, Any]:
    if names is not None:
        expected = _names(names)
        if expected != fqns:
            only_groups = sorted(set(fqns) - set(expected))[:5]
            only_names = sorted(set(expected) - set(fqns))[:5]
            detail = (
                f"only in the groups: {only_groups}; only in names: {only_names}"
                if only_groups or only_names
                else "the same names in another order"
            )
            raise LayoutError(
                f"rekey: the param groups list {len(fqns)} fqns and names has {len(expected)}, "
                f"which must be the same, in the same order ({detail})"
            )
    if len(set(fqns)) != len(fqns):
        raise LayoutError("rekey: an fqn is listed twice in the param groups")
    by_fqn = {fqn: i for i, fqn in enumerate(fqns)}
    state = _rekeyed_state(osd[STATE], lambda k: by_fqn.get(k, k) if type(k) is str else k)
    out_groups = []
    for group in osd[PARAM_GROUPS]:
        g = dict(group)
        g[PARAMS] = [by_fqn[f] for f in group[PARAMS]]
        out_groups.append(g)
    return _with_extras(osd, state, out_groups)
