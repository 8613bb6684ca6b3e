r"""Readable, exact reports of key diffs, over hundreds of thousands of keys.

:func:`compress` groups flat keys into :class:`Pattern` values: a pattern is a
product of per-segment alternatives, written ``layers.{0..3,5..60}.attn.{wk,wq}``.
Integer segments become ranges with every gap shown; other segments become
alternatives. Compression is **exact**: :func:`expand` of a pattern yields
exactly the keys it stands for, never a key that does not exist (for the two
keys ``layers.0.experts.1`` and ``layers.1.experts.0`` you get two patterns, not
``layers.{0,1}.experts.{0,1}``), and the patterns of one call are disjoint.

Pattern syntax: segments are joined by ``.``; a segment is a literal or a brace
group ``{a,b,0..3}`` of alternatives, where ``m..n`` (``m < n``) is every
integer from ``m`` to ``n`` written in plain decimal. Only segments that are
plain decimals (``0``, ``17``; not ``01`` or ``-1``) ever become ranges, so
``01`` stays ``01``. The characters ``\ { } ,`` inside a key are escaped with a
backslash (the key ``a{b`` is the pattern ``a\{b``), so every pattern text
parses back to the same keys (:func:`parse_pattern`).

Reports never print: they return text, as :meth:`KeyDiff.__str__` does, so a
trainer can log them where it likes.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from typing import TYPE_CHECKING, Any

from dsdmerge._gc import gc_paused
from dsdmerge._text import dtype_name, printable, short_repr
from dsdmerge.errors import PatternError, StateDictTypeError

if TYPE_CHECKING:
    from dsdmerge.diff import Changed, KeyDiff, Mismatch, TensorMeta
    from dsdmerge.rename import SuggestedRename
    from dsdmerge.resize import Resized

__all__ = [
    "Pattern",
    "PatternError",
    "compress",
    "expand",
    "format_keys",
    "format_mismatches",
    "format_resized",
    "parse_pattern",
    "render",
    "render_patterns",
    "summary",
]

_SHOWN = 10
_DECIMAL = re.compile(r"(?:0|[1-9][0-9]*)\Z")
_SPECIAL = re.compile(r"([\\{},])")
_RUN = 3  # consecutive integers shown as a range from this many on; fewer are listed
_PARTS = 16  # parts per brace group in reports: longer groups are split into more patterns


def _is_decimal(segment: str) -> bool:
    return _DECIMAL.match(segment) is not None


def _order(segment: str) -> tuple[int, int, str]:
    """Plain decimals first, numerically; then everything else, by code point."""
    if _is_decimal(segment):
        return (0, int(segment), "")
    return (1, 0, segment)


def _escape(segment: str) -> str:
    return _SPECIAL.sub(r"\\\1", segment) if _SPECIAL.search(segment) else segment


def _parts(alternatives: Iterable[str]) -> list[tuple[str, tuple[str, ...]]]:
    """The comma-separated parts of a brace group: ``(text, the alternatives it stands for)``.

    Runs of at least ``_RUN`` consecutive plain decimals are one ``m..n`` part;
    other decimals, numerically, then the other alternatives, escaped, are one
    part each.
    """
    parts: list[tuple[str, tuple[str, ...]]] = []
    numbers = sorted(int(s) for s in alternatives if _is_decimal(s))
    i = 0
    while i < len(numbers):
        j = i
        while j + 1 < len(numbers) and numbers[j + 1] == numbers[j] + 1:
            j += 1
        if j - i + 1 >= _RUN:
            run = tuple(str(n) for n in numbers[i : j + 1])
            parts.append((f"{numbers[i]}..{numbers[j]}", run))
        else:
            parts.extend((str(n), (str(n),)) for n in numbers[i : j + 1])
        i = j + 1
    others = sorted((s for s in alternatives if not _is_decimal(s)), key=_order)
    parts.extend((_escape(s), (s,)) for s in others)
    return parts


@functools.lru_cache(maxsize=4096)  # reports render the same few groups many times
def _render_segment(alternatives: tuple[str, ...]) -> str:
    if len(alternatives) == 1:
        return _escape(alternatives[0])
    return "{" + ",".join(text for text, _ in _parts(alternatives)) + "}"


@dataclasses.dataclass(frozen=True, slots=True)
class Pattern:
    """A set of flat keys written as one product of per-segment alternatives.

    Attributes:
        segments: For each dot-separated position, the alternatives at that
            position in display order (plain decimals numerically, then the
            rest). The pattern stands for every key that joins one alternative
            per position with dots, and for nothing else.

    ``str(pattern)`` is the pattern text (``layers.{0..2}.w``); ``len()`` and
    :attr:`count` are the number of keys.

    Examples:
        >>> from dsdmerge.report import compress
        >>> [p] = compress(["layers.0.w", "layers.1.w", "layers.2.w", "layers.4.w"])
        >>> str(p), p.count
        ('layers.{0..2,4}.w', 4)
    """

    segments: tuple[tuple[str, ...], ...]

    @property
    def count(self) -> int:
        """How many keys the pattern stands for."""
        return math.prod(len(s) for s in self.segments)

    def __len__(self) -> int:
        return self.count

    def __str__(self) -> str:
        return ".".join(_render_segment(s) for s in self.segments)

    def keys(self) -> set[str]:
        """Exactly the keys the pattern stands for (the same as :func:`expand`)."""
        return {".".join(parts) for parts in itertools.product(*self.segments)}

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready ``{"pattern": "layers.{0..2}.w", "count": 3}``."""
        return {"pattern": str(self), "count": self.count}


def compress(keys: Iterable[str], /, *, max_parts: int | None = None) -> list[Pattern]:
    """Group keys into disjoint, exact patterns; the largest first.

    Keys are split at dots; keys with the same number of segments that differ
    in one segment only are merged into one pattern, repeatedly, until no two
    patterns can be merged that way. So every pattern stands for exactly keys
    from ``keys`` (never more), every key is in exactly one pattern, and the
    result depends only on the set of keys, not on their order. Does not modify
    its input.

    Args:
        keys: Flat keys (str), in any order; duplicates are ignored.
        max_parts: If given, a brace group never has more than this many
            comma-separated parts (a range ``m..n`` is one part): longer groups
            are split into several disjoint patterns, so every line of a report
            stays short. Reports use 16.

    Returns:
        The patterns, ordered by key count (largest first), then by text.

    Raises:
        StateDictTypeError: A key is not a str.
        ValueError: ``max_parts`` is less than 1.

    Examples:
        >>> from dsdmerge.report import compress
        >>> keys = [f"layers.{i}.attn.{w}" for i in (0, 1, 2, 3, 5) for w in ("wq", "wk")]
        >>> [(str(p), p.count) for p in compress(keys, max_parts=_PARTS)]
        [('layers.{0..3,5}.attn.{wk,wq}', 10)]
        >>> [str(p) for p in compress(["layers.0.experts.1", "layers.1.experts.0"])]
        ['layers.0.experts.1', 'layers.1.experts.0']
    """
    if max_parts is not None and max_parts < 1:
        raise ValueError(f"max_parts must be at least 1, got {max_parts}")
    # A mapping's keys or a set are unique already; anything else goes through
    # dict.fromkeys, not set: keys that share their text before the last segment usually
    # come together (a parameter's state fields, a module's weight and bias), and grouping
    # them in that order touches memory in order; in a set's hash order the same loop is
    # three to four times slower. The result depends on the set of keys only.
    unique: Iterable[Any] = keys if isinstance(keys, (Mapping, Set)) else dict.fromkeys(keys)
    if not set(map(type, unique)) <= {str}:
        bad = next(key for key in unique if type(key) is not str)
        raise StateDictTypeError(f"compress takes str keys, got {bad!r}")
    # Only acyclic tuples, lists and frozensets are built: the collector's passes would
    # find nothing, but would walk everything built so far (70% of the time at 661k keys).
    with gc_paused():
        return _compress(unique, max_parts)


def _compress(unique: Iterable[str], max_parts: int | None) -> list[Pattern]:
    sets: list[frozenset[str]] = []
    ids: dict[frozenset[str], int] = {}

    def intern(alternatives: frozenset[str]) -> int:
        sid = ids.get(alternatives)
        if sid is None:
            sid = ids[alternatives] = len(sets)
            sets.append(alternatives)
        return sid

    # The first cycle of merges, last position first, on strings: a box is the
    # text before its merged positions (None once every segment is merged) and
    # the interned alternative sets of those positions. Boxes agreeing on both
    # but for one segment merge; texts are split once, from the right.
    singletons: dict[str, int] = {}
    done: list[tuple[int, ...]] = []
    lasts: dict[str | None, list[str]] = {}
    for key in unique:
        head, dot, last = key.rpartition(".")
        lasts.setdefault(head if dot else None, []).append(last)
    pending: dict[tuple[str | None, tuple[int, ...]], list[str]] = {
        (text, ()): segments for text, segments in lasts.items()
    }
    del lasts
    while pending:
        following: dict[tuple[str | None, tuple[int, ...]], list[str]] = {}
        for (rest, tail), segments in pending.items():
            if len(segments) == 1:
                sid = singletons.get(segments[0])
                if sid is None:
                    sid = singletons[segments[0]] = intern(frozenset(segments))
            else:
                sid = intern(frozenset(segments))
            if rest is None:
                done.append((sid, *tail))
            else:
                before, dot, segment = rest.rpartition(".")
                following.setdefault((before if dot else None, (sid, *tail)), []).append(segment)
        pending = following
    by_length: dict[int, list[tuple[int, ...]]] = {}
    for box in done:
        by_length.setdefault(len(box), []).append(box)

    # Patterns share few distinct alternative sets: each is ordered (and split) once.
    ordered: dict[int, tuple[str, ...]] = {}
    chunks: dict[int, list[tuple[str, ...]]] = {}
    patterns: list[Pattern] = []
    for length, same_length in by_length.items():
        for merged in _merge_boxes(same_length, length, sets, intern):
            for s in merged:
                if s not in ordered:
                    ordered[s] = tuple(sorted(sets[s], key=_order))
            if max_parts is None:
                patterns.append(Pattern(tuple(map(ordered.__getitem__, merged))))
                continue
            for s in merged:
                if s not in chunks:
                    chunks[s] = _chunks(ordered[s], max_parts)
            patterns.extend(map(Pattern, itertools.product(*map(chunks.__getitem__, merged))))
    return sorted(patterns, key=_rank)


def _chunks(alternatives: tuple[str, ...], max_parts: int) -> list[tuple[str, ...]]:
    """One segment's alternatives, in groups of at most ``max_parts`` parts (disjoint)."""
    parts = _parts(alternatives)
    if len(parts) <= max_parts:
        return [alternatives]
    return [
        tuple(a for _, run in parts[i : i + max_parts] for a in run)
        for i in range(0, len(parts), max_parts)
    ]


def _merge_boxes(
    boxes: list[tuple[int, ...]],
    length: int,
    sets: list[frozenset[str]],
    intern: Callable[[frozenset[str]], int],
) -> list[tuple[int, ...]]:
    """Merge boxes equal in all positions but one, last position first, cyclically.

    Boxes are disjoint products of alternative sets (by interned id), already
    through one cycle of merges that ended at position 0. Merging boxes that
    agree everywhere but at ``p`` unions their (disjoint) sets at ``p``: the
    product of the result is exactly the union of their products. Stops when
    a whole cycle of positions merges nothing. Which boxes merge depends only
    on the set of boxes, never on their order.
    """
    unchanged = 1  # consecutive positions that merged nothing (position 0 just did)
    p = length - 1
    while unchanged < length and len(boxes) > 1:
        groups: dict[tuple[int, ...], list[int]] = {}
        for box in boxes:
            groups.setdefault(box[:p] + box[p + 1 :], []).append(box[p])
        if len(groups) == len(boxes):
            unchanged += 1
        else:
            unchanged = 1
            merged: list[tuple[int, ...]] = []
            for rest, sids in groups.items():
                if len(sids) > 1:
                    sid = intern(frozenset().union(*(sets[s] for s in sids)))
                else:
                    sid = sids[0]
                merged.append((*rest[:p], sid, *rest[p:]))
            boxes = merged
        p = p - 1 if p > 0 else length - 1
    return boxes


def _rank(pattern: Pattern) -> tuple[int, str]:
    return (-pattern.count, str(pattern))


def parse_pattern(text: str, /) -> Pattern:
    """Read a pattern text back into a :class:`Pattern` (the inverse of ``str``).

    Ranges are expanded: the pattern holds every key it stands for (to match keys
    against a pattern without expanding it, use :func:`dsdmerge.policy.matcher`).

    Args:
        text: A pattern such as ``layers.{0..3,5}.{wk,wq}`` (see the module
            docstring for the syntax and escapes).

    Returns:
        The pattern.

    Raises:
        PatternError: The text is not a valid pattern.

    Examples:
        >>> from dsdmerge.report import parse_pattern
        >>> sorted(parse_pattern("a.{0..2,x}").keys())
        ['a.0', 'a.1', 'a.2', 'a.x']
    """
    segments = []
    for items in pattern_alternatives(text):
        alternatives: set[str] = set()
        for item in items:
            if isinstance(item, str):
                alternatives.add(item)
            else:
                alternatives.update(map(str, range(int(item[0]), int(item[1]) + 1)))
        segments.append(tuple(sorted(alternatives, key=_order)))
    return Pattern(tuple(segments))


Alternative = str | tuple[str, str]
"""One alternative of a pattern's segment: a literal, or a range ``(first, last)`` of plain
decimals (``m..n``), kept as their digits."""

_RANGE_DIGITS = 64  # the bounds of a range have at most this many digits


def pattern_alternatives(text: str, /) -> list[tuple[Alternative, ...]]:
    """The alternatives of each segment of a pattern text, ranges not expanded.

    Work and memory are linear in the text: ``x.{0..999999}`` is one range, not a
    million strings (:func:`dsdmerge.policy.matcher` matches it as one).

    Raises:
        PatternError: The text is not a valid pattern.

    Examples:
        >>> from dsdmerge.report import pattern_alternatives
        >>> pattern_alternatives("layers.{0..999999,x}.w")
        [('layers',), (('0', '999999'), 'x'), ('w',)]
    """
    segments: list[tuple[Alternative, ...]] = []
    i, n = 0, len(text)
    while True:
        alternatives: list[Alternative]
        if i < n and text[i] == "{":
            alternatives, i = _parse_group(text, i + 1)
            if i < n and text[i] != ".":
                raise PatternError(
                    f"pattern {text!r}: expected '.' or the end after '}}' at {i}; "
                    "a brace group must be a whole segment"
                )
        else:
            literal, i = _parse_literal(text, i, stops=".")
            alternatives = [literal]
        segments.append(tuple(dict.fromkeys(alternatives)))
        if i >= n:
            return segments
        i += 1  # the dot


def _parse_literal(text: str, i: int, *, stops: str) -> tuple[str, int]:
    out: list[str] = []
    n = len(text)
    while i < n and text[i] not in stops:
        ch = text[i]
        if ch == "\\":
            if i + 1 >= n:
                raise PatternError(f"pattern {text!r}: a lone '\\' at the end")
            out.append(text[i + 1])
            i += 2
            continue
        if ch in "{}":
            raise PatternError(f"pattern {text!r}: unescaped {ch!r} at {i}; write '\\{ch}'")
        out.append(ch)
        i += 1
    return "".join(out), i


def _parse_group(text: str, i: int) -> tuple[list[Alternative], int]:
    alternatives: list[Alternative] = []
    n = len(text)
    while True:
        start = i
        item, i = _parse_literal(text, i, stops=",}.")
        if i < n and text[i] == "." and text[start:i] == item and _is_decimal(item):
            # a range m..n
            if not text.startswith("..", i):
                raise PatternError(f"pattern {text!r}: expected '..' at {i}")
            end, i = _parse_literal(text, i + 2, stops=",}.")
            if not _is_decimal(end) or (len(end), end) < (len(item), item):
                raise PatternError(
                    f"pattern {text!r}: bad range {item}..{end}; write m..n with plain "
                    "decimals and m <= n"
                )
            if len(end) > _RANGE_DIGITS:
                raise PatternError(
                    f"pattern {text!r}: a range's bounds have at most {_RANGE_DIGITS} digits"
                )
            alternatives.append((item, end))
        elif i < n and text[i] == ".":
            raise PatternError(f"pattern {text!r}: unexpected '.' in a brace group at {i}")
        else:
            alternatives.append(item)
        if i >= n:
            raise PatternError(f"pattern {text!r}: unclosed '{{'")
        if text[i] == "}":
            return alternatives, i + 1
        i += 1  # the comma


def range_regex(first: str, last: str, /) -> str:
    r"""A regex matching exactly the plain decimals from ``first`` to ``last`` (digit strings).

    Its size grows with the number of digits (quadratically), not with how many
    numbers the range holds. ``first <= last``, both plain decimals.

    Examples:
        >>> import re
        >>> from dsdmerge.report import range_regex
        >>> rx = re.compile(range_regex("7", "120") + r"\Z")
        >>> [n for n in range(200) if rx.match(str(n))] == list(range(7, 121))
        True
        >>> bool(rx.match("07")), bool(rx.match("8x"))
        (False, False)
    """
    parts = []
    for width in range(len(first), len(last) + 1):
        low = first if width == len(first) else "1" + "0" * (width - 1)
        high = last if width == len(last) else "9" * width
        parts.append(_same_width(low, high))
    return "(?:" + "|".join(parts) + ")"


def _same_width(low: str, high: str) -> str:
    """A regex for the decimals of one width from ``low`` to ``high`` (``low <= high``)."""
    common = 0
    while common < len(low) and low[common] == high[common]:
        common += 1
    head, low, high = low[:common], low[common:], high[common:]
    if not low:
        return head
    rest = len(low) - 1
    if not rest:
        return f"{head}[{low}-{high}]"
    parts = []
    first_full, last_full = int(low[0]), int(high[0])
    if low[1:] != "0" * rest:  # low's first digit: only from low up
        parts.append(low[0] + _same_width(low[1:], "9" * rest))
        first_full += 1
    tail = None
    if high[1:] != "9" * rest:  # high's first digit: only up to high
        tail = high[0] + _same_width("0" * rest, high[1:])
        last_full -= 1
    if first_full <= last_full:
        parts.append(f"[{first_full}-{last_full}][0-9]{{{rest}}}")
    if tail is not None:
        parts.append(tail)
    return head + "(?:" + "|".join(parts) + ")"


def expand(pattern: Pattern | str, /) -> set[str]:
    """Exactly the keys a pattern (or a pattern text) stands for.

    Args:
        pattern: A :class:`Pattern`, or its text.

    Returns:
        The set of keys.

    Raises:
        PatternError: ``pattern`` is a text that does not parse.

    Examples:
        >>> from dsdmerge.report import compress, expand
        >>> keys = {"layers.0.experts.1", "layers.1.experts.0", "head.w"}
        >>> set().union(*map(expand, compress(keys))) == keys
        True
        >>> sorted(expand("layers.{0,1}.w"))
        ['layers.0.w', 'layers.1.w']
    """
    if isinstance(pattern, str):
        pattern = parse_pattern(pattern)
    return pattern.keys()


# -- text ----------------------------------------------------------------------


def _quote(text: str) -> str:
    return f"'{text}'" if text.isprintable() else repr(text)


def _line(p: Pattern) -> str:
    """A pattern as a report line shows it: its text, or its ``repr`` if a character does not print.

    A key holding ESC or CR must not move the cursor or recolour the terminal.
    """
    return printable(str(p))


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _rest(patterns: Sequence[Pattern], limit: int) -> str:
    """``"12 more keys in 3 patterns"`` for the patterns past ``limit``; ``""`` if none."""
    rest = patterns[limit:]
    if not rest:
        return ""
    n = sum(p.count for p in rest)
    return f"{_plural(n, 'more key')} in {_plural(len(rest), 'pattern')}"


def format_keys(keys: Iterable[str], /, *, limit: int = _SHOWN) -> str:
    """The keys as compressed patterns on one line: the ``limit`` largest and a count of the rest.

    Each pattern is quoted and followed by its key count when it stands for
    more than one key. Deterministic; does not modify its input.

    Args:
        keys: Flat keys, in any order.
        limit: How many patterns to show before the count of the rest.

    Returns:
        One line of text.

    Examples:
        >>> from dsdmerge.report import format_keys
        >>> format_keys(["b", "a.0", "a.1", "a.2", "c.x"], limit=2)
        "'a.{0..2}' (3 keys), 'b' and 1 more key in 1 pattern"
    """
    patterns = compress(keys, max_parts=_PARTS)
    shown = ", ".join(_pattern_text(p) for p in patterns[:limit])
    rest = _rest(patterns, limit)
    return f"{shown} and {rest}" if rest else shown


def _pattern_text(p: Pattern) -> str:
    return _quote(str(p)) + (f" ({p.count:,} keys)" if p.count > 1 else "")


def _meta(meta: TensorMeta) -> str:
    return f"{dtype_name(meta.dtype)}{list(meta.shape)}"


def _mismatch_groups(items: Iterable[Mismatch]) -> list[tuple[Pattern, str, str]]:
    """Mismatches grouped by (checkpoint, reference) metadata, keys compressed per group."""
    groups: dict[tuple[str, str], list[str]] = {}
    for m in items:
        groups.setdefault((_meta(m.checkpoint), _meta(m.reference)), []).append(m.key)
    out = [(p, c, r) for (c, r), keys in groups.items() for p in compress(keys, max_parts=_PARTS)]
    out.sort(key=lambda item: (*_rank(item[0]), item[1], item[2]))
    return out


def format_mismatches(items: Iterable[Mismatch], /, *, limit: int = _SHOWN) -> str:
    """``'key' (checkpoint float32[2, 3], reference float32[4, 3])`` per pattern, on one line.

    Keys with the same pair of shapes and dtypes are compressed into patterns;
    the ``limit`` largest are shown. Does not modify its input.

    Args:
        items: The mismatches, e.g. ``KeyDiff.mismatched``.
        limit: How many patterns to show before the count of the rest.

    Returns:
        One line of text.

    Examples:
        >>> import torch, dsdmerge as dm
        >>> from dsdmerge.report import format_mismatches
        >>> format_mismatches(dm.diff({"w": torch.zeros(2)}, {"w": torch.zeros(3)}).mismatched)
        "'w' (checkpoint float32[2], reference float32[3])"
    """
    groups = _mismatch_groups(items)
    shown = ", ".join(
        f"{_quote(str(p))} ({f'{p.count:,} keys, ' if p.count > 1 else ''}"
        f"checkpoint {c}, reference {r})"
        for p, c, r in groups[:limit]
    )
    rest = _rest([p for p, _, _ in groups], limit)
    return f"{shown} and {rest}" if rest else shown


def _resized_groups(items: Iterable[Resized]) -> list[tuple[Pattern, Resized]]:
    """Resizes grouped by their pair of shapes and dtypes, keys compressed per group."""
    groups: dict[tuple[str, str], list[Resized]] = {}
    for r in items:
        groups.setdefault((_meta(r.checkpoint), _meta(r.reference)), []).append(r)
    out = [
        (p, same[0])
        for same in groups.values()
        for p in compress([r.key for r in same], max_parts=_PARTS)
    ]
    out.sort(key=lambda item: _rank(item[0]))
    return out


def _resized_text(p: Pattern, r: Resized) -> str:
    changes = ", ".join(
        f"dim {i} {r.checkpoint.shape[i]} -> {r.reference.shape[i]}" for i in r.dims
    )
    each = " each" if p.count > 1 else ""
    return (
        f"{_line(p)}: {changes}; {r.kept:,} elements kept, "
        f"{r.from_reference:,} from the reference{each}"
    )


def format_resized(items: Iterable[Resized], /, *, limit: int = _SHOWN) -> str:
    """``'key' (dim 0 10 -> 12; 40 elements kept, 8 from the reference)`` per pattern, one line.

    Keys with the same pair of shapes and dtypes are compressed into patterns;
    the ``limit`` largest are shown. Does not modify its input.

    Args:
        items: The resizes, e.g. ``KeyDiff.resized``.
        limit: How many patterns to show before the count of the rest.

    Returns:
        One line of text.

    Examples:
        >>> import torch, dsdmerge as dm
        >>> from dsdmerge.report import format_resized
        >>> rs = [dm.Resized.of(k, torch.zeros(2, 3), torch.zeros(4, 3)) for k in ("a.w", "b.w")]
        >>> format_resized(rs)
        "'{a,b}.w' (2 keys, dim 0 2 -> 4; 6 elements kept, 6 from the reference each)"
    """
    groups = _resized_groups(items)
    shown = ", ".join(
        f"{_quote(str(p))} ({f'{p.count:,} keys, ' if p.count > 1 else ''}"
        f"{_resized_text(p, r).removeprefix(f'{_line(p)}: ')})"
        for p, r in groups[:limit]
    )
    rest = _rest([p for p, _ in groups], limit)
    return f"{shown} and {rest}" if rest else shown


def _rule_text(s: SuggestedRename) -> str:
    pattern = (
        f"r'{s.pattern}'"
        if "'" not in s.pattern and not s.pattern.endswith("\\") and s.pattern.isprintable()
        else repr(s.pattern)
    )
    preset = f" (preset {s.preset!r})" if s.preset else ""
    old, new = s.example
    return (
        f"{pattern} -> {s.replacement!r}{preset}: {_plural(s.params, 'param')}, "
        f"{_plural(s.keys, 'key')}, e.g. {printable(old)} -> {printable(new)}"
    )


_MISSING = "missing from the checkpoint (will be taken from the reference)"
_UNEXPECTED = "unexpected in the checkpoint (not in the reference)"
_MISMATCHED = "in both with a different shape or dtype"
_CHANGED = "differ between checkpoint and reference (a merge keeps the checkpoint's)"

_COLORS = {
    "missing": "33",
    "unexpected": "36",
    "mismatched": "31",
    "changed": "35",
    "renamed": "35",
    "resized": "32",
    "dim": "2",
    "bold": "1",
}


def _paint(text: str, what: str, color: bool) -> str:
    return f"\x1b[{_COLORS[what]}m{text}\x1b[0m" if color else text


def render(
    diff: KeyDiff, /, *, limit: int = _SHOWN, table: bool = False, color: bool = False
) -> str:
    """A readable multi-line report of a :class:`~dsdmerge.KeyDiff`, keys compressed.

    One section per kind of difference, each listing the ``limit`` largest
    patterns (exact: see :func:`compress`) and how many keys and patterns are
    not shown. Mismatches are grouped by their pair of shapes and dtypes and
    show both sides. Deterministic; does not modify its input.

    Args:
        diff: The diff to report.
        limit: Patterns shown per section.
        table: Put key counts in an aligned left column (for terminals) rather
            than after each pattern.
        color: Add ANSI colours (for terminals).

    Returns:
        The report, without a trailing newline; ``"no differences"`` for an
        empty diff.

    Examples:
        >>> import dsdmerge as dm
        >>> print(dm.KeyDiff(missing=("a.0", "a.1", "a.2", "b")))
        4 keys missing from the checkpoint (will be taken from the reference):
          a.{0..2}  (3 keys)
          b
    """
    if not diff:
        return "no differences"
    lines: list[str] = []
    tied = {key for key, _ in diff.tied}  # (listed on their own, below)
    for name, keys, what in (
        ("missing", [k for k in diff.missing if k not in tied] if tied else diff.missing, _MISSING),
        ("unexpected", diff.unexpected, _UNEXPECTED),
    ):
        if keys:
            lines.append(_paint(f"{_plural(len(keys), 'key')} {what}:", name, color))
            patterns = compress(keys, max_parts=_PARTS)
            lines.extend(render_patterns(patterns, limit=limit, table=table, color=color))
    if diff.mismatched:
        n = len(diff.mismatched)
        lines.append(_paint(f"{_plural(n, 'tensor')} {_MISMATCHED}:", "mismatched", color))
        groups = _mismatch_groups(diff.mismatched)
        rows = [
            (p.count, f"{_line(p)}: checkpoint {c}, reference {r}") for p, c, r in groups[:limit]
        ]
        lines.extend(_rows(rows, table, color))
        if len(groups) > limit:
            rest = _rest([p for p, _, _ in groups], limit)
            lines.append("  " + _paint(f"... and {rest}", "dim", color))
    changed = diff.changed
    if changed:
        n = len(changed)
        lines.append(_paint(f"{_plural(n, 'non-tensor value')} {_CHANGED}:", "changed", color))
        groups = _changed_groups(changed)
        rows = [
            (p.count, f"{_line(p)}: checkpoint {c}, reference {r}") for p, c, r in groups[:limit]
        ]
        lines.extend(_rows(rows, table, color))
        if len(groups) > limit:
            rest = _rest([p for p, _, _ in groups], limit)
            lines.append("  " + _paint(f"... and {rest}", "dim", color))
    if diff.renames:
        n = sum(s.keys for s in diff.renames)
        lines.append(
            _paint(
                f"{_plural(n, 'unexpected key')} look renamed (each pairs with a missing key of "
                "the same shape and dtype); rename=<these rules> would apply them:",
                "renamed",
                color,
            )
        )
        lines.extend(f"  {_rule_text(s)}" for s in diff.renames)
    conversions = getattr(diff, "conversions", ())
    if conversions:
        lines.append(
            _paint(
                "unexpected keys look like another layout of missing ones (same shapes and "
                f"dtypes once converted); convert={list(conversions)!r} would convert them",
                "renamed",
                color,
            )
        )
    if diff.resized:
        lines.append(
            _paint(
                f"{_plural(len(diff.resized), 'tensor')} resized (the checkpoint's overlapping "
                "slice kept, the rest from the reference):",
                "resized",
                color,
            )
        )
        rs = _resized_groups(diff.resized)
        lines.extend(_rows([(p.count, _resized_text(p, r)) for p, r in rs[:limit]], table, color))
        if len(rs) > limit:
            lines.append("  " + _paint(f"... and {_rest([p for p, _ in rs], limit)}", "dim", color))
    if diff.tied:
        lines.append(
            f"{_plural(len(diff.tied), 'missing key')} tied to a key the checkpoint has (one "
            "tensor in the reference; each takes that key's tensor):"
        )
        lines.extend(f"  {key} <- {source}" for key, source in diff.tied[:limit])
        if len(diff.tied) > limit:
            lines.append("  " + _paint(f"... and {len(diff.tied) - limit} more", "dim", color))
    return "\n".join(lines)


def _changed_groups(items: Iterable[Changed]) -> list[tuple[Pattern, str, str]]:
    """Changed values grouped by their pair of values (as text), keys compressed per group."""
    groups: dict[tuple[str, str], list[str]] = {}
    for c in items:
        groups.setdefault((short_repr(c.checkpoint), short_repr(c.reference)), []).append(c.key)
    out = [(p, a, b) for (a, b), keys in groups.items() for p in compress(keys, max_parts=_PARTS)]
    out.sort(key=lambda item: (*_rank(item[0]), item[1], item[2]))
    return out


def render_patterns(
    patterns: Sequence[Pattern], /, *, limit: int = _SHOWN, table: bool = False, color: bool = False
) -> list[str]:
    r"""The lines listing the first ``limit`` patterns, indented, and a count of the rest.

    Args:
        patterns: Patterns, as :func:`compress` returns them (largest first).
        limit: How many to show.
        table: Key counts in an aligned left column rather than after each pattern.
        color: Add ANSI colours.

    Returns:
        One line per shown pattern, plus ``"  ... and M more keys in K patterns"``
        when some are not shown.

    Examples:
        >>> from dsdmerge.report import compress, render_patterns
        >>> print("\n".join(render_patterns(compress(["a.0", "a.1", "a.2", "b", "c.d"]), limit=2)))
          a.{0..2}  (3 keys)
          b
          ... and 1 more key in 1 pattern
    """
    lines = _rows([(p.count, _line(p)) for p in patterns[:limit]], table, color)
    if len(patterns) > limit:
        lines.append("  " + _paint(f"... and {_rest(patterns, limit)}", "dim", color))
    return lines


def _rows(rows: Sequence[tuple[int, str]], table: bool, color: bool) -> list[str]:
    if not rows:
        return []
    if table:
        width = max(len(f"{n:,}") for n, _ in rows)
        return [f"  {_paint(f'{n:>{width},}', 'dim', color)}  {text}" for n, text in rows]
    return [
        f"  {text}" + (_paint(f"  ({n:,} keys)", "dim", color) if n > 1 else "") for n, text in rows
    ]


def summary(diff: KeyDiff, /, *, limit: int | None = None) -> dict[str, Any]:
    """A JSON-ready, compressed form of a diff: counts and patterns per section.

    Args:
        diff: The diff.
        limit: At most this many patterns per section (``None``: all of them);
            ``"patterns_not_shown"`` says how many were left out.

    Returns:
        ``{"missing": {"count": n, "patterns": [{"pattern": ..., "count": ...}],
        "patterns_not_shown": k}, "unexpected": {...}, "mismatched": {...}, "renames":
        [...]}``; mismatched patterns also carry ``"checkpoint"`` and ``"reference"``;
        ``"renames"`` lists the suggested renames (:meth:`SuggestedRename.to_dict`).

    Examples:
        >>> import dsdmerge as dm
        >>> from dsdmerge.report import summary
        >>> summary(dm.KeyDiff(missing=("a.0", "a.1")))["missing"]
        {'count': 2, 'patterns': [{'pattern': 'a.{0,1}', 'count': 2}], 'patterns_not_shown': 0}
    """
    out: dict[str, Any] = {}
    for name, keys in (("missing", diff.missing), ("unexpected", diff.unexpected)):
        patterns = compress(keys, max_parts=_PARTS)
        shown = patterns if limit is None else patterns[:limit]
        out[name] = {
            "count": len(keys),
            "patterns": [p.to_dict() for p in shown],
            "patterns_not_shown": len(patterns) - len(shown),
        }
    groups = _mismatch_groups(diff.mismatched)
    shown_groups = groups if limit is None else groups[:limit]
    out["mismatched"] = {
        "count": len(diff.mismatched),
        "patterns": [{**p.to_dict(), "checkpoint": c, "reference": r} for p, c, r in shown_groups],
        "patterns_not_shown": len(groups) - len(shown_groups),
    }
    changed = diff.changed
    if changed:
        groups = _changed_groups(changed)
        shown_groups = groups if limit is None else groups[:limit]
        out["changed"] = {
            "count": len(changed),
            "patterns": [
                {**p.to_dict(), "checkpoint": c, "reference": r} for p, c, r in shown_groups
            ],
            "patterns_not_shown": len(groups) - len(shown_groups),
        }
    out["renames"] = [s.to_dict() for s in diff.renames]
    if getattr(diff, "conversions", ()):
        out["conversions"] = list(diff.conversions)
    return out
