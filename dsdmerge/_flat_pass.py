"""The flat pass: two flat state dicts compared (and merged) in a few C-level passes.

What it computes (the plain definition is :mod:`dsdmerge._spec`): the keys
missing from the checkpoint and unexpected in it (:mod:`dsdmerge._keys`), the tensor
pairs that differ in shape or dtype (:mod:`dsdmerge._tensors`), and, when merging,
``{**reference, **checkpoint}`` in the checkpoint's key order, with each missing key
tied to a checkpoint key given its tensor (:func:`~dsdmerge._tensors.tied`) and every
param group settled: backfilled ``param_groups.*`` keys given their group's checkpoint
value, moved members their new group's, conflicts found (:mod:`dsdmerge._groups`;
first the quick proof that no group can disagree). Every key is touched a small
constant number of times, with no Python frame per key in the common case.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import cache, partial
from itertools import compress, count, islice, repeat
from operator import contains, is_
from typing import Any

from dsdmerge._groups import Values, prefixed, proven_lazily, resolve
from dsdmerge._keys import (
    align,
    missing_in_union,
    require_str_keys,
    union,
    values_at,
)
from dsdmerge._keys import merged as merged_dict
from dsdmerge._records import Mismatch, Outcome, Slot
from dsdmerge._tensors import mismatches as tensor_mismatches
from dsdmerge._tensors import scan, tied
from dsdmerge._values import MISSING
from dsdmerge.layout import PG_PREFIX, holds_hyperparameters, in_section

__all__ = ["flat_pass", "run_flat"]


def flat_pass(
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
    """The flat pass: keys aligned, tensors checked, the merged dict built, groups resolved.

    ``picked``: 1 per tensor-like value of ``r``, whose types are among
    ``r_tensor_types``; ``groups``: the reference's param groups when it was nested
    (lists of fqns), else ``None`` (inferred). The group proof makes the types of the
    chunks it reads itself (as fast as it would slice them from the scan's per-value
    lists, which the engine does not keep, for their memory). See the module docstring.
    """
    c_key_types: set[type] = set()
    r_key_types: set[type] = set()
    aligned = align(c, r, c_key_types, r_key_types)
    if aligned is None:  # the keys come in another order: find the differences by hashing
        require_str_keys(c, "checkpoint", set(map(type, c)))
        require_str_keys(r, "reference", set(map(type, r)))
        return _by_union(
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
        merged = merged_dict(c, r, missing, unexpected, keep_unexpected)
    if 1 in picked:  # at the reference's tensor positions
        u_vals = list(compress(values_at(c, r, runs, missing), picked))
    if u_vals:
        r_vals = list(compress(r.values(), picked))
    mismatches = tensor_mismatches(r, picked, u_vals, r_vals, r_tensor_types, key_prefix)
    del u_vals, r_vals

    def conflict_free() -> bool:
        # the checkpoint's values at the reference's positions, read lazily (no list of them)
        c_from = partial(values_at, c, r, runs, missing, MISSING)
        return _conflict_free(r, c_from, picked, _holes(runs, len(r)))

    return _finish(
        c,
        r,
        merged,
        missing,
        unexpected,
        mismatches,
        picked=picked,
        conflicts=conflicts,
        groups=groups,
        c_at_r=lambda: values_at(c, r, runs, missing, MISSING),
        conflict_free=conflict_free if merge or conflicts else None,
    )


def _by_union(
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
    """:func:`flat_pass` for keys in other orders: every key hashed once, in ``{**r, **c}``."""
    joined, unexpected, n_missing = union(c, r)
    # The reference's tensors, and the union's values at the same places: the checkpoint's
    # value, or the reference's own tensor when the checkpoint lacks the key.
    r_vals: list[Any] = []
    u_vals: list[Any] = []
    if 1 in picked:
        r_vals = list(compress(r.values(), picked))
        u_vals = list(compress(joined.values(), picked))
    mismatches = tensor_mismatches(r, picked, u_vals, r_vals, r_tensor_types, key_prefix)
    # missing keys keep the reference's own value in the union: among the tensors, those are
    # the only candidates (besides a tensor the checkpoint shares with the reference)
    kept = list(compress(count(), map(is_, u_vals, r_vals))) if n_missing else []
    r_keys = list(compress(r, picked)) if kept else []
    missing = missing_in_union(c, r, joined, n_missing, [r_keys[i] for i in kept])
    del r_keys, r_vals, u_vals
    merged: dict[str, Any] | None = None
    if merge:
        merged = merged_dict(c, r, missing, unexpected, keep_unexpected)
    return _finish(
        c,
        r,
        merged,
        missing,
        unexpected,
        mismatches,
        picked=picked,
        conflicts=conflicts,
        groups=groups,
        conflict_free=lambda: _conflict_free(
            r, lambda start: islice(joined.values(), start, len(r)), picked
        ),
    )


def _finish(
    c: Mapping[str, Any],
    r: Mapping[str, Any],
    merged: dict[str, Any] | None,
    missing: list[str],
    unexpected: list[str],
    mismatches: list[Mismatch],
    *,
    picked: bytes,
    conflicts: bool,
    groups: list[list[str]] | None,
    c_at_r: Callable[[], Iterable[Any]] | None = None,
    conflict_free: Callable[[], bool] | None = None,
) -> Outcome:
    """The :class:`Outcome` of a flat pass.

    ``c_at_r()``, if the pass can tell: the checkpoint's values at the reference's
    positions, ``MISSING`` where it lacks the key. ``conflict_free()``, if given:
    whether no param group can have members that disagree (then none is looked at).
    A merge looks at every group (members that disagree are settled into the result)
    and so does a pass asked for ``conflicts``; a plain comparison looks at none.
    """
    slots = (
        {
            m.key: Slot(partial(merged.__setitem__, m.key), merged[m.key], r[m.key])
            for m in mismatches
        }
        if merged is not None and mismatches
        else {}
    )
    ties = _tie(r, missing, picked, merged) if missing else []
    outcome = Outcome(merged, missing, unexpected, mismatches, take_reference=slots, ties=ties)
    detect = merged is not None or conflicts
    if detect and conflict_free is not None and conflict_free():
        detect = False  # proven: no group can have members that disagree
    backfilled = list(compress(missing, map(str.startswith, missing, repeat(PG_PREFIX))))
    if backfilled or (detect and any(map(str.startswith, c, repeat(PG_PREFIX)))):
        resolve(
            c, r, groups, backfilled, outcome, detect=detect, conflicts=conflicts, c_at_r=c_at_r
        )
    if missing or detect:
        prefixed(c, r, outcome, detect=detect, conflicts=conflicts)
    return outcome


def _tie(
    r: Mapping[str, Any], missing: list[str], picked: bytes, merged: dict[str, Any] | None
) -> list[tuple[str, str, Callable[[Any], None]]]:
    """Missing keys whose reference tensor is a key's the checkpoint has take its tensor.

    Tied weights (:func:`~dsdmerge._tensors.tied`): loading the result then writes the
    checkpoint's tensor through both keys, whatever their order (a fresh copy would
    overwrite the trained one). Not for a flattened optimizer's keys. Returns the
    outcome's ``ties`` (``merged`` written already).
    """
    holds = cache(partial(holds_hyperparameters, r))  # asked once per prefix
    pairs = tied(r, missing, picked, lambda key: not in_section(r, key, holds))
    ties: list[tuple[str, str, Callable[[Any], None]]] = []
    for key, source in pairs:
        if merged is not None:
            merged[key] = merged[source]
            ties.append((key, source, partial(merged.__setitem__, key)))
        else:
            ties.append((key, source, _nowhere))
    return ties


def _nowhere(value: Any) -> None:
    """Where a value of a comparison that builds nothing goes."""


def run_flat(
    c: Mapping[str, Any],
    r: Mapping[str, Any],
    *,
    merge: bool,
    keep_unexpected: bool,
    conflicts: bool,
    key_prefix: str = "",
) -> Outcome:
    """:func:`flat_pass` of two flat mappings (a flat sub-dict pair of a nested walk)."""
    r_scan = scan(r)
    r_codes, r_tt = r_scan.tensor_codes()
    return flat_pass(
        c,
        r,
        r_codes,
        r_tt,
        merge=merge,
        keep_unexpected=keep_unexpected,
        conflicts=conflicts,
        groups=None,
        key_prefix=key_prefix,
    )


_INVERT = bytes.maketrans(b"\x00\x01", b"\x01\x00")
_PG = "param_groups."  # in every hyperparameter key, top-level or under a prefix


def _holes(runs: list[tuple[int, int, int]], n: int) -> list[int]:
    """The reference positions no run of :func:`~dsdmerge._keys.align` covers (missing keys)."""
    out: list[int] = []
    at = 0
    for _, j, length in runs:
        out += range(at, j)
        at = j + length
    out += range(at, n)
    return out


def _conflict_free(
    r: Mapping[str, Any],
    c_from: Callable[[int], Iterator[Any]],
    picked: bytes,
    holes: list[int] | None = None,
) -> bool:
    """:func:`~dsdmerge._groups.proven_consistent` over the reference's non-tensor values.

    ``c_from(i)``: the checkpoint's value at each reference position from ``i`` on;
    ``holes``, if known: the positions where the checkpoint lacks the key (its value
    there may be anything).
    Every side is read through iterators, a chunk at a time
    (:func:`~dsdmerge._groups.proven_lazily`): no list as long as ``r`` is made. A
    hyperparameter held as a tensor (some optimizers take a tensor ``lr``) is not
    covered: when a tensor's key names param groups, nothing is proven.
    """
    if len(picked) != len(r):  # no tensor-like type at all (see _engine.run)
        picked = bytes(len(r))
    first = picked.find(0)
    if first < 0:
        first = len(r)
    tail_holes = None
    if 1 not in picked[first:]:  # torch's layout: the state's tensors, then the rest
        tensor_keys: Iterable[str] = islice(r, first)
        r_vals: Values = partial(islice, r.values(), first, None)
        c_vals: Values = partial(c_from, first)
        keys: Iterable[str] = islice(r, first, None)
        if holes is not None:
            tail_holes = [p - first for p in holes if p >= first]

    else:
        others = picked.translate(_INVERT)
        tensor_keys = compress(r, picked)
        r_vals = partial(compress, r.values(), others)
        c_vals = lambda: compress(c_from(0), others)  # noqa: E731
        keys = compress(r, others)
        if holes is not None:  # their places among the others
            tail_holes = []
            before = at = 0
            for p in holes:
                before += others.count(1, at, p)
                at = p
                if others[p]:
                    tail_holes.append(before)
    if any(map(contains, tensor_keys, repeat(_PG))):
        return False
    n = len(r) - picked.count(1)
    return proven_lazily(r_vals, c_vals, n, _period(keys), holes=tail_holes)


def _period(keys: Iterable[str]) -> int:
    """How many keys in a row share the first key's prefix (one row of torch's table)."""
    it = iter(keys)
    head = next(it, "").rpartition(".")[0]
    n = 1
    for key in islice(it, 255):
        if key.rpartition(".")[0] != head:
            break
        n += 1
    return n
