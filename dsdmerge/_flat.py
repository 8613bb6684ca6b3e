"""The flat pass: two flat state dicts compared (and merged) in a few C-level passes.

What it computes (the plain definition is :mod:`dsdmerge._semantics`): the keys
missing from the checkpoint and unexpected in it (:mod:`dsdmerge._keys`), the tensor
pairs that differ in shape or dtype (:mod:`dsdmerge._tensors`), and, when merging,
``{**reference, **checkpoint}`` in the checkpoint's key order with each backfilled
``param_groups.*`` key given its group's checkpoint value and group conflicts found
(:mod:`dsdmerge._groups`). Every key is touched a small constant number of times,
with no Python frame per key in the common case.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from functools import partial
from itertools import compress, count, repeat
from operator import is_
from typing import Any

from dsdmerge._groups import prefixed, resolve
from dsdmerge._keys import align, missing_in_union, require_str_keys, union, values_at
from dsdmerge._keys import merged as merged_dict
from dsdmerge._records import Mismatch, Outcome, Slot
from dsdmerge._tensors import KNOWN_TENSOR_TYPES, scan
from dsdmerge._tensors import mismatches as tensor_mismatches
from dsdmerge._values import MISSING, tensor_like
from dsdmerge.layout import PG_PREFIX

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
    (lists of fqns), else ``None`` (inferred). See the module docstring.
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
    if 1 in picked:  # the checkpoint's values at the reference's tensor positions
        u_vals = list(compress(values_at(c, r, runs, missing), picked))
    if u_vals:
        r_vals = list(compress(r.values(), picked))
    mismatches = tensor_mismatches(r, picked, u_vals, r_vals, r_tensor_types, key_prefix)
    return _finish(
        c,
        r,
        merged,
        missing,
        unexpected,
        mismatches,
        conflicts=conflicts,
        groups=groups,
        c_at_r=lambda: values_at(c, r, runs, missing, MISSING),
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
        c, r, merged, missing, unexpected, mismatches, conflicts=conflicts, groups=groups
    )


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
        resolve(c, r, groups, backfilled, outcome, conflicts=conflicts, c_at_r=c_at_r)
    if missing or conflicts:
        prefixed(c, r, outcome, conflicts=conflicts)
    return outcome


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
    r_codes, r_types = scan(r)
    if r_codes is None:  # some value of an uncommon type: tensor-like by the general test
        r_tt = tensor_like(r_types)
        r_codes = bytes(map(r_tt.__contains__, map(type, r.values()))) if r_tt else b""
    else:
        r_tt = KNOWN_TENSOR_TYPES
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
