"""Resizing a trained tensor to a new shape: keep the trained slice, take the rest from a reference.

When a model grows (a larger vocabulary in ``embed_tokens``/``lm_head``, more
experts in a fused ``[E, ...]`` tensor, a wider head) or shrinks, the
checkpoint's tensors and their optimizer moments have the old shape. With
``on_shape_mismatch="resize"``, :func:`~dsdmerge.merge` gives each such key
(the weight, and ``exp_avg``, ``exp_avg_sq``, ``momentum_buffer`` or any state
field of the same parameter whose shape differs) a new tensor of the
reference's shape and device that holds the overlapping leading slice of
the checkpoint's tensor and the reference's values everywhere else; scalars
such as ``step`` keep the checkpoint's value (their shapes agree).

The dtype follows the rule of any dtype mismatch: the merge keeps the
checkpoint's dtype (the reference's values are cast into it) and torch casts on
load, while the policy's ``dtype`` action decides whether to say so (``strict``
refuses, ``warn`` warns); a cast that drops an imaginary part is warned about
under every policy that does not refuse it.

These are the only tensors dsdmerge ever creates: one allocation per resized
key (a clone of the reference, then one copy of the overlap into it). Every
other value of a merge is still shared by identity. A merge bounds what they
take together by the bytes its inputs' tensors hold (:func:`held_nbytes`: each
storage once, so an expanded, stride-0 reference tensor that claims a huge shape
over a few bytes cannot make it allocate gigabytes), unless told a bound; an
allocation that fails is a :class:`~dsdmerge.MergeError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch

from dsdmerge._records import Resized
from dsdmerge.errors import MergeError, StateDictTypeError

__all__ = ["OnShapeMismatch", "Resized", "held_nbytes", "resize", "resize_nbytes"]

OnShapeMismatch = Literal["raise", "take_reference", "resize"]
"""What a merge does about a tensor whose shape differs between checkpoint and reference:
``"raise"`` (as the policy says: every built-in policy raises), ``"take_reference"``
(drop the checkpoint's tensor) or ``"resize"`` (keep its overlapping slice)."""

SHAPE_CHOICES: tuple[OnShapeMismatch, ...] = ("raise", "take_reference", "resize")


def why_not_resizable(checkpoint: Any, reference: Any) -> str | None:
    """Why :func:`resize` would refuse this pair, or ``None`` if it would not."""
    for side, value in (("checkpoint", checkpoint), ("reference", reference)):
        if not isinstance(value, torch.Tensor):
            return f"the {side}'s value is a {type(value).__name__}, not a torch tensor"
        if type(value) not in (torch.Tensor, torch.nn.Parameter):
            return (
                f"the {side}'s tensor is a {type(value).__name__}; resize plain tensors (e.g. "
                "DTensor.full_tensor()) and shard the result"
            )
        if value.is_meta:
            return f"the {side}'s tensor is on the meta device (it has no values to keep)"
        if value.layout != torch.strided:
            return f"the {side}'s tensor has layout {value.layout}; only strided tensors resize"
    if checkpoint.dim() != reference.dim():
        return (
            f"its rank changed ({checkpoint.dim()} -> {reference.dim()}); only sizes of "
            "existing dimensions can change"
        )
    return None


def resize(
    checkpoint: torch.Tensor, reference: torch.Tensor, /, *, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """A new tensor like ``reference`` holding the overlapping leading slice of ``checkpoint``.

    The result has the reference's shape, device and strides, and ``dtype`` (the
    reference's by default); along each dimension, indices below both sizes hold
    the checkpoint's values (cast and moved as needed), all others the
    reference's. A grown dimension keeps every trained row; a shrunk one keeps
    the leading rows. One allocation (a copy of the reference in ``dtype``) and
    one copy of the overlap. When shape, dtype and device already agree,
    ``checkpoint`` itself is returned. Does not modify its inputs; the result is
    a new tensor (the only kind of value dsdmerge ever creates), never tracked
    by autograd. A complex value cast to a real dtype keeps its real part.

    Args:
        checkpoint: The trained tensor.
        reference: A tensor of the new shape, e.g. the fresh model's parameter
            or optimizer state.
        dtype: The result's dtype; :func:`~dsdmerge.merge` passes the
            checkpoint's (torch casts on load, as for any dtype mismatch).

    Returns:
        The new tensor.

    Raises:
        StateDictTypeError: An argument is not a plain (strided, non-meta)
            torch tensor (a DTensor: resize its ``full_tensor()``), or the ranks
            differ.
        MergeError: The new tensor could not be made (its allocation failed).

    Examples:
        >>> import torch, dsdmerge as dm
        >>> dm.resize(torch.ones(2, 2), torch.zeros(3, 2))
        tensor([[1., 1.],
                [1., 1.],
                [0., 0.]])
        >>> dm.resize(torch.ones(2, dtype=torch.float64), torch.zeros(3), dtype=torch.float64)
        tensor([1., 1., 0.], dtype=torch.float64)
    """
    problem = why_not_resizable(checkpoint, reference)
    if problem is not None:
        raise StateDictTypeError(f"cannot resize: {problem}")
    if dtype is None:
        dtype = reference.dtype
    if (
        checkpoint.shape == reference.shape
        and checkpoint.dtype == dtype
        and checkpoint.device == reference.device
    ):
        return checkpoint
    overlap = tuple(
        slice(0, min(c, r)) for c, r in zip(checkpoint.shape, reference.shape, strict=True)
    )
    try:
        with torch.no_grad():
            out = _real_part(reference.detach(), dtype).to(dtype=dtype, copy=True)
            out[overlap].copy_(_real_part(checkpoint.detach()[overlap], dtype))
    except (RuntimeError, MemoryError) as err:  # torch's allocators raise RuntimeError
        text = " ".join(str(err).split())[:200] or type(err).__name__
        nbytes = resize_nbytes(checkpoint, reference, dtype=dtype)
        raise MergeError(
            f"cannot resize: a {list(reference.shape)} {dtype} tensor of "
            f"{nbytes:,} bytes could not be made ({text})"
        ) from None
    return out


def resize_nbytes(checkpoint: Any, reference: Any, /, *, dtype: torch.dtype | None = None) -> int:
    """The bytes :func:`resize` allocates for this pair (0 when it returns ``checkpoint``).

    ``dtype`` is the one :func:`resize` would be given (the reference's by default).

    Examples:
        >>> import torch
        >>> from dsdmerge.resize import resize_nbytes
        >>> resize_nbytes(torch.ones(2), torch.zeros(4096, 4096).expand(3, 4096, 4096))
        201326592
    """
    if dtype is None:
        dtype = reference.dtype
    if (
        checkpoint.shape == reference.shape
        and checkpoint.dtype == dtype
        and checkpoint.device == reference.device
    ):
        return 0
    return int(reference.numel()) * dtype.itemsize


def held_nbytes(*trees: Any) -> int:
    """The bytes the tensors in ``trees`` hold: each storage's bytes, each storage once.

    Not their ``numel``: an expanded tensor (stride 0) claims any shape over a few
    bytes, and views of one storage share it. Meta tensors hold none. Walks mappings,
    lists and tuples at any depth (without recursion).

    Examples:
        >>> import torch
        >>> from dsdmerge.resize import held_nbytes
        >>> base = torch.zeros(4)
        >>> held_nbytes({"a": base, "b": base[:2], "c": torch.zeros(1).expand(10**6)})
        20
    """
    seen: set[tuple[str, int]] = set()
    total = 0
    stack: list[Any] = list(trees)
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            if type(value) not in (torch.Tensor, torch.nn.Parameter) or value.is_meta:
                continue  # a DTensor or a subclass: not resized; a meta tensor: no bytes
            if value.layout != torch.strided:
                continue
            storage = value.untyped_storage()
            key = (str(value.device), storage.data_ptr())
            if key not in seen:
                seen.add(key)
                total += int(storage.nbytes())
        elif isinstance(value, Mapping):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    return total


def _real_part(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor``, or its real part when it is complex and ``dtype`` is not.

    (torch's own cast keeps the real part too, with a warning about it; the merge
    reports that cast itself.)
    """
    return tensor.real if tensor.is_complex() and not dtype.is_complex else tensor
