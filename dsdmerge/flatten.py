"""Lossless conversion between nested and flat state dicts: the public verbs.

:func:`flatten` (defined in :mod:`dsdmerge._trees`, with the other tree walks)
spells optimizer state dicts exactly as torch's ``_flatten_optim_state_dict`` does
(``state.<fqn>.<name>`` and one ``param_groups.<fqn>.<hyperparameter>`` per
parameter) and every other nested mapping as dotted paths. :func:`unflatten` goes
back, exactly when given the nested state dict to take the structure from
(``like=``), and by the DSD rules otherwise.

Both walk their input with an explicit stack, so nesting depth is bounded by
memory, not by Python's recursion limit, and both refuse cycles.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from functools import partial
from itertools import chain, compress, count, filterfalse, islice, repeat
from operator import is_
from typing import Any

from dsdmerge._gc import gc_paused
from dsdmerge._keys import require_str_keys
from dsdmerge._table import PgTable, joined, read_rows, spelled_rows
from dsdmerge._trees import flatten
from dsdmerge._values import MISSING, freeze, is_tensor_like, key_str, same_value, short_repr
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
    layout_of,
    lists_param,
    require_mapping,
    value_types,
)

# (flatten lives with the other tree walks in dsdmerge._trees, below the engine that needs
# it; it is public here)
__all__ = ["flatten", "unflatten"]


# --------------------------------------------------------------------------------------
# unflatten


def unflatten(
    flat: Mapping[str, Any], /, *, like: Mapping[Any, Any] | None = None
) -> dict[Any, Any]:
    """Rebuild a nested state dict from a flat one.

    With ``like`` (a nested state dict, typically the reference), the structure
    comes from it exactly: int param ids, group membership, fqns containing
    dots, nested state and key order. Keys of ``like`` absent from ``flat``
    are left out (a parameter whose state is absent gets none); keys of
    ``flat`` that ``like`` has no place for are placed under the parameter or
    mapping they extend, or rejected when there is none. Under an optimizer,
    a key that names no parameter is the optimizer's own: ``state.<name>``
    (no dots) an optimizer-level state entry, as without ``like``, and any
    other key one beside ``state`` and ``param_groups``.

    Without ``like``, a DSD flattened optimizer dict (only ``state.*`` and
    ``param_groups.*`` keys) becomes a fqn-keyed nested optimizer dict: the fqns
    come from the ``param_groups.*`` keys, and parameters whose hyperparameters
    are all equal form one group, in order of first appearance. Any other flat
    dict is split on dots.

    Does not modify its inputs; leaves are shared, never copied.

    Args:
        flat: A flat state dict (every value a leaf, every key a str).
        like: Optional nested state dict to take the structure from.

    Returns:
        A new nested dict.

    Raises:
        LayoutError: ``flat`` is not flat, a value would have to be both a leaf
            and a mapping, members of one group disagree on a hyperparameter, or a
            key names a parameter ``like`` does not have.
        StateDictTypeError: An argument is not a mapping, or ``flat`` has a key
            that is not a str.

    Examples:
        >>> import dsdmerge as dm
        >>> flat = {"state.a.w.step": 3, "param_groups.a.w.lr": 0.1, "param_groups.b.lr": 0.1}
        >>> dm.unflatten(flat)
        {'state': {'a.w': {'step': 3}}, 'param_groups': [{'lr': 0.1, 'params': ['a.w', 'b']}]}
        >>> osd = {"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}
        >>> dm.unflatten({"state.0.step": 3, "param_groups.0.lr": 0.2}, like=osd)
        {'state': {0: {'step': 3}}, 'param_groups': [{'lr': 0.2, 'params': [0]}]}
        >>> dm.unflatten({"state.k": 7, "param_groups.0.lr": 0.2, "heavyball.step": 7}, like=osd)
        {'state': {'k': 7}, 'param_groups': [{'lr': 0.2, 'params': [0]}], 'heavyball': {'step': 7}}
    """
    require_flat(flat, "flat")
    if like is None:
        return _unflatten_free(flat)
    require_mapping(like, "like")
    if classify(like) is Layout.FLAT:
        return dict(flat)
    with gc_paused():  # one new dict per parameter, none of them cyclic (see dsdmerge._gc)
        return _Unflattener(flat).run(like)


def require_flat(
    flat: object, what: str, types: set[type] | frozenset[type] | None = None
) -> Mapping[str, Any]:
    """Raise unless ``flat`` is a flat mapping with str keys (``types``: its value types)."""
    mapping = require_mapping(flat, what)
    if types is None:
        types = value_types(mapping)
    if layout_of(mapping, types) is not Layout.FLAT:
        nested = next(k for k, v in mapping.items() if isinstance(v, Mapping))
        raise LayoutError(
            f"{what} must be a flat state dict, but {short_repr(nested)} holds a mapping; "
            "flatten it first with dsdmerge.flatten()."
        )
    require_str_keys(mapping, what, set(map(type, mapping)))
    return mapping


def _is_flat_optimizer(flat: Mapping[str, Any]) -> bool:
    """Whether every key is ``state.*`` or ``param_groups.*``, some of them hyperparameters.

    Hyperparameters, not tensors: a model's modules may be named ``param_groups``.
    """
    if not all(map(str.startswith, flat, repeat((STATE_PREFIX, PG_PREFIX)))):
        return False
    hyper = compress(flat.values(), map(str.startswith, flat, repeat(PG_PREFIX)))
    return not all(map(is_tensor_like, map(type, hyper)))  # (stops at the first hyperparameter)


def _insert(root: dict[Any, Any], parts: list[str], value: Any, key: str) -> None:
    """Put ``value`` at the dotted path ``parts`` under ``root``, creating dicts."""
    node = root
    for part in parts[:-1]:
        child = node.get(part, MISSING)
        if child is MISSING:
            child = node[part] = {}
        elif type(child) is not dict:
            raise LayoutError(
                f"cannot unflatten {key!r}: a prefix of it, ending in {part!r}, is also a key "
                "with a value of its own. Pass like= to say which structure is meant."
            )
        node = child
    last = parts[-1]
    if last in node:
        raise LayoutError(
            f"cannot unflatten {key!r}: it is both a value and a prefix of other keys. "
            "Pass like= to say which structure is meant."
        )
    node[last] = value


def _unflatten_free(flat: Mapping[str, Any]) -> dict[Any, Any]:
    if not _is_flat_optimizer(flat):
        out: dict[Any, Any] = {}
        for key, v in flat.items():
            _insert(out, key.split("."), v, key)
        return out
    with gc_paused():  # one new dict per parameter, none of them cyclic (see dsdmerge._gc)
        return _unflatten_optimizer(flat)


def _unflatten_optimizer(flat: Mapping[str, Any]) -> dict[Any, Any]:
    """:func:`unflatten` of a DSD flattened optimizer dict, without ``like``."""
    is_pg = bytes(map(str.startswith, flat, repeat(PG_PREFIX)))
    table = PgTable.of(flat)
    if table is not None:  # torch's layout: the same, read by rows (see dsdmerge._table)
        k = len(table.names)
        in_flat = list(compress(flat.values(), table.picked))  # each row in its own order
        hyper: dict[str, dict[str, Any]] = {}
        for first, end, names in table.blocks:
            hyper |= _rows(table.fqns[first:end], names, in_flat[first * k : end * k])
    else:
        hyper = {}
        for key, v in compress(flat.items(), is_pg):
            fqn, dot, name = key[len(PG_PREFIX) :].rpartition(".")
            if not dot or not fqn or not name:
                raise LayoutError(
                    f"{key!r} is not of the form 'param_groups.<fqn>.<hyperparameter>'"
                )
            hyper.setdefault(fqn, {})[name] = v
    is_state = is_pg.translate(_INVERT)
    state = _state_by_rows(list(compress(flat, is_state)), flat, is_state, hyper)
    if state is None:
        state = {}
        longest = max(map(len, hyper), default=0)
        for key, v in compress(flat.items(), is_state):
            rest = key[len(STATE_PREFIX) :]
            found = split_param_key(rest, hyper, longest)
            if found is None and rest and "." not in rest:  # an optimizer-level entry
                if rest in state:
                    raise LayoutError(f"{key!r} is both a value and a prefix of other keys")
                state[rest] = v
                continue
            if found is None:
                raise LayoutError(
                    f"{key!r} names no parameter of the param_groups.* keys, so its fqn "
                    "cannot be told from its state name. Pass like= (the nested reference)."
                )
            fqn, rest = found
            _insert(state.setdefault(fqn, {}), rest.split("."), v, key)
    # parameters whose hyperparameters are all equal (same names, equal values) form a group,
    # in order of first appearance. Each distinct row is frozen once: plain scalars are told
    # apart by their types and values (torch.load gives each parameter its own float
    # objects), other values by their objects (every value is alive in flat). Rows that are
    # equal but told apart here (NaN is never == itself) are joined by their frozen signature.
    names_rows = list(map(tuple, hyper.values()))
    value_rows = list(map(tuple, map(dict.values, hyper.values())))
    type_rows = list(map(tuple, map(map, repeat(type), value_rows)))
    plain = {  # per row of types: which cells are plain, which are not
        types: (bytes(t in _PLAIN for t in types), bytes(t not in _PLAIN for t in types))
        for types in set(type_rows)
    }
    rows = [
        (names, types, tuple(compress(values, is_plain)), tuple(map(id, compress(values, other))))
        for names, types, values, (is_plain, other) in zip(
            names_rows, type_rows, value_rows, map(plain.__getitem__, type_rows), strict=True
        )
    ]
    groups: dict[Any, dict[str, Any]] = {}
    group_of_row: dict[Any, dict[str, Any]] = {}
    for row, fqn in _first_fqns(rows, hyper).items():
        values = hyper[fqn]
        signature = tuple(zip(row[0], map(freeze, values.values()), strict=True))
        group = groups.get(signature)
        if group is None:
            group = groups[signature] = {**values, PARAMS: []}
        group_of_row[row] = group
    for fqn, row in zip(hyper, rows, strict=True):
        group_of_row[row][PARAMS].append(fqn)
    return {STATE: state, PARAM_GROUPS: list(groups.values())}


def _first_fqns(rows: list[Any], hyper: Mapping[str, Any]) -> dict[Any, str]:
    """Each distinct row of ``rows`` (one per fqn of ``hyper``): the fqn where it first appears."""
    first: dict[Any, str] = {}
    for row, fqn in zip(rows, hyper, strict=True):
        first.setdefault(row, fqn)
    return first


def _rows(fqns: list[str], names: list[str], values: list[Any]) -> dict[str, Any]:
    """``{fqn: {name: value}}`` from values laid out row after row, one row per fqn."""
    k = len(names)
    columns = [values[j::k] for j in range(k)]
    rows = zip(*columns, strict=True)  # one tuple per fqn
    return dict(zip(fqns, map(dict, map(zip, repeat(names), rows)), strict=True))


def _state_by_rows(
    keys: list[str], flat: Mapping[str, Any], is_state: bytes, hyper: Mapping[str, Any]
) -> dict[str, Any] | None:
    """The ``state.*`` keys as ``{fqn: {name: value}}``, if they have torch's usual shape.

    Usual: rows ``state.<fqn>.<name>`` read by :func:`~dsdmerge._table.read_rows` (one
    parameter after another, state names without dots), each fqn one of ``hyper``.
    Then each key is what the key-by-key path would split it into (the longest known
    fqn ending at a dot is ``fqn`` itself). ``None`` when they do not have that shape.
    """
    if not keys:
        return {}
    found = read_rows(keys, STATE_PREFIX)
    if found is None or not all(map(hyper.__contains__, found[0])):
        return None
    fqns, blocks = found
    k = len(blocks[0][2])
    values = list(compress(flat.values(), is_state))
    state: dict[str, Any] = {}
    for first, end, names in blocks:
        state |= _rows(fqns[first:end], names, values[first * k : end * k])
    return state


# Values compared by type and ==, as freeze compares them
_PLAIN = frozenset({float, int, bool, str, type(None)})
_INVERT = bytes.maketrans(b"\x00\x01", b"\x01\x00")


def split_param_key(
    rest: str, known: Container[str], longest: int | None = None
) -> tuple[str, str] | None:
    """Split ``"<fqn>.<name...>"`` at the longest prefix that is a known fqn.

    ``longest``, the length of the longest known fqn, bounds the search: a key of
    any length then costs work in proportion to ``longest``, not to its own length.
    """
    end = len(rest) if longest is None else min(len(rest), longest + 1)
    while True:
        end = rest.rfind(".", 0, end)
        if end <= 0:
            return None
        if rest[:end] in known:
            return rest[:end], rest[end + 1 :]


class _Unflattener:
    """Rebuild a nested dict with the structure of ``like``; see :func:`unflatten`."""

    def __init__(self, flat: Mapping[str, Any]) -> None:
        self.flat = flat
        self.hits = 0
        # prefix -> (pid spelling -> pid, rebuilt state, pid -> rebuilt group, rebuilt optimizer)
        self.optimizers: dict[
            str, tuple[dict[str, Any], dict[Any, Any], dict[Any, dict[str, Any]], dict[Any, Any]]
        ] = {}
        self.trees: dict[str, dict[Any, Any]] = {}
        # flat's keys and values as lists, made when first needed (see _values_of), and
        # where the last run of keys found there ended
        self.keys: list[str] | None = None
        self.values: list[Any] = []
        self.after = 0
        # optimizer prefix -> length of its longest param id; ".optimizers" / ".trees" -> of the
        # longest prefix: bounds on the searches that place keys like does not spell
        self.longest: dict[str, int] = {}

    def run(self, like: Mapping[Any, Any]) -> dict[Any, Any]:
        if is_optimizer_state_dict(like):
            out = self._optimizer(like, "", {id(like)})
        else:
            out = self._tree(like, "", {id(like)})
        if self.hits != len(self.flat):
            self._place_leftovers(like)
        return out

    def _tree(
        self, root: Mapping[Any, Any], prefix: str, on_path: set[int], *, in_state: bool = False
    ) -> dict[Any, Any]:
        """Rebuild a generic mapping; ``in_state`` for the nested state of one parameter."""
        flat = self.flat
        out: dict[Any, Any] = {}
        if not in_state:
            self.trees[prefix] = out
        stack: list[tuple[str, Any, Mapping[Any, Any], dict[Any, Any]]] = [
            (prefix, iter(root.items()), root, out)
        ]
        while stack:
            pfx, items, node, dest = stack[-1]
            for k, v in items:
                key = pfx + (k if type(k) is str else key_str(k, pfx[:-1]))
                if isinstance(v, Mapping):
                    if id(v) in on_path:
                        raise LayoutError(f"cycle: the mapping at {key!r} in like contains itself")
                    on_path.add(id(v))
                    if not in_state and is_optimizer_state_dict(v):
                        dest[k] = self._optimizer(v, key + ".", on_path)
                        on_path.discard(id(v))
                        continue
                    child: dict[Any, Any] = {}
                    dest[k] = child
                    if not in_state:
                        self.trees[key + "."] = child
                    stack.append((key + ".", iter(v.items()), v, child))
                    break
                value = flat.get(key, MISSING)
                if value is not MISSING:
                    dest[k] = value
                    self.hits += 1
            else:
                stack.pop()
                if node is not root:
                    on_path.discard(id(node))
        return out

    def _optimizer(self, like: Mapping[Any, Any], prefix: str, on_path: set[int]) -> dict[Any, Any]:
        check_not_mixed(like, prefix[:-1])
        flat = self.flat
        pids: dict[str, Any] = {}
        state: dict[Any, Any] = {}
        state_prefix = prefix + STATE_PREFIX
        if not self._fast_state(like[STATE], state_prefix, pids, state):
            for pid, entry in like[STATE].items():
                spelled = key_str(pid, prefix + STATE)
                pids[spelled] = pid
                if not isinstance(entry, Mapping):  # an optimizer-level entry: a leaf
                    if lists_param(like, pid):
                        raise LayoutError(
                            f"{state_prefix + spelled!r} in like: the optimizer state of a "
                            "parameter must be a mapping"
                        )
                    value = flat.get(state_prefix + spelled, MISSING)
                    if value is not MISSING:
                        state[pid] = value
                        self.hits += 1
                    continue
                if not entry:
                    state[pid] = {}
                    continue
                fields = self._tree(entry, state_prefix + spelled + ".", on_path, in_state=True)
                if fields:
                    state[pid] = fields
        groups: list[dict[str, Any]] = []
        member_of: dict[Any, dict[str, Any]] = {}
        group_prefix = prefix + PG_PREFIX
        for index, like_group in enumerate(like[PARAM_GROUPS]):
            where = f"{prefix}{PARAM_GROUPS}[{index}]"
            group_items(like_group, where)
            params = like_group[PARAMS]
            if set(map(type, params)) <= {int, str}:  # an f-string spells them as key_str
                spelled_params = list(map(str, params))
            else:
                spelled_params = [key_str(pid, where) for pid in params]
            bases = [f"{group_prefix}{spelled}." for spelled in spelled_params]
            names = [name for name in like_group if name != PARAMS]
            # every member's values, row after row (torch's order): one slice of flat when its
            # keys stand there in that order, else one lookup per key
            table = self._values_of_rows(bases, names) if names else []
            column = dict(zip(names, count()))
            group: dict[str, Any] = {}
            for name, like_value in like_group.items():
                if name == PARAMS:
                    group[PARAMS] = list(params)
                    continue
                if not params:  # torch's format has no key for an empty group: keep like's
                    group[name] = like_value
                    continue
                # one object for all members (the usual case) needs no comparison
                values = table[column[name] :: len(names)]
                found = list(filterfalse(partial(is_, MISSING), values))
                self.hits += len(found)
                if not found:
                    continue
                value = found[0]
                if not all(map(is_, found, repeat(value))):
                    for spelled, v in zip(spelled_params, values, strict=True):
                        if v is not MISSING and not same_value(v, value):
                            raise LayoutError(
                                f"cannot unflatten: members of {where} disagree on {name!r} "
                                f"({group_prefix}{spelled}.{name} is {short_repr(v)}, an earlier "
                                f"member has {short_repr(value)}); a nested param group holds one "
                                "value per hyperparameter."
                            )
                group[name] = value
            groups.append(group)
            for pid, spelled in zip(params, spelled_params, strict=True):
                pids[spelled] = pid
                member_of[pid] = group
        out: dict[Any, Any] = {}
        self.optimizers[prefix] = (pids, state, member_of, out)
        for k, v in like.items():  # like's order, with the keys beside state and param_groups
            if k == STATE:
                out[STATE] = state
            elif k == PARAM_GROUPS:
                out[PARAM_GROUPS] = groups
            else:
                key = prefix + (k if type(k) is str else key_str(k, prefix[:-1]))
                if isinstance(v, Mapping):
                    if id(v) in on_path:
                        raise LayoutError(f"cycle: the mapping at {key!r} in like contains itself")
                    on_path.add(id(v))  # (no optimizer state dict inside one, as flatten sees it)
                    out[k] = self._tree(v, key + ".", on_path, in_state=True)
                    on_path.discard(id(v))
                else:
                    value = flat.get(key, MISSING)
                    if value is not MISSING:
                        out[k] = value
                        self.hits += 1
        return out

    def _fast_state(
        self,
        like_state: Mapping[Any, Any],
        state_prefix: str,
        pids: dict[str, Any],
        state: dict[Any, Any],
    ) -> bool:
        """Rebuild the per-parameter state in C-level passes; ``False`` if unusual.

        Usual: int or str param ids, plain-dict entries with str state names and no
        nested state. The values of all ``state.*`` keys are looked up in one pass.
        """
        entries = list(like_state.values())
        if not (
            set(map(type, like_state)) <= {int, str}
            and set(map(type, entries)) <= {dict}
            and set(map(type, chain.from_iterable(entries))) <= {str}
            and not any(
                issubclass(tp, Mapping)
                for tp in set(map(type, chain.from_iterable(map(dict.values, entries))))
            )
        ):
            return False
        spelled = list(map(str, like_state))
        keys = [
            f"{state_prefix}{s}.{name}" for s, e in zip(spelled, entries, strict=True) for name in e
        ]
        values = self._values_of(keys)
        lost = sum(map(is_, values, repeat(MISSING)))
        self.hits += len(values) - lost
        taken = iter(values)
        rebuilt = map(dict, map(zip, entries, map(islice, repeat(taken), map(len, entries))))
        if not lost:
            state.update(zip(like_state, rebuilt, strict=True))
        else:  # a parameter keeps the state names the flat dict has, and none if it has none
            for pid, entry, fields in zip(like_state, entries, rebuilt, strict=True):
                kept = {k: v for k, v in fields.items() if v is not MISSING}
                if kept or not entry:
                    state[pid] = kept
        pids.update(zip(spelled, like_state, strict=True))
        return True

    def _values_of_rows(self, bases: list[str], names: list[str]) -> list[Any]:
        """:meth:`_values_of` the keys ``base + name``, row after row (torch's order).

        Shortcut: when flat holds those keys at its current position, in order,
        one string comparison tells (the expected keys joined by NUL, built by one
        ``join`` per row, against flat's keys joined the same way; a key holding a
        NUL makes the test fall back), and no key string is spelled at all.
        """
        flat, n = self.flat, len(bases) * len(names)
        if type(flat) is dict and n >= 64:
            if self.keys is None:
                self.keys, self.values = list(flat), list(flat.values())
            at = self.after
            got = joined(self.keys[at : at + n])
            if got is not None and got == spelled_rows(bases, names):
                self.after = at + n
                return self.values[at : at + n]
        return self._values_of([b + name for b in bases for name in names])

    def _values_of(self, keys: list[str]) -> list[Any]:
        """The flat value of each of ``keys``, ``MISSING`` where flat lacks it.

        Semantically ``[flat.get(k, MISSING) for k in keys]``. Shortcut: where the
        keys stand in flat one after another in this order (torch's layout, when
        ``like`` is the reference the flat dict was made from), their values are a
        slice of flat's values, found by comparing runs of keys (see :func:`_run`)
        instead of hashing each key. A key out of that order (a backfilled one at
        the end, an extra one in between) is looked up by hash, and the walk goes on.
        """
        flat = self.flat
        if type(flat) is not dict or len(keys) < 64:
            return list(map(flat.get, keys, repeat(MISSING)))
        if self.keys is None:
            self.keys, self.values = list(flat), list(flat.values())
        have, values = self.keys, self.values
        out: list[Any] = []
        i, at, n = 0, self.after, len(keys)
        while i < n:
            length = _run(keys, i, have, at, n - i)
            if length:
                out += values[at : at + length]
                i += length
                at += length
                continue
            key = keys[i]  # out of order: by hash, then look a few keys ahead in flat
            out.append(flat.get(key, MISSING))
            i += 1
            if out[-1] is not MISSING:
                ahead = have[at : at + _AHEAD]
                if key in ahead:
                    at += ahead.index(key) + 1
        self.after = at
        return out

    def _place_leftovers(self, like: Mapping[Any, Any]) -> None:
        placed = set(flatten(like))
        self.longest[".optimizers"] = max(map(len, self.optimizers), default=0)
        self.longest[".trees"] = max(map(len, self.trees), default=0)
        unplaced: list[str] = []
        for key, v in self.flat.items():
            if key in placed:
                continue
            if not self._place(key, v):
                unplaced.append(key)
        if unplaced:
            unplaced.sort()
            shown = ", ".join(repr(k) for k in unplaced[:10])
            more = f" and {len(unplaced) - 10} more" if len(unplaced) > 10 else ""
            raise LayoutError(
                f"like has no place for {len(unplaced)} flat key(s): {shown}{more}. They name "
                "parameters that like's optimizer does not have; pass a like that has them "
                "(the reference state dict) or drop them first."
            )

    def _place(self, key: str, value: Any) -> bool:
        """Place a key ``like`` does not spell under the parameter or mapping it extends."""
        prefix = _longest_prefix(key, self.optimizers, self.longest[".optimizers"])
        if prefix is not None:
            return self._place_in_optimizer(prefix, key, value)
        prefix = _longest_prefix(key, self.trees, self.longest[".trees"])
        if prefix is None:
            return False
        _insert(self.trees[prefix], key[len(prefix) :].split("."), value, key)
        return True

    def _place_in_optimizer(self, prefix: str, key: str, value: Any) -> bool:
        pids, state, member_of, optimizer = self.optimizers[prefix]
        rest = key[len(prefix) :]
        if rest.startswith(STATE_PREFIX):
            longest = self.longest.get(prefix)
            if longest is None:
                longest = self.longest[prefix] = max(map(len, pids), default=0)
            found = split_param_key(rest[len(STATE_PREFIX) :], pids, longest)
            if found is None:
                name = rest[len(STATE_PREFIX) :]
                if not name or "." in name or name in pids:
                    return False
                # an optimizer-level entry (MADGRAD's state['k']), as unflatten without like
                # reads it: a leaf under a key that is no parameter
                _insert(state, [name], value, key)
                return True
            pid = pids[found[0]]
            _insert(state.setdefault(pid, {}), found[1].split("."), value, key)
            return True
        if rest.startswith(PG_PREFIX):
            spelled, _, name = rest[len(PG_PREFIX) :].rpartition(".")
            pid = pids.get(spelled, MISSING)
            group = None if pid is MISSING else member_of.get(pid)
            if group is None or not name:
                return False
            if name in group and not same_value(group[name], value):
                raise LayoutError(
                    f"cannot unflatten: {key!r} is {short_repr(value)} but its group holds "
                    f"{short_repr(group[name])}"
                )
            group[name] = value
            return True
        # a key beside state and param_groups (heavyball's): under the optimizer, split on dots
        _insert(optimizer, rest.split("."), value, key)
        return True


_AHEAD = 8  # keys of flat skipped at most to find the next key in order (extra keys)


def _run(a: list[str], i: int, b: list[str], j: int, limit: int) -> int:
    """The largest ``n <= limit`` with ``a[i:i + n] == b[j:j + n]``.

    Slices are compared in C (a string compares by identity, then length, then
    bytes), galloping then bisecting: a run of ``n`` equal keys costs a few passes
    over about ``n`` keys (never over the rest of the lists), not ``n`` Python steps.
    """
    if j >= len(b) or a[i] != b[j]:
        return 0
    lo, step = 1, 64  # a[i:i+lo] == b[j:j+lo] holds; past lo + step it is not known
    while lo < limit:
        step = min(step, limit - lo)
        if a[i + lo : i + lo + step] != b[j + lo : j + lo + step]:
            break
        lo += step
        step *= 2
    else:
        return limit
    hi = min(limit, lo + step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[i + lo : i + mid] == b[j + lo : j + mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _longest_prefix(key: str, prefixes: Mapping[str, Any], longest: int) -> str | None:
    """The longest of ``prefixes`` (each ``""`` or ending in a dot) that ``key`` starts with.

    ``longest`` is the length of the longest prefix: it bounds the search.
    """
    end = min(len(key), longest)
    while end > 0:
        end = key.rfind(".", 0, end)
        if end < 0:
            break
        if key[: end + 1] in prefixes:
            return key[: end + 1]
    return "" if "" in prefixes else None
