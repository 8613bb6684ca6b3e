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


def dtype_name(dtype: Any) -> str:
    """``torch.float32`` -> ``"float32"``; other dtypes by ``str()``."""
    text = str(dtype)
    return text[len("torch.") :] if text.startswith("torch.") else text
