"""Text helpers every layer uses, torch-free: bounded reprs and dtype names.

Kept apart from :mod:`dsdmerge._values` (which imports torch) so that the report
module, and with it the command line's torch-free paths, can name values and
dtypes without importing torch.
"""

from __future__ import annotations

import reprlib
from typing import Any

__all__: list[str] = []

_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxstring = 120
_REPR.maxother = 120


def short_repr(value: object) -> str:
    """A bounded ``repr`` for messages: never recurses deeply, never raises, never huge."""
    try:
        return _REPR.repr(value)
    except Exception:  # an exotic __repr__  # noqa: BLE001
        return f"<{type(value).__name__} object>"


def shown_name(text: str) -> str:
    """A name from a file, fit for a one-line message (printable, at most 120 chars)."""
    if text.isprintable() and len(text) <= 120:
        return text
    return repr(text[:120]) + ("..." if len(text) > 120 else "")


def printable(text: str) -> str:
    r"""``text`` for a terminal or a log: itself if every character prints, else its ``repr``.

    A key holding ESC, CR, LF, a bidirectional override or a lone surrogate would
    otherwise move the cursor, recolour or overwrite what was printed before it, or
    fail to encode; its ``repr`` shows every character as an escape (and is ASCII
    where those are). Printable text, non-ASCII letters included, is unchanged.

    Examples:
        >>> from dsdmerge._text import printable
        >>> printable("layers.0.w"), printable("a\x1b[2Jb")
        ('layers.0.w', "'a\\x1b[2Jb'")
    """
    return text if text.isprintable() else repr(text)


def escaped(text: str) -> str:
    r"""``text`` with each character that does not print written as its escape, in place.

    For whole messages (a warning, an error line): the message stays readable and a
    crafted name inside it cannot move the cursor or recolour the terminal.

    Examples:
        >>> from dsdmerge._text import escaped
        >>> escaped("dsdmerge: 'a\rb' is missing")
        "dsdmerge: 'a\\rb' is missing"
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def dtype_name(dtype: Any) -> str:
    """``torch.float32`` -> ``"float32"``; other dtypes by ``str()``."""
    text = str(dtype)
    return text[len("torch.") :] if text.startswith("torch.") else text
