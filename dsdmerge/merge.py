"""Merging a checkpoint over a reference under a policy.

``merge(checkpoint, reference)`` returns a new state dict, in the checkpoint's
layout, that torch will load: every checkpoint value kept by identity, every
key the checkpoint lacks taken from the reference, and anything torch would
reject later reported now, naming the keys.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from dsdmerge._options import Fresh, MergeOptions
from dsdmerge._pipeline import Merged, run
from dsdmerge._verdict import judge
from dsdmerge._verdict import rename_hint as _rename_hint
from dsdmerge._verdict import reshaped as _reshaped
from dsdmerge.convert import Conversions
from dsdmerge.diff import KeyDiff
from dsdmerge.policy import Action, Policy, PolicyName
from dsdmerge.rename import Rules
from dsdmerge.resize import OnShapeMismatch

__all__ = ["Fresh", "Merged", "check", "merge", "merge_with_diff"]


def merge(
    checkpoint: Mapping[Any, Any],
    reference: Mapping[Any, Any],
    /,
    *,
    policy: PolicyName | Policy = "default",
    allow_missing: str | Iterable[str] = (),
    allow_unexpected: str | Iterable[str] = (),
    rename: Rules | None = None,
    convert: Conversions | None = None,
    on_shape_mismatch: OnShapeMismatch = "raise",
    fresh: Fresh = "reference",
    max_resize_bytes: int | None = None,
) -> dict[Any, Any]:
    """Merge a loaded checkpoint over a fresh reference state dict.

    Every checkpoint value is kept by identity; every key only the reference
    has is backfilled from it (a backfilled ``param_groups.<fqn>.<hp>`` takes
    the value the checkpoint has for the other members of that parameter's
    group, so a new parameter does not reset the scheduled learning rate; a key
    tied in the reference to one the checkpoint has takes that key's tensor).
    Each param group's members end up agreeing on every hyperparameter, as
    torch's loaders need: a parameter moved to another group takes its new
    group's values (see :mod:`dsdmerge.policy` for the rule). Differences are
    handled by ``policy``. Does not modify its inputs; leaves are shared, never
    copied, except the new tensors of ``on_shape_mismatch="resize"``.

    Args:
        checkpoint: The state dict you loaded (flat or nested).
        reference: The state dict of the model or optimizer you have now, e.g.
            ``get_optimizer_state_dict(model, fresh_optimizer, options=...)``.
            Nested when the checkpoint is nested.
        policy: ``"default"``, ``"warn"``, ``"strict"`` or a :class:`~dsdmerge.Policy`.
        allow_missing: fnmatch globs over flat keys the checkpoint may lack.
        allow_unexpected: fnmatch globs over flat keys the reference may lack.
        rename: Rules applied to the checkpoint's fqns first (see
            :func:`~dsdmerge.rename`; a preset name such as ``"ddp"`` works); a
            rule that matches nothing is handled as ``policy.unmatched_rename``
            says (a warning, an error under ``"strict"``).
        convert: Layout conversions applied to the checkpoint next, after
            ``rename`` (see :func:`~dsdmerge.convert`: records and preset names such
            as ``"qkv"``, in order); the optimizer state converts with the weights.
        on_shape_mismatch: For tensors whose shapes differ: ``"raise"`` (as the
            policy's ``shape`` action says; every built-in policy raises),
            ``"take_reference"`` (the reference's tensor, with a warning: the
            trained values are dropped) or ``"resize"`` (same rank only: a new
            tensor with the reference's shape and device holding the
            checkpoint's overlapping leading slice and the reference's values
            elsewhere, for the weight and for every optimizer state tensor of
            it whose shape differs; ``step`` and other scalars stay the
            checkpoint's). Resizes are reported in ``KeyDiff.resized``. A resized
            tensor has the checkpoint's dtype (the reference's values cast into
            it), and a dtype that differs is handled as the policy's ``dtype``
            action says, as for any dtype mismatch.
        fresh: ``"reference"`` backfills the optimizer state of a parameter the
            checkpoint has no state for from the reference (for DSD's reference:
            its zero-gradient step, Adam ``step == 1``); ``"as_fresh"`` leaves it
            without state, so that it starts exactly like in a new optimizer (its
            keys are still reported missing; load the result nested, as
            ``set_optimizer_state_dict`` of a flat dict needs every state key).
        max_resize_bytes: The most bytes the new tensors of ``"resize"`` may take
            together. By default, as many as the checkpoint's and the reference's
            tensors hold (their storages' bytes, each storage once: an expanded,
            stride-0 reference tensor holds few bytes however large its shape).

    Returns:
        A new state dict in the checkpoint's layout. A flat result lists the
        checkpoint's keys in the checkpoint's order, then the backfilled keys in
        the reference's order (equal to ``{**reference, **checkpoint}`` as a
        mapping); a nested result follows the reference's structure. torch's
        loaders look keys up by name, so the order never changes what loads.

    Raises:
        MergeError: The policy rejects a difference (always for tensor shape
            mismatches under the built-in policies, unless ``on_shape_mismatch``
            says otherwise), an int-keyed optimizer's group sizes differ, which
            ``Optimizer.load_state_dict`` rejects, or a tensor cannot be resized
            (its rank changed, it is a meta tensor or a DTensor, the resizes would
            take more than ``max_resize_bytes``, or allocating one failed).
        LayoutError: An argument is malformed, or the checkpoint is nested and
            the reference flat.
        StateDictTypeError: An argument is not a mapping.
        RenameError: A rename rule is not valid, or renames two keys to one.
        ConversionError: A conversion cannot be applied (see :func:`~dsdmerge.convert`).
        InvalidPolicyError: A bad policy, allow-list or ``on_shape_mismatch``.

    Examples:
        >>> import dsdmerge as dm
        >>> ckpt = {"state.w.step": 7, "param_groups.w.lr": 5e-5}
        >>> fresh = {"state.w.step": 1, "state.idx.step": 1,
        ...          "param_groups.w.lr": 1e-3, "param_groups.idx.lr": 1e-3}
        >>> merged = dm.merge(ckpt, fresh)
        >>> merged["state.w.step"], merged["state.idx.step"], merged["param_groups.idx.lr"]
        (7, 1, 5e-05)
    """
    options = MergeOptions.of(
        policy,
        allow_missing=allow_missing,
        allow_unexpected=allow_unexpected,
        rename=rename,
        convert=convert,
        on_shape_mismatch=on_shape_mismatch,
        fresh=fresh,
        max_resize_bytes=max_resize_bytes,
    )
    return run(checkpoint, reference, options, stacklevel=2).state_dict


def merge_with_diff(
    checkpoint: Mapping[Any, Any],
    reference: Mapping[Any, Any],
    /,
    *,
    policy: PolicyName | Policy = "default",
    allow_missing: str | Iterable[str] = (),
    allow_unexpected: str | Iterable[str] = (),
    rename: Rules | None = None,
    convert: Conversions | None = None,
    on_shape_mismatch: OnShapeMismatch = "raise",
    fresh: Fresh = "reference",
    max_resize_bytes: int | None = None,
) -> Merged:
    """Like :func:`merge`, but also return the :class:`~dsdmerge.KeyDiff`, from the same pass.

    Does not modify its inputs.

    Args:
        checkpoint: The state dict you loaded (flat or nested).
        reference: The state dict of the model or optimizer you have now.
        policy: ``"default"``, ``"warn"``, ``"strict"`` or a :class:`~dsdmerge.Policy`.
        allow_missing: fnmatch globs over flat keys the checkpoint may lack.
        allow_unexpected: fnmatch globs over flat keys the reference may lack.
        rename: Rules applied to the checkpoint's fqns first (see :func:`merge`).
        convert: Layout conversions applied next (see :func:`merge`).
        on_shape_mismatch: ``"raise"``, ``"take_reference"`` or ``"resize"``
            (see :func:`merge`); the diff's ``resized`` lists what was resized.
        fresh: ``"reference"`` or ``"as_fresh"`` (see :func:`merge`).
        max_resize_bytes: The most bytes resizes may allocate (see :func:`merge`).

    Returns:
        ``Merged(state_dict, diff, conflicts)``.

    Examples:
        >>> import dsdmerge as dm
        >>> sd, d = dm.merge_with_diff({"a": 1}, {"a": 0, "b": 2})[:2]
        >>> sd, d.missing
        ({'a': 1, 'b': 2}, ('b',))
    """
    options = MergeOptions.of(
        policy,
        allow_missing=allow_missing,
        allow_unexpected=allow_unexpected,
        rename=rename,
        convert=convert,
        on_shape_mismatch=on_shape_mismatch,
        fresh=fresh,
        max_resize_bytes=max_resize_bytes,
    )
    return run(checkpoint, reference, options, stacklevel=2)


def check(
    checkpoint: Mapping[Any, Any],
    reference: Mapping[Any, Any],
    /,
    *,
    policy: PolicyName | Policy = "default",
    allow_missing: str | Iterable[str] = (),
    allow_unexpected: str | Iterable[str] = (),
    rename: Rules | None = None,
    convert: Conversions | None = None,
    on_shape_mismatch: OnShapeMismatch = "raise",
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
        rename: Rules applied to the checkpoint's fqns first (see :func:`merge`);
            a view is renamed without reading any tensor.
        convert: Layout conversions applied next (see :func:`merge`); a view
            converts by shape, without reading any tensor.
        on_shape_mismatch: As for :func:`merge`; ``"resize"`` is checked for
            ranks only (a view holds no tensors to resize).

    Returns:
        The :class:`~dsdmerge.KeyDiff`.

    Raises:
        MergeError: The policy rejects a difference.

    Examples:
        >>> import dsdmerge as dm
        >>> ref = {"a": 0, "idx.w": 2}
        >>> dm.check({"a": 1}, ref, policy="strict", allow_missing=["idx.*"]).missing
        ('idx.w',)
    """
    options = MergeOptions.of(
        policy,
        allow_missing=allow_missing,
        allow_unexpected=allow_unexpected,
        rename=rename,
        convert=convert,
        on_shape_mismatch=on_shape_mismatch,
    )
    return run(checkpoint, reference, options, stacklevel=2, merge=False).diff


# --------------------------------------------------------------------------------------
# internal names this module used to hold, one release as deprecated aliases


def _merge_resolved(
    checkpoint: Mapping[Any, Any],
    reference: Mapping[Any, Any],
    policy: Policy,
    *,
    stacklevel: int,
    rename: Rules | None = None,
    convert: Conversions | None = None,
    on_shape_mismatch: OnShapeMismatch = "raise",
    fresh: Fresh = "reference",
    max_resize_bytes: int | None = None,
) -> Merged:
    """The old ``merge_resolved``: :func:`merge_with_diff` under a resolved policy."""
    options = MergeOptions.of(
        policy,
        rename=rename,
        convert=convert,
        on_shape_mismatch=on_shape_mismatch,
        fresh=fresh,
        max_resize_bytes=max_resize_bytes,
    )
    return run(checkpoint, reference, options, stacklevel=stacklevel)


def _apply_policy(
    outcome: Any,
    policy: Policy,
    *,
    stacklevel: int,
    extra: Sequence[tuple[Action, str]] = (),
    on_shape_mismatch: OnShapeMismatch = "raise",
    renames: tuple[Any, ...] = (),
    reference: Mapping[Any, Any] | None = None,
) -> tuple[KeyDiff, tuple[str, ...]]:
    """The old ``apply_policy``: the verdict on an engine outcome."""
    return judge(
        outcome,
        policy,
        stacklevel=stacklevel + 1,
        findings=extra,
        on_shape_mismatch=on_shape_mismatch,
        renames=renames,
        reference=reference,
    )


_DEPRECATED: dict[str, Callable[..., Any]] = {
    "apply_policy": _apply_policy,
    "merge_resolved": _merge_resolved,
    "rename_hint": _rename_hint,
    "reshaped": _reshaped,
}


def __getattr__(name: str) -> Any:
    """Internal names this module held, one release as deprecated aliases."""
    found = _DEPRECATED.get(name)
    if found is None:
        raise AttributeError(f"module 'dsdmerge.merge' has no attribute {name!r}")
    warnings.warn(
        f"dsdmerge.merge.{name} is internal and goes in the next release; use "
        "dsdmerge.merge_with_diff or dsdmerge.check, whose KeyDiff says what differs",
        DeprecationWarning,
        stacklevel=2,
    )
    return found
