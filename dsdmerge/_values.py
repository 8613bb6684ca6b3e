"""Leaf values: what a leaf is, how a nested key is spelled, when two values are equal.

* :func:`key_str`: the flat-key spelling of a nested key (``str`` as is, ``int`` in
  decimal; anything else is refused).
* :func:`freeze` / :func:`same_value`: equality of hyperparameter values (floats by
  value with NaN equal to NaN, containers element-wise, small CPU tensors by content,
  everything else by identity), bounded for hostile values.
* :func:`is_tensor_like` / :func:`tensor_like`: a value is tensor-like when its class
  defines ``shape`` and ``dtype``; :data:`KNOWN_LEAF_TYPES` are the common leaf types, and
  :func:`leaf_codes` tells them apart in one C-level pass.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

# re-exported: the modules that take their value helpers from here take it too
from dsdmerge._text import short_repr as short_repr
from dsdmerge.errors import StateDictTypeError

__all__: list[str] = []

MISSING: Any = object()
"""A value no state dict holds: "no value here" where ``None`` is a value."""


def key_str(key: object, where: str) -> str:
    """The flat-key spelling of a nested key: ``str`` as is, ``int`` in decimal."""
    tp = type(key)
    if tp is str:
        return key  # type: ignore[return-value]
    if tp is int:
        return str(key)
    if isinstance(key, int) and not isinstance(key, bool):
        return str(int(key))
    place = f"under {where!r}" if where else "at the top level"
    raise StateDictTypeError(
        f"key {short_repr(key)} {place} is a {tp.__name__}; state dict keys must be str "
        "(module paths, state names) or int (optimizer param ids)."
    )


# freeze() compares containers by content up to this depth and this many items in all;
# deeper, larger or cyclic values compare by identity (a hostile value costs bounded work).
_FREEZE_DEPTH = 32
_FREEZE_ITEMS = 4096


class _TooBig(Exception):
    pass


def freeze(value: Any) -> Any:
    """A hashable stand-in for a hyperparameter value: equal values, equal stand-ins.

    Floats compare by value (NaN equals NaN here), tuples and lists element-wise,
    small CPU tensors by dtype, shape and contents; anything unhashable, any other
    tensor, and containers that are cyclic, deeper than 32 levels or hold more
    than 4096 items in all, by identity.
    """
    try:
        return _freeze(value, 0, [_FREEZE_ITEMS])
    except _TooBig:
        return ("id", id(value))


def _freeze(value: Any, depth: int, budget: list[int]) -> Any:
    tp = type(value)
    if tp is float:
        return (float, "nan") if math.isnan(value) else (float, value)
    if tp in (str, int, bool) or value is None:
        return (tp, value)
    if tp is tuple or tp is list or isinstance(value, Mapping):
        budget[0] -= len(value)
        if depth >= _FREEZE_DEPTH or budget[0] < 0:
            raise _TooBig
        if tp is tuple or tp is list:
            return (tp, tuple(_freeze(item, depth + 1, budget) for item in value))
        return (
            Mapping,
            tuple(
                (_freeze(k, depth + 1, budget), _freeze(v, depth + 1, budget))
                for k, v in value.items()
            ),
        )
    if isinstance(value, torch.Tensor):
        if (
            tp is torch.Tensor
            and value.layout == torch.strided
            and not value.is_quantized
            and value.device.type == "cpu"
            and value.numel() <= 64
        ):
            try:
                return (tp, str(value.dtype), tuple(value.shape), repr(value.tolist()))
            except (RuntimeError, TypeError, ValueError, NotImplementedError):
                pass  # a tensor whose contents cannot be read as Python values
        return ("id", id(value))
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return (tp, value)


def same_value(a: Any, b: Any) -> bool:
    """Whether two hyperparameter values are equal in the sense of :func:`freeze`."""
    if a is b:
        return True
    try:
        return bool(freeze(a) == freeze(b))
    except Exception:  # an exotic __eq__; treat as different  # noqa: BLE001
        return False


def tensor_like(types: Iterable[type]) -> frozenset[type]:
    """The tensor-like ones among ``types``.

    A type is tensor-like when the class itself defines both ``shape`` and
    ``dtype``: ``torch.Tensor`` and its subclasses (``Parameter``, ``DTensor``,
    meta tensors), :class:`~dsdmerge.TensorMeta`, NumPy arrays.
    """
    return frozenset(tp for tp in types if is_tensor_like(tp))


def is_tensor_like(tp: type) -> bool:
    """Whether values of class ``tp`` are tensor-like (see :func:`tensor_like`)."""
    return hasattr(tp, "shape") and hasattr(tp, "dtype")


# The value types of almost every flat state dict (a constant, never modified): values of any
# other type send :func:`dsdmerge._tensors.scan` to the general path, so it decides nothing a
# full type test would not.
KNOWN_LEAF_TYPES = frozenset(
    {torch.Tensor, torch.nn.Parameter, float, int, bool, type(None), str, tuple, list}
)
KNOWN_TENSORS = frozenset(tp for tp in KNOWN_LEAF_TYPES if is_tensor_like(tp))

_LEAF_CODES: dict[type, int] = {tp: int(tp in KNOWN_TENSORS) for tp in KNOWN_LEAF_TYPES}


def leaf_codes(values: Iterable[Any]) -> bytes | None:
    """Per value, 1 for a torch tensor and 0 for another common leaf, in one C-level pass.

    ``None`` when some value has another type (a mapping, a NumPy array, a tensor
    subclass such as DTensor, ...): the caller then scans the types in full. When
    not ``None``, every value is a leaf (no mapping) and every tensor-like value
    is a ``torch.Tensor`` or ``Parameter``.
    """
    try:
        return bytes(map(_LEAF_CODES.__getitem__, map(type, values)))
    except KeyError:  # a type not in the table
        return None


def shape_dtype(value: Any) -> tuple[tuple[int, ...], Any]:
    """The ``(shape, dtype)`` of a tensor-like value, the shape as a tuple of ints."""
    return tuple(int(n) for n in value.shape), value.dtype
