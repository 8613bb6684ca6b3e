"""The records diff and merge produce: data about what differed, and what one pass found.

Records are data, not printouts: tuples of flat keys and small frozen dataclasses
that a trainer can log, test or turn into JSON (``to_dict``), with a readable
``str()`` (rendered by :mod:`dsdmerge.report`). They sit below the code that
produces them, so every layer can name them:

* :class:`TensorMeta`: shape and dtype of a tensor-like value, without its data;
* :class:`Mismatch`: a key whose tensors differ in shape or dtype;
* :class:`Changed`: a key whose non-tensor values differ;
* :class:`SuggestedRename`: a rename rule that would pair unexpected keys with missing ones;
* :class:`Resized`: a tensor a merge resized;
* :class:`KeyDiff`: all of the above for one checkpoint against one reference;
* :class:`Outcome`: what one pass of the engine found and built (before any policy),
  with a :class:`Slot` per mismatch to put a value into the merged result.

The public ones are re-exported by :mod:`dsdmerge.diff`, :mod:`dsdmerge.rename` and
:mod:`dsdmerge.resize` (and the package).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

from dsdmerge._text import dtype_name, short_repr
from dsdmerge._values import shape_dtype
from dsdmerge.errors import StateDictTypeError
from dsdmerge.report import render

__all__ = [
    "Changed",
    "KeyDiff",
    "Mismatch",
    "Outcome",
    "Resized",
    "Slot",
    "SuggestedRename",
    "TensorMeta",
    "dtype_name",
]


@dataclasses.dataclass(frozen=True, slots=True)
class TensorMeta:
    """What dsdmerge knows about a tensor without its data: shape and dtype.

    It is a tensor-like leaf: :func:`diff` and :func:`~dsdmerge.merge` compare
    it with tensors and with other ``TensorMeta`` by shape and dtype. Checkpoint
    views that read metadata only hold these instead of tensors.

    Attributes:
        shape: The global shape, a tuple of ints.
        dtype: The dtype, usually a ``torch.dtype``.

    Examples:
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


@dataclasses.dataclass(frozen=True, slots=True)
class Mismatch:
    """A key in both state dicts whose tensors differ in shape or dtype.

    Attributes:
        key: The flat key.
        checkpoint: Shape and dtype in the checkpoint.
        reference: Shape and dtype in the reference.

    Examples:
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

    Examples:
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


@dataclasses.dataclass(frozen=True, slots=True)
class SuggestedRename:
    r"""A rename rule that would turn unexpected keys into missing ones (found by ``diff``).

    Every parameter it renames has all its checkpoint keys unexpected, lands on a
    parameter whose reference keys are all missing, and the keys pair up one to
    one with equal shapes and dtypes. It is a suggestion: nothing applies it
    unless you pass it as ``rename=``.

    Attributes:
        pattern: The regular expression, as :func:`~dsdmerge.rename` takes it.
        replacement: Its replacement.
        params: How many fqns it renames.
        keys: How many unexpected flat keys it pairs with missing ones.
        example: One ``(checkpoint fqn, reference fqn)`` pair.
        preset: The :data:`~dsdmerge.RENAME_PRESETS` name whose rule this is, if any.

    Examples:
        >>> import torch, dsdmerge as dm
        >>> ckpt = {f"l.{i}.attn.wq.weight": torch.zeros(2) for i in range(3)}
        >>> ref = {f"l.{i}.attn.q_proj.weight": torch.zeros(2) for i in range(3)}
        >>> [s] = dm.diff(ckpt, ref).renames
        >>> s.pattern, s.replacement, s.params
        ('\\.attn\\.wq\\.', '.attn.q_proj.', 3)
    """

    pattern: str
    replacement: str
    params: int
    keys: int
    example: tuple[str, str]
    preset: str | None = None

    def __str__(self) -> str:
        preset = f" (preset {self.preset!r})" if self.preset else ""
        return f"{self.pattern!r} -> {self.replacement!r}{preset}"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the attributes."""
        return {
            "pattern": self.pattern,
            "replacement": self.replacement,
            "params": self.params,
            "keys": self.keys,
            "example": list(self.example),
            "preset": self.preset,
        }


@dataclasses.dataclass(frozen=True, slots=True)
class Resized:
    """A tensor a merge resized: which dims changed and how many elements came from where.

    Attributes:
        key: The flat key.
        checkpoint: Shape and dtype of the checkpoint's tensor.
        reference: Shape and dtype of the reference's tensor (the result's).

    Examples:
        >>> import torch, dsdmerge as dm
        >>> r = dm.Resized.of("embed.weight", torch.zeros(10, 4), torch.zeros(12, 4))
        >>> r.dims, r.kept, r.from_reference
        ((0,), 40, 8)
        >>> str(r)
        'embed.weight: dim 0 10 -> 12; 40 elements kept, 8 from the reference'
    """

    key: str
    checkpoint: TensorMeta
    reference: TensorMeta

    @classmethod
    def of(cls, key: str, checkpoint: Any, reference: Any) -> Resized:
        """The record for two tensor-like values."""
        return cls(key, TensorMeta.of(checkpoint), TensorMeta.of(reference))

    @classmethod
    def from_mismatch(cls, m: Mismatch) -> Resized:
        """The record of a shape mismatch that was resized."""
        return cls(m.key, m.checkpoint, m.reference)

    @property
    def dims(self) -> tuple[int, ...]:
        """The dimensions whose size changed."""
        return tuple(
            i
            for i, (c, r) in enumerate(
                zip(self.checkpoint.shape, self.reference.shape, strict=True)
            )
            if c != r
        )

    @property
    def kept(self) -> int:
        """How many elements of the result are the checkpoint's (the overlap)."""
        return math.prod(
            min(c, r) for c, r in zip(self.checkpoint.shape, self.reference.shape, strict=True)
        )

    @property
    def from_reference(self) -> int:
        """How many elements of the result are the reference's."""
        return math.prod(self.reference.shape) - self.kept

    def __str__(self) -> str:
        changes = ", ".join(
            f"dim {i} {self.checkpoint.shape[i]} -> {self.reference.shape[i]}" for i in self.dims
        )
        return (
            f"{self.key}: {changes}; {self.kept:,} elements kept, "
            f"{self.from_reference:,} from the reference"
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: key, both shapes and dtypes, dims, kept and from_reference."""
        return {
            "key": self.key,
            "checkpoint": self.checkpoint.to_dict(),
            "reference": self.reference.to_dict(),
            "dims": list(self.dims),
            "kept": self.kept,
            "from_reference": self.from_reference,
        }


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
        conversions: Suggested layout conversions: names of presets in
            :data:`~dsdmerge.CONVERSION_PRESETS` that would turn unexpected keys into
            missing keys of the same shapes and dtypes (``"qkv"`` for separate q/k/v
            projections against a fused ``qkv_proj``), for ``convert=``. Filled by
            :func:`~dsdmerge.diff`; never applied by themselves.
        tied: Missing keys whose reference tensor is the very tensor of a key the
            checkpoint has (tied weights: a ``save_pretrained`` checkpoint omits
            ``lm_head.weight`` tied to the embedding), as ``(missing key, that
            key)`` pairs in reference order: a merge gives each the checkpoint's
            tensor of that key, so that loading keeps the tie. They are still in
            :attr:`missing`.

    ``bool(diff)`` is ``False`` iff missing, unexpected, mismatched and changed
    are all empty; ``str(diff)`` is a readable report.

    Examples:
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
    conversions: tuple[str, ...] = ()
    tied: tuple[tuple[str, str], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.mismatched or self.changed)

    def __repr__(self) -> str:
        # changed, renames, resized and tied only when there are some (the three lists always)
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
                ("conversions", self.conversions),
                ("tied", self.tied),
            )
            if v
        ]
        return f"KeyDiff({', '.join(f'{n}={v!r}' for n, v in fields)})"

    def __str__(self) -> str:
        return render(self)

    @property
    def mismatched_keys(self) -> tuple[str, ...]:
        """The keys of :attr:`mismatched`, in the same order."""
        return tuple(m.key for m in self.mismatched)

    @property
    def suggested_rules(self) -> dict[str, str]:
        r"""The :attr:`renames`, as rules for ``rename=`` (``{pattern: replacement}``, in order).

        Examples:
            >>> import torch, dsdmerge as dm
            >>> d = dm.diff({"module.w": torch.zeros(2)}, {"w": torch.zeros(2)})
            >>> d.suggested_rules
            {'^module\\.': ''}
        """
        return {s.pattern: s.replacement for s in self.renames}

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of lists: the three kinds of difference, ``renames``, ``resized``.

        Examples:
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
        if self.conversions:
            out["conversions"] = list(self.conversions)
        if self.tied:
            out["tied"] = [{"key": key, "takes": source} for key, source in self.tied]
        return out


# --------------------------------------------------------------------------------------
# what one pass of the engine found


class Slot(NamedTuple):
    """Where a mismatched value sits in the merged result, with both sides' values.

    Calling it puts the reference's value there; :attr:`put` puts any value there
    (a resize puts a new tensor).
    """

    put: Callable[[Any], None]
    checkpoint: Any
    reference: Any

    def __call__(self) -> None:
        self.put(self.reference)


@dataclasses.dataclass
class Outcome:
    """What one pass found (and built)."""

    merged: dict[Any, Any] | None
    missing: list[str]
    unexpected: list[str]
    mismatches: list[Mismatch]
    conflicts: list[str] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)
    # mismatch key -> its place in ``merged``: call it to put the reference's value there
    take_reference: dict[str, Slot] = dataclasses.field(default_factory=dict)
    # tied missing keys: (key, the checkpoint key whose tensor it took, where it sits)
    ties: list[tuple[str, str, Callable[[Any], None]]] = dataclasses.field(default_factory=list)
