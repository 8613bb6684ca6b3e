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
other value of a merge is still shared by identity.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from dsdmerge._records import Resized
from dsdmerge.errors import StateDictTypeError

__all__ = ["OnShapeMismatch", "Resized", "resize"]

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

    Example:
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
    with torch.no_grad():
        out = _real_part(reference.detach(), dtype).to(dtype=dtype, copy=True)
        out[overlap].copy_(_real_part(checkpoint.detach()[overlap], dtype))
    return out


def _real_part(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor``, or its real part when it is complex and ``dtype`` is not.

    (torch's own cast keeps the real part too, with a warning about it; the merge
    reports that cast itself.)
    """
    return tensor.real if tensor.is_complex() and not dtype.is_complex else tensor
