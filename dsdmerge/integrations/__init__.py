"""Integrations with torch's checkpoint formats and trainer resume paths.

:mod:`dsdmerge.integrations.checkpoints` reads checkpoints safely: metadata-only
views (:func:`read_metadata`) to diff against a model before loading anything,
and full loads (:func:`load_checkpoint`) that never run pickled code unless told
the checkpoint is trusted.

:mod:`dsdmerge.integrations.resume` is the one call a trainer makes on resume:
:func:`resume_optimizer`, :func:`resume_model`, and :func:`load_dcp` for DCP
directories (policy-checked, scoped partial loads).

:mod:`dsdmerge.integrations.hooks` makes a trainer's own save and load calls go
through dsdmerge: :func:`record_param_names` (every later ``optimizer.state_dict()``
carries the parameters' names), :func:`install_load_hook` and
:func:`install_model_load_hook` (``load_state_dict`` merges first).

Names are imported from their modules on first use (PEP 562), so that the command line
can read a safetensors header or a Hugging Face directory without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # Reading checkpoints
    from dsdmerge.integrations.checkpoints import (
        CheckpointFormat,
        CheckpointView,
        detect_format,
        load_checkpoint,
        read_metadata,
    )

    # Trainers' own save and load calls
    from dsdmerge.integrations.hooks import (
        LoadHook,
        ModelLoadHook,
        install_load_hook,
        install_model_load_hook,
        record_param_names,
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
    # Trainers' own save and load calls
    "LoadHook",
    "ModelLoadHook",
    "install_load_hook",
    "install_model_load_hook",
    "record_param_names",
]

_HOME = {
    **dict.fromkeys(__all__[:5], "checkpoints"),
    **dict.fromkeys(__all__[5:11], "resume"),
    **dict.fromkeys(__all__[11:], "hooks"),
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'dsdmerge.integrations' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"dsdmerge.integrations.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME})
