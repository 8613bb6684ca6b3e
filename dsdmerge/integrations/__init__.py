"""Integrations with torch's checkpoint formats and trainer resume paths.

:mod:`dsdmerge.integrations.checkpoints` reads checkpoints safely: metadata-only
views (:func:`read_metadata`) to diff against a model before loading anything,
and full loads (:func:`load_checkpoint`) that never run pickled code unless told
the checkpoint is trusted.
"""

from __future__ import annotations

# Reading checkpoints
from dsdmerge.integrations.checkpoints import (
    CheckpointFormat,
    CheckpointView,
    detect_format,
    load_checkpoint,
    read_metadata,
)

__all__ = [
    # Reading checkpoints
    "CheckpointFormat",
    "CheckpointView",
    "detect_format",
    "load_checkpoint",
    "read_metadata",
]
