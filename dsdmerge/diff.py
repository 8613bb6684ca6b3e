"""Key diffs between a checkpoint and a reference state dict.

A :class:`KeyDiff` is data, not a printout: three tuples of flat keys (and
mismatch records) that a trainer can log, test or turn into JSON, and a
readable ``str()``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from itertools import compress
from operator import eq, is_not
from typing import Any

from dsdmerge._engine import run
from dsdmerge._ids import one_spelling

# The records live in dsdmerge._records, below the code that produces them; this module
# re-exports them (and dtype_name, which integrations.checkpoints takes from here).
from dsdmerge._records import Changed, KeyDiff, Mismatch, SuggestedRename, TensorMeta
from dsdmerge._text import dtype_name as dtype_name
from dsdmerge._trees import flatten
from dsdmerge._values import is_tensor_like, same_value
from dsdmerge.convert import Conversions, convert_checkpoint, suggest_conversions
from dsdmerge.errors import DSDMergeError, DSDMergeWarning
from dsdmerge.layout import Layout, classify
from dsdmerge.rename import Rules, rename_checkpoint, suggest_renames

__all__ = ["Changed", "KeyDiff", "Mismatch", "TensorMeta", "diff"]


def diff(
    checkpoint: Mapping[Any, Any],
    reference: Mapping[Any, Any],
    /,
    *,
    rename: Rules | None = None,
    convert: Conversions | None = None,
    values: bool = False,
) -> KeyDiff:
    """Compare a checkpoint with a reference state dict, by flat key.

    Either side may be flat or nested (a nested side is compared as its
    :func:`~dsdmerge.flatten` would be), or a metadata-only view whose values
    are :class:`TensorMeta`. Shapes and dtypes are compared only where both
    values are tensor-like; scalars are never mismatched. With ``values=True``,
    non-tensor values present on both sides are compared too (learning rates,
    betas, ``step``: equal by value, NaN equal to NaN) and those that differ are
    in :attr:`KeyDiff.changed`. When keys are both missing and unexpected,
    :attr:`KeyDiff.renames` suggests rename rules that would pair them. Does not
    modify its inputs.

    Args:
        checkpoint: The state dict you loaded.
        reference: The state dict the model or optimizer has now.
        rename: Rename rules applied to the checkpoint first (see
            :func:`~dsdmerge.rename`); a rule that matches nothing gives a
            :class:`~dsdmerge.DSDMergeWarning`.
        convert: Layout conversions applied to the checkpoint next (see
            :func:`~dsdmerge.convert`: records and preset names, in order).
        values: Also compare non-tensor values.

    Returns:
        The :class:`KeyDiff`.

    Raises:
        StateDictTypeError: An argument is not a mapping.
        LayoutError: An argument is malformed (see :func:`~dsdmerge.flatten`).
        RenameError: A rename rule is not valid, or renames two keys to one.
        ConversionError: A conversion cannot be applied (see :func:`~dsdmerge.convert`).

    When unexpected keys would become missing ones through a conversion preset,
    :attr:`KeyDiff.conversions` names it.

    Examples:
        >>> import torch, dsdmerge as dm
        >>> ckpt = {"w": torch.zeros(2), "old": torch.zeros(1)}
        >>> ref = {"w": torch.zeros(2), "head": torch.zeros(4)}
        >>> d = dm.diff(ckpt, ref)
        >>> d.missing, d.unexpected, d.mismatched
        (('head',), ('old',), ())
        >>> fused = {"attn.qkv_proj.weight": torch.zeros(6, 4)}
        >>> dm.diff({f"attn.{n}_proj.weight": torch.zeros(2, 4) for n in "qkv"}, fused).conversions
        ('qkv',)
    """
    checkpoint, reference = one_spelling(checkpoint, reference)
    if rename is not None:
        checkpoint, unmatched = rename_checkpoint(checkpoint, rename)
        if unmatched:
            warnings.warn(DSDMergeWarning(f"dsdmerge: {unmatched}"), stacklevel=2)
    if convert is not None:
        checkpoint = convert_checkpoint(checkpoint, convert, stacklevel=2)
    outcome = run(checkpoint, reference, merge=False)
    changed = changed_values(checkpoint, reference) if values else ()
    return KeyDiff(
        tuple(outcome.missing),
        tuple(outcome.unexpected),
        tuple(outcome.mismatches),
        tuple(changed),
        suggest(checkpoint, reference, outcome.missing, outcome.unexpected),
        conversions=conversions_for(checkpoint, reference, outcome.missing, outcome.unexpected),
        tied=tuple((key, source) for key, source, _ in outcome.ties),
    )


# values of these types are compared with == in one C-level pass (NaN is looked at again)
_PLAIN = frozenset({bool, int, float, str, type(None), tuple})


def changed_values(checkpoint: Mapping[Any, Any], reference: Mapping[Any, Any]) -> list[Changed]:
    """The non-tensor values present on both sides that differ, in reference key order.

    Either side may be nested (compared as flattened). Tensor-like values, and
    values a metadata-only view did not read (any object whose class sets
    ``__dsdmerge_unread__``), are not compared.
    """
    c = (
        flatten(checkpoint)
        if any(isinstance(v, Mapping) for v in checkpoint.values())
        else checkpoint
    )
    r = flatten(reference) if any(isinstance(v, Mapping) for v in reference.values()) else reference
    keys = list(compress(r, map(c.__contains__, r)))
    c_vals = list(map(c.__getitem__, keys))
    r_vals = list(map(r.__getitem__, keys))
    at = list(compress(range(len(keys)), map(is_not, c_vals, r_vals)))  # the same object: equal
    if not at:
        return []
    c_vals = [c_vals[i] for i in at]
    r_vals = [r_vals[i] for i in at]
    types = set(map(type, c_vals)) | set(map(type, r_vals))
    if types <= _PLAIN:
        try:  # plain values (tuples of them too) compare in C; only the unequal are looked at
            equal = list(map(eq, c_vals, r_vals))
        except Exception:  # an exotic value in a tuple  # noqa: BLE001
            equal = [False] * len(at)
    else:
        equal = [False] * len(at)
    out = []
    skip: dict[type, bool] = {}
    for i, a, b, same in zip(at, c_vals, r_vals, equal, strict=True):
        if same:
            continue
        for tp in (type(a), type(b)):
            if tp not in skip:
                skip[tp] = is_tensor_like(tp) or bool(getattr(tp, "__dsdmerge_unread__", False))
        if skip[type(a)] or skip[type(b)] or same_value(a, b):
            continue
        out.append(Changed(keys[i], a, b))
    return out


def conversions_for(
    checkpoint: Mapping[Any, Any],
    reference: Mapping[Any, Any],
    missing: Sequence[str],
    unexpected: Sequence[str],
) -> tuple[str, ...]:
    """The :attr:`KeyDiff.conversions` for these differences (best effort: ``()`` when unsure)."""
    if not missing or not unexpected:
        return ()
    try:
        c = checkpoint if classify(checkpoint) is Layout.FLAT else flatten(checkpoint)
        r = reference if classify(reference) is Layout.FLAT else flatten(reference)
        return suggest_conversions(c, r, missing, unexpected)
    except DSDMergeError:  # a layout the suggestions cannot read: no suggestion
        return ()


def suggest(
    checkpoint: Mapping[Any, Any],
    reference: Mapping[Any, Any],
    missing: Sequence[str],
    unexpected: Sequence[str],
) -> tuple[SuggestedRename, ...]:
    """The :attr:`KeyDiff.renames` for these differences (best effort: ``()`` when unsure)."""
    if not missing or not unexpected:
        return ()
    try:
        c = checkpoint if classify(checkpoint) is Layout.FLAT else flatten(checkpoint)
        r = reference if classify(reference) is Layout.FLAT else flatten(reference)
        return suggest_renames(c, r, missing, unexpected)
    except DSDMergeError:  # a layout the suggestions cannot read: no suggestion
        return ()
