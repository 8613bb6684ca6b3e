"""Where a state dict names parameters, for the layout conversions: read, changed, spelled.

The rule: each part of a state dict that names parameters is read into a table of
parameters, changed by :mod:`dsdmerge.convert` one rule at a time, and spelled back in
the input's own layout; everything else is passed through, leaves shared.

* :class:`ModelPart`: ``{fqn: value}``, a model state dict or the model keys of a flat
  checkpoint under their prefix (``model.<fqn>``).
* :class:`FlatOptim`: a DSD-flattened optimizer (``state.<fqn>.<name>`` and
  ``param_groups.<fqn>.<hyperparameter>``, under a prefix in a flattened checkpoint).
  Torch's layout (every state key first, each parameter's keys one row after another)
  is read as a table of rows; any other order key by key.
* :class:`NestedOptim`: a nested optimizer state dict keyed by fqn, or by int id with the
  ``param_names`` of its groups (which say the fqns; ids are renumbered in group order
  on the way out, as ``optimizer.state_dict()`` numbers them).
* :class:`FlatNode`, :class:`OptimNode`, :class:`Tree`, :class:`Leafy`: the mappings of a
  state dict, each spelling its output.

Placement: every entry carries an *anchor*, the position of the original entry it
descends from (then its index among split parts): a target takes its first source's
anchor, so it stands where that source stood, in ``state``, in its group's ``params``
and among a flat dict's keys. ``param_names`` lists follow the same substitutions.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from itertools import compress, count
from operator import itemgetter, methodcaller, ne
from typing import Any

import torch

from dsdmerge import _convert_ops as ops
from dsdmerge._table import read_rows
from dsdmerge.errors import ConversionError, LayoutError, StateDictTypeError
from dsdmerge.flatten import split_param_key
from dsdmerge.layout import (
    PARAM_GROUPS,
    PARAM_NAMES,
    PARAMS,
    PG_PREFIX,
    STATE,
    STATE_PREFIX,
    check_not_mixed,
)
from dsdmerge.rename import copy_tree, optimizer_prefixes

__all__ = [
    "Anchor",
    "FlatNode",
    "FlatOptim",
    "Hyper",
    "Leafy",
    "ModelPart",
    "NestedOptim",
    "OptimNode",
    "Tree",
]

Anchor = tuple[int, ...]
"""Where a converted entry goes: the position of the original entry it descends from,
then its index among the parts it was split into (sorted as tuples)."""
_first = itemgetter(0)
_second = itemgetter(1)
_PLAIN = frozenset({float, int, bool, str, type(None)})
_LEAF_TYPES = frozenset({torch.Tensor, torch.nn.Parameter, *_PLAIN, tuple, list, set})
_INVERT = bytes.maketrans(b"\x00\x01", b"\x01\x00")


class ModelPart:
    """``{fqn: value}`` (a model state dict, or the model keys under a flat prefix)."""

    def __init__(
        self, before: str, fqns: list[str], values: list[Any], indices: Iterable[int]
    ) -> None:
        self.before = before
        self.values: dict[str, Any] = dict(zip(fqns, values, strict=True))
        self.index: dict[str, int] = dict(zip(fqns, indices, strict=True))  # original, unchanged
        self.anchor: dict[str, Anchor] = {}  # new entries
        self.dead: list[int] = []

    def fqns(self) -> list[str]:
        return list(self.values)

    def anchor_of(self, fqn: str) -> Anchor:
        found = self.anchor.get(fqn)
        return found if found is not None else (self.index[fqn],)

    def commit(self, changes: list[tuple[list[str], list[str], list[Any]]]) -> None:
        placed = []
        for sources, targets, values in changes:
            base = self.anchor_of(sources[0])
            if len(targets) == 1:
                placed.append((targets[0], base, values[0]))
            else:
                placed += [
                    (t, (*base, i), v) for i, (t, v) in enumerate(zip(targets, values, strict=True))
                ]
        for sources, _, _ in changes:
            for fqn in sources:
                del self.values[fqn]
                if fqn in self.index:
                    self.dead.append(self.index.pop(fqn))
                else:
                    del self.anchor[fqn]
        for fqn, anchor, value in placed:
            self.values[fqn] = value
            self.anchor[fqn] = anchor

    def new_items(self) -> list[tuple[Anchor, str, Any]]:
        return [(a, self.before + fqn, self.values[fqn]) for fqn, a in self.anchor.items()]

    def shape(self, fqn: str) -> tuple[int, ...] | None:
        value = self.values.get(fqn)
        if value is None or not ops.is_tensor(value):
            return None
        return tuple(value.shape)


class Hyper:
    """A parameter's hyperparameters (``param_names`` left out), their names and values.

    ``key`` names its group: equal keys, equal hyperparameters (``None`` in a flat dict,
    where each parameter has its own).
    """

    __slots__ = ("key", "names", "values")

    def __init__(self, key: object, names: tuple[str, ...], values: tuple[Any, ...]) -> None:
        if PARAM_NAMES in names:
            at = names.index(PARAM_NAMES)
            names, values = names[:at] + names[at + 1 :], values[:at] + values[at + 1 :]
        self.key = key
        self.names = names
        self.values = values

    @classmethod
    def of(cls, key: object, names: tuple[str, ...], values: tuple[Any, ...]) -> Hyper:
        """One whose ``names`` are known to lack ``param_names``."""
        out = cls.__new__(cls)
        out.key, out.names, out.values = key, names, values
        return out


def _spell_suffix(path: Hashable) -> str:
    return str(path)[1:]


def _spell_path(path: Hashable) -> str:
    return ".".join(map(str, path)) if isinstance(path, tuple) else str(path)


class FlatOptim:
    """A DSD-flattened optimizer: the ``state.*`` and ``param_groups.*`` keys of a flat dict.

    Under a prefix ``P`` (``""`` for an optimizer alone): ``P + "state.<fqn>.<name>"``
    and ``P + "param_groups.<fqn>.<hyperparameter>"``.
    """

    spell = staticmethod(_spell_suffix)

    def __init__(self, prefix: str, keys: list[str], values: list[Any]) -> None:
        self.keys, self.values = keys, values
        self.st = prefix + STATE_PREFIX
        self.pg = prefix + PG_PREFIX
        # each parameter's original keys (positions); a range when they stand together
        self.state_idx: dict[str, Sequence[int]] = {}
        self.pg_idx: dict[str, Sequence[int]] = {}
        # read as a table (see _read_table): each parameter's suffixes and hyperparameter names,
        # one tuple per block of rows, shared
        self.suffixes: dict[str, tuple[str, ...]] = {}
        self.names: dict[str, tuple[tuple[str, ...], int]] = {}
        self.state_new: dict[str, tuple[Anchor, ops.Fields]] = {}
        self.pg_new: dict[str, tuple[Anchor, ops.Fields]] = {}
        self.current: dict[str, None] = {}
        self.dead: list[Sequence[int]] = []  # the original keys of each removed entry
        self.names_at: list[int] = []  # original param_groups.<fqn>.param_names keys
        self.subs: list[dict[str, list[str]]] = []

    def finish_parsing(self) -> None:
        self.current = dict.fromkeys(self.pg_idx)
        self.current.update(dict.fromkeys(self.state_idx))

    def fqns(self) -> list[str]:
        return list(self.current)

    def _fields(self, before: str, fqn: str, indices: Sequence[int], skip: int = 0) -> ops.Fields:
        """``(suffix, value)`` of the keys at ``indices`` (``skip``: characters more to cut)."""
        cut = itemgetter(slice(len(before) + len(fqn) + skip, None))
        keys, values = self.keys, self.values
        first, last = indices[0], indices[-1]
        if last - first + 1 == len(indices):  # one run of keys: C-level slices
            return list(
                zip(map(cut, keys[first : last + 1]), values[first : last + 1], strict=True)
            )
        return [(cut(keys[i]), values[i]) for i in indices]

    def state_of(self, fqn: str) -> ops.Fields | None:
        new = self.state_new.get(fqn)
        if new is not None:
            return new[1]
        indices = self.state_idx.get(fqn)
        if indices is None:
            return None
        suffixes = self.suffixes.get(fqn)
        if suffixes is not None:  # read as a table: a range, with the block's suffixes
            return list(zip(suffixes, self.values[indices[0] : indices[-1] + 1], strict=True))
        return self._fields(self.st, fqn, indices)

    def hyper_of(self, fqn: str) -> Hyper | None:
        new = self.pg_new.get(fqn)
        if new is not None:
            rows = new[1]
            return Hyper(None, tuple(str(k)[1:] for k, _ in rows), tuple(map(_second, rows)))
        indices = self.pg_idx.get(fqn)
        if indices is None:
            return None
        named = self.names.get(fqn)
        if named is not None:  # read as a table: the block's names (param_names left out)
            names, skip = named
            values = tuple(self.values[indices[0] : indices[-1] + 1])
            if skip >= 0:
                values = values[:skip] + values[skip + 1 :]
            return Hyper.of(None, names, values)
        cut = itemgetter(slice(len(self.pg) + len(fqn) + 1, None))  # hyperparameter names
        first, last = indices[0], indices[-1]
        if last - first + 1 == len(indices):  # one run of keys: C-level slices
            keys = self.keys[first : last + 1]
            return Hyper(None, tuple(map(cut, keys)), tuple(self.values[first : last + 1]))
        return Hyper(
            None,
            tuple(cut(self.keys[i]) for i in indices),
            tuple(self.values[i] for i in indices),
        )

    def _anchor(
        self, fqn: str, new: dict[str, tuple[Anchor, ops.Fields]], idx: dict[str, Sequence[int]]
    ) -> Anchor | None:
        found = new.get(fqn)
        if found is not None:
            return found[0]
        indices = idx.get(fqn)
        return None if indices is None else (indices[0],)

    def _pg_rows(self, fqn: str) -> ops.Fields | None:
        new = self.pg_new.get(fqn)
        if new is not None:
            return new[1]
        indices = self.pg_idx.get(fqn)
        return None if indices is None else self._fields(self.pg, fqn, indices)

    def commit(
        self, changes: list[tuple[str, list[str], list[str], list[ops.Fields | None]]]
    ) -> None:
        state_placed: list[tuple[str, Anchor, ops.Fields]] = []
        pg_placed: list[tuple[str, Anchor, ops.Fields]] = []
        subs: dict[str, list[str]] = {}
        for mode, sources, targets, states in changes:
            first = sources[0]
            st_anchor = next(
                (
                    a
                    for a in (self._anchor(s, self.state_new, self.state_idx) for s in sources)
                    if a
                ),
                None,
            )
            pg_anchor = self._anchor(first, self.pg_new, self.pg_idx)
            rows = self._pg_rows(first)
            for i, (target, state) in enumerate(zip(targets, states, strict=True)):
                sub = () if len(targets) == 1 else (i,)
                if state is not None:
                    assert st_anchor is not None
                    state_placed.append((target, (*st_anchor, *sub), state))
                if rows is not None and pg_anchor is not None:
                    pg_placed.append((target, (*pg_anchor, *sub), list(rows)))
            if mode != "same":
                subs[first] = list(targets)
                subs.update((s, []) for s in sources[1:])
        for _, sources, _, _ in changes:
            for fqn in sources:
                self._remove(fqn)
        for fqn, anchor, fields in state_placed:
            self.state_new[fqn] = (anchor, fields)
            self.current[fqn] = None
        for fqn, anchor, fields in pg_placed:
            self.pg_new[fqn] = (anchor, fields)
            self.current[fqn] = None
        if subs:
            self.subs.append(subs)

    def _remove(self, fqn: str) -> None:
        self.current.pop(fqn, None)
        self.names.pop(fqn, None)
        self.suffixes.pop(fqn, None)
        for idx, new in ((self.state_idx, self.state_new), (self.pg_idx, self.pg_new)):
            indices = idx.pop(fqn, None)
            if indices is not None:
                self.dead.append(indices)
            new.pop(fqn, None)

    def group_names(self) -> set[str]:
        """Every hyperparameter name (for recognising the optimizer)."""
        names: set[str] = set()
        for fqn in list(self.pg_idx)[:64]:
            hyper = self.hyper_of(fqn)
            if hyper is not None:
                names.update(hyper.names)
        for _, rows in list(self.pg_new.values())[:64]:
            names.update(str(s)[1:] for s, _ in rows)
        return names

    def new_items(self) -> list[tuple[Anchor, str, Any]]:
        out = []
        for before, new in ((self.st, self.state_new), (self.pg, self.pg_new)):
            for fqn, (anchor, fields) in new.items():
                out += [(anchor, f"{before}{fqn}{suffix}", value) for suffix, value in fields]
        return out

    def renamed_lists(self, replaced: dict[int, Any], items: list[tuple[Anchor, str, Any]]) -> None:
        """Apply the rules' substitutions to every ``param_names`` list (new lists)."""
        if not self.subs:
            return
        if not self.names_at:
            for j, (anchor, key, value) in enumerate(items):
                if key.startswith(self.pg) and key.endswith("." + PARAM_NAMES):
                    fqn = key[len(self.pg) : -len(PARAM_NAMES) - 1]
                    items[j] = (anchor, key, self._renamed(value, fqn, {}))
            return
        done: dict[int, Any] = {}
        dead = {i for indices in self.dead for i in indices}
        for i in self.names_at:
            if i in dead:
                continue
            fqn = self.keys[i][len(self.pg) : -len(PARAM_NAMES) - 1]
            replaced[i] = self._renamed(self.values[i], fqn, done)
        for j, (anchor, key, value) in enumerate(items):
            if key.startswith(self.pg) and key.endswith("." + PARAM_NAMES):
                fqn = key[len(self.pg) : -len(PARAM_NAMES) - 1]
                items[j] = (anchor, key, self._renamed(value, fqn, done))

    def _renamed(self, names: Any, fqn: str, done: dict[int, Any]) -> Any:
        if type(names) is not list or not all(type(n) is str for n in names):
            return names
        found = done.get(id(names))
        if found is not None:
            return found
        prefix = _names_prefix(names, fqn)
        current = list(names)
        for subs in self.subs:
            current = _substituted(current, subs, prefix)
        out = current if current != names else names
        done[id(names)] = out
        return out


def _names_prefix(names: list[str], fqn: str) -> str:
    """What the names in a ``param_names`` list put before fqns (``module.`` for DDP's)."""
    if fqn in names:
        return ""
    for name in names:
        if name.endswith("." + fqn):
            return name[: -len(fqn)]
    return ""


def _substituted(names: list[str], subs: Mapping[str, list[str]], prefix: str) -> list[str]:
    out: list[str] = []
    for name in names:
        if name.startswith(prefix) and name[len(prefix) :] in subs:
            out += [prefix + t for t in subs[name[len(prefix) :]]]
        else:
            out.append(name)
    return out


class Group:
    """One nested param group: its items, its members (by anchor) and their names."""

    def __init__(self, original: Mapping[str, Any]) -> None:
        self.original = original
        self.items: list[tuple[str, Any]] = [
            (k, v) for k, v in original.items() if k not in (PARAMS, PARAM_NAMES)
        ]
        self.members: dict[str, Anchor] = {}
        self.names: dict[str, str] | None = None
        self.hyper: Hyper | None = None


class NestedOptim:
    """A nested optimizer state dict, keyed by fqn or by int id with ``param_names``."""

    spell = staticmethod(_spell_path)

    def __init__(self, osd: Mapping[Any, Any], where: str) -> None:
        check_not_mixed(osd, where)
        self.osd = osd
        self.where = where
        state, groups = osd[STATE], osd[PARAM_GROUPS]
        if not isinstance(state, Mapping):
            raise LayoutError(f"{where or 'the optimizer'}['state'] must be a mapping")
        self.groups = [Group(self._group(g, i)) for i, g in enumerate(groups)]
        for i, group in enumerate(self.groups):
            items = group.items
            group.hyper = Hyper(i, tuple(map(_first, items)), tuple(map(_second, items)))
        params = [p for g in self.groups for p in g.original[PARAMS]]
        kinds = {type(p) for p in params}
        if kinds - {int, str} or len(kinds) > 1:
            raise StateDictTypeError(
                f"{where or 'the optimizer'}: param ids must be all fqns (str) or all int ids, "
                f"got {', '.join(sorted(t.__name__ for t in kinds))}"
            )
        self.by_id = kinds == {int}
        self.str_ids = False
        fqn_of: dict[Any, str] = {}  # state key -> fqn
        position = 0
        for gi, group in enumerate(self.groups):
            members = list(group.original[PARAMS])
            got = group.original.get(PARAM_NAMES)
            names: list[str] = list(got) if type(got) in (list, tuple) else []  # type: ignore[arg-type]
            has_names = len(names) == len(members) and all(type(n) is str for n in names)
            if self.by_id and not has_names and members:
                raise ConversionError(
                    f"{where or 'the optimizer'}: param group {gi} keys its parameters by int "
                    "id and has no 'param_names', so which parameter is which cannot be told. "
                    "Key it by fqn first: dsdmerge.rekey(optimizer_state_dict, "
                    "model.named_parameters()) (the model the checkpoint was saved from)."
                )
            fqns = names if self.by_id else members
            if has_names:
                group.names = dict(zip(fqns, names, strict=True))
            for pid, fqn in zip(members, fqns, strict=True):
                if fqn in group.members or any(fqn in g.members for g in self.groups[:gi]):
                    raise LayoutError(
                        f"{where or 'the optimizer'}: {fqn!r} is listed twice in its param groups"
                    )
                group.members[fqn] = (position,)
                position += 1
                fqn_of[pid] = fqn
        self.group_of: dict[str, int] = {
            fqn: gi for gi, g in enumerate(self.groups) for fqn in g.members
        }
        # state: parameters' entries (converted lazily) and optimizer-level entries, in order
        self.entries: dict[str, tuple[Anchor, Any]] = {}  # fqn -> (anchor, entry)
        self.new: dict[str, tuple[Anchor, ops.Fields]] = {}
        self.levels: list[tuple[Anchor, Any, Any]] = []  # (anchor, key, value) kept as they are
        self.state_keys: dict[str, Any] = {}
        for i, (key, entry) in enumerate(state.items()):
            fqn = self._fqn_of_key(key, fqn_of)
            if fqn is None or not isinstance(entry, Mapping):
                self.levels.append(((i,), key, entry))
                continue
            if type(key) is str and self.by_id:
                self.str_ids = True
            self.entries[fqn] = ((i,), entry)
            self.state_keys[fqn] = key
        self.changed = False

    def _group(self, group: object, index: int) -> Mapping[str, Any]:
        if not isinstance(group, Mapping) or not isinstance(group.get(PARAMS), (list, tuple)):
            raise LayoutError(
                f"{self.where or 'the optimizer'}[{PARAM_GROUPS!r}][{index}] must be a mapping "
                "with a 'params' list"
            )
        return group

    def _fqn_of_key(self, key: Any, fqn_of: Mapping[Any, str]) -> str | None:
        if not self.by_id:
            return key if type(key) is str else None
        if type(key) is int:
            return fqn_of.get(key)
        if type(key) is str and key.isdecimal() and key.isascii():
            return fqn_of.get(int(key))
        return None

    def fqns(self) -> list[str]:
        out = dict.fromkeys(self.group_of)
        out.update(dict.fromkeys(self.entries))
        out.update(dict.fromkeys(self.new))
        return list(out)

    def state_of(self, fqn: str) -> ops.Fields | None:
        new = self.new.get(fqn)
        if new is not None:
            return new[1]
        found = self.entries.get(fqn)
        return None if found is None else _walk_entry(found[1], fqn)

    def hyper_of(self, fqn: str) -> Hyper | None:
        gi = self.group_of.get(fqn)
        return None if gi is None else self.groups[gi].hyper

    def _state_anchor(self, fqn: str) -> Anchor | None:
        new = self.new.get(fqn)
        if new is not None:
            return new[0]
        found = self.entries.get(fqn)
        return None if found is None else found[0]

    def commit(
        self, changes: list[tuple[str, list[str], list[str], list[ops.Fields | None]]]
    ) -> None:
        self.changed = True
        placed: list[
            tuple[str, Anchor | None, ops.Fields | None, int | None, Anchor | None, str | None]
        ] = []
        for _, sources, targets, states in changes:
            first = sources[0]
            st_anchor = next((a for a in map(self._state_anchor, sources) if a), None)
            gi = self.group_of.get(first)
            member = None if gi is None else self.groups[gi].members[first]
            name = None
            if gi is not None and self.groups[gi].names is not None:
                name = self.groups[gi].names[first]  # type: ignore[index]
            for i, (target, state) in enumerate(zip(targets, states, strict=True)):
                sub = () if len(targets) == 1 else (i,)
                placed.append(
                    (
                        target,
                        None if st_anchor is None else (*st_anchor, *sub),
                        state,
                        gi,
                        None if member is None else (*member, *sub),
                        None if name is None else _derived_name(name, first, target, self.where),
                    )
                )
        for _, sources, _, _ in changes:
            for fqn in sources:
                self.entries.pop(fqn, None)
                self.new.pop(fqn, None)
                self.state_keys.pop(fqn, None)
                gi = self.group_of.pop(fqn, None)
                if gi is not None:
                    del self.groups[gi].members[fqn]
                    if self.groups[gi].names is not None:
                        del self.groups[gi].names[fqn]  # type: ignore[union-attr]
        for fqn, st_anchor, state, gi, member, name in placed:
            if state is not None:
                assert st_anchor is not None
                self.new[fqn] = (st_anchor, state)
            if gi is not None:
                assert member is not None
                self.group_of[fqn] = gi
                self.groups[gi].members[fqn] = member
                if name is not None:
                    self.groups[gi].names[fqn] = name  # type: ignore[index]

    def group_names(self) -> set[str]:
        return {name for g in self.groups for name, _ in g.items}

    def output(self) -> dict[Any, Any]:
        if not self.changed:
            return copy_tree(self.osd, self.where)  # type: ignore[no-any-return]
        groups_out = []
        ids: dict[str, Any] = {}
        position = 0
        for group in self.groups:
            members = sorted(group.members, key=group.members.__getitem__)
            if self.by_id:
                new_ids = list(range(position, position + len(members)))
                ids.update(zip(members, new_ids, strict=True))
                position += len(members)
                params: list[Any] = new_ids
            else:
                params = members
            g: dict[str, Any] = {}
            for k, v in group.original.items():
                if k == PARAMS:
                    g[k] = params
                elif k == PARAM_NAMES and group.names is not None:
                    g[k] = [group.names[m] for m in members]
                else:
                    g[k] = v
            groups_out.append(g)
        rows: list[tuple[Anchor, Any, Any]] = [
            (a, k, copy_tree(v, f"{self.where}.{STATE}")) for a, k, v in self.levels
        ]
        for fqn, (anchor, entry) in self.entries.items():
            rows.append((anchor, self._key(fqn, ids), copy_tree(entry, f"{self.where}.{STATE}")))
        for fqn, (anchor, fields) in self.new.items():
            rows.append((anchor, self._key(fqn, ids), _rebuild_entry(fields)))
        rows.sort(key=lambda r: r[0])
        state: dict[Any, Any] = {}
        for _, key, value in rows:
            if key in state:
                raise ConversionError(
                    f"{self.where or 'the optimizer'}: the renumbered param id {key!r} is also "
                    "the key of state that belongs to no parameter; drop that entry first",
                    keys=(str(key),),
                )
            state[key] = value
        out: dict[Any, Any] = {}
        for k, v in self.osd.items():
            if k == STATE:
                out[k] = state
            elif k == PARAM_GROUPS:
                out[k] = groups_out
            else:
                out[k] = copy_tree(v, f"{self.where}.{k}" if self.where else str(k))
        return out

    def _key(self, fqn: str, ids: Mapping[str, Any]) -> Any:
        if not self.by_id:
            return fqn
        pid = ids.get(fqn)
        if pid is None:  # state of a parameter no group lists any more: cannot happen
            raise ConversionError(
                f"{fqn} has optimizer state but is in no param group", keys=(fqn,)
            )
        return str(pid) if self.str_ids else pid


def _derived_name(name: str, source: str, target: str, where: str) -> str:
    """The ``param_names`` entry of ``target``, from ``source``'s entry ``name``."""
    if name == source:
        return target
    if name.endswith("." + source):
        return name[: -len(source)] + target
    raise ConversionError(
        f"{where or 'the optimizer'}: the param_names entry {name!r} of {source} is not its fqn "
        "(nor the fqn behind a prefix), so the converted parameter's name cannot be told; "
        "fix or drop param_names first",
        keys=(source,),
    )


def _walk_entry(entry: Mapping[Any, Any], where: str) -> ops.Fields:
    """A nested state entry's leaves at their key paths (an empty mapping is a leaf)."""
    types = set(map(type, entry.values()))
    if types <= _LEAF_TYPES or not any(issubclass(tp, Mapping) for tp in types):
        return list(zip(zip(entry), entry.values(), strict=True))  # one (key,) path per leaf
    out: ops.Fields = []
    on_path = {id(entry)}
    stack: list[tuple[tuple[Any, ...], Any, Mapping[Any, Any]]] = [((), iter(entry.items()), entry)]
    while stack:
        path, items, node = stack[-1]
        for k, v in items:
            if isinstance(v, Mapping) and v:
                if id(v) in on_path:
                    raise LayoutError(
                        f"cycle: a mapping in the optimizer state of {where!r} contains itself"
                    )
                on_path.add(id(v))
                stack.append(((*path, k), iter(v.items()), v))
                break
            out.append(((*path, k), v))
        else:
            stack.pop()
            on_path.discard(id(node))
    return out


def _rebuild_entry(fields: ops.Fields) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for path, value in fields:
        node = out
        assert isinstance(path, tuple)
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = dict(value) if isinstance(value, Mapping) else value
    return out


# --------------------------------------------------------------------------------------
# the nodes of a state dict: flat mappings, optimizers, containers


class FlatNode:
    """A flat mapping with str keys: its model keys and its DSD-flattened optimizers."""

    def __init__(self, flat: Mapping[str, Any]) -> None:
        keys = list(flat)
        values = list(flat.values())
        self.keys, self.values = keys, values
        self.optims: list[FlatOptim] = []
        self.models: dict[str, ModelPart] = {}
        optim = FlatOptim("", keys, values)
        if _read_table(optim, keys):  # an optimizer alone, as torch writes it: the common case
            self.optims.append(optim)
            return
        sections = bytes(map(methodcaller("startswith", (STATE_PREFIX, PG_PREFIX)), keys))
        if keys and 0 not in sections and any(map(methodcaller("startswith", PG_PREFIX), keys)):
            prefixes = [""]  # an optimizer alone, its keys in another order
        elif any(map(methodcaller("__contains__", PG_PREFIX), keys)):
            prefixes = optimizer_prefixes(keys)
        else:
            prefixes = []
        if not prefixes:  # a model state dict (or any flat dict): every key is an fqn
            if keys:
                self.models[""] = ModelPart("", keys, values, range(len(keys)))
            return
        depth = prefixes[0].count(".")
        is_opt = bytearray(len(keys))
        heads = list(map(_first, map(methodcaller("rpartition", "."), keys)))
        # runs of keys with one head (``state.<fqn>``, ``param_groups.<fqn>``): a parameter's
        # keys stand together in torch's layout, so there are about two runs per parameter
        starts = [0, *compress(range(1, len(keys)), map(ne, heads[1:], heads))]
        runs = list(zip(starts, [*starts[1:], len(keys)], strict=True))
        for p in prefixes:
            optim = FlatOptim(p, keys, values)
            self._parse_optimizer(optim, is_opt, heads, runs)
            self.optims.append(optim)
        model: dict[str, tuple[list[str], list[Any], list[int]]] = {}
        for i in compress(range(len(keys)), bytes(is_opt).translate(_INVERT)):
            key = keys[i]
            parts = key.split(".", depth)
            if len(parts) <= depth:
                continue
            before, fqn = ".".join(parts[:depth]) + ".", parts[depth]
            found = model.get(before)
            if found is None:
                found = model[before] = ([], [], [])
            found[0].append(fqn)
            found[1].append(values[i])
            found[2].append(i)
        for before, (fqns, vals, indices) in model.items():
            self.models[before] = ModelPart(before, fqns, vals, indices)

    def _parse_optimizer(
        self, optim: FlatOptim, is_opt: bytearray, heads: list[str], runs: list[tuple[int, int]]
    ) -> None:
        keys = self.keys
        pg, st = optim.pg, optim.st
        state_runs = []
        for start, end in runs:
            head = heads[start]
            if head.startswith(st):
                state_runs.append((start, end))
                continue
            if is_opt[start] or not head.startswith(pg) or len(head) == len(pg):
                continue
            fqn = head[len(pg) :]
            is_opt[start:end] = b"\x01" * (end - start)
            found = optim.pg_idx.get(fqn)
            optim.pg_idx[fqn] = range(start, end) if found is None else [*found, *range(start, end)]
        suffix = "." + PARAM_NAMES
        optim.names_at = [
            i
            for i in compress(range(len(keys)), map(methodcaller("endswith", suffix), keys))
            if is_opt[i] and keys[i].startswith(pg)
        ]
        known = optim.pg_idx
        longest = max(map(len, known), default=0)
        for start, end in state_runs:
            if is_opt[start]:
                continue
            fqn = heads[start][len(st) :]
            if fqn in known:  # state.<fqn>.<name>: the whole run
                is_opt[start:end] = b"\x01" * (end - start)
                found = optim.state_idx.get(fqn)
                optim.state_idx[fqn] = (
                    range(start, end) if found is None else [*found, *range(start, end)]
                )
                continue
            for i in range(start, end):  # nested state, or an optimizer-level entry
                split = split_param_key(keys[i][len(st) :], known, longest)
                is_opt[i] = 1  # (an optimizer-level entry, MADGRAD's state.k, is kept as is)
                if split is not None:
                    optim.state_idx[split[0]] = [*optim.state_idx.get(split[0], ()), i]
        optim.finish_parsing()

    def output(self) -> dict[str, Any]:
        keys, values = self.keys, self.values
        n = len(keys)
        alive = bytearray(b"\x01") * n
        replaced: dict[int, Any] = {}
        items: list[tuple[Anchor, str, Any]] = []
        for model in self.models.values():
            for i in model.dead:
                alive[i] = 0
            items += model.new_items()
        for optim in self.optims:
            for indices in optim.dead:
                first, last = indices[0], indices[-1]
                if last - first + 1 == len(indices):  # one run (the usual case)
                    alive[first : last + 1] = bytes(len(indices))
                else:
                    for i in indices:
                        alive[i] = 0
            new = optim.new_items()
            optim.renamed_lists(replaced, new)
            items += new
        if not items and alive.count(0) == 0 and not replaced:
            return dict(zip(keys, values, strict=True))
        items.sort(key=lambda item: item[0])
        out: dict[str, Any] = {}
        start = 0
        for anchor, key, value in items:
            end = anchor[0]
            if end > start:
                out.update(_kept(keys, values, alive, start, end))
                start = end
            out[key] = value
        if start < n:
            out.update(_kept(keys, values, alive, start, n))
        for i, value in replaced.items():
            out[keys[i]] = value
        if len(out) != n - alive.count(0) + len(items):
            clash = _first_clash(out, keys, alive, items)
            raise ConversionError(
                f"the converted key {clash!r} is also a key of the state dict; a state dict "
                "holds one value per key",
                keys=(clash,),
            )
        return out


def _rows_into(index: dict[str, Sequence[int]], fqns: list[str], at: int, k: int) -> int:
    """``index[fqn] = range(...)``: rows of ``k`` keys from position ``at``; the end."""
    stop = at + len(fqns) * k
    index.update(zip(fqns, map(range, range(at, stop, k), range(at + k, stop + k, k)), strict=True))
    return stop


def _read_table(optim: FlatOptim, keys: list[str]) -> bool:
    """Index an optimizer alone laid out as torch writes it, by rows; ``False``: it is not.

    Torch's layout: every ``state.*`` key before the first ``param_groups.*`` key, each
    parameter's keys one row after another, every row of a block the same names
    (:func:`~dsdmerge._table.read_rows` checks all of this in C-level passes). Then a
    parameter's keys are a range of positions, and no key is split on its own.
    """
    # the first param_groups.* key (a scan that stops there); read_rows then checks that
    # every key before it is a state row and every key from it on a param_groups row
    first = next(compress(count(), map(methodcaller("startswith", PG_PREFIX), keys)), None)
    if first is None:
        return False
    groups = read_rows(keys[first:], PG_PREFIX)
    if groups is None:
        return False
    state = read_rows(keys[:first], STATE_PREFIX) if first else ([], [])
    if state is None:
        return False
    at = first
    fqns, blocks = groups
    for start, end, names in blocks:
        stop = _rows_into(optim.pg_idx, fqns[start:end], at, len(names))
        skip = names.index(PARAM_NAMES) if PARAM_NAMES in names else -1
        named = (tuple(n for n in names if n != PARAM_NAMES), skip)
        optim.names.update(dict.fromkeys(fqns[start:end], named))
        if skip >= 0:
            optim.names_at += range(at + skip, stop, len(names))
        at = stop
    at = 0
    fqns, blocks = state
    for start, end, names in blocks:
        stop = _rows_into(optim.state_idx, fqns[start:end], at, len(names))
        optim.suffixes.update(dict.fromkeys(fqns[start:end], tuple("." + n for n in names)))
        at = stop
    if not all(map(optim.pg_idx.__contains__, state[0])):
        for index in (optim.pg_idx, optim.state_idx, optim.names, optim.suffixes):
            index.clear()
        optim.names_at.clear()
        return False
    optim.finish_parsing()
    return True


def _kept(
    keys: list[str], values: list[Any], alive: bytearray, start: int, end: int
) -> Iterable[tuple[str, Any]]:
    """The items ``start..end`` of a flat dict that stay (C-level passes)."""
    kept = alive[start:end]
    return zip(compress(keys[start:end], kept), compress(values[start:end], kept))  # noqa: B905


def _first_clash(
    out: Mapping[str, Any], keys: list[str], alive: bytearray, items: list[tuple[Anchor, str, Any]]
) -> str:
    kept = set(compress(keys, alive))
    for _, key, _ in items:
        if key in kept:
            return key
        kept.add(key)
    return next(iter(out), "")


class Tree:
    """A mapping holding mappings: its children converted, its leaves shared."""

    def __init__(self, items: list[tuple[Any, Any, bool]]) -> None:
        self.items = items  # (key, child node or leaf, whether it is a node)

    def output(self) -> dict[Any, Any]:
        return {k: (v.output() if node else v) for k, v, node in self.items}


class Leafy:
    """A mapping of leaves under keys that are not all str: nothing in it is an fqn."""

    def __init__(self, mapping: Mapping[Any, Any]) -> None:
        self.mapping = mapping

    def output(self) -> dict[Any, Any]:
        return dict(self.mapping)


class OptimNode:
    def __init__(self, part: NestedOptim) -> None:
        self.part = part

    def output(self) -> dict[Any, Any]:
        return self.part.output()
