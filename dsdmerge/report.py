"""Readable reports of key diffs.

Reports never print: they return text, as :meth:`KeyDiff.__str__` does, so a
trainer can log them where it likes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dsdmerge.diff import KeyDiff, Mismatch, TensorMeta

__all__ = ["format_keys", "format_mismatches", "render"]

_SHOWN = 10


def format_keys(keys: Sequence[str], /, *, limit: int = _SHOWN) -> str:
    """The keys, sorted and quoted, at most ``limit`` of them and a count of the rest.

    Does not modify its input.

    Example:
        >>> from dsdmerge.report import format_keys
        >>> format_keys(["b", "a", "c"], limit=2)
        "'a', 'b' and 1 more"
    """
    ordered = sorted(keys)
    shown = ", ".join(repr(k) for k in ordered[:limit])
    rest = len(ordered) - limit
    return f"{shown} and {rest} more" if rest > 0 else shown


def _meta(meta: TensorMeta) -> str:
    from dsdmerge.diff import dtype_name

    return f"{dtype_name(meta.dtype)}{list(meta.shape)}"


def format_mismatches(items: Sequence[Mismatch], /, *, limit: int = _SHOWN) -> str:
    """``'key' (checkpoint float32[2, 3], reference float32[4, 3])`` for each, sorted by key.

    Does not modify its input.

    Example:
        >>> import torch, dsdmerge as dm
        >>> from dsdmerge.report import format_mismatches
        >>> format_mismatches(dm.diff({"w": torch.zeros(2)}, {"w": torch.zeros(3)}).mismatched)
        "'w' (checkpoint float32[2], reference float32[3])"
    """
    ordered = sorted(items, key=lambda m: m.key)
    shown = ", ".join(
        f"{m.key!r} (checkpoint {_meta(m.checkpoint)}, reference {_meta(m.reference)})"
        for m in ordered[:limit]
    )
    rest = len(ordered) - limit
    return f"{shown} and {rest} more" if rest > 0 else shown


def render(diff: KeyDiff, /, *, limit: int = _SHOWN) -> str:
    """A readable multi-line report of a :class:`~dsdmerge.KeyDiff`.

    Does not modify its input.

    Example:
        >>> import dsdmerge as dm
        >>> print(dm.KeyDiff(missing=("a",)))
        1 key missing from the checkpoint (will be taken from the reference):
          a
    """
    if not diff:
        return "no differences"
    lines: list[str] = []
    sections = (
        (diff.missing, "missing from the checkpoint (will be taken from the reference)"),
        (diff.unexpected, "unexpected in the checkpoint (not in the reference)"),
    )
    for keys, what in sections:
        if keys:
            lines.append(f"{len(keys)} key{'s' if len(keys) != 1 else ''} {what}:")
            ordered = sorted(keys)
            lines.extend(f"  {k}" for k in ordered[:limit])
            if len(ordered) > limit:
                lines.append(f"  ... and {len(ordered) - limit} more")
    if diff.mismatched:
        n = len(diff.mismatched)
        lines.append(f"{n} tensor{'s' if n != 1 else ''} with a different shape or dtype:")
        for m in sorted(diff.mismatched, key=lambda m: m.key)[:limit]:
            lines.append(
                f"  {m.key}: checkpoint {_meta(m.checkpoint)}, reference {_meta(m.reference)}"
            )
        if n > limit:
            lines.append(f"  ... and {n - limit} more")
    return "\n".join(lines)
