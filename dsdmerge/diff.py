"""Key diffs between a checkpoint and a reference state dict.

A :class:`KeyDiff` is data, not a printout: three tuples of flat keys (and
mismatch records) that a trainer can log, test or turn into JSON, and a
readable ``str()``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from itertools import compress
from typing import TYPE_CHECKING, Any

from dsdmerge._values import shape_dtype, short_repr
from dsdmerge.errors import DSDMergeError, StateDictTypeError

if TYPE_CHECKING:
    from dsdmerge.rename import Rules, SuggestedRename
    from dsdmerge.resize import Resized

__all__ = ["Changed", "KeyDiff", "Mismatch", "TensorMeta", "diff"]


@dataclasses.dataclass(frozen=True, slots=True)
class TensorMeta:
    """What dsdmerge knows about a tensor without its data: shape and dtype.

    It is a tensor-like leaf: :func:`diff` and :func:`~dsdmerge.merge` compare
    it with tensors and with other ``TensorMeta`` by shape and dtype. Checkpoint
    views that read metadata only hold these instead of tensors.

    Attributes:
        shape: The global shape, a tuple of ints.
        dtype: The dtype, usually a ``torch.dtype``.

    Example:
        >>> import torch, dsdmerge as dm
        >>> dm.TensorMeta.of(torch.zeros(2, 3))
        TensorMeta(shape=(2, 3), dtype=torch.float32)
    """

    shape: tuple[int, ...]
    dtype: Any

    @classmethod
    def of(cls, tensor: Any) -> TensorMeta:
        """The metadata of a tensor-like value (anything with ``shape`` and ``dtype``).

        Raises:
            StateDictTypeError: ``tensor`` has no ``dtype``, or no ``shape`` of ints.
        """
        try:
            shape, dtype = shape_dtype(tensor)
        except (AttributeError, TypeError, ValueError, RuntimeError):
            raise StateDictTypeError(
                f"{short_repr(tensor)} ({type(tensor).__name__}) is not tensor-like: it needs a "
                "shape of ints and a dtype"
            ) from None
        return cls(shape, dtype)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready ``{"shape": [...], "dtype": "float32"}``."""
        return {"shape": list(self.shape), "dtype": dtype_name(self.dtype)}


def dtype_name(dtype: Any) -> str:
    """``torch.float32`` -> ``"float32"``; other dtypes by ``str()``."""
    text = str(dtype)
    return text[len("torch.") :] if text.startswith("torch.") else text


@dataclasses.dataclass(frozen=True, slots=True)
class Mismatch:
    """A key in both state dicts whose tensors differ in shape or dtype.

    Attributes:
        key: The flat key.
        checkpoint: Shape and dtype in the checkpoint.
        reference: Shape and dtype in the reference.

    Example:
        >>> import torch, dsdmerge as dm
        >>> m = dm.diff({"w": torch.zeros(2)}, {"w": torch.zeros(3)}).mismatched[0]
        >>> m.key, m.shape_differs, m.dtype_differs
        ('w', True, False)
    """

    key: str
    checkpoint: TensorMeta
    reference: TensorMeta

    @property
    def shape_differs(self) -> bool:
        """Whether the shapes differ (``torch`` rejects this on load)."""
        return self.checkpoint.shape != self.reference.shape

    @property
    def dtype_differs(self) -> bool:
        """Whether the dtypes differ (``torch`` casts silently on load)."""
        return bool(self.checkpoint.dtype != self.reference.dtype)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict with the key and both sides' shape and dtype."""
        return {
            "key": self.key,
            "checkpoint": self.checkpoint.to_dict(),
            "reference": self.reference.to_dict(),
        }


@dataclasses.dataclass(frozen=True, slots=True)
class Changed:
    """A key in both state dicts whose non-tensor values differ (a learning rate, ``step``).

    The checkpoint's value is what a merge keeps; this says the reference had
    another one (usually the point of resuming: the scheduled learning rate).

    Attributes:
        key: The flat key.
        checkpoint: The checkpoint's value.
        reference: The reference's value.

    Example:
        >>> import dsdmerge as dm
        >>> dm.diff({"lr": 5e-5}, {"lr": 1e-3}, values=True).changed
        (Changed(key='lr', checkpoint=5e-05, reference=0.001),)
    """

    key: str
    checkpoint: Any
    reference: Any

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: the key and both values (``repr`` of what JSON cannot hold)."""
        return {
            "key": self.key,
            "checkpoint": _json_value(self.checkpoint),
            "reference": _json_value(self.reference),
        }


def _json_value(value: Any) -> Any:
    if value is None or type(value) in (bool, int, str):
        return value
    if type(value) is float:
        return value if value == value and abs(value) != float("inf") else repr(value)
    if type(value) in (tuple, list) and len(value) <= 64:
        return [_json_value(v) for v in value]
    return short_repr(value)


@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class KeyDiff:
    """The differences between a checkpoint and a reference, by flat key.

    Attributes:
        missing: Keys in the reference but not in the checkpoint, in reference
            order (a default merge takes them from the reference).
        unexpected: Keys in the checkpoint but not in the reference, in
            checkpoint order (a default merge keeps them).
        mismatched: Keys in both whose tensors differ in shape or dtype, in
            reference order.
        changed: Keys in both whose non-tensor values differ
            (:class:`Changed`), in reference order; filled by
            ``diff(..., values=True)`` (the command line's ``diff`` does), empty
            otherwise.
        renames: Suggested renames (:class:`~dsdmerge.SuggestedRename`): rules
            that would pair unexpected keys one to one with missing keys of the
            same shapes and dtypes (``attn.wq`` -> ``attn.q_proj`` in every
            layer). Never applied by themselves; empty when none.
        resized: The tensors a merge with ``on_shape_mismatch="resize"`` resized
            (:class:`~dsdmerge.Resized`); empty otherwise.

    ``bool(diff)`` is ``False`` iff missing, unexpected, mismatched and changed
    are all empty; ``str(diff)`` is a readable report.

    Example:
        >>> import dsdmerge as dm
        >>> d = dm.KeyDiff(missing=("a",))
        >>> bool(d), d.missing, bool(dm.KeyDiff())
        (True, ('a',), False)
    """

    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    mismatched: tuple[Mismatch, ...] = ()
    changed: tuple[Changed, ...] = ()
    renames: tuple[SuggestedRename, ...] = ()
    resized: tuple[Resized, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.mismatched or self.changed)

    def __repr__(self) -> str:
        # changed, renames and resized only when there are some (the three lists always)
        fields: list[tuple[str, tuple[Any, ...]]] = [
            ("missing", self.missing),
            ("unexpected", self.unexpected),
            ("mismatched", self.mismatched),
        ]
        fields += [
            (n, v)
            for n, v in (
                ("changed", self.changed),
                ("renames", self.renames),
                ("resized", self.resized),
            )
            if v
        ]
        return f"KeyDiff({', '.join(f'{n}={v!r}' for n, v in fields)})"

    def __str__(self) -> str:
        from dsdmerge.report import render

        return render(self)

    @property
    def mismatched_keys(self) -> tuple[str, ...]:
        """The keys of :attr:`mismatched`, in the same order."""
        return tuple(m.key for m in self.mismatched)

    @property
    def suggested_rules(self) -> dict[str, str]:
        r"""The :attr:`renames`, as rules for ``rename=`` (``{pattern: replacement}``, in order).

        Example:
            >>> import torch, dsdmerge as dm
            >>> d = dm.diff({"module.w": torch.zeros(2)}, {"w": torch.zeros(2)})
            >>> d.suggested_rules
            {'^module\\.': ''}
        """
        return {s.pattern: s.replacement for s in self.renames}

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of lists: the three kinds of difference, ``renames``, ``resized``.

        Example:
            >>> import dsdmerge as dm
            >>> dm.KeyDiff(missing=("a",)).to_dict()
            {'missing': ['a'], 'unexpected': [], 'mismatched': [], 'renames': [], 'resized': []}
        """
        out = {
            "missing": list(self.missing),
            "unexpected": list(self.unexpected),
            "mismatched": [m.to_dict() for m in self.mismatched],
            "renames": [r.to_dict() for r in self.renames],
            "resized": [r.to_dict() for r in self.resized],
        }
        if self.changed:
            out["changed"] = [c.to_dict() for c in self.changed]
        return out


def diff(
    checkpoint: Mapping[Any, Any],
    reference: Mapping[Any, Any],
    /,
    *,
    rename: Rules | None = None,
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
        values: Also compare non-tensor values.

    Returns:
        The :class:`KeyDiff`.

    Raises:
        StateDictTypeError: An argument is not a mapping.
        LayoutError: An argument is malformed (see :func:`~dsdmerge.flatten`).
        RenameError: A rename rule is not valid, or renames two keys to one.

    Example:
        >>> import torch, dsdmerge as dm
        >>> ckpt = {"w": torch.zeros(2), "old": torch.zeros(1)}
        >>> ref = {"w": torch.zeros(2), "head": torch.zeros(4)}
        >>> d = dm.diff(ckpt, ref)
        >>> d.missing, d.unexpected, d.mismatched
        (('head',), ('old',), ())
    """
    from dsdmerge._engine import run

    if rename is not None:
        from dsdmerge.rename import rename_checkpoint

        checkpoint, unmatched = rename_checkpoint(checkpoint, rename)
        if unmatched:
            import warnings

            from dsdmerge.errors import DSDMergeWarning

            warnings.warn(DSDMergeWarning(f"dsdmerge: {unmatched}"), stacklevel=2)
    outcome = run(checkpoint, reference, merge=False)
    changed = changed_values(checkpoint, reference) if values else ()
    return KeyDiff(
        tuple(outcome.missing),
        tuple(outcome.unexpected),
        tuple(outcome.mismatches),
        tuple(changed),
        suggest(checkpoint, reference, outcome.missing, outcome.unexpected),
    )


# values of these types are compared with == in one C-level pass (NaN is looked at again)
_PLAIN = frozenset({bool, int, float, str, type(None), tuple})


def changed_values(checkpoint: Mapping[Any, Any], reference: Mapping[Any, Any]) -> list[Changed]:
    """The non-tensor values present on both sides that differ, in reference key order.

    Either side may be nested (compared as flattened). Tensor-like values, and
    values a metadata-only view did not read (any object whose class sets
    ``__dsdmerge_unread__``), are not compared.
    """
    from operator import eq, is_not

    from dsdmerge._values import is_tensor_like, same_value
    from dsdmerge.flatten import flatten

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


def suggest(
    checkpoint: Mapping[Any, Any],
    reference: Mapping[Any, Any],
    missing: Sequence[str],
    unexpected: Sequence[str],
) -> tuple[SuggestedRename, ...]:
    """The :attr:`KeyDiff.renames` for these differences (best effort: ``()`` when unsure)."""
    if not missing or not unexpected:
        return ()
    from dsdmerge.flatten import flatten
    from dsdmerge.layout import Layout, classify
    from dsdmerge.rename import suggest_renames

    try:
        c = checkpoint if classify(checkpoint) is Layout.FLAT else flatten(checkpoint)
        r = reference if classify(reference) is Layout.FLAT else flatten(reference)
        return suggest_renames(c, r, missing, unexpected)
    except DSDMergeError:  # a layout the suggestions cannot read: no suggestion
        return ()
