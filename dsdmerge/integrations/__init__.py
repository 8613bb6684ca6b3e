"""Integrations with torch's checkpoint formats and trainer resume paths.

:mod:`dsdmerge.integrations.checkpoints` reads checkpoints safely: metadata-only
views (:func:`read_metadata`) to diff against a model before loading anything,
and full loads (:func:`load_checkpoint`) that never run pickled code unless told
the checkpoint is trusted.

:mod:`dsdmerge.integrations.resume` is the one call a trainer makes on resume:
:func:`resume_optimizer`, :func:`resume_model`, and :func:`load_dcp` for DCP
directories (policy-checked, scoped partial loads).
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

# Resuming
from dsdmerge.integrations.resume import (
    DCPLoad,
    Fresh,
    backfill_optimizer_state,
    load_dcp,
    resume_model,
    resume_optimizer,
)

__all__ = [
    # Reading checkpoints
    "CheckpointFormat",
    "CheckpointView",
    "detect_format",
    "load_checkpoint",
    "read_metadata",
    # Resuming
    "DCPLoad",
    "Fresh",
    "backfill_optimizer_state",
    "load_dcp",
    "resume_model",
    "resume_optimizer",
]
