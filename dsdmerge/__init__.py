"""dsdmerge: resume PyTorch training from checkpoints whose state dicts do not match.

Stateless functions that classify state dicts as nested or flat, convert between
the two losslessly, diff them by flat key, and merge a checkpoint over a fresh
reference under a policy::

    import dsdmerge as dm
    optimizer_sd = dm.merge(loaded_optimizer_sd, fresh_optimizer_sd)  # policy="default"

Model surgery carries the optimizer state along: ``rename`` (and ``rename=``)
maps fqns by rules everywhere they appear, ``on_shape_mismatch="resize"`` keeps
the trained slice of a resized tensor and of its moments, and ``rekey`` turns
``optimizer.state_dict()``'s int ids into fqns.
"""

from __future__ import annotations

# Diffs
from dsdmerge.diff import Changed, KeyDiff, Mismatch, TensorMeta, diff

# Errors and warnings
from dsdmerge.errors import (
    CheckpointReadError,
    DSDMergeError,
    DSDMergeWarning,
    LayoutError,
    MergeError,
    PatternError,
    RenameError,
    StateDictTypeError,
    UnsafeCheckpointError,
)

# Conversion
from dsdmerge.flatten import flatten, unflatten

# Layouts
from dsdmerge.layout import Layout, classify, is_optimizer_state_dict

# Merging and policies
from dsdmerge.merge import Fresh, Merged, check, merge, merge_with_diff
from dsdmerge.policy import (
    DEFAULT,
    STRICT,
    WARN,
    Action,
    InvalidPolicyError,
    Policy,
    resolve_policy,
)

# Model surgery: renames, resized tensors, int ids to fqns
from dsdmerge.rekey import rekey
from dsdmerge.rename import RENAME_PRESETS, SuggestedRename, rename, strip_prefix

# Reports
from dsdmerge.report import Pattern, compress, expand
from dsdmerge.resize import OnShapeMismatch, Resized, resize

__version__ = "0.1.0"

__all__ = [
    # Layouts
    "Layout",
    "classify",
    "is_optimizer_state_dict",
    # Conversion
    "flatten",
    "unflatten",
    # Diffs
    "Changed",
    "KeyDiff",
    "Mismatch",
    "TensorMeta",
    "diff",
    # Merging and policies
    "Fresh",
    "Merged",
    "merge",
    "merge_with_diff",
    "check",
    "Policy",
    "Action",
    "DEFAULT",
    "WARN",
    "STRICT",
    "resolve_policy",
    # Reports
    "Pattern",
    "compress",
    "expand",
    # Model surgery
    "rename",
    "strip_prefix",
    "RENAME_PRESETS",
    "SuggestedRename",
    "resize",
    "Resized",
    "OnShapeMismatch",
    "rekey",
    # Errors and warnings
    "DSDMergeError",
    "LayoutError",
    "MergeError",
    "StateDictTypeError",
    "InvalidPolicyError",
    "CheckpointReadError",
    "UnsafeCheckpointError",
    "PatternError",
    "RenameError",
    "DSDMergeWarning",
]
