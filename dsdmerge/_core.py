"""The core as :mod:`dsdmerge.integrations` sees it: a small, named, typed interface.

The integrations (torch-facing resume helpers, checkpoint files) use the core
only through these names, so the engine behind them can change freely:

* :func:`merge_under`: a merge under an already-resolved :class:`~dsdmerge.Policy`
  (the integrations adjust ``drop_unexpected`` to what their loader accepts),
  returning the :class:`~dsdmerge.Merged` state dict, diff and conflicts;
* :func:`verdict`: the policy applied to the differences of two state dicts
  (either may be a metadata-only view), nothing merged: the
  :class:`~dsdmerge.KeyDiff`, or a :class:`~dsdmerge.MergeError`;
* :func:`surgery`: a checkpoint (or a view of it) renamed and converted as
  ``rename=`` / ``convert=`` do it, with the findings :func:`verdict` then reports;
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

from collections.abc import Mapping, Sequence
from typing import Any

from dsdmerge._engine import run
from dsdmerge._groups import most_common
from dsdmerge._ids import normalise_ids, one_spelling, respelled_state
from dsdmerge._records import KeyDiff, Mismatch
from dsdmerge._trees import copy_tree
from dsdmerge._values import MISSING, short_repr
from dsdmerge.convert import Conversions, convert_checkpoint
from dsdmerge.merge import (
    Merged,
    _renamed,
    _shape_choice,
    _unresizable,
    apply_policy,
    merge_resolved,
    reshaped,
)
from dsdmerge.policy import Action, Policy
from dsdmerge.rename import Rules
from dsdmerge.resize import OnShapeMismatch

__all__ = [
    "MISSING",
    "Finding",
    "Merged",
    "Mismatch",
    "copy_tree",
    "merge_under",
    "most_common",
    "normalise_ids",
    "respelled_state",
    "reshaped",
    "short_repr",
    "surgery",
    "verdict",
]

Finding = tuple[Action, str]
"""One thing a policy decides about: the action it takes, and the line that says what."""


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
    checkpoint: Mapping[Any, Any],
    reference: Mapping[Any, Any],
    policy: Policy,
    *,
    stacklevel: int,
    findings: Sequence[Finding] = (),
    on_shape_mismatch: OnShapeMismatch = "raise",
) -> KeyDiff:
    """The policy's verdict on the differences, without merging (warnings at ``stacklevel``).

    Like :func:`dsdmerge.check` without rename suggestions: either side may be a
    metadata-only view (``"resize"`` is then checked for ranks only). ``findings``:
    more to report, as :func:`surgery` returns them. Raises
    :class:`~dsdmerge.MergeError` when the policy rejects a difference. Does not
    modify its inputs.
    """
    shapes = _shape_choice(on_shape_mismatch)
    checkpoint, reference = one_spelling(checkpoint, reference)
    outcome = run(checkpoint, reference, merge=False, conflicts=policy.conflict != "ignore")
    extra = list(findings)
    if shapes == "resize":
        extra.extend(_unresizable(outcome, metadata_only=True))
    return apply_policy(
        outcome,
        policy,
        stacklevel=stacklevel + 2,
        extra=extra,
        on_shape_mismatch=shapes,
        reference=reference,
    )[0]


def surgery(
    checkpoint: Mapping[Any, Any],
    policy: Policy,
    *,
    rename: Rules | None,
    convert: Conversions | None,
    stacklevel: int,
    quiet: bool = False,
) -> tuple[Mapping[Any, Any], list[Finding]]:
    """``checkpoint`` renamed, then converted (each if given), and the findings about it.

    Exactly what ``rename=`` and ``convert=`` of :func:`dsdmerge.check` do to the
    checkpoint side (a view is renamed and converted by shape, without reading any
    tensor); the findings (rename rules that matched nothing) go to :func:`verdict`.
    Every leaf neither renames nor converts is shared by identity, in the order of
    a flat input's keys. ``quiet``: no conversion warnings (a second pass over data
    whose view was converted already). Does not modify its input.
    """
    if quiet and convert is not None:
        renamed, findings = _renamed(checkpoint, rename, policy)
        return convert_checkpoint(renamed, convert, stacklevel=2, quiet=True), findings
    return _renamed(checkpoint, rename, policy, convert=convert, stacklevel=stacklevel + 2)
