"""The core as :mod:`dsdmerge.integrations` sees it: a small, named, typed interface.

The integrations (torch-facing resume helpers, checkpoint files) use the core
only through these names, so the engine behind them can change freely:

* :func:`merge_under`: a merge under an already-resolved :class:`~dsdmerge.Policy`
  (the integrations adjust ``drop_unexpected`` to what their loader accepts),
  returning the :class:`~dsdmerge.Merged` state dict, diff and conflicts;
* :func:`verdict`: the policy applied to the differences of two state dicts
  (either may be a metadata-only view), nothing merged: the
  :class:`~dsdmerge.KeyDiff`, or a :class:`~dsdmerge.MergeError`;
* :func:`reshaped`: whether a mismatch is a real change of shape (torch rejects it);
* :func:`copy_tree`: new containers, shared leaves;
* :func:`normalise_ids` / :func:`respelled_state`: int param ids, and int keys inside
  a parameter's state, that a DCP round trip spelled as strings made int again
  (:mod:`dsdmerge._ids`), as every verb reads them;
* :func:`most_common`: the group rule "the checkpoint group most members come
  from" (:mod:`dsdmerge._groups`), for building a reference the merge agrees with;
* :data:`MISSING` and :func:`short_repr`: the sentinel for "no value" and the
  bounded repr of messages.

``stacklevel`` arguments are as for ``warnings.warn``, counted from the caller of
the interface function: 1 names the caller, 2 the caller's caller.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dsdmerge._engine import run
from dsdmerge._groups import most_common
from dsdmerge._ids import normalise_ids, one_spelling, respelled_state
from dsdmerge._records import KeyDiff, Mismatch
from dsdmerge._trees import copy_tree
from dsdmerge._values import MISSING, short_repr
from dsdmerge.convert import Conversions
from dsdmerge.merge import Merged, apply_policy, merge_resolved, reshaped
from dsdmerge.policy import Policy
from dsdmerge.rename import Rules
from dsdmerge.resize import OnShapeMismatch

__all__ = [
    "MISSING",
    "Merged",
    "Mismatch",
    "copy_tree",
    "merge_under",
    "most_common",
    "normalise_ids",
    "respelled_state",
    "reshaped",
    "short_repr",
    "verdict",
]


def merge_under(
    checkpoint: Mapping[Any, Any],
    reference: Mapping[Any, Any],
    policy: Policy,
    *,
    stacklevel: int,
    rename: Rules | None = None,
    convert: Conversions | None = None,
    on_shape_mismatch: OnShapeMismatch = "raise",
) -> Merged:
    """:func:`dsdmerge.merge_with_diff` under a resolved policy, warnings at ``stacklevel``.

    Does not modify its inputs.
    """
    return merge_resolved(
        checkpoint,
        reference,
        policy,
        stacklevel=stacklevel + 2,
        rename=rename,
        convert=convert,
        on_shape_mismatch=on_shape_mismatch,
    )


def verdict(
    checkpoint: Mapping[Any, Any], reference: Mapping[Any, Any], policy: Policy, *, stacklevel: int
) -> KeyDiff:
    """The policy's verdict on the differences, without merging (warnings at ``stacklevel``).

    Like :func:`dsdmerge.check` without renames (neither applied nor suggested):
    either side may be a metadata-only view. Raises
    :class:`~dsdmerge.MergeError` when the policy rejects a difference. Does not
    modify its inputs.
    """
    checkpoint, reference = one_spelling(checkpoint, reference)
    outcome = run(checkpoint, reference, merge=False, conflicts=policy.conflict != "ignore")
    return apply_policy(outcome, policy, stacklevel=stacklevel + 2, reference=reference)[0]
