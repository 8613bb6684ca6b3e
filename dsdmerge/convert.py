"""Layout conversions that carry the optimizer state: fuse, split, stack, unstack, transpose.

Model code changes its tensor layout more often than its math: q/k/v fused into one
``qkv_proj``, per-expert MoE weights stacked into one 3-D parameter, a weight stored
transposed. :func:`convert` applies conversion records (:class:`Fuse`, :class:`Split`,
:class:`Stack`, :class:`Unstack`, :class:`Transpose`, or a preset of
:data:`CONVERSION_PRESETS`) to the parameters' tensors *and* to everything the
optimizer keeps about them, so that training continues where it stopped. The rule:

* Rules apply in order, each to the result of the one before; a rule whose sources
  match no fqn anywhere in the state dict is an error, and so is a match that finds
  only some of a rule's sources (the parts of a fuse, the experts ``0..n-1`` of a stack).
* It applies to every part of the state dict that names parameters: model state
  dicts (``{fqn: tensor}``, nested or under a flattened checkpoint's prefix), optimizer
  state dicts nested and keyed by fqn (``get_optimizer_state_dict``), keyed by int id
  with the ``param_names`` torch >= 2.6 stores in each group (``optimizer.state_dict()``
  of an optimizer built from named parameters), or flattened by DSD
  (``state.<fqn>.<name>``, ``param_groups.<fqn>.<hyperparameter>``), and whole
  checkpoints holding those, nested or flattened with dots.
* Optimizer state: see :mod:`dsdmerge._convert_ops` (param-shaped tensors convert by
  the same operation, scalars must agree and are copied, anything else raises, or
  with ``nonelementwise="reset"`` leaves the target fresh, with a warning naming it).
* Param groups: the sources of a fuse or stack must hold equal hyperparameters; the
  target takes them and the first source's place (in its group's ``params``, in
  ``state``, and among a flat dict's keys); split targets take the source's values and
  place, in order. ``param_names`` lists follow. Int ids are renumbered in group
  order, as torch numbers them.
* Converting the state of an optimizer known not to be elementwise warns once (its
  moments convert, but the dynamics of a fused tensor differ from its parts').

Everything else is left as it is, and shared by identity. Nothing is modified; an
error leaves nothing half-done.
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable, Iterable, Mapping, Sequence
from itertools import compress
from operator import itemgetter, methodcaller, ne
from typing import Any, Literal

import torch

from dsdmerge import _convert_ops as ops
from dsdmerge._conversions import (
    CONVERSION_PRESETS,
    Conversion,
    Fuse,
    Split,
    Stack,
    Transpose,
    Unstack,
    expand,
)
from dsdmerge._gc import gc_paused
from dsdmerge._records import TensorMeta
from dsdmerge._table import read_rows
from dsdmerge._templates import Template
from dsdmerge._values import short_repr
from dsdmerge.errors import (
    ConversionError,
    DSDMergeError,
    DSDMergeWarning,
    LayoutError,
    StateDictTypeError,
)
from dsdmerge.flatten import split_param_key
from dsdmerge.layout import (
    PARAM_GROUPS,
    PARAMS,
    PG_PREFIX,
    STATE,
    STATE_PREFIX,
    check_not_mixed,
    is_optimizer_state_dict,
    require_mapping,
)
from dsdmerge.rename import copy_tree, optimizer_prefixes

__all__ = [
    "CONVERSION_PRESETS",
    "NONELEMENTWISE_OPTIMIZERS",
    "ConversionError",
    "Fuse",
    "Split",
    "Stack",
    "Transpose",
    "Unstack",
    "convert",
]

Nonelementwise = Literal["raise", "reset"]
_first = itemgetter(0)
_second = itemgetter(1)
PARAM_NAMES = "param_names"
Anchor = tuple[int, ...]
"""Where a converted entry goes: the position of the original entry it descends from,
then its index among the parts it was split into (sorted as tuples)."""

# --------------------------------------------------------------------------------------
# optimizers that are not elementwise


NONELEMENTWISE_OPTIMIZERS: tuple[tuple[str, frozenset[str], str], ...] = (
    (
        "torch.optim.Adafactor",
        frozenset({"beta2_decay", "d"}),
        "factored second moments (one row and one column per matrix) and updates clipped "
        "by their own RMS",
    ),
    (
        "Muon (torch.optim.Muon, pytorch_optimizer.Muon)",
        frozenset({"ns_steps"}),
        "a Newton-Schulz orthogonalisation of each matrix's update, and a learning rate "
        "scaled by its shape",
    ),
    ("heavyball.Muon", frozenset({"heavyball_momentum"}), "orthogonalised updates per matrix"),
    (
        "torch.optim.LBFGS",
        frozenset({"history_size", "line_search_fn"}),
        "curvature pairs over all parameters flattened into one vector",
    ),
    (
        "pytorch_optimizer.Lamb",
        frozenset({"adam", "grad_averaging"}),
        "a trust ratio (weight norm over update norm) per tensor",
    ),
    (
        "pytorch_optimizer.NovoGrad",
        frozenset({"grad_averaging"}),
        "one second moment per tensor (layer-wise)",
    ),
    ("pytorch_optimizer.LARS", frozenset({"trust_coefficient"}), "a trust ratio per tensor"),
    (
        "pytorch_optimizer.AdamP / SGDP",
        frozenset({"wd_ratio", "delta"}),
        "a projection decided by each tensor's cosine similarity with its gradient",
    ),
    (
        "pytorch_optimizer.AdaFactor / CAME",
        frozenset({"eps1", "eps2"}),
        "factored second moments (one row and one column per matrix)",
    ),
    (
        "transformers.optimization.Adafactor",
        frozenset({"clip_threshold", "decay_rate", "scale_parameter"}),
        "factored second moments, and updates scaled by each tensor's RMS",
    ),
    (
        "pytorch_optimizer.Shampoo",
        frozenset({"matrix_eps"}),
        "preconditioner matrices per dimension of each tensor",
    ),
    (
        "pytorch_optimizer.ScalableShampoo",
        frozenset({"moving_average_for_momentum"}),
        "preconditioner matrices per dimension of each tensor",
    ),
    (
        "SOAP (pytorch_optimizer.SOAP, heavyball.SOAP)",
        frozenset({"shampoo_beta"}),
        "an eigenbasis preconditioner per dimension of each tensor",
    ),
    (
        "PSGD Kron (pytorch_optimizer.Kron, heavyball.PSGDKron)",
        frozenset({"max_size_triangular"}),
        "Kronecker-factored preconditioners per tensor",
    ),
)
"""Optimizers known not to be elementwise: ``(class, hyperparameter names, what differs)``.

A state dict does not name its optimizer's class: an optimizer is recognised when
one of its param groups holds all the hyperparameter names listed (the first entry
that fits wins). Their moments convert like any other param-shaped state, but a
converted tensor's updates are not its parts' updates put together, so
:func:`convert` warns once when it converts their state.
"""


def nonelementwise_kind(names: Iterable[str]) -> tuple[str, str] | None:
    """``(class, what differs)`` of the known non-elementwise optimizer these names fit."""
    have = set(names)
    for cls, marks, what in NONELEMENTWISE_OPTIMIZERS:
        if marks <= have:
            return cls, what
    return None


# --------------------------------------------------------------------------------------
# rules: matching, planning


class _Rule:
    """One record, compiled: how it is spelled in messages, what it does."""

    def __init__(self, record: Conversion, preset: str | None) -> None:
        self.record = record
        self.text = f"rule {record!r}" + (f" (preset {preset!r})" if preset else "")
        if isinstance(record, Fuse):
            self.mode, self.op = "combine", "fuse"
            self.sources: tuple[Template, ...] = record._sources
        elif isinstance(record, Stack):
            self.mode, self.op = "combine", "stack"
            self.sources = (record._source,)
        elif isinstance(record, Split):
            self.mode, self.op = "divide", "split"
            self.sources = (record._source,)
        elif isinstance(record, Unstack):
            self.mode, self.op = "divide", "unstack"
            self.sources = (record._source,)
        else:
            self.mode, self.op = "same", "transpose"
            self.sources = (record._key,)
        self.dim = getattr(record, "dim", 0)

    def context(self, spell: Any, nonelementwise: str) -> ops.Context:
        return ops.Context(self.record, self.text, spell, nonelementwise)

    def error(self, text: str, keys: Sequence[str] = ()) -> ConversionError:
        return ConversionError(f"{self.text}: {text}", rule=self.record, keys=tuple(keys))


class _Instance:
    """One match of a rule: its source fqns and (for all but an unstack) its target fqns."""

    __slots__ = ("binding", "sources", "targets")

    def __init__(self, sources: list[str], targets: list[str], binding: dict[str, str]) -> None:
        self.sources = sources
        self.targets = targets
        self.binding = binding


def _plan(rule: _Rule, fqns: list[str]) -> list[_Instance]:
    """The instances of ``rule`` among ``fqns`` (unstack targets are filled in later)."""
    record = rule.record
    if isinstance(record, Fuse):
        groups: dict[tuple[str, ...], list[str | None]] = {}
        where: dict[str, int] = {}
        k = len(record._sources)
        names = record._target.names  # each match keyed by its values in this order
        for i, source in enumerate(record._sources):
            order = [source.names.index(n) for n in names]
            for fqn, values in source.matches(fqns):
                if fqn in where:
                    raise rule.error(
                        f"{fqn} matches two of its sources ({record.sources[where[fqn]]!r} and "
                        f"{record.sources[i]!r}); make the templates more specific",
                        [fqn],
                    )
                where[fqn] = i
                key = tuple(map(values.__getitem__, order))
                found = groups.get(key)
                if found is None:
                    found = groups[key] = [None] * k
                found[i] = fqn
        out = []
        for key, found in groups.items():
            binding = dict(zip(names, key, strict=True))
            if None in found:
                have = [f for f in found if f is not None]
                lack = [
                    t.fill(binding)
                    for t, f in zip(record._sources, found, strict=True)
                    if f is None
                ]
                raise rule.error(
                    f"found {', '.join(have)} but not {', '.join(lack)}; a fuse needs every "
                    "one of its sources",
                    [*have, *lack],
                )
            out.append(_Instance(list(found), [record._target.fill(binding)], binding))  # type: ignore[arg-type]
        return out
    if isinstance(record, Stack):
        parts: dict[tuple[str, ...], dict[str, str]] = {}
        names = record._source.names
        at = names.index(record.over)
        others = names[:at] + names[at + 1 :]
        for fqn, values in record._source.matches(fqns):
            key = values[:at] + values[at + 1 :]
            by_index = parts.get(key)
            if by_index is None:
                by_index = parts[key] = {}
            by_index[values[at]] = fqn
        out = []
        for key, by_index in parts.items():
            binding = dict(zip(others, key, strict=True))
            bad: list[str] = []
            if not (all(map(str.isdecimal, by_index)) and all(map(str.isascii, by_index))) or any(
                i[0] == "0" and len(i) > 1 for i in by_index
            ):
                bad = sorted(
                    i for i in by_index if not (i.isdecimal() and i.isascii() and str(int(i)) == i)
                )
            if bad:
                raise rule.error(
                    f"{by_index[bad[0]]} has {record.over}={bad[0]!r}, not an index "
                    f"(0, 1, ...); the parts of a stack are numbered from 0",
                    [by_index[b] for b in bad],
                )
            numbers = sorted(map(int, by_index))  # distinct: every index is spelled one way
            if numbers[-1] != len(numbers) - 1:
                missing = sorted(set(range(numbers[-1] + 1)) - set(numbers))
                absent = [record._source.fill({**binding, record.over: str(m)}) for m in missing]
                raise rule.error(
                    f"{record.over} runs over {len(numbers)} indices up to {numbers[-1]} but "
                    f"{', '.join(absent[:5])}{' and more' if len(absent) > 5 else ''} "
                    f"{'is' if len(absent) == 1 else 'are'} missing; a stack needs the parts "
                    "0..n-1, every one",
                    absent,
                )
            sources = list(map(by_index.__getitem__, map(str, numbers)))
            out.append(_Instance(sources, [record._target.fill(binding)], binding))
        return out
    source = rule.sources[0]
    out = []
    for fqn, values in source.matches(fqns):
        binding = dict(zip(source.names, values, strict=True))
        if isinstance(record, Split):
            targets = [t.fill(binding) for t in record._targets]
        elif isinstance(record, Transpose):
            targets = [fqn]
        else:
            targets = []  # an unstack: once the number of parts is known
        out.append(_Instance([fqn], targets, binding))
    return out


def _unstack_targets(rule: _Rule, instance: _Instance, n: int) -> list[str]:
    record = rule.record
    assert isinstance(record, Unstack)
    return [record._target.fill({**instance.binding, record.over: str(i)}) for i in range(n)]


# --------------------------------------------------------------------------------------
# the parts of a state dict that name parameters


class _ModelPart:
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


class _Hyper:
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
    def of(cls, key: object, names: tuple[str, ...], values: tuple[Any, ...]) -> _Hyper:
        """One whose ``names`` are known to lack ``param_names``."""
        out = cls.__new__(cls)
        out.key, out.names, out.values = key, names, values
        return out


def _spell_suffix(path: Hashable) -> str:
    return str(path)[1:]


def _spell_path(path: Hashable) -> str:
    return ".".join(map(str, path)) if isinstance(path, tuple) else str(path)


class _FlatOptim:
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

    def hyper_of(self, fqn: str) -> _Hyper | None:
        new = self.pg_new.get(fqn)
        if new is not None:
            rows = new[1]
            return _Hyper(None, tuple(str(k)[1:] for k, _ in rows), tuple(map(_second, rows)))
        indices = self.pg_idx.get(fqn)
        if indices is None:
            return None
        named = self.names.get(fqn)
        if named is not None:  # read as a table: the block's names (param_names left out)
            names, skip = named
            values = tuple(self.values[indices[0] : indices[-1] + 1])
            if skip >= 0:
                values = values[:skip] + values[skip + 1 :]
            return _Hyper.of(None, names, values)
        cut = itemgetter(slice(len(self.pg) + len(fqn) + 1, None))  # hyperparameter names
        first, last = indices[0], indices[-1]
        if last - first + 1 == len(indices):  # one run of keys: C-level slices
            keys = self.keys[first : last + 1]
            return _Hyper(None, tuple(map(cut, keys)), tuple(self.values[first : last + 1]))
        return _Hyper(
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


class _Group:
    """One nested param group: its items, its members (by anchor) and their names."""

    def __init__(self, original: Mapping[str, Any]) -> None:
        self.original = original
        self.items: list[tuple[str, Any]] = [
            (k, v) for k, v in original.items() if k not in (PARAMS, PARAM_NAMES)
        ]
        self.members: dict[str, Anchor] = {}
        self.names: dict[str, str] | None = None
        self.hyper: _Hyper | None = None


class _NestedOptim:
    """A nested optimizer state dict, keyed by fqn or by int id with ``param_names``."""

    spell = staticmethod(_spell_path)

    def __init__(self, osd: Mapping[Any, Any], where: str) -> None:
        check_not_mixed(osd, where)
        self.osd = osd
        self.where = where
        state, groups = osd[STATE], osd[PARAM_GROUPS]
        if not isinstance(state, Mapping):
            raise LayoutError(f"{where or 'the optimizer'}['state'] must be a mapping")
        self.groups = [_Group(self._group(g, i)) for i, g in enumerate(groups)]
        for i, group in enumerate(self.groups):
            items = group.items
            group.hyper = _Hyper(i, tuple(map(_first, items)), tuple(map(_second, items)))
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

    def hyper_of(self, fqn: str) -> _Hyper | None:
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


class _FlatNode:
    """A flat mapping with str keys: its model keys and its DSD-flattened optimizers."""

    def __init__(self, flat: Mapping[str, Any]) -> None:
        keys = list(flat)
        values = list(flat.values())
        self.keys, self.values = keys, values
        self.optims: list[_FlatOptim] = []
        self.models: dict[str, _ModelPart] = {}
        sections = bytes(map(methodcaller("startswith", (STATE_PREFIX, PG_PREFIX)), keys))
        if keys and 0 not in sections and any(map(methodcaller("startswith", PG_PREFIX), keys)):
            prefixes = [""]  # an optimizer alone (DSD's flattened form): the common case
        elif any(map(methodcaller("__contains__", PG_PREFIX), keys)):
            prefixes = optimizer_prefixes(keys)
        else:
            prefixes = []
        if not prefixes:  # a model state dict (or any flat dict): every key is an fqn
            if keys:
                self.models[""] = _ModelPart("", keys, values, range(len(keys)))
            return
        if prefixes == [""] and 0 not in sections:
            optim = _FlatOptim("", keys, values)
            if _read_table(optim, keys):
                self.optims.append(optim)
                return
        depth = prefixes[0].count(".")
        is_opt = bytearray(len(keys))
        heads = list(map(_first, map(methodcaller("rpartition", "."), keys)))
        # runs of keys with one head (``state.<fqn>``, ``param_groups.<fqn>``): a parameter's
        # keys stand together in torch's layout, so there are about two runs per parameter
        starts = [0, *compress(range(1, len(keys)), map(ne, heads[1:], heads))]
        runs = list(zip(starts, [*starts[1:], len(keys)], strict=True))
        for p in prefixes:
            optim = _FlatOptim(p, keys, values)
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
            self.models[before] = _ModelPart(before, fqns, vals, indices)

    def _parse_optimizer(
        self, optim: _FlatOptim, is_opt: bytearray, heads: list[str], runs: list[tuple[int, int]]
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


def _read_table(optim: _FlatOptim, keys: list[str]) -> bool:
    """Index an optimizer alone laid out as torch writes it, by rows; ``False``: it is not.

    Torch's layout: every ``state.*`` key before the first ``param_groups.*`` key, each
    parameter's keys one row after another, every row of a block the same names
    (:func:`~dsdmerge._table.read_rows` checks all of this in C-level passes). Then a
    parameter's keys are a range of positions, and no key is split on its own.
    """
    is_pg = bytes(map(methodcaller("startswith", PG_PREFIX), keys))
    first = is_pg.find(1)
    if first < 0 or 0 in is_pg[first:]:
        return False
    groups = read_rows(keys[first:], PG_PREFIX)
    state = read_rows(keys[:first], STATE_PREFIX) if first else ([], [])
    if groups is None or state is None:
        return False
    at = first
    fqns, blocks = groups
    for start, end, names in blocks:
        k = len(names)
        skip = names.index(PARAM_NAMES) if PARAM_NAMES in names else -1
        named = (tuple(n for n in names if n != PARAM_NAMES), skip)
        for fqn in fqns[start:end]:
            optim.pg_idx[fqn] = range(at, at + k)
            optim.names[fqn] = named
            at += k
        if skip >= 0:
            optim.names_at += range(at - (end - start) * k + skip, at, k)
    at = 0
    fqns, blocks = state
    for start, end, names in blocks:
        k = len(names)
        suffixes = tuple("." + n for n in names)
        for fqn in fqns[start:end]:
            optim.state_idx[fqn] = range(at, at + k)
            optim.suffixes[fqn] = suffixes
            at += k
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


class _Tree:
    """A mapping holding mappings: its children converted, its leaves shared."""

    def __init__(self, items: list[tuple[Any, Any, bool]]) -> None:
        self.items = items  # (key, child node or leaf, whether it is a node)

    def output(self) -> dict[Any, Any]:
        return {k: (v.output() if node else v) for k, v, node in self.items}


class _Leafy:
    """A mapping of leaves under keys that are not all str: nothing in it is an fqn."""

    def __init__(self, mapping: Mapping[Any, Any]) -> None:
        self.mapping = mapping

    def output(self) -> dict[Any, Any]:
        return dict(self.mapping)


class _OptimNode:
    def __init__(self, part: _NestedOptim) -> None:
        self.part = part

    def output(self) -> dict[Any, Any]:
        return self.part.output()


# --------------------------------------------------------------------------------------
# the job


class _Job:
    def __init__(self, rules: list[tuple[Conversion, str | None]], nonelementwise: str) -> None:
        self.rules = [_Rule(r, p) for r, p in rules]
        self.nonelementwise = nonelementwise
        self.models: list[_ModelPart] = []
        self.optims: list[_FlatOptim | _NestedOptim] = []
        self.resets: list[str] = []
        self.converted: list[_FlatOptim | _NestedOptim] = []
        self.example: str | None = None

    # -- reading the state dict

    def build(self, root: Mapping[Any, Any]) -> Any:
        node = self._node(root, "")
        if node is not None:
            return node
        on_path = {id(root)}
        top: list[tuple[Any, Any, bool]] = []
        stack: list[tuple[Any, list[tuple[Any, Any, bool]], str, Mapping[Any, Any]]] = [
            (iter(root.items()), top, "", root)
        ]
        while stack:
            items, dest, prefix, mapping = stack[-1]
            for k, v in items:
                if not isinstance(v, Mapping):
                    dest.append((k, v, False))
                    continue
                path = f"{prefix}{k}"
                if id(v) in on_path:
                    raise LayoutError(f"cycle: the mapping at {path!r} contains itself")
                child = self._node(v, path)
                if child is not None:
                    dest.append((k, child, True))
                    continue
                inner: list[tuple[Any, Any, bool]] = []
                dest.append((k, _Tree(inner), True))
                on_path.add(id(v))
                stack.append((iter(v.items()), inner, path + ".", v))
                break
            else:
                stack.pop()
                on_path.discard(id(mapping))
        return _Tree(top)

    def _node(self, node: Mapping[Any, Any], path: str) -> Any:
        if is_optimizer_state_dict(node):
            part = _NestedOptim(node, path)
            self.optims.append(part)
            return _OptimNode(part)
        types = set(map(type, node.values()))
        if any(issubclass(tp, Mapping) for tp in types):
            return None
        if not set(map(type, node)) <= {str}:
            return _Leafy(node)
        flat = _FlatNode(node)
        self.models += flat.models.values()
        self.optims += flat.optims
        return flat

    # -- applying the rules

    def shape(self, fqn: str) -> tuple[int, ...] | None:
        """The parameter's shape as the model parts say it (``None``: unknown, or they differ)."""
        if len(self.models) == 1:
            return self.models[0].shape(fqn)
        shapes = {s for s in (m.shape(fqn) for m in self.models) if s is not None}
        return next(iter(shapes)) if len(shapes) == 1 else None

    def run(self) -> None:
        for rule in self.rules:
            plans = []
            for part in [*self.models, *self.optims]:
                fqns = part.fqns()
                if self.example is None and fqns:
                    self.example = fqns[0]
                instances = _plan(rule, fqns)
                if instances:
                    plans.append((part, fqns, instances))
            if not plans:
                seen = (
                    f"; fqns look like {self.example!r}"
                    if self.example is not None
                    else "; the state dict names no parameters"
                )
                raise rule.error(f"its sources match no parameter{seen}")
            shapes = {  # the sources' shapes, as the model parts say them before this rule
                s: self.shape(s)
                for part, _, instances in (plans if self.models else ())
                if not isinstance(part, _ModelPart)
                for inst in instances
                for s in inst.sources
            }
            for part, fqns, instances in plans:
                if isinstance(part, _ModelPart):
                    self._model(rule, part, fqns, instances)
            for part, fqns, instances in plans:
                if not isinstance(part, _ModelPart):
                    self._optim(rule, part, fqns, instances, shapes)

    def _check_targets(self, rule: _Rule, fqns: list[str], instances: list[_Instance]) -> None:
        sources = {s for inst in instances for s in inst.sources}
        taken = set(fqns) - sources
        made: set[str] = set()
        for inst in instances:
            for t in inst.targets:
                if t in taken or t in made:
                    raise rule.error(
                        f"its target {t} {'already exists' if t in taken else 'is made twice'}; "
                        "a state dict holds one value per key. Drop or rename it first.",
                        [t],
                    )
                made.add(t)

    def _model(
        self, rule: _Rule, part: _ModelPart, fqns: list[str], instances: list[_Instance]
    ) -> None:
        ctx = rule.context(str, self.nonelementwise)
        changes = []
        for inst in instances:
            values = [part.values[s] for s in inst.sources]
            keys = [part.before + s for s in inst.sources]
            if rule.mode == "combine":
                new = [ops.combine(rule.op, rule.dim, values, ctx, keys)]
            elif rule.mode == "same":
                record = rule.record
                assert isinstance(record, Transpose)
                new = [ops.transpose(record.dims, values[0], ctx, keys[0])]
            else:
                new = self._divide_value(rule, inst, values[0], ctx, keys[0])
            changes.append((inst.sources, inst.targets, new))
        self._check_targets(rule, fqns, instances)
        part.commit(changes)

    def _divide_value(
        self, rule: _Rule, inst: _Instance, value: Any, ctx: ops.Context, key: str
    ) -> list[Any]:
        size = ops.size_along(value, rule.dim, ctx, key)
        if rule.op == "split":
            record = rule.record
            assert isinstance(record, Split)
            parts = ops.split_sizes(size, len(record.targets), record.sizes, ctx, key)
            return ops.divide("split", rule.dim, value, parts, ctx, key)
        if not size:
            raise ctx.error(
                f"{key} has size 0 along dimension {rule.dim}: nothing to unstack", [key]
            )
        if not inst.targets:
            inst.targets = _unstack_targets(rule, inst, size)
        return ops.divide("unstack", rule.dim, value, [], ctx, key)

    def _optim(
        self,
        rule: _Rule,
        part: _FlatOptim | _NestedOptim,
        fqns: list[str],
        instances: list[_Instance],
        shapes: Mapping[str, tuple[int, ...] | None],
    ) -> None:
        ctx = rule.context(part.spell, self.nonelementwise)
        changes = []
        converted = False
        for inst in instances:
            states = [part.state_of(s) for s in inst.sources]
            source_shapes = [shapes.get(s) for s in inst.sources]
            if rule.mode == "combine":
                self._check_hyper(rule, part, inst.sources)
                new = ops.combine_state(rule.op, rule.dim, states, source_shapes, ctx, inst.sources)
                results: list[ops.Fields | None] | Any = new if new is ops.RESET else [new]
            elif rule.mode == "same":
                record = rule.record
                assert isinstance(record, Transpose)
                new = ops.transpose_state(
                    record.dims, states[0], source_shapes[0], ctx, inst.sources[0]
                )
                results = new if new is ops.RESET else [new]
            else:
                results = self._divide_state(rule, inst, states[0], source_shapes[0], ctx)
            if results is ops.RESET:
                self.resets.append(ctx.reset_reason)
                results = [None] * len(inst.targets)
            elif any(r is not None for r in results):
                converted = True
            changes.append((rule.mode, inst.sources, inst.targets, results))
        self._check_targets(rule, fqns, instances)
        part.commit(changes)
        if converted and part not in self.converted:
            self.converted.append(part)

    def _divide_state(
        self,
        rule: _Rule,
        inst: _Instance,
        state: ops.Fields | None,
        shape: tuple[int, ...] | None,
        ctx: ops.Context,
    ) -> Any:
        key = inst.sources[0]
        size: int | None = None
        if shape is not None:
            if not -len(shape) <= rule.dim < len(shape):
                raise ctx.error(f"{key} of shape {list(shape)} has no dimension {rule.dim}", [key])
            size = shape[rule.dim]
        elif state is not None:
            inferred = ops.infer_shape(state)
            if inferred is not None and -len(inferred) <= rule.dim < len(inferred):
                size = inferred[rule.dim]
        if rule.op == "unstack" and not inst.targets:
            if size is None:
                raise ctx.error(
                    f"how many parts {key} unstacks into cannot be told: no model state dict "
                    "beside the optimizer's says its shape, and it has no optimizer state "
                    "shaped like it. Convert the whole checkpoint (model and optimizer) at once.",
                    [key],
                )
            inst.targets = _unstack_targets(rule, inst, size)
        n = len(inst.targets)
        parts = None
        if rule.op == "split" and state is not None and size is not None:
            record = rule.record
            assert isinstance(record, Split)
            parts = ops.split_sizes(size, n, record.sizes, ctx, key)
        elif rule.op == "split" and state is not None:
            parts = None  # resolved per tensor below (equal parts or the given sizes)
        if rule.op == "split" and state is not None and parts is None:
            record = rule.record
            assert isinstance(record, Split)
            inferred = ops.infer_shape(state)
            if inferred is not None and -len(inferred) <= rule.dim < len(inferred):
                parts = ops.split_sizes(inferred[rule.dim], n, record.sizes, ctx, key)
        return ops.divide_state(
            "split" if rule.op == "split" else "unstack", rule.dim, state, shape, parts, ctx, key, n
        )

    def _check_hyper(
        self, rule: _Rule, part: _FlatOptim | _NestedOptim, sources: list[str]
    ) -> None:
        hypers = [part.hyper_of(s) for s in sources]
        have = [h is not None for h in hypers]
        if not any(have):
            return
        if not all(have):
            listed = [s for s, h in zip(sources, have, strict=True) if h]
            unlisted = [s for s, h in zip(sources, have, strict=True) if not h]
            raise rule.error(
                f"{', '.join(listed)} {'is' if len(listed) == 1 else 'are'} in a param group but "
                f"{', '.join(unlisted)} {'is' if len(unlisted) == 1 else 'are'} in none; the "
                "parts of a fused parameter need one group's hyperparameters",
                [*listed, *unlisted],
            )
        first = hypers[0]
        assert first is not None
        plain = all(map(_is_plain, first.values))  # == on these is a bool, never a tensor
        for source, hyper in zip(sources[1:], hypers[1:], strict=True):
            assert hyper is not None
            if hyper.key is not None and hyper.key == first.key:
                continue
            if plain and hyper.names == first.names and hyper.values == first.values:
                continue  # (== on plain values; anything else by the comparison below)
            want = dict(zip(first.names, first.values, strict=True))
            got = dict(zip(hyper.names, hyper.values, strict=True))
            for name in [*want, *(k for k in got if k not in want)]:
                a, b = want.get(name, _ABSENT), got.get(name, _ABSENT)
                if a is _ABSENT or b is _ABSENT or not ops.same_scalar(a, b):
                    raise rule.error(
                        f"the parts' hyperparameter {name!r} differs ({sources[0]}: "
                        f"{_shown(a)}, {source}: {_shown(b)}); a fused parameter has one value "
                        "per hyperparameter. Put the parts in one param group (equal "
                        "hyperparameters) before converting.",
                        [sources[0], source],
                    )

    # -- after the rules

    def warn(self, stacklevel: int) -> None:
        if self.resets:
            shown = "; ".join(self.resets[:5])
            more = f"; and {len(self.resets) - 5} more" if len(self.resets) > 5 else ""
            warnings.warn(
                DSDMergeWarning(
                    f"dsdmerge: convert gave {len(self.resets)} converted parameter(s) fresh "
                    f"optimizer state (nonelementwise='reset'), as their state cannot be "
                    f"converted elementwise: {shown}{more}"
                ),
                stacklevel=stacklevel,
            )
        kinds: dict[str, str] = {}
        for part in self.converted:
            found = nonelementwise_kind(part.group_names())
            if found is not None:
                kinds.setdefault(*found)
        if kinds:
            shown = "; ".join(f"{cls}: {what}" for cls, what in kinds.items())
            warnings.warn(
                DSDMergeWarning(
                    f"dsdmerge: converted the optimizer state of an optimizer that is not "
                    f"elementwise ({shown}). Its moments convert, but a converted tensor's "
                    "updates differ from the updates its parts would have had: training goes "
                    "on from the converted state, not exactly as before the conversion."
                ),
                stacklevel=stacklevel,
            )


_ABSENT: Any = object()
_PLAIN = frozenset({float, int, bool, str, type(None)})
_LEAF_TYPES = frozenset({torch.Tensor, torch.nn.Parameter, *_PLAIN, tuple, list, set})


def _is_plain(value: Any) -> bool:
    """A value whose ``==`` is a bool: a plain scalar, or a tuple of them (``betas``)."""
    tp = type(value)
    return tp in _PLAIN or (tp is tuple and all(type(v) in _PLAIN for v in value))


_INVERT = bytes.maketrans(b"\x00\x01", b"\x01\x00")


def _shown(value: Any) -> str:
    return "absent" if value is _ABSENT else short_repr(value)


# --------------------------------------------------------------------------------------
# the public function


Conversions = Sequence[Conversion | str] | Conversion | str
"""What ``convert=`` takes: conversion records and preset names, in order (or one of them)."""


def convert(
    state_dict: Mapping[Any, Any],
    conversions: Conversions,
    /,
    *,
    nonelementwise: Nonelementwise = "raise",
) -> dict[Any, Any]:
    """Apply layout conversions to a state dict, optimizer state included.

    Each rule (:class:`Fuse`, :class:`Split`, :class:`Stack`, :class:`Unstack`,
    :class:`Transpose`, or the name of a preset in :data:`CONVERSION_PRESETS`) applies
    in order to every place the state dict names parameters: model state dicts,
    optimizer state dicts (nested by fqn, by int id with ``param_names``, or DSD
    flattened) and whole checkpoints holding those. Optimizer state shaped like a
    parameter converts by the parameter's operation; scalars (``step``) must agree
    across the parts and are copied to split parts; the parts of a fuse or stack must
    share their hyperparameters, and the result takes the first part's place. For an
    elementwise optimizer (Adam, AdamW, SGD, RMSprop, Adagrad, Lion, ...) with equal
    hyperparameters, training then continues exactly as it would have without the
    conversion. Converting the state of an optimizer known not to be elementwise
    (:data:`NONELEMENTWISE_OPTIMIZERS`) warns once.

    Does not modify its input; every leaf it does not convert is shared by identity,
    and every converted tensor is a new contiguous tensor.

    Args:
        state_dict: A model or optimizer state dict, or a whole checkpoint.
        conversions: A list of conversion records and preset names (or one of them).
        nonelementwise: What to do about optimizer state that is neither shaped like its
            parameter nor a scalar (Adafactor's factored moments, Shampoo's
            preconditioners): ``"raise"`` a :class:`ConversionError`, or ``"reset"``:
            leave the converted parameter without state (fresh, as a new optimizer has
            it) and warn (:class:`~dsdmerge.DSDMergeWarning`) naming it.

    Returns:
        A new state dict, in the input's layout, with the parameters converted.

    Raises:
        ConversionError: A rule matches nothing, finds only some of its parts, cannot
            combine their tensors (shapes, dtypes, devices), or meets optimizer state or
            hyperparameters it cannot carry over (naming the rule and the keys).
        LayoutError: The state dict is malformed.
        StateDictTypeError: It is not a mapping, or holds keys of a bad type.

    Example:
        >>> import torch, dsdmerge as dm
        >>> sd = {f"attn.{n}_proj.weight": torch.ones(2, 4) for n in "qkv"}
        >>> out = dm.convert(sd, ["qkv"])
        >>> {k: tuple(v.shape) for k, v in out.items()}
        {'attn.qkv_proj.weight': (6, 4)}
        >>> osd = {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.ones(2, 3)}},
        ...        "param_groups": [{"lr": 0.1, "params": ["w"]}]}
        >>> out = dm.convert(osd, [dm.Transpose("w", dims=(0, 1))])
        >>> tuple(out["state"]["w"]["exp_avg"].shape), out["state"]["w"]["step"]
        ((3, 2), tensor(3.))
    """
    return convert_checkpoint(state_dict, conversions, nonelementwise=nonelementwise, stacklevel=3)


def convert_checkpoint(
    state_dict: Mapping[Any, Any],
    conversions: Conversions,
    /,
    *,
    nonelementwise: Nonelementwise = "raise",
    stacklevel: int,
    quiet: bool = False,
) -> dict[Any, Any]:
    """:func:`convert`, warning at ``stacklevel`` (as for ``warnings.warn``, from here).

    What ``convert=`` of :func:`~dsdmerge.merge`, :func:`~dsdmerge.diff`, ... applies
    to the checkpoint (after ``rename=``). ``quiet``: no warnings (for trials whose
    result is not handed out; no warning filter is touched, so threads are safe).
    """
    rules = expand(conversions)
    if nonelementwise not in ("raise", "reset"):
        raise ConversionError(
            f"nonelementwise must be 'raise' or 'reset', got {short_repr(nonelementwise)}"
        )
    require_mapping(state_dict, "the state dict")
    job = _Job(rules, nonelementwise)
    with gc_paused():  # many small containers, none of them cyclic (see dsdmerge._gc)
        root = job.build(state_dict)
        job.run()
        out: dict[Any, Any] = root.output()
    if not quiet:
        job.warn(stacklevel + 1)
    return out


def suggest_conversions(
    checkpoint: Mapping[str, Any],
    reference: Mapping[str, Any],
    missing: Sequence[str],
    unexpected: Sequence[str],
) -> tuple[str, ...]:
    """The presets that would turn unexpected keys of ``checkpoint`` into missing ones.

    ``checkpoint`` and ``reference`` are flat; ``missing`` and ``unexpected`` are keys
    of the reference and of the checkpoint. A preset fits when, applied to the
    unexpected keys alone (by shape: their tensors as :class:`~dsdmerge.TensorMeta`),
    it converts something and every key it makes is missing, with the reference's
    shape and dtype. Best effort: ``()`` when none fits or when unsure.
    """
    if not missing or not unexpected:
        return ()
    text = "\0".join(unexpected)  # one C-level search per literal, not one per key
    names = [
        name
        for name, rules in CONVERSION_PRESETS.items()
        if any(t.literal.strip(".") in text for r in rules for t in _Rule(r, name).sources)
    ]
    if not names:
        return ()
    view = {k: _meta(checkpoint[k]) for k in unexpected if k in checkpoint}
    missing_set = set(missing)
    found = []
    for name in names:
        try:
            converted = convert_checkpoint(view, [name], stacklevel=2, quiet=True)
        except (DSDMergeError, RecursionError):
            continue
        made = [k for k in converted if k not in view]
        if made and all(k in missing_set and _same_meta(converted[k], reference[k]) for k in made):
            found.append(name)
    return tuple(found)


def _meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return TensorMeta(tuple(value.shape), value.dtype)
    return value


def _same_meta(a: Any, b: Any) -> bool:
    a_tensor, b_tensor = ops.is_tensor(a), ops.is_tensor(b)
    if a_tensor != b_tensor:
        return False
    return not a_tensor or (tuple(a.shape) == tuple(b.shape) and str(a.dtype) == str(b.dtype))
