"""dsdmerge: resume PyTorch training from checkpoints whose state dicts do not match.

Stateless functions that classify state dicts as nested or flat, convert between
the two losslessly, diff them by flat key, and merge a checkpoint over a fresh
reference under a policy::

    import dsdmerge as dm
    optimizer_sd = dm.merge(loaded_optimizer_sd, fresh_optimizer_sd)  # policy="default"
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

# Reports
from dsdmerge.report import Pattern, compress, expand

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
    # Errors and warnings
    "DSDMergeError",
    "LayoutError",
    "MergeError",
    "StateDictTypeError",
    "InvalidPolicyError",
    "CheckpointReadError",
    "UnsafeCheckpointError",
    "PatternError",
    "DSDMergeWarning",
]
