"""The one pass behind :func:`~dsdmerge.diff` and :func:`~dsdmerge.merge`.

:func:`run` compares a checkpoint with a reference and, when asked, builds the
merged state dict in the checkpoint's layout, in one walk:

* flat pairs: one C-level type pass over each side's values; a walk of the two
  key sequences side by side (string comparisons, a lookup only where they
  differ) that finds the missing and unexpected keys and checks the key types;
  the result, ``{**reference, **checkpoint}`` as a mapping but in the checkpoint's
  key order: a copy of the checkpoint plus one write per missing key; the
  shape/dtype checks of all tensor pairs in C-level passes; group-consistent
  values for backfilled ``param_groups.*`` keys. Keys in another order fall back
  to a pass over the union;
* nested pairs: per parameter (never per flat key), in C-level passes over all
  parameters in the common case, with new containers and shared leaves.

Everything here works on the whole state dict with a few passes of ``map``,
``compress``, ``zip`` and list/bytes operations rather than a Python frame per
key: at ~10^6 keys, the cost of a flat merge is a small multiple of the cost of
building one dict. Policy decisions are made by :mod:`dsdmerge.merge` on what
this returns.
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import partial
from itertools import accumulate, chain, compress, count, cycle, filterfalse, islice, repeat
from operator import (
    add,
    and_,
    attrgetter,
    contains,
    is_,
    itemgetter,
    methodcaller,
    ne,
    not_,
)
from typing import Any

import torch

from dsdmerge._records import Mismatch, Outcome, Slot, TensorMeta
from dsdmerge._values import (
    KNOWN_LEAF_TYPES,
    MISSING,
    freeze,
    is_tensor_like,
    key_str,
    leaf_codes,
    same_value,
    short_repr,
    tensor_like,
)
from dsdmerge.errors import LayoutError, StateDictTypeError
from dsdmerge.flatten import (
    _flatten_into,
    _flatten_tree,
    _group_items,
    flatten,
    require_str_keys,
)
from dsdmerge.layout import (
    PARAM_GROUPS,
    PARAMS,
    PG_PREFIX,
    STATE,
    STATE_PREFIX,
    Layout,
    check_not_mixed,
    is_optimizer_state_dict,
    layout_of,
    lists_param,
    require_mapping,
    value_types,
)

__all__: list[str] = []


def run(
    checkpoint: Mapping[Any, Any],
    reference: Mapping[Any, Any],
    *,
    merge: bool,
    keep_unexpected: bool = True,
    conflicts: bool = False,
    key_prefix: str = "",
) -> Outcome:
    """Compare (and merge) ``checkpoint`` over ``reference``; see the module docstring.

    ``key_prefix`` is only for naming keys in errors: the path of this pair inside a
    larger state dict.
    """
    require_mapping(checkpoint, "checkpoint")
    require_mapping(reference, "reference")
    # One pass over each side's values serves classify, require_flat and the tensor checks:
    # a set of the value types, or for the reference (whose tensor positions the flat pass
    # needs) a code per value when every value has a common leaf type.
    c_types = value_types(checkpoint)
    r_codes, r_types = _scan(reference)
    c_layout = layout_of(checkpoint, c_types)
    r_layout = layout_of(reference, r_types)
    if c_layout is Layout.NESTED and r_layout is Layout.NESTED:
        return _Nested(merge=merge, keep_unexpected=keep_unexpected, conflicts=conflicts).run(
            checkpoint, reference
        )
    if c_layout is Layout.NESTED:
        if merge:
            raise LayoutError(
                "the checkpoint is nested but the reference is flat, so the merged result "
                "(in the checkpoint's layout) has no structure for the reference's keys. Pass "
                "the reference nested, or merge dsdmerge.flatten(checkpoint) instead."
            )
        checkpoint = flatten(checkpoint)
        c_types = value_types(checkpoint)
    groups = None
    if r_layout is Layout.NESTED:
        if is_optimizer_state_dict(reference):
            groups = [
                [key_str(pid, f"{PARAM_GROUPS}[{i}]") for pid in g[PARAMS]]
                for i, g in enumerate(reference[PARAM_GROUPS])
                if isinstance(g, Mapping) and isinstance(g.get(PARAMS), (list, tuple))
            ]
        reference = flatten(reference)
        r_codes, r_types = _scan(reference)
    # both are flat now; _flat checks that their keys are str, on its way through them
    if r_codes is None:  # some value of an uncommon type: tensor-like by the general test
        r_tt = tensor_like(r_types)
        r_codes = bytes(map(r_tt.__contains__, map(type, reference.values()))) if r_tt else b""
    else:
        r_tt = _KNOWN_TENSOR_TYPES
    return _flat(
        checkpoint,
        reference,
        r_codes,
        r_tt,
        merge=merge,
        keep_unexpected=keep_unexpected,
        conflicts=conflicts,
        groups=groups,
        key_prefix=key_prefix,
    )


_KNOWN_TENSOR_TYPES = tensor_like(KNOWN_LEAF_TYPES)


def _scan(sd: Mapping[Any, Any]) -> tuple[bytes | None, frozenset[type] | set[type]]:
    """``(codes, types)``: :func:`leaf_codes` of the values, and their types (or a superset)."""
    codes = leaf_codes(sd.values())
    if codes is not None:
        return codes, KNOWN_LEAF_TYPES
    return None, value_types(sd)


# --------------------------------------------------------------------------------------
# leaves


def _meta(value: Any, key: str) -> TensorMeta:
    try:
        return TensorMeta.of(value)
    except StateDictTypeError as err:  # a value that only looks tensor-like: name its key
        raise StateDictTypeError(f"{key!r}: {err}") from None


def _differs(c: Any, r: Any) -> bool:
    """Whether two tensor-like values differ in shape or dtype."""
    try:
        return bool(c.shape != r.shape or c.dtype != r.dtype)
    except Exception:  # e.g. a NumPy dtype compared with a torch dtype  # noqa: BLE001
        return True


def _torch_types(types: Iterable[type]) -> bool:
    return all(issubclass(tp, torch.Tensor) for tp in types)


# ``(value.shape, value.dtype)`` in one C-level call: with ``map`` the pairs are compared
# without a Python frame per tensor (``.shape`` builds a new torch.Size every time, so the
# attribute fetches are most of the cost of a tensor check).
_SHAPE_DTYPE = attrgetter("shape", "dtype")


def _mismatched(
    c_vals: list[Any],
    r_vals: list[Any],
    c_seen: Iterable[type] | None = None,
    r_seen: Iterable[type] | None = None,
) -> list[int]:
    """Positions where both values are tensor-like, not one object, and differ in shape or dtype.

    ``c_vals`` and ``r_vals`` are aligned (same length); ``c_seen`` and ``r_seen``, when
    given, are the types in them (or supersets). Type checks run once per distinct
    type; the comparisons run in C when every compared value is a torch tensor.
    """
    c_seen = set(map(type, c_vals)) if c_seen is None else set(c_seen)
    r_seen = set(map(type, r_vals)) if r_seen is None else set(r_seen)
    c_tt, r_tt = tensor_like(c_seen), tensor_like(r_seen)
    if not c_tt or not r_tt:
        return []
    positions: Iterable[int] = range(len(c_vals))
    if len(c_tt) < len(c_seen) or len(r_tt) < len(r_seen):  # keep the tensor pairs only
        keep = bytes(
            map(
                and_,
                map(c_tt.__contains__, map(type, c_vals)),
                map(r_tt.__contains__, map(type, r_vals)),
            )
        )
        positions = list(compress(positions, keep))
        c_vals = list(compress(c_vals, keep))
        r_vals = list(compress(r_vals, keep))
    if _torch_types(c_tt) and _torch_types(r_tt):
        # identical objects compare equal, so they need no filtering
        try:
            differ = list(map(ne, map(_SHAPE_DTYPE, c_vals), map(_SHAPE_DTYPE, r_vals)))
        except Exception:  # a tensor whose .shape raises (nested): pair by pair below  # noqa: BLE001
            pass
        else:
            return list(compress(positions, differ))
    return [
        i
        for i, cv, rv in zip(positions, c_vals, r_vals, strict=True)
        if cv is not rv and _differs(cv, rv)
    ]


# --------------------------------------------------------------------------------------
# flat


def _flat(
    c: Mapping[str, Any],
    r: Mapping[str, Any],
    picked: bytes,
    r_tensor_types: frozenset[type],
    *,
    merge: bool,
    keep_unexpected: bool,
    conflicts: bool,
    groups: list[list[str]] | None,
    key_prefix: str = "",
) -> Outcome:
    """``picked``: 1 per tensor-like value of ``r``, whose types are among ``r_tensor_types``."""
    c_key_types: set[type] = set()
    r_key_types: set[type] = set()
    aligned = _align(c, r, c_key_types, r_key_types)
    if aligned is None:  # the keys come in another order: find the differences by hashing
        require_str_keys(c, "checkpoint", set(map(type, c)))
        require_str_keys(r, "reference", set(map(type, r)))
        return _flat_by_union(
            c,
            r,
            picked,
            r_tensor_types,
            merge=merge,
            keep_unexpected=keep_unexpected,
            conflicts=conflicts,
            groups=groups,
            key_prefix=key_prefix,
        )
    require_str_keys(c, "checkpoint", c_key_types)
    require_str_keys(r, "reference", r_key_types)
    runs, missing, unexpected = aligned
    merged: dict[str, Any] | None = None
    r_vals: list[Any] = []
    u_vals: list[Any] = []
    if merge:
        merged = _checkpoint_then_backfill(c, r, missing, unexpected, keep_unexpected)
    if 1 in picked:  # the checkpoint's values at the reference's tensor positions
        u_vals = list(compress(_c_values_at_r(c, r, runs, missing), picked))
    if u_vals:
        r_vals = list(compress(r.values(), picked))
    mismatches = _mismatches(r, picked, u_vals, r_vals, r_tensor_types, key_prefix)
    return _finish(
        c,
        r,
        merged,
        missing,
        unexpected,
        mismatches,
        conflicts=conflicts,
        groups=groups,
        c_at_r=lambda: _c_values_at_r(c, r, runs, missing, MISSING),
    )


def _checkpoint_then_backfill(
    c: Mapping[str, Any],
    r: Mapping[str, Any],
    missing: list[str],
    unexpected: list[str],
    keep_unexpected: bool,
) -> dict[str, Any]:
    """The merged flat dict: the checkpoint's keys in its order, then the missing ones.

    A copy of the checkpoint (a copy of its hash table, no lookups) and one write per
    missing key, with the reference's value; unexpected keys are dropped unless kept.
    Equal to ``{**r, **c}`` as a mapping, with the values of ``c`` by identity.
    """
    merged = {**c}
    if missing:
        merged.update(zip(missing, map(r.__getitem__, missing), strict=True))
    if unexpected and not keep_unexpected:
        for key in unexpected:
            del merged[key]
    return merged


def _mismatches(
    r: Mapping[str, Any],
    picked: bytes,
    u_vals: list[Any],
    r_vals: list[Any],
    r_tensor_types: frozenset[type],
    key_prefix: str,
) -> list[Mismatch]:
    bad = _mismatched(u_vals, r_vals, None, r_tensor_types)
    if not bad:
        return []
    r_keys = list(compress(r, picked))
    out = []
    for i in bad:
        where = key_prefix + r_keys[i]
        out.append(Mismatch(r_keys[i], _meta(u_vals[i], where), _meta(r_vals[i], where)))
    return out


def _finish(
    c: Mapping[str, Any],
    r: Mapping[str, Any],
    merged: dict[str, Any] | None,
    missing: list[str],
    unexpected: list[str],
    mismatches: list[Mismatch],
    *,
    conflicts: bool,
    groups: list[list[str]] | None,
    c_at_r: Callable[[], Iterable[Any]] | None = None,
) -> Outcome:
    """The :class:`Outcome` of a flat pass.

    ``c_at_r()``, if the pass can tell: the checkpoint's values at the reference's
    positions, ``MISSING`` where it lacks the key.
    """
    outcome = Outcome(merged, missing, unexpected, mismatches)
    if merged is not None:
        outcome.take_reference = {
            m.key: Slot(partial(merged.__setitem__, m.key), merged[m.key], r[m.key])
            for m in mismatches
        }
    backfilled = [k for k in missing if k.startswith(PG_PREFIX)]
    if backfilled or (conflicts and any(map(str.startswith, c, repeat(PG_PREFIX)))):
        _resolve_groups(c, r, groups, backfilled, outcome, conflicts=conflicts, c_at_r=c_at_r)
    if missing or conflicts:
        _prefixed_groups(c, r, outcome, conflicts=conflicts)
    return outcome


def _resolve_groups(
    c: Mapping[str, Any],
    r: Mapping[str, Any],
    groups: list[list[str]] | None,
    backfilled: list[str],
    outcome: Outcome,
    *,
    conflicts: bool,
    c_at_r: Callable[[], Iterable[Any]] | None = None,
) -> None:
    """Group-consistent values for backfilled ``param_groups.*`` keys, and conflicts.

    By columns when the reference's ``param_groups.*`` keys form a table (every
    parameter with the same hyperparameter names, in the same order: what torch
    writes), else key by key.
    """
    table = _PgTable.of(r)
    if table is None:
        _group_hyperparameters(c, r, groups, backfilled, outcome, conflicts=conflicts)
    else:
        table.resolve(c, groups, backfilled, outcome, conflicts=conflicts, c_at_r=c_at_r)


_NESTED_PG = "." + PG_PREFIX


def _group_prefix(key: str) -> str:
    """``"optim."`` for ``"optim.param_groups.w.lr"``; ``""`` when there is no such prefix."""
    at = key.find(_NESTED_PG)
    return key[: at + 1] if at >= 0 else ""


def _prefixed_groups(
    c: Mapping[str, Any], r: Mapping[str, Any], outcome: Outcome, *, conflicts: bool
) -> None:
    """Group-consistent hyperparameters for flattened optimizers under a prefix.

    A flattened whole checkpoint spells its optimizer's keys
    ``optim.param_groups.<fqn>.<hp>``: each such prefix gets the same treatment as
    top-level ``param_groups.*`` keys, on the keys under it.
    """
    merged = outcome.merged
    backfilled = [k for k in outcome.missing if _NESTED_PG in k]
    prefixes = dict.fromkeys(filter(None, map(_group_prefix, backfilled)))
    if conflicts:
        # only keys with ".param_groups." in them (a C-level pass) have a prefix
        nested = compress(c, map(contains, c, repeat(_NESTED_PG)))
        prefixes.update(dict.fromkeys(filter(None, map(_group_prefix, nested))))
    for prefix in prefixes:
        head, n = prefix + PG_PREFIX, len(prefix)
        sub_c = {k[n:]: v for k, v in c.items() if k.startswith(head)}
        sub_r = {k[n:]: v for k, v in r.items() if k.startswith(head)}
        mine = [k[n:] for k in backfilled if k.startswith(head)]
        sub = Outcome({} if merged is not None else None, [], [], [])
        _resolve_groups(sub_c, sub_r, None, mine, sub, conflicts=conflicts)
        if merged is not None and sub.merged:
            merged.update((prefix + k, v) for k, v in sub.merged.items())
        outcome.conflicts.extend(f"{prefix[:-1]!r}: {line}" for line in sub.conflicts)
        outcome.problems.extend(f"{prefix[:-1]!r}: {line}" for line in sub.problems)


_CHUNK = 1024  # keys taken from each side at a time in _align


def _align(
    c: Mapping[str, Any], r: Mapping[str, Any], c_key_types: set[type], r_key_types: set[type]
) -> tuple[list[tuple[int, int, int]], list[str], list[str]] | None:
    """Walk the two key sequences side by side: ``(runs, missing, unexpected)``, or ``None``.

    State dicts of one model come in one key order, so the checkpoint's keys are
    mostly the reference's keys at shifted positions. The walk takes the keys a
    chunk at a time from each side (adding their types to ``c_key_types`` and
    ``r_key_types`` while the chunk is in cache) and skips equal stretches by
    comparing the chunks in C, a string comparison per key and no hashing. Where
    keys differ, one lookup tells which side has a key the other lacks. ``runs``
    are ``(c_position, r_position, length)`` of equal keys; ``missing`` and
    ``unexpected`` come out in reference and checkpoint order. ``None`` when both
    keys at a difference exist on the other side (the orders differ) or when the
    differences are too many for a walk to pay off; the key types are then partial.
    """
    c_iter, r_iter = iter(c), iter(r)
    cb: list[Any] = []  # keys taken but not walked yet; cb[0] is at position i
    rb: list[Any] = []
    i = j = 0
    run_i = run_j = 0
    runs: list[tuple[int, int, int]] = []
    missing: list[str] = []
    unexpected: list[str] = []
    budget = 64 + len(r) // 16
    while True:
        if len(cb) < _CHUNK:
            more = list(islice(c_iter, _CHUNK))
            _add_key_types(c_key_types, more)
            cb += more
        if len(rb) < _CHUNK:
            more = list(islice(r_iter, _CHUNK))
            _add_key_types(r_key_types, more)
            rb += more
        n = min(len(cb), len(rb))
        if not n:
            break
        if cb == rb if len(cb) == len(rb) else cb[:n] == rb[:n]:
            del cb[:n], rb[:n]
            i += n
            j += n
            continue
        step = next(compress(count(), map(ne, cb, rb)))  # the first key that differs
        del cb[:step], rb[:step]
        i += step
        j += step
        if i > run_i:
            runs.append((run_i, run_j, i - run_i))
        a, b = cb[0], rb[0]
        if b not in c:
            missing.append(b)
            del rb[0]
            j += 1
        elif a not in r:
            unexpected.append(a)
            del cb[0]
            i += 1
        else:
            return None
        run_i, run_j = i, j
        budget -= 1
        if budget < 0:
            return None
    if i > run_i:
        runs.append((run_i, run_j, i - run_i))
    for rest, it, types, out in (
        (rb, r_iter, r_key_types, missing),
        (cb, c_iter, c_key_types, unexpected),
    ):
        rest += it
        _add_key_types(types, rest)
        out += rest
    return runs, missing, unexpected


def _add_key_types(types: set[type], keys: list[Any]) -> None:
    """Add the types of ``keys`` to ``types`` (counting exact str is the cheap common case)."""
    if list(map(type, keys)).count(str) == len(keys):
        types.add(str)
    else:
        types.update(map(type, keys))


def _c_values_at_r(
    c: Mapping[str, Any],
    r: Mapping[str, Any],
    runs: list[tuple[int, int, int]],
    missing: list[str],
    fill: Any = None,
) -> Iterator[Any]:
    """The checkpoint's value at each position of the reference, lazily, from :func:`_align`.

    Where the checkpoint lacks the key, ``fill`` stands in (the reference's own value
    when ``fill`` is ``None``).
    """

    def gap(keys: list[str]) -> Iterable[Any]:
        return map(r.__getitem__, keys) if fill is None else repeat(fill, len(keys))

    def parts() -> Iterator[Iterable[Any]]:
        values = iter(c.values())
        at_c = at_r = m = 0
        for i, j, n in runs:
            if j > at_r:  # missing keys before this run
                yield gap(missing[m : m + j - at_r])
                m += j - at_r
            if i > at_c:  # skip the unexpected ones
                next(islice(values, i - at_c, i - at_c), None)
            yield islice(values, n)
            at_c, at_r = i + n, j + n
        if m < len(missing):
            yield gap(missing[m:])

    return chain.from_iterable(parts())


def _flat_by_union(
    c: Mapping[str, Any],
    r: Mapping[str, Any],
    picked: bytes,
    r_tensor_types: frozenset[type],
    *,
    merge: bool,
    keep_unexpected: bool,
    conflicts: bool,
    groups: list[list[str]] | None,
    key_prefix: str = "",
) -> Outcome:
    """:func:`_flat` for keys in different orders: every key is hashed once, in ``{**r, **c}``."""
    # The union has the reference's keys in order, with the checkpoint's value wherever the
    # checkpoint has the key, then the checkpoint's new keys (the unexpected ones) in order.
    union = {**r, **c}
    n_r = len(r)
    n_missing = len(union) - len(c)
    unexpected = list(islice(union, n_r, None)) if len(union) > n_r else []
    # The reference's tensors, and the union's values at the same places: the checkpoint's
    # value, or the reference's own tensor when the checkpoint lacks the key.
    r_vals: list[Any] = []
    u_vals: list[Any] = []
    if 1 in picked:
        r_vals = list(compress(r.values(), picked))
        u_vals = list(compress(union.values(), picked))
    mismatches = _mismatches(r, picked, u_vals, r_vals, r_tensor_types, key_prefix)
    # missing keys keep the reference's own value in the union: among the tensors, those are
    # the only candidates (besides a tensor the checkpoint shares with the reference)
    kept = list(compress(count(), map(is_, u_vals, r_vals))) if n_missing else []
    r_keys = list(compress(r, picked)) if kept else []
    missing = _missing(c, r, union, n_missing, [r_keys[i] for i in kept])
    del r_keys, r_vals, u_vals
    merged: dict[str, Any] | None = None
    if merge:
        merged = _checkpoint_then_backfill(c, r, missing, unexpected, keep_unexpected)
    return _finish(
        c, r, merged, missing, unexpected, mismatches, conflicts=conflicts, groups=groups
    )


def _missing(
    c: Mapping[str, Any],
    r: Mapping[str, Any],
    union: dict[str, Any],
    count: int,
    tensor_candidates: list[str],
) -> list[str]:
    """The ``count`` keys of ``r`` that ``c`` lacks, in reference order.

    A missing key keeps the reference's value in the union, so only keys whose union
    value *is* the reference's value need a lookup in ``c``. Tensors are distinct
    objects on the two sides, so the tensor keys with that property are tried first:
    when they account for every missing key, the other values (``False``, ``None``,
    ... are shared objects) need no lookups at all.
    """
    if not count:
        return []
    if count == len(r):
        return list(r)
    if tensor_candidates:
        found = list(filterfalse(c.__contains__, tensor_candidates))
        if len(found) == count:
            return found
    return list(filterfalse(c.__contains__, compress(r, map(is_, r.values(), union.values()))))


@dataclasses.dataclass
class _PgTable:
    """The ``param_groups.*`` keys of a flat reference as a table: one row per parameter.

    Torch's flattened format writes, for every parameter, the same hyperparameters in
    the same order. When the reference's keys have that shape, group inference,
    backfills and conflict checks work on columns of the table in C-level passes.
    """

    picked: bytes  # 1 per reference key that is a param_groups.* key
    keys: list[str]  # those keys, row after row
    fqns: list[str]  # one per row
    names: list[str]  # the hyperparameters, one per column
    values: list[Any]  # the reference's values, row after row

    @classmethod
    def of(cls, r: Mapping[str, Any]) -> _PgTable | None:
        """The table of ``r``, or ``None`` when its keys do not have that shape.

        torch writes every ``state.*`` key before the first ``param_groups.*`` key,
        so the keys from the first ``param_groups.*`` key on are tried as the table
        first (finding it scans only the keys before it); when they do not all
        fit, every key is tested.
        """
        first = next(compress(count(), map(str.startswith, r, repeat(PG_PREFIX))), None)
        if first is None:
            return None
        tail = bytes(first) + b"\x01" * (len(r) - first)
        table = cls._shaped(
            tail, list(islice(r, first, None)), lambda: list(islice(r.values(), first, None))
        )
        if table is None:  # other keys among them, or no table at all
            picked = bytes(map(str.startswith, r, repeat(PG_PREFIX)))
            if picked != tail:
                table = cls._shaped(
                    picked, list(compress(r, picked)), lambda: list(compress(r.values(), picked))
                )
        return table

    @classmethod
    def _shaped(
        cls, picked: bytes, keys: list[str], values: Callable[[], list[Any]]
    ) -> _PgTable | None:
        """The table of ``keys`` (at the positions ``picked``), if they have its shape.

        The shape is checked without splitting every key: the first row gives the
        hyperparameter names, the first key of each row its fqn, and then every key
        must be ``param_groups.<row fqn>.<column name>`` (prefix, suffix and length),
        which is what :func:`_parse_groups` would make of it.
        """
        n = len(PG_PREFIX)
        if not keys:
            return None
        first_fqn, dot, _ = keys[0][n:].rpartition(".")
        names = []
        for key in keys:
            fqn, dot, name = key[n:].rpartition(".")
            if fqn != first_fqn:
                break
            names.append(name)
        k = len(names)
        rows, rest = divmod(len(keys), k)
        if rest or not dot or not first_fqn or len(set(names)) != k or "." in "".join(names):
            return None
        suffixes = ["." + name for name in names]
        heads = keys[::k]
        if not all(map(str.endswith, heads, repeat(suffixes[0]))):
            return None
        fqns = list(map(itemgetter(slice(n, -len(suffixes[0]))), heads))
        prefixes = list(map(add, repeat(PG_PREFIX), map(add, fqns, repeat("."))))
        each = list(chain.from_iterable(map(repeat, prefixes, repeat(k))))
        if (
            not all(fqns)
            or len(set(fqns)) != rows
            or not all(map(str.startswith, keys, each))
            or not all(map(str.endswith, keys, cycle(suffixes)))
            or list(map(len, keys)) != list(map(add, map(len, each), cycle(map(len, names))))
        ):
            return None
        return cls(picked, keys, fqns, names, values())

    def inferred_groups(self) -> list[list[int]]:
        """Rows whose reference hyperparameters are all equal, in order of first appearance.

        Members of a group share their value objects, so rows are matched by identity
        to a few template rows (a bit mask per template, ANDed over the columns), and
        only the templates are frozen and compared by value.
        """
        k, n_rows = len(self.names), len(self.fqns)
        columns = [self.values[j::k] for j in range(k)]
        left = (1 << (8 * n_rows)) - 1  # a bit per row at 8-bit spacing: the rows not matched
        left &= int.from_bytes(b"\x01" * n_rows, "little")
        templates: list[tuple[int, int]] = []  # (first row, mask of the rows like it)
        while left:
            if len(templates) == 64:  # too many distinct rows for masks: freeze every row
                return _equal_hyperparameters(
                    (i, zip(self.names, self.values[i * k : i * k + k], strict=True))
                    for i in range(n_rows)
                )
            t = ((left & -left).bit_length() - 1) // 8
            mask = left
            for column in columns:
                mask &= int.from_bytes(bytes(map(is_, column, repeat(column[t]))), "little")
            templates.append((t, mask))
            left &= ~mask
        masks: dict[Any, int] = {}  # signature -> rows, in order of first appearance
        for t, mask in templates:
            row = self.values[t * k : t * k + k]
            signature = tuple((name, freeze(v)) for name, v in zip(self.names, row, strict=True))
            masks[signature] = masks.get(signature, 0) | mask
        return [list(compress(count(), mask.to_bytes(n_rows, "little"))) for mask in masks.values()]

    def resolve(
        self,
        c: Mapping[str, Any],
        groups: list[list[str]] | None,
        backfilled: list[str],
        outcome: Outcome,
        *,
        conflicts: bool,
        c_at_r: Callable[[], Iterable[Any]] | None,
    ) -> None:
        """:func:`_group_hyperparameters`, by columns."""
        inferred = " (inferred)" if groups is None else ""
        if groups is None:
            rows = self.inferred_groups()
        else:
            row_of = dict(zip(self.fqns, count()))
            rows = [[i for i in map(row_of.get, g) if i is not None] for g in groups]
        if backfilled:
            fqns = self.fqns
            _backfill_from_groups(
                c,
                outcome.merged,
                backfilled,
                [[fqns[i] for i in members] for members in rows],
                inferred=groups is None,
                problems=outcome.problems,
            )
        if not conflicts:
            return
        if c_at_r is None:
            c_vals = list(map(c.get, self.keys, repeat(MISSING)))
        else:
            c_vals = list(compress(c_at_r(), self.picked))
        k = len(self.names)
        for index, members in enumerate(rows):
            found: list[tuple[int, int, str]] = []
            for j, name in enumerate(self.names):
                column = list(map(c_vals[j::k].__getitem__, members))
                if column and all(map(is_, column, repeat(column[0]))) and column[0] is not MISSING:
                    continue  # the same object for every member: no conflict
                first: tuple[int, Any] | None = None
                for at, value in enumerate(column):
                    if value is MISSING:
                        continue
                    if first is None:
                        first = (at, value)
                    elif not same_value(first[1], value):
                        text = _conflict(
                            f"{index}{inferred}",
                            name,
                            (self.fqns[members[first[0]]], first[1]),
                            (self.fqns[members[at]], value),
                        )
                        found.append((at, j, text))
                        break
            found.sort(key=itemgetter(0, 1))
            outcome.conflicts.extend(text for _, _, text in found)


def _equal_hyperparameters(rows: Iterable[tuple[Any, Iterable[tuple[str, Any]]]]) -> list[Any]:
    """Group row ids by equal ``(hyperparameter, value)`` rows, in order of first appearance.

    Parameters of one group share their value objects, so each object is frozen once.
    """
    frozen: dict[int, Any] = {}
    by_signature: dict[Any, list[Any]] = {}
    for row, pairs in rows:
        signature = []
        for name, v in pairs:
            f = frozen.get(id(v), MISSING)
            if f is MISSING:
                f = frozen[id(v)] = freeze(v)
            signature.append((name, f))
        by_signature.setdefault(tuple(signature), []).append(row)
    return list(by_signature.values())


def _backfill_from_groups(
    c: Mapping[str, Any],
    merged: dict[str, Any] | None,
    backfilled: list[str],
    groups: list[list[str]],
    *,
    inferred: bool,
    problems: list[str],
) -> None:
    """Give each backfilled ``param_groups.*`` key its group's checkpoint value.

    ``groups`` are lists of fqns. The value is the one the checkpoint's members of
    the group hold (the most common one, the first on a tie, when they disagree:
    members moved in from another group are the minority); the reference's when
    no member has one. With ``inferred`` groups (made from equal reference values)
    members that disagree may be two groups the inference could not tell apart,
    so no value is picked: a line goes to ``problems`` (the merge is refused).
    Writes into ``merged`` unless it is ``None`` (a check). Each group and
    hyperparameter is scanned once.
    """
    group_of = {fqn: index for index, members in enumerate(groups) for fqn in members}
    n = len(PG_PREFIX)
    found: dict[tuple[int, str], Any] = {}  # (group, hyperparameter) -> checkpoint value
    for key in backfilled:
        fqn, _, name = key[n:].rpartition(".")
        index = group_of.get(fqn)
        if index is None:
            continue
        value = found.get((index, name), found)
        if value is found:  # first backfilled key of this group and name: scan the group once
            members = groups[index]
            keys = [f"{PG_PREFIX}{member}.{name}" for member in members]
            values = list(map(c.get, keys, repeat(MISSING)))
            value = _group_value(values)
            if value is _DISAGREE:
                if inferred:
                    problems.append(_ambiguous(index, name, members, values, key))
                    value = MISSING
                else:
                    value = _majority(values)
            found[index, name] = value
        if value is not MISSING and merged is not None:
            merged[key] = value


_DISAGREE: Any = object()


def _group_value(values: list[Any]) -> Any:
    """The one value the present ``values`` share, ``MISSING`` if none, else ``_DISAGREE``."""
    present = [v for v in values if v is not MISSING]
    if not present:
        return MISSING
    first = present[0]
    if all(map(is_, present, repeat(first))) or all(same_value(first, v) for v in present):
        return first
    return _DISAGREE


def _majority(values: list[Any]) -> Any:
    """The most common present value (by equality; the first of them on a tie)."""
    kinds: list[list[Any]] = []  # [representative, count]
    for v in values:
        if v is MISSING:
            continue
        for kind in kinds:
            if kind[0] is v or same_value(kind[0], v):
                kind[1] += 1
                break
        else:
            kinds.append([v, 1])
    best = max(kind[1] for kind in kinds)
    return next(kind[0] for kind in kinds if kind[1] == best)


def _ambiguous(index: int, name: str, members: list[str], values: list[Any], key: str) -> str:
    shown: list[tuple[str, Any]] = []
    for member, v in zip(members, values, strict=True):
        if v is not MISSING and not any(same_value(v, seen) for _, seen in shown):
            shown.append((member, v))
        if len(shown) == 2:
            break
    (a, va), (b, vb) = shown
    return (
        f"param group {index} (inferred from equal reference hyperparameters): its checkpoint "
        f"members disagree on {name!r} ({a} has {short_repr(va)}, {b} has {short_repr(vb)}), "
        f"so it may be two groups scheduled apart and the value for {key!r} cannot be told. "
        "Pass the reference nested (get_optimizer_state_dict without "
        "flatten_optimizer_state_dict), so that the true groups are known."
    )


def _conflict(group: str, name: str, first: tuple[str, Any], other: tuple[str, Any]) -> str:
    """The report of two checkpoint members of a param group that disagree on ``name``."""
    return (
        f"param group {group}: checkpoint members disagree on {name!r}: {first[0]} has "
        f"{short_repr(first[1])}, {other[0]} has {short_repr(other[1])}; "
        "torch keeps the first member's value for the whole group"
    )


def _parse_groups(flat: Mapping[str, Any]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """``param_groups.<fqn>.<hp>`` keys -> ``{fqn: {hp: value}}`` in key order, and the keys.

    The second mapping is ``{fqn: {hp: flat key}}``, so that the same key can be
    looked up elsewhere without spelling it again.
    """
    hyper: dict[str, dict[str, Any]] = {}
    keys: dict[str, Any] = {}
    n = len(PG_PREFIX)
    for key, value in compress(flat.items(), map(methodcaller("startswith", PG_PREFIX), flat)):
        fqn, dot, name = key[n:].rpartition(".")
        if dot and fqn:
            values = hyper.get(fqn)
            if values is None:
                values = hyper[fqn] = {}
                keys[fqn] = {}
            values[name] = value
            keys[fqn][name] = key
    return hyper, keys


def _group_hyperparameters(
    c: Mapping[str, Any],
    r: Mapping[str, Any],
    groups: list[list[str]] | None,
    backfilled: list[str],
    outcome: Outcome,
    *,
    conflicts: bool,
) -> None:
    """Give backfilled ``param_groups.*`` keys their group's checkpoint value; find conflicts.

    A group is the reference's (when it was nested) or else the parameters whose
    reference hyperparameters are all equal. A backfilled key takes the value of
    the first member of its group (in reference order) that the checkpoint has,
    and the reference's value only when no member has one.
    """
    r_hyper, r_keys = _parse_groups(r)
    inferred_from_nested = groups is not None
    inferred = " (inferred)" if groups is None else ""
    if groups is None:
        groups = _equal_hyperparameters((fqn, values.items()) for fqn, values in r_hyper.items())
    if backfilled:
        _backfill_from_groups(
            c,
            outcome.merged,
            backfilled,
            groups,
            inferred=not inferred_from_nested,
            problems=outcome.problems,
        )
    if not conflicts:
        return
    c_get = c.get
    for index, members in enumerate(groups):
        seen: dict[str, tuple[str, Any]] = {}
        reported: set[str] = set()
        for member in members:
            keys = r_keys.get(member)
            if not keys:
                continue
            for name, key in keys.items():
                value = c_get(key, MISSING)
                if value is MISSING or name in reported:
                    continue
                first = seen.get(name)
                if first is None:
                    seen[name] = (member, value)
                elif first[1] is not value and not same_value(first[1], value):
                    reported.add(name)
                    outcome.conflicts.append(
                        _conflict(f"{index}{inferred}", name, first, (member, value))
                    )


# --------------------------------------------------------------------------------------
# nested


def _flat_keys(value: Any, key: str, *, in_optimizer: bool = False) -> list[str]:
    """The flat keys a nested value at ``key`` spells (one key for a leaf).

    ``in_optimizer``: the value is inside an optimizer state dict (a parameter's state,
    a key beside state and param_groups), where :func:`flatten` sees no optimizer.
    """
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        if in_optimizer:
            _flatten_tree(out, value, key + ".", {id(value)}, optimizers=False)
        else:
            _flatten_into(out, value, key + ".")
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
                dest[k] = [_copy_group(g) for g in v]
            else:
                dest[k] = v
        else:
            stack.pop()
    return root


def _copy_group(group: Any) -> Any:
    if not isinstance(group, Mapping):
        return group
    out = dict(group)
    if isinstance(out.get(PARAMS), (list, tuple)):
        out[PARAMS] = list(out[PARAMS])
    return out


class _Nested:
    """Merge two nested state dicts: the reference drives the walk, the checkpoint wins."""

    def __init__(self, *, merge: bool, keep_unexpected: bool, conflicts: bool) -> None:
        self.merge = merge
        self.keep = keep_unexpected
        self.want_conflicts = conflicts
        self.outcome = Outcome({}, [], [], [])
        self.any_unexpected = False
        self.types: dict[type, bool] = {}
        # id of a checkpoint sub-dict merged by the flat pass -> its unexpected keys
        self.flat_unexpected: dict[int, list[str]] = {}
        # the optimizer state dicts whose state is being merged (for optimizer-level entries)
        self.c_osd: Mapping[Any, Any] = {}
        self.r_osd: Mapping[Any, Any] = {}

    def run(self, c: Mapping[Any, Any], r: Mapping[Any, Any]) -> Outcome:
        if is_optimizer_state_dict(c) != is_optimizer_state_dict(r):
            raise _optimizer_vs_tree("")
        optimizer = is_optimizer_state_dict(c)
        merged = self._optimizer(c, r, "") if optimizer else self._tree(c, r, "")
        if self.any_unexpected:
            if optimizer:
                self._optimizer_unexpected(c, r, merged, "")
            else:
                self._tree_unexpected(c, r, merged, "")
        self.outcome.merged = merged if self.merge else None
        return self.outcome

    # -- leaves --------------------------------------------------------------------

    def _is_tensor(self, tp: type) -> bool:
        known = self.types.get(tp)
        if known is None:
            known = self.types[tp] = is_tensor_like(tp)
        return known

    def _leaf(self, dest: dict[Any, Any], k: Any, cv: Any, rv: Any, key: str) -> None:
        dest[k] = cv
        if cv is rv or not self._is_tensor(type(cv)) or not self._is_tensor(type(rv)):
            return
        if _differs(cv, rv):
            self.outcome.mismatches.append(Mismatch(key, _meta(cv, key), _meta(rv, key)))
            self.outcome.take_reference[key] = Slot(partial(dest.__setitem__, k), cv, rv)

    def _backfill(
        self, dest: dict[Any, Any], k: Any, rv: Any, key: str, *, in_optimizer: bool = False
    ) -> None:
        self.outcome.missing.extend(_flat_keys(rv, key, in_optimizer=in_optimizer))  # first:
        dest[k] = copy_tree(rv, in_optimizer=in_optimizer)  # _flat_keys refuses cycles

    # -- generic mappings ------------------------------------------------------------

    def _tree(
        self, c: Mapping[Any, Any], r: Mapping[Any, Any], prefix: str, *, in_state: bool = False
    ) -> dict[Any, Any]:
        """Merge two mappings, the reference's keys first.

        ``in_state``: inside an optimizer (a parameter's state, the optimizer's own keys),
        where, as :func:`flatten` sees it, there is no optimizer state dict and no flat
        sub-dict to look for.
        """
        out: dict[Any, Any] = {}
        on_path = {id(c), id(r)}
        stack: list[tuple[Mapping[Any, Any], Mapping[Any, Any], dict[Any, Any], str, Any]] = [
            (c, r, out, prefix, iter(r.items()))
        ]
        while stack:
            cn, rn, dest, pfx, items = stack[-1]
            for k, rv in items:
                key = pfx + (k if type(k) is str else key_str(k, pfx[:-1]))
                cv = cn.get(k, MISSING)
                if cv is MISSING:
                    self._backfill(dest, k, rv, key, in_optimizer=in_state)
                    continue
                c_map, r_map = isinstance(cv, Mapping), isinstance(rv, Mapping)
                if not c_map and not r_map:
                    self._leaf(dest, k, cv, rv, key)
                    continue
                if c_map != r_map:
                    raise LayoutError(
                        f"{key!r} is a {'mapping' if c_map else 'leaf'} in the checkpoint but a "
                        f"{'mapping' if r_map else 'leaf'} in the reference; the two state dicts "
                        "have different structures there."
                    )
                if id(cv) in on_path or id(rv) in on_path:
                    raise LayoutError(f"cycle: the mapping at {key!r} contains itself")
                if not in_state and (is_optimizer_state_dict(cv) or is_optimizer_state_dict(rv)):
                    if not (is_optimizer_state_dict(cv) and is_optimizer_state_dict(rv)):
                        raise _optimizer_vs_tree(key)
                    dest[k] = self._optimizer(cv, rv, key + ".")
                    continue
                if not in_state and _flat_pair(cv, rv):
                    dest[k] = self._flat(cv, rv, key)
                    continue
                child: dict[Any, Any] = {}
                dest[k] = child
                on_path.update((id(cv), id(rv)))
                stack.append((cv, rv, child, key + ".", iter(rv.items())))
                break
            else:
                stack.pop()
                on_path.discard(id(cn))
                on_path.discard(id(rn))
                if len(cn) > len(rn) or any(k not in rn for k in cn):
                    self.any_unexpected = True
        return out

    def _flat(self, c: Mapping[str, Any], r: Mapping[str, Any], key: str) -> dict[str, Any]:
        """A pair of flat sub-dicts (a model, a flattened optimizer): the flat pass, re-keyed.

        So a flattened optimizer inside a whole checkpoint gets group-consistent
        hyperparameter backfill, exactly as it would on its own.
        """
        prefix = key + "."
        sub = run(
            c,
            r,
            merge=True,
            keep_unexpected=self.keep,
            conflicts=self.want_conflicts,
            key_prefix=prefix,
        )
        outcome = self.outcome
        outcome.missing.extend(prefix + k for k in sub.missing)
        for m in sub.mismatches:
            outcome.mismatches.append(Mismatch(prefix + m.key, m.checkpoint, m.reference))
            outcome.take_reference[prefix + m.key] = sub.take_reference[m.key]
        outcome.conflicts.extend(f"{key!r}: {line}" for line in sub.conflicts)
        outcome.problems.extend(f"{key!r}: {line}" for line in sub.problems)
        self.flat_unexpected[id(c)] = [prefix + k for k in sub.unexpected]
        if sub.unexpected:
            self.any_unexpected = True
        assert sub.merged is not None
        return sub.merged

    def _tree_unexpected(
        self,
        c: Mapping[Any, Any],
        r: Mapping[Any, Any],
        out: dict[Any, Any],
        prefix: str,
        *,
        in_state: bool = False,
    ) -> None:
        """Second, checkpoint-driven walk: unexpected keys in checkpoint order."""
        stack: list[tuple[Mapping[Any, Any], dict[Any, Any], str, Any]] = [
            (r, out, prefix, iter(c.items()))
        ]
        while stack:
            rn, dest, pfx, items = stack[-1]
            for k, cv in items:
                key = pfx + (k if type(k) is str else key_str(k, pfx[:-1]))
                rv = rn.get(k, MISSING)
                if rv is MISSING:
                    self.outcome.unexpected.extend(_flat_keys(cv, key, in_optimizer=in_state))
                    if self.keep:
                        dest[k] = copy_tree(cv, in_optimizer=in_state)
                    continue
                if not isinstance(cv, Mapping):
                    continue
                if not in_state and is_optimizer_state_dict(cv):
                    self._optimizer_unexpected(cv, rv, dest[k], key + ".")
                    continue
                flat_unexpected = None if in_state else self.flat_unexpected.get(id(cv))
                if flat_unexpected is not None:  # merged by the flat pass, which found these
                    self.outcome.unexpected.extend(flat_unexpected)
                    continue
                stack.append((rv, dest[k], key + ".", iter(cv.items())))
                break
            else:
                stack.pop()

    # -- optimizers ------------------------------------------------------------------

    def _optimizer(self, c: Mapping[Any, Any], r: Mapping[Any, Any], prefix: str) -> dict[Any, Any]:
        check_not_mixed(c, prefix[:-1])
        check_not_mixed(r, prefix[:-1])
        c_state, r_state = c[STATE], r[STATE]
        _check_id_kinds(c, r, prefix)
        self.c_osd, self.r_osd = c, r
        state: dict[Any, Any] = {}
        if not _id_types_ok(r_state) or not self._fast_state(c_state, r_state, state, prefix):
            self._state(c_state, r_state, state, prefix)
        if not c_state.keys() <= r_state.keys():
            self.any_unexpected = True
        groups = self._groups(c, r, prefix)
        c_extra, r_extra = _extras(c), _extras(r)
        if not c_extra and not r_extra:
            return {STATE: state, PARAM_GROUPS: groups}
        # keys an optimizer keeps beside state and param_groups: merged like any mapping (like
        # a parameter's state: flatten sees no optimizer state dict inside an optimizer's)
        extra = self._tree(c_extra, r_extra, prefix, in_state=True)
        return {STATE: state, PARAM_GROUPS: groups, **extra}

    def _state(
        self,
        c_state: Mapping[Any, Any],
        r_state: Mapping[Any, Any],
        state: dict[Any, Any],
        prefix: str,
    ) -> None:
        """Merge the per-parameter state, one parameter at a time."""
        state_prefix = prefix + STATE_PREFIX
        for pid, r_entry in r_state.items():
            key = state_prefix + key_str(pid, prefix + STATE)
            c_entry = c_state.get(pid, MISSING)
            if not isinstance(r_entry, Mapping) or not (
                c_entry is MISSING or isinstance(c_entry, Mapping)
            ):
                if isinstance(r_entry, Mapping) or isinstance(c_entry, Mapping):
                    raise LayoutError(
                        f"{key!r} is a parameter's state (a mapping) on one side and an "
                        "optimizer-level entry (a leaf) on the other"
                    )
                _require_optimizer_level(pid, key, self.c_osd, self.r_osd)
                if c_entry is MISSING:
                    self._backfill(state, pid, r_entry, key, in_optimizer=True)
                else:  # an optimizer-level entry (MADGRAD's state['k']): a leaf
                    self._leaf(state, pid, c_entry, r_entry, key)
                continue
            if c_entry is MISSING:
                self._backfill(state, pid, r_entry, key, in_optimizer=True)
            elif type(c_entry) is dict and c_entry.keys() == r_entry.keys():
                state[pid] = self._entry(c_entry, r_entry, key)
            else:
                state[pid] = self._tree(c_entry, r_entry, key + ".", in_state=True)

    def _fast_state(
        self,
        c_state: Mapping[Any, Any],
        r_state: Mapping[Any, Any],
        state: dict[Any, Any],
        prefix: str,
    ) -> bool:
        """:meth:`_state` in C-level passes over all parameters, in the common case.

        A parameter whose two entries are plain dicts with the same state names in
        the same order gets a copy of the checkpoint's entry; the value pairs of all
        such parameters are type-checked and compared together, and reported in the
        order :meth:`_state` would report them. The other parameters (backfills,
        other entry types) go through :meth:`_state` one by one, in order. Returns
        ``False``, having done nothing, when the state names differ somewhere or a
        state value is itself a mapping (nested state): :meth:`_state` then does it all.
        """
        c_entries = list(map(c_state.get, r_state, repeat(MISSING)))
        fast = bytes(
            map(
                and_,
                map(is_, map(type, c_entries), repeat(dict)),
                map(is_, map(type, r_state.values()), repeat(dict)),
            )
        )
        fast_c = list(compress(c_entries, fast))
        fast_r = list(compress(r_state.values(), fast))
        del c_entries
        # the same names in the same order, parameter by parameter (lengths, then all names)
        if list(map(len, fast_c)) != list(map(len, fast_r)) or list(
            chain.from_iterable(fast_c)
        ) != list(chain.from_iterable(fast_r)):
            return False
        c_vals = list(chain.from_iterable(map(dict.values, fast_c)))
        r_vals = list(chain.from_iterable(map(dict.values, fast_r)))
        c_seen, r_seen = set(map(type, c_vals)), set(map(type, r_vals))
        if any(issubclass(tp, Mapping) for tp in c_seen | r_seen):
            return False
        # the merged state in reference order: copies of the checkpoint's entries, and the
        # other parameters one by one (few: backfilled ones, unusual entry types)
        mismatches = self.outcome.mismatches
        mark = len(mismatches)
        spans: list[tuple[int, int, int]] = []  # (r position, first, end) of their mismatches
        copies = iter(list(map(dict.copy, fast_c)))
        pids = iter(r_state)
        done = 0
        for slow in compress(count(), map(not_, fast)):
            state.update(zip(islice(pids, slow - done), copies))  # noqa: B905
            pid = next(pids)
            first = len(mismatches)
            self._state(c_state, {pid: r_state[pid]}, state, prefix)
            if len(mismatches) > first:
                spans.append((slow, first, len(mismatches)))
            done = slow + 1
        state.update(zip(pids, copies))  # noqa: B905
        bad = _mismatched(c_vals, r_vals, c_seen, r_seen)
        if not bad:
            return True
        # name the batch's mismatches, and put all of them in walk order
        positions = list(compress(count(), fast))
        ends = list(accumulate(map(len, fast_c)))
        found: list[tuple[int, int, Mismatch]] = []
        for i in bad:
            n = bisect_right(ends, i)
            pid = next(islice(r_state, positions[n], None))
            fields = state[pid]
            name = list(fields)[i - (ends[n - 1] if n else 0)]
            key = f"{_state_key(prefix, pid)}.{name}"
            found.append(
                (positions[n], i, Mismatch(key, _meta(c_vals[i], key), _meta(r_vals[i], key)))
            )
            self.outcome.take_reference[key] = Slot(
                partial(fields.__setitem__, name), c_vals[i], r_vals[i]
            )
        for at, first, end in spans:
            found.extend((at, k, mismatches[k]) for k in range(first, end))
        found.sort(key=itemgetter(0, 1))
        mismatches[mark:] = [m for _, _, m in found]
        return True

    def _entry(
        self, c_entry: dict[Any, Any], r_entry: Mapping[Any, Any], key: str
    ) -> dict[Any, Any]:
        """One parameter's state when both sides have the same state names (the common case)."""
        fields: dict[Any, Any] = {}
        mark = len(self.outcome.mismatches)
        for name, cv in c_entry.items():
            rv = r_entry[name]
            if isinstance(cv, Mapping) or isinstance(rv, Mapping):  # nested state: the general walk
                for m in self.outcome.mismatches[mark:]:
                    del self.outcome.take_reference[m.key]
                del self.outcome.mismatches[mark:]
                return self._tree(c_entry, r_entry, key + ".", in_state=True)
            self._leaf(fields, name, cv, rv, f"{key}.{name}")
        return fields

    def _groups(
        self, c: Mapping[Any, Any], r: Mapping[Any, Any], prefix: str
    ) -> list[dict[str, Any]]:
        """Merge param groups: hyperparameters from the checkpoint, membership from the reference.

        A reference group takes the hyperparameters of its checkpoint group: the
        one at the same position (as ``Optimizer.load_state_dict`` pairs groups)
        when some of its members come from it, else the one most of its members
        come from (the first on a tie; groups were reordered). New members and
        members moved from another group take them too (biases moved to the
        no-decay group get its decay, however many they are), hyperparameters the checkpoint
        group lacks come from the reference group, and a reference group with no
        member in the checkpoint is taken whole from the reference. The ``params``
        lists are the reference's (``Optimizer.load_state_dict`` maps by position),
        so a checkpoint parameter that no longer exists is in no group.
        """
        where = prefix + PARAM_GROUPS
        c_groups = [
            (g, _group_items(g, f"{where}[{i}] (checkpoint)"))
            for i, g in enumerate(c[PARAM_GROUPS])
        ]
        r_groups = [
            (g, _group_items(g, f"{where}[{i}] (reference)")) for i, g in enumerate(r[PARAM_GROUPS])
        ]
        self._check_positional(c_groups, r_groups, c, r, where)
        try:
            c_index: dict[Any, int] = {}
            for i, (g, _) in enumerate(c_groups):
                c_index.update(zip(g[PARAMS], repeat(i)))
            r_index: dict[Any, int] = {}
            for i, (g, _) in enumerate(r_groups):
                r_index.update(zip(g[PARAMS], repeat(i)))
            for side, index, sides_groups in (
                ("checkpoint", c_index, c_groups),
                ("reference", r_index, r_groups),
            ):
                if len(index) != sum(len(g[PARAMS]) for g, _ in sides_groups):
                    _twice(sides_groups, side, where)
        except TypeError:  # an unhashable param id: name it
            for side, sides_groups in (("checkpoint", c_groups), ("reference", r_groups)):
                for i, (g, _) in enumerate(sides_groups):
                    for pid in g[PARAMS]:
                        key_str(pid, f"{where}[{i}] ({side})")
            raise StateDictTypeError(f"{where}: a param id is unhashable") from None
        c_names = [{name for name, _ in items} for _, items in c_groups]
        r_names = [{name for name, _ in items} for _, items in r_groups]
        group_prefix = prefix + PG_PREFIX
        missing = self.outcome.missing
        out: list[dict[str, Any]] = []
        matched: set[int] = set()
        empty_c_groups = iter([i for i, (g, _) in enumerate(c_groups) if not g[PARAMS]])
        for ri, (rg, r_items) in enumerate(r_groups):
            params = rg[PARAMS]
            if not set(map(type, params)) <= {int, str}:  # key_str raises, naming the first
                [key_str(pid, f"{where}[{ri}]") for pid in params]
            owners = list(map(c_index.get, params))  # each member's checkpoint group
            # the checkpoint group at the same position, as Optimizer.load_state_dict pairs
            # groups, when some member comes from it; else where most members come from
            ci = ri if ri in owners else _most_common(owners)
            if ci is None and not params:  # an empty group: the checkpoint's next empty one
                ci = next(empty_c_groups, None)
            if ci is None:
                for pid in params:
                    s = key_str(pid, "")
                    missing.extend(f"{group_prefix}{s}.{name}" for name, _ in r_items)
                out.append(_copy_group(rg))
                continue
            matched.add(ci)
            cg, c_items = c_groups[ci]
            if self.keep:
                group = dict(c_items)
            else:  # what the reference group lacks is left out, as a flat merge drops it
                group = {name: v for name, v in c_items if name in r_names[ri]}
            for name, value in r_items:
                group.setdefault(name, value)
            group[PARAMS] = list(params)
            out.append(group)
            lacking = [name for name, _ in r_items if name not in c_names[ci]]
            if not lacking and owners.count(ci) == len(owners):
                continue  # every member has the group's hyperparameters in the checkpoint
            for pid, own in zip(params, owners, strict=True):
                s = key_str(pid, "")
                if own == ci:
                    names = lacking
                else:
                    have = c_names[own] if own is not None else ()
                    names = [name for name, _ in r_items if name not in have]
                    if own is not None and self.want_conflicts:
                        self.outcome.conflicts.append(
                            f"{where}: {s} moved: it is in checkpoint group {own} but the "
                            f"reference puts it with members of checkpoint group {ci}, whose "
                            "hyperparameters it takes"
                        )
                missing.extend(f"{group_prefix}{s}.{name}" for name in names)
        if len(matched) < len(c_groups):
            self.any_unexpected = True
            if self.keep:  # a checkpoint group no reference group took: kept for its dead members
                for i, (g, _) in enumerate(c_groups):
                    # (not for members that live on in a reference group: torch rejects a
                    # parameter listed twice, and more groups than the optimizer has)
                    dead = [pid for pid in g[PARAMS] if pid not in r_index]
                    if i not in matched and (dead or not g[PARAMS]):
                        out.append({**_copy_group(g), PARAMS: dead})
        for ci, (cg, _) in enumerate(c_groups):
            for ri in set(map(r_index.get, cg[PARAMS], repeat(-1))):
                if ri < 0 or not c_names[ci] <= r_names[ri]:
                    self.any_unexpected = True
        return out

    def _check_positional(
        self,
        c_groups: list[tuple[Any, Any]],
        r_groups: list[tuple[Any, Any]],
        c: Mapping[Any, Any],
        r: Mapping[Any, Any],
        where: str,
    ) -> None:
        """Int-keyed optimizers map params by position: group sizes must agree, as torch demands."""
        kinds = set(map(type, c[STATE]))
        kinds.update(map(type, r[STATE]))
        for g, _ in c_groups + r_groups:
            kinds.update(map(type, g[PARAMS]))
        if kinds != {int}:
            return
        if len(c_groups) != len(r_groups):
            self.outcome.problems.append(
                f"{where}: the checkpoint has {len(c_groups)} param group(s) but the reference has "
                f"{len(r_groups)}; Optimizer.load_state_dict maps int-keyed state by position and "
                "rejects this. Save fqn-keyed state (get_optimizer_state_dict) to merge across "
                "model changes."
            )
            return
        for i, ((cg, _), (rg, _)) in enumerate(zip(c_groups, r_groups, strict=True)):
            if len(cg[PARAMS]) != len(rg[PARAMS]):
                self.outcome.problems.append(
                    f"{where}[{i}]: {len(cg[PARAMS])} params in the checkpoint but "
                    f"{len(rg[PARAMS])} in the reference; Optimizer.load_state_dict maps int-keyed "
                    "state by position and rejects a group whose size changed. Save fqn-keyed "
                    "state (get_optimizer_state_dict) to merge across model changes."
                )

    def _optimizer_unexpected(
        self, c: Mapping[Any, Any], r: Mapping[Any, Any], out: dict[Any, Any], prefix: str
    ) -> None:
        c_state, r_state = c[STATE], r[STATE]
        state = out[STATE]
        state_prefix = prefix + STATE_PREFIX
        for pid, c_entry in c_state.items():
            key = state_prefix + key_str(pid, prefix + STATE)
            r_entry = r_state.get(pid, MISSING)
            if not isinstance(c_entry, Mapping):  # an optimizer-level entry: a leaf
                _require_optimizer_level(pid, key, c, r)
                if r_entry is MISSING:
                    self.outcome.unexpected.append(key)
                    if self.keep:
                        state[pid] = c_entry
                elif isinstance(r_entry, Mapping):
                    raise LayoutError(
                        f"{key!r} is a parameter's state (a mapping) on one side and an "
                        "optimizer-level entry (a leaf) on the other"
                    )
                continue
            if r_entry is MISSING:
                self.outcome.unexpected.extend(_flat_keys(c_entry, key, in_optimizer=True))
                if self.keep:
                    state[pid] = copy_tree(c_entry, in_optimizer=True)
            elif not (
                type(c_entry) is dict
                and c_entry.keys() == r_entry.keys()
                and not any(isinstance(v, Mapping) for v in c_entry.values())
            ):  # only flat entries with the same names have nothing unexpected (see _entry)
                self._tree_unexpected(c_entry, r_entry, state[pid], key + ".", in_state=True)
        where = prefix + PARAM_GROUPS
        r_names: dict[Any, set[str]] = {}
        for g in r[PARAM_GROUPS]:
            r_group_names = {name for name in g if name != PARAMS}
            for pid in g[PARAMS]:
                r_names[pid] = r_group_names
        group_prefix = prefix + PG_PREFIX
        unexpected = self.outcome.unexpected
        for i, g in enumerate(c[PARAM_GROUPS]):
            names = [name for name in g if name != PARAMS]
            for pid in g[PARAMS]:
                have = r_names.get(pid)
                if have is not None and have.issuperset(names):
                    continue
                s = key_str(pid, f"{where}[{i}]")
                unexpected.extend(
                    f"{group_prefix}{s}.{name}"
                    for name in names
                    if have is None or name not in have
                )
        c_extra = _extras(c)
        if c_extra:  # after param_groups, as flatten spells them
            self._tree_unexpected(c_extra, _extras(r), out, prefix, in_state=True)


def _most_common(owners: list[int | None]) -> int | None:
    """The checkpoint group most members come from (the first on a tie), ``None`` if none."""
    counts: dict[int, int] = {}
    for own in owners:
        if own is not None:
            counts[own] = counts.get(own, 0) + 1
    if not counts:
        return None
    best = max(counts.values())
    return next(own for own, n in counts.items() if n == best)


def _twice(groups: list[tuple[Any, Any]], side: str, where: str) -> None:
    """Raise :class:`LayoutError` naming a param id listed twice among ``groups``."""
    seen: dict[Any, int] = {}
    for i, (g, _) in enumerate(groups):
        for pid in g[PARAMS]:
            if pid in seen:
                raise LayoutError(
                    f"{where} ({side}): parameter {short_repr(pid)} is listed twice (in groups "
                    f"{seen[pid]} and {i}); torch.optim rejects a parameter in two groups"
                )
            seen[pid] = i


def _require_optimizer_level(pid: Any, key: str, *osds: Mapping[Any, Any]) -> None:
    """Raise unless ``pid``, whose state entry is a leaf, is no parameter of ``osds``' groups.

    A leaf in ``state`` is an optimizer-level entry (MADGRAD keeps ``state['k']``);
    a parameter's state must be a mapping.
    """
    for osd in osds:
        if lists_param(osd, pid):
            raise LayoutError(
                f"{key!r}: the optimizer state of a parameter must be a mapping of state "
                "names to values"
            )


def _extras(osd: Mapping[Any, Any]) -> dict[Any, Any]:
    """The keys of an optimizer state dict beside ``state`` and ``param_groups``."""
    if len(osd) == 2:
        return {}
    return {k: v for k, v in osd.items() if k != STATE and k != PARAM_GROUPS}


def _state_key(prefix: str, pid: Any) -> str:
    return prefix + STATE_PREFIX + key_str(pid, prefix + STATE)


def _id_types_ok(state: Mapping[Any, Any]) -> bool:
    """Whether every param id is a str or an int (else the walk raises, in order)."""
    return set(map(type, state)) <= {int, str}


def _id_kind(osd: Mapping[Any, Any]) -> type | None:
    """``int`` or ``str`` when every param id of an optimizer state dict has that type."""
    kinds = set(map(type, osd[STATE]))
    for group in osd[PARAM_GROUPS]:
        if isinstance(group, Mapping) and isinstance(group.get(PARAMS), (list, tuple)):
            kinds.update(map(type, group[PARAMS][:1]))
    return kinds.pop() if len(kinds) == 1 else None


def _check_id_kinds(c: Mapping[Any, Any], r: Mapping[Any, Any], prefix: str) -> None:
    c_kind, r_kind = _id_kind(c), _id_kind(r)
    if {c_kind, r_kind} == {int, str}:
        where = f" at {prefix[:-1]!r}" if prefix else ""
        raise LayoutError(
            f"the checkpoint optimizer{where} is keyed by {c_kind.__name__ if c_kind else ''} "
            f"param ids and the reference by {r_kind.__name__ if r_kind else ''} ids: one came "
            "from optimizer.state_dict() (int ids), the other from get_optimizer_state_dict "
            "(fqns). Produce both the same way."
        )


def _flat_pair(c: Mapping[Any, Any], r: Mapping[Any, Any]) -> bool:
    """Whether two sub-dicts are both flat with str keys (the flat pass handles them)."""
    return (
        set(map(type, c)) <= {str}
        and set(map(type, r)) <= {str}
        and layout_of(c, value_types(c)) is Layout.FLAT
        and layout_of(r, value_types(r)) is Layout.FLAT
    )


def _optimizer_vs_tree(key: str) -> LayoutError:
    where = f"at {key!r}" if key else "at the top level"
    return LayoutError(
        f"{where} one side is a nested optimizer state dict ('state' + 'param_groups') and the "
        "other is not. If one is flattened (flatten_optimizer_state_dict=True), convert the other "
        "with dsdmerge.flatten() so both have the same layout."
    )
