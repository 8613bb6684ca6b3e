"""Merging a checkpoint over a reference under a policy.

``merge(checkpoint, reference)`` returns a new state dict, in the checkpoint's
layout, that torch will load: every checkpoint value kept by identity, every
key the checkpoint lacks taken from the reference, and anything torch would
reject later reported now, naming the keys.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from dsdmerge._engine import Outcome, run
from dsdmerge._values import short_repr
from dsdmerge.diff import KeyDiff, Mismatch
from dsdmerge.errors import DSDMergeWarning, MergeError
from dsdmerge.policy import Action, Policy, matcher, resolve_policy
from dsdmerge.report import format_keys, format_mismatches

__all__ = ["Merged", "check", "merge", "merge_with_diff"]


class Merged(NamedTuple):
    """The result of :func:`merge_with_diff`: the merged state dict and what differed.

    Attributes:
        state_dict: The merged state dict, in the checkpoint's layout.
        diff: The :class:`~dsdmerge.KeyDiff` of checkpoint against reference.
        conflicts: One line per param group whose checkpoint members disagree on
            a hyperparameter (looked for only when the policy's ``conflict``
            action is not ``"ignore"``).
    """

    state_dict: dict[Any, Any]
    diff: KeyDiff
    conflicts: tuple[str, ...] = ()


def merge(
    checkpoint: Mapping[Any, Any],
    reference: Mapping[Any, Any],
    /,
    *,
    policy: str | Policy = "default",
    allow_missing: str | Iterable[str] = (),
    allow_unexpected: str | Iterable[str] = (),
) -> dict[Any, Any]:
    """Merge a loaded checkpoint over a fresh reference state dict.

    Every checkpoint value is kept by identity; every key only the reference
    has is backfilled from it (a backfilled ``param_groups.<fqn>.<hp>`` takes
    the value the checkpoint has for the other members of that parameter's
    group, so a new parameter does not reset the scheduled learning rate);
    differences are handled by ``policy`` (see :mod:`dsdmerge.policy`). Does not
    modify its inputs; leaves are shared, never copied.

    Args:
        checkpoint: The state dict you loaded (flat or nested).
        reference: The state dict of the model or optimizer you have now, e.g.
            ``get_optimizer_state_dict(model, fresh_optimizer, options=...)``.
            Nested when the checkpoint is nested.
        policy: ``"default"``, ``"warn"``, ``"strict"`` or a :class:`~dsdmerge.Policy`.
        allow_missing: fnmatch globs over flat keys the checkpoint may lack.
        allow_unexpected: fnmatch globs over flat keys the reference may lack.

    Returns:
        A new state dict in the checkpoint's layout. A flat result lists the
        checkpoint's keys in the checkpoint's order, then the backfilled keys in
        the reference's order (equal to ``{**reference, **checkpoint}`` as a
        mapping); a nested result follows the reference's structure. torch's
        loaders look keys up by name, so the order never changes what loads.

    Raises:
        MergeError: The policy rejects a difference (always for tensor shape
            mismatches under the built-in policies), or an int-keyed optimizer's
            group sizes differ, which ``Optimizer.load_state_dict`` rejects.
        LayoutError: An argument is malformed, or the checkpoint is nested and
            the reference flat.
        StateDictTypeError: An argument is not a mapping.

    Example:
        >>> import dsdmerge as dm
        >>> ckpt = {"state.w.step": 7, "param_groups.w.lr": 5e-5}
        >>> fresh = {"state.w.step": 1, "state.idx.step": 1,
        ...          "param_groups.w.lr": 1e-3, "param_groups.idx.lr": 1e-3}
        >>> merged = dm.merge(ckpt, fresh)
        >>> merged["state.w.step"], merged["state.idx.step"], merged["param_groups.idx.lr"]
        (7, 1, 5e-05)
    """
    return _merge(
        checkpoint, reference, policy, allow_missing, allow_unexpected, stacklevel=4
    ).state_dict


def merge_with_diff(
    checkpoint: Mapping[Any, Any],
    reference: Mapping[Any, Any],
    /,
    *,
    policy: str | Policy = "default",
    allow_missing: str | Iterable[str] = (),
    allow_unexpected: str | Iterable[str] = (),
) -> Merged:
    """Like :func:`merge`, but also return the :class:`~dsdmerge.KeyDiff`, from the same pass.

    Does not modify its inputs.

    Args:
        checkpoint: The state dict you loaded (flat or nested).
        reference: The state dict of the model or optimizer you have now.
        policy: ``"default"``, ``"warn"``, ``"strict"`` or a :class:`~dsdmerge.Policy`.
        allow_missing: fnmatch globs over flat keys the checkpoint may lack.
        allow_unexpected: fnmatch globs over flat keys the reference may lack.

    Returns:
        ``Merged(state_dict, diff, conflicts)``.

    Example:
        >>> import dsdmerge as dm
        >>> sd, d = dm.merge_with_diff({"a": 1}, {"a": 0, "b": 2})[:2]
        >>> sd, d.missing
        ({'a': 1, 'b': 2}, ('b',))
    """
    return _merge(checkpoint, reference, policy, allow_missing, allow_unexpected, stacklevel=4)


def check(
    checkpoint: Mapping[Any, Any],
    reference: Mapping[Any, Any],
    /,
    *,
    policy: str | Policy = "default",
    allow_missing: str | Iterable[str] = (),
    allow_unexpected: str | Iterable[str] = (),
) -> KeyDiff:
    """Apply a policy to the differences without merging anything.

    Raises and warns exactly as :func:`merge` would, but builds no state dict,
    so either side may be a metadata-only view (values that are
    :class:`~dsdmerge.TensorMeta`): decide before loading any tensor. Does not
    modify its inputs.

    Args:
        checkpoint: The checkpoint's state dict, or a metadata-only view of it.
        reference: The state dict you have now, or a view of it.
        policy: ``"default"``, ``"warn"``, ``"strict"`` or a :class:`~dsdmerge.Policy`.
        allow_missing: fnmatch globs over flat keys the checkpoint may lack.
        allow_unexpected: fnmatch globs over flat keys the reference may lack.

    Returns:
        The :class:`~dsdmerge.KeyDiff`.

    Raises:
        MergeError: The policy rejects a difference.

    Example:
        >>> import dsdmerge as dm
        >>> ref = {"a": 0, "idx.w": 2}
        >>> dm.check({"a": 1}, ref, policy="strict", allow_missing=["idx.*"]).missing
        ('idx.w',)
    """
    pol = resolve_policy(policy, allow_missing=allow_missing, allow_unexpected=allow_unexpected)
    outcome = run(checkpoint, reference, merge=False, conflicts=pol.conflict != "ignore")
    return _apply(outcome, pol, stacklevel=3)[0]


def _merge(
    checkpoint: Mapping[Any, Any],
    reference: Mapping[Any, Any],
    policy: str | Policy,
    allow_missing: str | Iterable[str],
    allow_unexpected: str | Iterable[str],
    *,
    stacklevel: int,
) -> Merged:
    pol = resolve_policy(policy, allow_missing=allow_missing, allow_unexpected=allow_unexpected)
    outcome = run(
        checkpoint,
        reference,
        merge=True,
        keep_unexpected=not pol.drop_unexpected,
        conflicts=pol.conflict != "ignore",
    )
    diff, conflicts = _apply(outcome, pol, stacklevel=stacklevel)
    for m in diff.mismatched:
        if m.shape_differs:  # not raised: torch would reject the checkpoint's tensor
            outcome.take_reference[m.key]()
    assert outcome.merged is not None
    return Merged(outcome.merged, diff, conflicts)


def _apply(outcome: Outcome, policy: Policy, *, stacklevel: int) -> tuple[KeyDiff, tuple[str, ...]]:
    """Decide, per kind of difference, whether to stay quiet, warn or raise."""
    diff = KeyDiff(tuple(outcome.missing), tuple(outcome.unexpected), tuple(outcome.mismatches))
    conflicts = tuple(outcome.conflicts)
    allowed_missing = matcher(policy.allow_missing)
    allowed_unexpected = matcher(policy.allow_unexpected)
    missing = [k for k in diff.missing if not allowed_missing(k)]
    unexpected = [k for k in diff.unexpected if not allowed_unexpected(k)]
    shape = [m for m in diff.mismatched if m.shape_differs]
    dtype = [m for m in diff.mismatched if m.dtype_differs and not m.shape_differs]
    findings: list[tuple[Action, str]] = []
    if missing:
        findings.append(
            (
                policy.missing,
                _keys_line(
                    policy.missing,
                    missing,
                    "missing from the checkpoint (taken from the reference)",
                    "allow_missing",
                ),
            )
        )
    if unexpected:
        fate = "dropped" if policy.drop_unexpected else "kept"
        findings.append(
            (
                policy.unexpected,
                _keys_line(
                    policy.unexpected,
                    unexpected,
                    f"unexpected in the checkpoint (not in the reference; {fate})",
                    "allow_unexpected",
                ),
            )
        )
    if shape:
        findings.append(
            (
                policy.shape,
                _mismatch_line(
                    policy.shape,
                    shape,
                    "shape",
                    "torch would reject them on load. If the model changed shape on purpose, "
                    "merge with dsdmerge.Policy(shape='warn') to take the reference's tensors"
                    if policy.shape == "raise"
                    else "torch would reject the checkpoint's tensors, so the reference's "
                    "were taken",
                ),
            )
        )
    if dtype:
        findings.append(
            (
                policy.dtype,
                _mismatch_line(
                    policy.dtype,
                    dtype,
                    "dtype",
                    "the checkpoint's tensors are kept and torch casts them on load",
                ),
            )
        )
    for line in conflicts:
        findings.append((policy.conflict, line))
    errors = [text for action, text in findings if action == "raise"]
    errors.extend(outcome.problems)
    if errors:
        message = f"policy {short_repr(policy.name)} rejected the merge:\n" + "\n".join(
            f"  - {text}" for text in errors
        )
        raise MergeError(message, diff=diff, problems=tuple(errors))
    for action, text in findings:
        if action == "warn":
            warnings.warn(DSDMergeWarning(f"dsdmerge: {text}"), stacklevel=stacklevel)
    return diff, conflicts


def _keys_line(action: Action, keys: Sequence[str], what: str, allow: str) -> str:
    advice = (
        f"to accept them, pass {allow}=[<glob>, ...] or a policy that does not raise"
        if action == "raise"
        else f"pass {allow}=[<glob>, ...] to accept them silently"
    )
    return f"{len(keys)} key(s) {what}: {format_keys(keys)}; {advice}."


def _mismatch_line(action: Action, items: Sequence[Mismatch], what: str, note: str) -> str:
    return (
        f"{len(items)} tensor(s) whose {what} differs between checkpoint and reference: "
        f"{format_mismatches(items)}; {note}."
    )
