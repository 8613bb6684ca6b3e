"""dsdmerge: resume PyTorch training from checkpoints whose state dicts do not match.

Stateless functions that classify state dicts as nested or flat, convert between
the two losslessly, diff them by flat key, and merge a checkpoint over a fresh
reference under a policy::

    import dsdmerge as dm
    optimizer_sd = dm.merge(loaded_optimizer_sd, fresh_optimizer_sd)  # policy="default"

Model surgery carries the optimizer state along: ``rename`` (and ``rename=``)
maps fqns by rules everywhere they appear, ``on_shape_mismatch="resize"`` keeps
the trained slice of a resized tensor and of its moments, and ``rekey`` turns
``optimizer.state_dict()``'s int ids into fqns. Layout changes carry it too:
``convert`` fuses (q/k/v into ``qkv_proj``), splits, stacks (MoE experts into one
3-D parameter), unstacks and transposes parameters and their optimizer state.

Importing the package is cheap: each public name is imported from its module on first
use (PEP 562), so ``dsdmerge --version`` and reading a safetensors header never import
torch.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names below are, for type checkers and readers
    # Layout conversions
    from dsdmerge.convert import (
        CONVERSION_PRESETS,
        Fuse,
        Split,
        Stack,
        Transpose,
        Unstack,
        convert,
    )

    # Diffs
    from dsdmerge.diff import Changed, KeyDiff, Mismatch, TensorMeta, diff

    # Errors and warnings
    from dsdmerge.errors import (
        CheckpointReadError,
        CheckpointWriteError,
        ConversionError,
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
        PolicyName,
        resolve_policy,
    )

    # Model surgery: renames, resized tensors, int ids to fqns
    from dsdmerge.rekey import rekey
    from dsdmerge.rename import RENAME_PRESETS, SuggestedRename, rename, strip_prefix

    # Reports
    from dsdmerge.report import Pattern, compress, expand
    from dsdmerge.resize import OnShapeMismatch, Resized, resize

__version__ = "0.1.0"

# Each public name and the module it comes from (what the TYPE_CHECKING block imports).
_HOME: dict[str, str] = {
    **dict.fromkeys(
        ("CONVERSION_PRESETS", "Fuse", "Split", "Stack", "Transpose", "Unstack", "convert"),
        "convert",
    ),
    **dict.fromkeys(("Changed", "KeyDiff", "Mismatch", "TensorMeta", "diff"), "diff"),
    **dict.fromkeys(
        (
            "CheckpointReadError",
            "ConversionError",
            "CheckpointWriteError",
            "DSDMergeError",
            "DSDMergeWarning",
            "LayoutError",
            "MergeError",
            "PatternError",
            "RenameError",
            "StateDictTypeError",
            "UnsafeCheckpointError",
        ),
        "errors",
    ),
    **dict.fromkeys(("flatten", "unflatten"), "flatten"),
    **dict.fromkeys(("Layout", "classify", "is_optimizer_state_dict"), "layout"),
    **dict.fromkeys(("Fresh", "Merged", "check", "merge", "merge_with_diff"), "merge"),
    **dict.fromkeys(
        (
            "DEFAULT",
            "STRICT",
            "WARN",
            "Action",
            "InvalidPolicyError",
            "Policy",
            "PolicyName",
            "resolve_policy",
        ),
        "policy",
    ),
    "rekey": "rekey",
    **dict.fromkeys(("RENAME_PRESETS", "SuggestedRename", "rename", "strip_prefix"), "rename"),
    **dict.fromkeys(("Pattern", "compress", "expand"), "report"),
    **dict.fromkeys(("OnShapeMismatch", "Resized", "resize"), "resize"),
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'dsdmerge' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"dsdmerge.{home}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME})


class _Package(types.ModuleType):
    """The package object: a submodule never hides the public function named like it.

    Importing ``dsdmerge.diff`` (the module) makes the import system set the package's
    ``diff`` attribute to that module; ``dm.diff`` must stay the function, as it was
    when this package imported its names eagerly.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _HOME and isinstance(value, types.ModuleType):
            return  # the module stays reachable as sys.modules["dsdmerge.<name>"]
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

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
    "PolicyName",
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
    # Layout conversions
    "convert",
    "Fuse",
    "Split",
    "Stack",
    "Unstack",
    "Transpose",
    "CONVERSION_PRESETS",
    # Errors and warnings
    "DSDMergeError",
    "LayoutError",
    "MergeError",
    "StateDictTypeError",
    "InvalidPolicyError",
    "CheckpointReadError",
    "CheckpointWriteError",
    "UnsafeCheckpointError",
    "PatternError",
    "RenameError",
    "ConversionError",
    "DSDMergeWarning",
]
