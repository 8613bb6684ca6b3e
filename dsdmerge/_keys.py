"""Flat key alignment: which keys are missing, which unexpected, and the merged key set.

What it means, before how. For two flat state dicts ``c`` (the checkpoint) and
``r`` (the reference):

* *missing*: the keys of ``r`` that ``c`` lacks, in ``r``'s order;
* *unexpected*: the keys of ``c`` that ``r`` lacks, in ``c``'s order;
* the merged dict (:func:`merged`): ``{**r, **c}`` as a mapping, the values of ``c``
  by identity, in ``c``'s key order with the missing keys after it (in ``r``'s order);
  unexpected keys dropped when asked;
* flat keys are exactly ``str`` (:func:`require_str_keys`).

How: state dicts of one model come in one key order, so :func:`align` walks the
two key sequences side by side a chunk at a time, comparing chunks as lists in C
(a string comparison per key, no hashing) and looking a key up only where the
sequences differ. Its ``runs`` of equal keys give the checkpoint's value at every
reference position without a lookup (:func:`values_at`). Keys in another order
make the walk give up; :func:`union` and :func:`missing_in_union` then find the
same answers by hashing every key once.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from itertools import chain, compress, count, filterfalse, islice, repeat
from operator import is_, ne
from typing import Any, NamedTuple

from dsdmerge._text import short_repr
from dsdmerge.errors import StateDictTypeError

__all__ = [
    "Aligned",
    "align",
    "at_positions",
    "merged",
    "missing_in_union",
    "require_str_keys",
    "union",
    "values_at",
]


def require_str_keys(mapping: Mapping[Any, Any], what: str, key_types: set[type]) -> None:
    """Raise unless ``key_types`` (the types of the keys of ``mapping``) is just ``str``."""
    if key_types - {str}:
        bad = next(k for k in mapping if type(k) is not str)
        raise StateDictTypeError(
            f"{what}: flat state dict keys must be str, got {short_repr(bad)} "
            f"({type(bad).__name__})"
        )


class Aligned(NamedTuple):
    """What :func:`align` found: runs of equal keys, and the keys on one side only."""

    runs: list[tuple[int, int, int]]  # (checkpoint position, reference position, length)
    missing: list[str]  # in reference order
    unexpected: list[str]  # in checkpoint order


_CHUNK = 1024  # keys taken from each side at a time in align


def align(
    c: Mapping[str, Any], r: Mapping[str, Any], c_key_types: set[type], r_key_types: set[type]
) -> Aligned | None:
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
    return Aligned(runs, missing, unexpected)


def _add_key_types(types: set[type], keys: list[Any]) -> None:
    """Add the types of ``keys`` to ``types`` (counting exact str is the cheap common case)."""
    if list(map(type, keys)).count(str) == len(keys):
        types.add(str)
    else:
        types.update(map(type, keys))


def values_at(
    c: Mapping[str, Any],
    r: Mapping[str, Any],
    runs: list[tuple[int, int, int]],
    missing: list[str],
    fill: Any = None,
    start: int = 0,
) -> Iterator[Any]:
    """The checkpoint's value at each position of the reference, lazily, from :func:`align`.

    Where the checkpoint lacks the key, ``fill`` stands in (the reference's own value
    when ``fill`` is ``None``); from the reference's position ``start`` on. The pieces
    (one per run and gap) are made up front and chained: C-level iterators over one
    iterator of the checkpoint's values (and one of ``missing``), where a piece
    ``islice(values, k, k)`` skips ``k`` unexpected values when it is reached. So the
    pieces read the values in order, each once, and no Python frame runs while they do.
    """
    values = iter(c.values())
    keys = iter(missing)  # read in order too, by the gaps

    def gap(n: int) -> Iterable[Any]:
        return map(r.__getitem__, islice(keys, n)) if fill is None else repeat(fill, n)

    pieces: list[Iterable[Any]] = []
    at_c = at_r = m = 0
    for i, j, n in runs:
        if j > at_r:  # missing keys before this run
            pieces.append(gap(j - at_r))
            m += j - at_r
        if i > at_c:  # skip the unexpected ones
            pieces.append(islice(values, i - at_c, i - at_c))
        pieces.append(islice(values, n))
        at_c, at_r = i + n, j + n
    if m < len(missing):
        pieces.append(gap(len(missing) - m))
    out = chain.from_iterable(pieces)
    return islice(out, start, None) if start else out


def at_positions(
    c_items: list[Any], r_items: list[Any], runs: list[tuple[int, int, int]]
) -> list[Any]:
    """Per reference position, the checkpoint's item (``r_items``' where the checkpoint lacks it).

    ``c_items`` and ``r_items`` are per-value lists of the two sides (their values, or
    their types), ``runs`` what :func:`align` found: a list made of slices, as
    :func:`values_at` would give for the values.
    """
    out: list[Any] = []
    at = 0
    for i, j, n in runs:
        if j > at:  # missing keys before this run
            out += r_items[at:j]
        out += c_items[i : i + n]
        at = j + n
    out += r_items[at:]
    return out


def merged(
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


def union(c: Mapping[str, Any], r: Mapping[str, Any]) -> tuple[dict[str, Any], list[str], int]:
    """``({**r, **c}, unexpected, number of missing keys)``: every key hashed once.

    The union has the reference's keys in order, with the checkpoint's value wherever
    the checkpoint has the key, then the checkpoint's new keys (the unexpected ones)
    in order. A missing key keeps the reference's own value in it.
    """
    joined = {**r, **c}
    n_r = len(r)
    unexpected = list(islice(joined, n_r, None)) if len(joined) > n_r else []
    return joined, unexpected, len(joined) - len(c)


def missing_in_union(
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
