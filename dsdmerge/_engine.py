"""The engine: one entry, :func:`run`, behind :func:`~dsdmerge.diff` and :func:`~dsdmerge.merge`.

:func:`run` compares a checkpoint with a reference and, when asked, builds the
merged state dict in the checkpoint's layout. What it must compute is defined
plainly, key by key, in :mod:`dsdmerge._spec`; the modules below compute the
same in a few C-level passes. It dispatches on the two layouts:

* both nested: the per-parameter walk of :mod:`dsdmerge._nested_walk` (which sends pairs
  of flat sub-dicts through the flat pass);
* otherwise both flat, a nested side flattened first (:func:`dsdmerge._trees.flatten`):
  the flat pass of :mod:`dsdmerge._flat_pass`, with the reference's param groups when it
  was a nested optimizer state dict (else they are inferred). A nested checkpoint
  over a flat reference can be compared, not merged (the result is in the
  checkpoint's layout, which has no place for the reference's keys).

Where each rule lives: key alignment in :mod:`dsdmerge._keys`, tensor checks in
:mod:`dsdmerge._tensors`, param groups in :mod:`dsdmerge._groups` (reading torch's
flat format with :mod:`dsdmerge._table`), nested trees and their flat keys in
:mod:`dsdmerge._trees`, the records in :mod:`dsdmerge._records`. Policy decisions
are made on the outcome by :mod:`dsdmerge._verdict`, in :mod:`dsdmerge._pipeline`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dsdmerge._flat_pass import flat_pass
from dsdmerge._gc import gc_paused
from dsdmerge._nested_walk import NestedMerge
from dsdmerge._records import Outcome
from dsdmerge._tensors import scan
from dsdmerge._trees import flatten
from dsdmerge._values import key_str
from dsdmerge.errors import LayoutError
from dsdmerge.layout import (
    PARAM_GROUPS,
    PARAMS,
    Layout,
    is_optimizer_state_dict,
    layout_of,
    require_mapping,
)

__all__ = ["Outcome", "run"]


def run(
    checkpoint: Mapping[Any, Any],
    reference: Mapping[Any, Any],
    *,
    merge: bool,
    keep_unexpected: bool = True,
    conflicts: bool = False,
    key_prefix: str = "",
) -> Outcome:
    """Compare (and merge) ``checkpoint`` over ``reference``; see the module docstring.

    Args:
        checkpoint: The checkpoint's state dict (flat or nested).
        reference: The reference's state dict (flat or nested).
        merge: Build the merged state dict (``Outcome.merged``), else only compare.
        keep_unexpected: Keep the checkpoint's keys the reference lacks in the result.
        conflicts: Look for param-group members whose checkpoint hyperparameters
            disagree (``Outcome.conflicts``).
        key_prefix: Only for naming keys in errors: the path of this pair inside a
            larger state dict.

    Returns:
        The :class:`~dsdmerge._records.Outcome`, before any policy.
    """
    if not (isinstance(checkpoint, Mapping) and isinstance(reference, Mapping)):
        require_mapping(checkpoint, "checkpoint")
        require_mapping(reference, "reference")
    # One pass over each side's values serves classify, require_flat and the tensor checks:
    # the type of each value (dsdmerge._tensors.scan).
    c_scan = scan(checkpoint)
    r_scan = scan(reference)
    r_codes, r_tt = r_scan.tensor_codes()  # for the flat pass (a nested side has few values)
    c_layout = layout_of(checkpoint, c_scan.types)
    r_layout = layout_of(reference, r_scan.types)
    if c_layout is Layout.NESTED and r_layout is Layout.NESTED:
        walk = NestedMerge(merge=merge, keep_unexpected=keep_unexpected, conflicts=conflicts)
        with gc_paused():  # a new dict per parameter, none of them cyclic (see dsdmerge._gc)
            return walk.run(checkpoint, reference)
    if c_layout is Layout.NESTED:
        if merge:
            raise LayoutError(
                "the checkpoint is nested but the reference is flat, so the merged result "
                "(in the checkpoint's layout) has no structure for the reference's keys. Pass "
                "the reference nested, or merge dsdmerge.flatten(checkpoint) instead."
            )
        checkpoint = flatten(checkpoint)
    groups = None
    if r_layout is Layout.NESTED:
        if is_optimizer_state_dict(reference):
            groups = [
                [key_str(pid, f"{PARAM_GROUPS}[{i}]") for pid in g[PARAMS]]
                for i, g in enumerate(reference[PARAM_GROUPS])
                if isinstance(g, Mapping) and isinstance(g.get(PARAMS), (list, tuple))
            ]
        reference = flatten(reference)
        r_codes, r_tt = scan(reference).tensor_codes()
    # Both are flat now; the flat pass checks that their keys are str, on its way through them.
    # The scans' per-value type lists (two lists as long as the dicts) are not kept through
    # the pass: the group proof makes each chunk's types itself, for a peak of ~1.3x one dict
    # instead of ~2x at 661k keys, in the same time.
    del c_scan, r_scan
    return flat_pass(
        checkpoint,
        reference,
        r_codes,
        r_tt,
        merge=merge,
        keep_unexpected=keep_unexpected,
        conflicts=conflicts,
        groups=groups,
        key_prefix=key_prefix,
    )
