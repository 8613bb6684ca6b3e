"""Tensor checks: which value pairs differ in shape or dtype (the hot loop of every merge).

What it means, before how: a pair of values *mismatches* when both are tensor-like
(their classes define ``shape`` and ``dtype``: torch tensors, parameters, DTensors,
meta tensors, :class:`~dsdmerge.TensorMeta`, NumPy arrays), they are not the same
object, and their shapes or dtypes differ; a pair whose shapes cannot be compared
mismatches. Scalars never mismatch. A mismatch is reported as a
:class:`~dsdmerge.Mismatch` naming the key (a value that only looks tensor-like is a
:class:`~dsdmerge.StateDictTypeError` naming it).

How: one C-level type pass over each side's values (:func:`scan`), type checks once
per distinct type, and, when every compared value is a torch tensor, all pairs
compared at once with ``map(ne, map(attrgetter("shape", "dtype"), ...))`` (the
attribute fetches are most of the cost: ``.shape`` builds a new ``torch.Size``).
Tensors whose ``.shape`` raises are compared pair by pair.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from itertools import compress
from operator import and_, attrgetter, ne
from typing import Any, NamedTuple

import torch

from dsdmerge._records import Mismatch, TensorMeta
from dsdmerge._values import KNOWN_LEAF_TYPES, KNOWN_TENSORS, tensor_like
from dsdmerge.errors import StateDictTypeError

__all__ = [
    "KNOWN_TENSOR_TYPES",
    "Scanned",
    "differs",
    "meta",
    "mismatched",
    "mismatches",
    "same_view",
    "scan",
    "tied",
]


KNOWN_TENSOR_TYPES = tensor_like(KNOWN_LEAF_TYPES)


class Scanned(NamedTuple):
    """One pass over a state dict's values: each one's type, and what follows from them.

    ``kinds``: the type of each value, in order; ``types``: the distinct ones;
    ``picked``: 1 per torch tensor and 0 per other value when every type is a
    common leaf type (:data:`~dsdmerge._values.KNOWN_LEAF_TYPES`), else ``None``.
    """

    picked: bytes | None
    types: set[type]
    kinds: list[type]

    def tensor_codes(self) -> tuple[bytes, frozenset[type]]:
        """1 per tensor-like value and 0 per other, and the tensor-like types among them.

        ``picked`` when every type is a common leaf type; else by the general test
        (:func:`~dsdmerge._values.tensor_like`) over the types seen.
        """
        if self.picked is not None:
            return self.picked, KNOWN_TENSOR_TYPES
        tt = tensor_like(self.types)
        return (bytes(map(tt.__contains__, self.kinds)) if tt else b""), tt


def scan(sd: Mapping[Any, Any]) -> Scanned:
    """The :class:`Scanned` values of ``sd``: one C-level type pass.

    torch writes an optimizer's state tensors first: a leading run of tensors
    (:func:`run_length`, in pointer comparisons) is not looked at
    again; the rest of the types are collected into a set, and only when tensors stand
    among them is each type tested again.
    """
    kinds = list(map(type, sd.values()))
    n = len(kinds)
    first = run_length(kinds, torch.Tensor) if n and kinds[0] is torch.Tensor else 0
    rest = set(kinds[first:]) if first < n else set()
    types = rest | {torch.Tensor} if first else rest
    if not types <= KNOWN_LEAF_TYPES:
        return Scanned(None, types, kinds)
    if rest.isdisjoint(KNOWN_TENSORS):
        return Scanned(b"\x01" * first + bytes(n - first), types, kinds)
    return Scanned(bytes(map(KNOWN_TENSORS.__contains__, kinds)), types, kinds)


def run_length(items: list[Any], item: Any, start: int = 0) -> int:
    """How many items from ``start`` on are ``item`` (or ``==`` it), in C-level comparisons.

    Galloping comparisons of slices with ``[item] * n``, then a bisection: a list
    comparison stops at its first difference, so the cost is about the run's length
    in identity comparisons (a type list: one pointer comparison per item).
    """
    n = len(items)
    at, size = start, 1
    while at < n:
        step = min(size, n - at)
        if items[at : at + step] == [item] * step:
            at += step
            size *= 2
            continue
        while step > 1:  # the first item unlike ``item`` is among the next ``step``
            half = step // 2
            if items[at : at + half] == [item] * half:
                at += half
                step -= half
            else:
                step = half
        break
    return at - start


def meta(value: Any, key: str) -> TensorMeta:
    """The :class:`TensorMeta` of a tensor-like value at ``key`` (a bad one is refused, named)."""
    try:
        return TensorMeta.of(value)
    except StateDictTypeError as err:  # a value that only looks tensor-like: name its key
        raise StateDictTypeError(f"{key!r}: {err}") from None


def differs(c: Any, r: Any) -> bool:
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


def mismatched(
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
    # plain tensors on both sides (almost every call) need no type tests at all
    plain = c_seen <= KNOWN_TENSORS and r_seen <= KNOWN_TENSORS
    c_tt = frozenset(c_seen) if plain else tensor_like(c_seen)
    r_tt = frozenset(r_seen) if plain else tensor_like(r_seen)
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
    if plain or (_torch_types(c_tt) and _torch_types(r_tt)):
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
        if cv is not rv and differs(cv, rv)
    ]


def mismatches(
    r: Mapping[str, Any],
    picked: bytes,
    u_vals: list[Any],
    r_vals: list[Any],
    r_tensor_types: frozenset[type],
    key_prefix: str,
) -> list[Mismatch]:
    """The :class:`Mismatch` records of tensor pairs taken from ``r``'s tensor positions.

    ``picked`` has a 1 per tensor-like value of ``r``; ``u_vals`` and ``r_vals`` are the
    two sides' values at those positions (``u_vals``: the checkpoint's, or the
    reference's own where the checkpoint lacks the key). Keys are named with
    ``key_prefix`` in errors.
    """
    bad = mismatched(u_vals, r_vals, None, r_tensor_types)
    if not bad:
        return []
    r_keys = list(compress(r, picked))
    out = []
    for i in bad:
        where = key_prefix + r_keys[i]
        out.append(Mismatch(r_keys[i], meta(u_vals[i], where), meta(r_vals[i], where)))
    return out


# --------------------------------------------------------------------------------------
# tied weights


def _real(value: Any) -> bool:
    """A plain torch tensor with memory (not meta, not empty, strided): one that can be tied."""
    return (
        type(value) in KNOWN_TENSORS
        and value.layout == torch.strided
        and not value.is_meta
        and value.numel() > 0
    )


def same_view(a: Any, b: Any) -> bool:
    """Whether two plain tensors are views of the same memory in the same way (tied weights)."""
    return (
        _real(a)
        and _real(b)
        and a.data_ptr() == b.data_ptr()
        and a.device == b.device
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


def tied(
    r: Mapping[str, Any],
    missing: list[str],
    picked: bytes,
    tieable: Callable[[str], bool],
) -> list[tuple[str, str]]:
    """``(missing key, key)`` pairs: a missing key's reference tensor is a key's the checkpoint has.

    Tied weights: a model whose ``lm_head.weight`` is its ``embed.weight`` holds one
    tensor under both keys, and a ``save_pretrained`` checkpoint keeps one of them.
    The first such key in reference order, among keys ``tieable`` accepts (not an
    optimizer's), for each missing key with memory (:func:`same_view`) that
    ``tieable`` accepts. How: the data pointers of the missing tensors first; the
    reference's other tensors are looked at only when some missing one can be tied,
    and ``tieable`` is asked only of the two keys of a pair that share memory (a
    fresh optimizer's state tensors share none: it is asked nothing).
    """
    wanted: dict[int, list[str]] = {}
    for key in missing:
        t = r[key]
        if _real(t):
            wanted.setdefault(t.data_ptr(), []).append(key)
    if not wanted:
        return []
    lost = set(missing)
    found: dict[str, str] = {}
    keys = list(compress(r, picked))
    values = list(compress(r.values(), picked))
    plain = bytes(map(KNOWN_TENSORS.__contains__, map(type, values)))
    keys, values = list(compress(keys, plain)), list(compress(values, plain))
    try:  # every pointer in one C-level pass
        ptrs = list(map(torch.Tensor.data_ptr, values))
    except RuntimeError:  # a tensor without storage (sparse): one by one
        ptrs = [t.data_ptr() if _real(t) else -1 for t in values]
    near = bytes(map(wanted.__contains__, ptrs))
    n_wanted = sum(map(len, wanted.values()))
    close = zip(compress(keys, near), compress(values, near), compress(ptrs, near), strict=True)
    for key, t, ptr in close:
        if key in lost or not tieable(key):
            continue
        for m in wanted[ptr]:
            if m not in found and same_view(r[m], t):
                if tieable(m):
                    found[m] = key
                else:  # an optimizer's key: never tied, and not looked for again
                    found[m] = ""
        if len(found) == n_wanted:
            break
    return [(m, found[m]) for m in missing if found.get(m)]
