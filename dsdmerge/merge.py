"""Merging a checkpoint over a reference under a policy.

``merge(checkpoint, reference)`` returns a new state dict, in the checkpoint's
layout, that torch will load: every checkpoint value kept by identity, every
key the checkpoint lacks taken from the reference, and anything torch would
reject later reported now, naming the keys.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

from dsdmerge._engine import run
from dsdmerge._ids import one_spelling
from dsdmerge._records import Outcome
from dsdmerge._values import short_repr
from dsdmerge.convert import Conversions, convert_checkpoint
from dsdmerge.diff import KeyDiff, Mismatch, suggest
from dsdmerge.errors import DSDMergeWarning, MergeError
from dsdmerge.flatten import flatten, split_param_key
from dsdmerge.layout import (
    PARAM_GROUPS,
    PARAMS,
    PG_PREFIX,
    STATE,
    STATE_PREFIX,
    Layout,
    classify,
    is_optimizer_state_dict,
    optimizer_sections,
)
from dsdmerge.policy import Action, InvalidPolicyError, Policy, PolicyName, matcher, resolve_policy
from dsdmerge.rename import Rules, rename_checkpoint
from dsdmerge.report import format_keys, format_mismatches, format_resized
from dsdmerge.resize import (
    SHAPE_CHOICES,
    OnShapeMismatch,
    Resized,
    held_nbytes,
    resize,
    resize_nbytes,
    why_not_resizable,
)

__all__ = ["Fresh", "Merged", "check", "merge", "merge_with_diff"]

Fresh = Literal["reference", "as_fresh"]
"""How a parameter without checkpointed optimizer state is merged: with the
reference's state (``"reference"``) or without state, to start fresh (``"as_fresh"``)."""


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
        checkpoint,
        reference,
        policy,
        allow_missing,
        allow_unexpected,
        stacklevel=3,
        rename=rename,
        convert=convert,
        on_shape_mismatch=on_shape_mismatch,
        fresh=fresh,
        max_resize_bytes=max_resize_bytes,
    ).state_dict


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

    Example:
        >>> import dsdmerge as dm
        >>> sd, d = dm.merge_with_diff({"a": 1}, {"a": 0, "b": 2})[:2]
        >>> sd, d.missing
        ({'a': 1, 'b': 2}, ('b',))
    """
    return _merge(
        checkpoint,
        reference,
        policy,
        allow_missing,
        allow_unexpected,
        stacklevel=3,
        rename=rename,
        convert=convert,
        on_shape_mismatch=on_shape_mismatch,
        fresh=fresh,
        max_resize_bytes=max_resize_bytes,
    )


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

    Example:
        >>> import dsdmerge as dm
        >>> ref = {"a": 0, "idx.w": 2}
        >>> dm.check({"a": 1}, ref, policy="strict", allow_missing=["idx.*"]).missing
        ('idx.w',)
    """
    pol = resolve_policy(policy, allow_missing=allow_missing, allow_unexpected=allow_unexpected)
    shapes = _shape_choice(on_shape_mismatch)
    checkpoint, reference = _one_spelling(checkpoint, reference)
    checkpoint, extra = _renamed(checkpoint, rename, pol, convert=convert, stacklevel=3)
    outcome = run(checkpoint, reference, merge=False, conflicts=pol.conflict != "ignore")
    if shapes == "resize":
        extra.extend(_unresizable(outcome, metadata_only=True))
    renames = suggest(checkpoint, reference, outcome.missing, outcome.unexpected)
    return apply_policy(
        outcome,
        pol,
        stacklevel=3,
        extra=extra,
        on_shape_mismatch=shapes,
        renames=renames,
        reference=reference,
    )[0]


def _merge(
    checkpoint: Mapping[Any, Any],
    reference: Mapping[Any, Any],
    policy: PolicyName | Policy,
    allow_missing: str | Iterable[str],
    allow_unexpected: str | Iterable[str],
    *,
    stacklevel: int,
    rename: Rules | None = None,
    convert: Conversions | None = None,
    on_shape_mismatch: OnShapeMismatch = "raise",
    fresh: Fresh = "reference",
    max_resize_bytes: int | None = None,
) -> Merged:
    """:func:`merge_resolved` after resolving the policy.

    ``stacklevel``, here as everywhere in this module, is as for ``warnings.warn``
    counted from the function that takes it (1: that function, 2: its caller).
    """
    _fresh_choice(fresh)
    pol = resolve_policy(policy, allow_missing=allow_missing, allow_unexpected=allow_unexpected)
    return merge_resolved(
        checkpoint,
        reference,
        pol,
        stacklevel=stacklevel + 1,
        rename=rename,
        convert=convert,
        on_shape_mismatch=on_shape_mismatch,
        fresh=fresh,
        max_resize_bytes=max_resize_bytes,
    )


def merge_resolved(
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
    """:func:`merge_with_diff` under a resolved :class:`~dsdmerge.Policy`.

    The engine's outcome, the policy applied to it (:func:`apply_policy`: raise or
    warn), then what the policy let through done: reshaped tensors resized or taken
    from the reference, fresh state left out with ``fresh="as_fresh"``, module
    metadata carried. ``stacklevel`` is as for ``warnings.warn`` from this function.
    """
    _fresh_choice(fresh)
    shapes = _shape_choice(on_shape_mismatch)
    if max_resize_bytes is not None and (type(max_resize_bytes) is not int or max_resize_bytes < 0):
        raise InvalidPolicyError(
            f"max_resize_bytes must be a number of bytes (an int >= 0) or None, got "
            f"{short_repr(max_resize_bytes)}"
        )
    checkpoint, reference = _one_spelling(checkpoint, reference)
    checkpoint, extra = _renamed(
        checkpoint, rename, policy, convert=convert, stacklevel=stacklevel + 1
    )
    outcome = run(
        checkpoint,
        reference,
        merge=True,
        keep_unexpected=not policy.drop_unexpected,
        conflicts=policy.conflict != "ignore",
    )
    if shapes == "resize":
        extra.extend(_unresizable(outcome, metadata_only=False))
        if not extra or all(action != "raise" for action, _ in extra):
            extra.extend(_resize_budget(outcome, checkpoint, reference, max_resize_bytes))
    renames = suggest(checkpoint, reference, outcome.missing, outcome.unexpected)
    diff, conflicts = apply_policy(
        outcome,
        policy,
        stacklevel=stacklevel + 1,
        extra=extra,
        on_shape_mismatch=shapes,
        renames=renames,
        reference=reference,
    )
    resized: list[Resized] = []
    put: dict[str, Any] = {}  # what each reshaped key holds now
    for m in diff.mismatched:
        if not reshaped(m):  # a 0-d against a 1-element tensor keeps the checkpoint's
            continue
        slot = outcome.take_reference[m.key]
        if shapes == "resize":  # each new tensor is made once, here, in the checkpoint's dtype
            try:
                put[m.key] = resize(slot.checkpoint, slot.reference, dtype=slot.checkpoint.dtype)
            except MergeError as err:  # allocating it failed
                raise MergeError(f"{m.key!r}: {err}", diff=diff) from err
            slot.put(put[m.key])
            resized.append(Resized.from_mismatch(m))
        else:  # not raised: torch would reject the checkpoint's tensor
            put[m.key] = slot.reference
            slot()
    for _, source, put_tied in outcome.ties:  # a tied key holds what its key holds
        if source in put:
            put_tied(put[source])
    if resized:
        diff = dataclasses.replace(diff, resized=tuple(resized))
    assert outcome.merged is not None
    merged = outcome.merged
    if fresh == "as_fresh" and diff.missing:
        merged = _without_fresh_state(merged, checkpoint, diff.missing)
    return Merged(_with_metadata(merged, checkpoint, reference), diff, conflicts)


def _one_spelling(
    checkpoint: Mapping[Any, Any], reference: Mapping[Any, Any]
) -> tuple[Mapping[Any, Any], Mapping[Any, Any]]:
    """Both sides with the int keys a DCP round trip spelled as strings made int (see _ids)."""
    return one_spelling(checkpoint, reference)


def _fresh_choice(fresh: object) -> None:
    if fresh not in ("reference", "as_fresh"):
        raise InvalidPolicyError(
            f"fresh must be 'reference' or 'as_fresh', got {short_repr(fresh)}"
        )


def _without_fresh_state(
    merged: dict[Any, Any], checkpoint: Mapping[Any, Any], missing: Sequence[str]
) -> dict[Any, Any]:
    """``merged`` without the backfilled state of parameters the checkpoint has no state for.

    Nested optimizer state dicts (also inside whole checkpoints) lose those
    parameters' entries; flat ones their ``state.<fqn>.*`` keys. A checkpoint entry
    that holds no value (schedulefree's ``{}``, heavyball's ``{0: {}}``: made for a
    parameter that never got a gradient) is no state either: it is kept as it is, with
    nothing backfilled into it (heavyball's schedule-free step turns a zero-gradient
    step's state next to the checkpoint's step counters into NaN).
    """
    if classify(merged) is Layout.FLAT:
        return _flat_without_fresh_state(merged, checkpoint, missing)
    out = dict(merged)
    stack: list[tuple[dict[Any, Any], Any, str]] = [(out, checkpoint, "")]
    while stack:
        node, c_node, prefix = stack.pop()
        if is_optimizer_state_dict(node):
            c_state = c_node.get(STATE) if isinstance(c_node, Mapping) else None
            c_state = c_state if isinstance(c_state, Mapping) else {}
            members = {
                pid
                for g in node[PARAM_GROUPS]
                if isinstance(g, Mapping)
                for pid in g.get(PARAMS, ())
                if isinstance(pid, (int, str))
            }
            node[STATE] = {
                pid: (c_state[pid] if _hollow(c_state[pid]) else entry) if pid in c_state else entry
                for pid, entry in node[STATE].items()
                if pid in c_state or pid not in members
            }
            continue
        for k, v in node.items():
            if not isinstance(v, dict):
                continue
            c_child = c_node.get(k) if isinstance(c_node, Mapping) else None
            key = f"{prefix}{k}."
            if classify(v) is Layout.FLAT:  # a flattened optimizer inside a whole checkpoint
                if isinstance(c_child, Mapping):
                    sub = [m[len(key) :] for m in missing if m.startswith(key)]
                    node[k] = _flat_without_fresh_state(v, c_child, sub) if sub else v
                continue
            child = dict(v)
            node[k] = child
            stack.append((child, c_child, key))
    return out


def _hollow(entry: Any) -> bool:
    """Whether a state entry is mappings all the way down, without one value."""
    if not isinstance(entry, Mapping):
        return False
    stack = [entry]
    while stack:
        node = stack.pop()
        for v in node.values():
            if not isinstance(v, Mapping):
                return False
            if len(stack) < 64:
                stack.append(v)
    return True


def _flat_without_fresh_state(
    merged: dict[Any, Any], checkpoint: Mapping[Any, Any], missing: Sequence[str]
) -> dict[Any, Any]:
    """``merged`` without the backfilled ``P state.<fqn>.*`` keys of stateless parameters.

    Only under the prefixes ``P`` of flattened optimizers, told by their shape
    (:func:`~dsdmerge.layout.optimizer_sections`): a model's module named ``state`` is
    no optimizer state.
    """
    fqns: dict[str, set[str]] = {}  # "<prefix>state." -> the fqns of its param_groups keys
    stateful: dict[str, set[str]] = {}  # "<prefix>state." -> fqns the checkpoint has state for
    heads = [p + STATE_PREFIX for p in optimizer_sections(merged)]
    heads.sort(key=len, reverse=True)  # the longest first: the innermost section
    drop = []
    for key in missing:
        head = next((h for h in heads if key.startswith(h)), None)
        if head is None:
            continue
        if head not in fqns:
            groups = head[: -len(STATE_PREFIX)] + PG_PREFIX
            known = {k[len(groups) :].rpartition(".")[0] for k in merged if k.startswith(groups)}
            known.discard("")
            fqns[head] = known
            longest = max(map(len, known), default=0)
            have = set()
            for k in checkpoint:
                if type(k) is str and k.startswith(head):
                    found = split_param_key(k[len(head) :], known, longest)
                    if found is not None:
                        have.add(found[0])
            stateful[head] = have
        found = split_param_key(key[len(head) :], fqns[head])
        if found is not None and found[0] not in stateful[head]:
            drop.append(key)
    if not drop:
        return merged
    gone = set(drop)
    return {k: v for k, v in merged.items() if k not in gone}


def _with_metadata(
    merged: dict[Any, Any], checkpoint: Mapping[Any, Any], reference: Mapping[Any, Any]
) -> dict[Any, Any]:
    """``merged`` with the ``_metadata`` of module state dicts (the checkpoint's wins).

    ``nn.Module.state_dict()`` returns an ``OrderedDict`` whose ``_metadata``
    attribute holds each module's version, which ``load_state_dict`` passes to the
    modules' load hooks (quantized and older modules need it). A new
    ``OrderedDict`` carries the union; the per-module entries are shared.
    """
    c_meta = getattr(checkpoint, "_metadata", None)
    r_meta = getattr(reference, "_metadata", None)
    if not isinstance(c_meta, Mapping) and not isinstance(r_meta, Mapping):
        return merged
    out: dict[Any, Any] = OrderedDict(merged)
    meta: OrderedDict[Any, Any] = OrderedDict()
    for part in (r_meta, c_meta):
        if isinstance(part, Mapping):
            meta.update(part)
    out._metadata = meta  # type: ignore[attr-defined]
    return out


def reshaped(m: Mismatch) -> bool:
    """Whether a mismatch is a real change of shape (not a 0-d against a 1-element tensor).

    A scalar kept as ``tensor(3.)`` in one place and ``tensor([3.])`` in another
    (optimizers' ``step`` across versions and options) holds the same one value.
    """
    if not m.shape_differs:
        return False
    return not (_numel(m.checkpoint.shape) == 1 and _numel(m.reference.shape) == 1)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _state_heads(reference: Mapping[Any, Any]) -> tuple[str, ...]:
    """``P + "state."`` for each flattened optimizer section ``P`` of the (flattened) reference.

    A key under one of them is optimizer state; told by the optimizer's shape
    (:func:`~dsdmerge.layout.optimizer_sections`), not by a segment named ``state``.
    """
    flat = reference if classify(reference) is Layout.FLAT else flatten(reference)
    return tuple(p + STATE_PREFIX for p in optimizer_sections(flat))


def _shape_choice(value: object) -> OnShapeMismatch:
    if value not in SHAPE_CHOICES:
        raise InvalidPolicyError(
            f"on_shape_mismatch must be one of {', '.join(map(repr, SHAPE_CHOICES))}, got "
            f"{short_repr(value)}"
        )
    return value


def _renamed(
    checkpoint: Mapping[Any, Any],
    rules: Rules | None,
    policy: Policy,
    *,
    convert: Conversions | None = None,
    stacklevel: int = 2,
) -> tuple[Mapping[Any, Any], list[tuple[Action, str]]]:
    """The checkpoint renamed by ``rules``, then converted by ``convert`` (each if given).

    Also the finding about rename rules that matched nothing. ``stacklevel`` is for the
    conversion's warnings, as for ``warnings.warn`` counted from this function.
    """
    extra: list[tuple[Action, str]] = []
    if rules is not None:
        checkpoint, unmatched = rename_checkpoint(checkpoint, rules)
        if unmatched:
            extra.append((policy.unmatched_rename, unmatched))
    if convert is not None:
        checkpoint = convert_checkpoint(checkpoint, convert, stacklevel=stacklevel + 1)
    return checkpoint, extra


def _unresizable(outcome: Outcome, *, metadata_only: bool) -> list[tuple[Action, str]]:
    """One finding (raised) per shape mismatch a resize cannot handle, before anything is made."""
    bad: dict[str, list[str]] = {}
    for m in outcome.mismatches:
        if not reshaped(m):
            continue
        if metadata_only:
            c_rank, r_rank = len(m.checkpoint.shape), len(m.reference.shape)
            why = (
                f"its rank changed ({c_rank} -> {r_rank}); only sizes of existing dimensions "
                "can change"
                if c_rank != r_rank
                else None
            )
        else:
            slot = outcome.take_reference[m.key]
            why = why_not_resizable(slot.checkpoint, slot.reference)
        if why is not None:
            bad.setdefault(why, []).append(m.key)
    return [
        (
            "raise",
            f"{len(keys)} tensor(s) cannot be resized: {format_keys(keys)}: {why}. Pass "
            "on_shape_mismatch='take_reference' to take the reference's tensors instead.",
        )
        for why, keys in bad.items()
    ]


def _resize_budget(
    outcome: Outcome,
    checkpoint: Mapping[Any, Any],
    reference: Mapping[Any, Any],
    max_bytes: int | None,
) -> list[tuple[Action, str]]:
    """A finding (raised) when the resizes would take more bytes than allowed.

    Allowed: ``max_bytes``, else the bytes the checkpoint's and the reference's tensors
    hold, the reference's counted in the widest dtype a resize makes from it (a resize
    keeps the checkpoint's dtype: a bfloat16 reference grown into a float64 checkpoint
    tensor takes four times its bytes). So a reference of a few bytes, an expanded
    tensor claiming any shape, cannot make a merge allocate more than a small multiple
    of what its inputs take.
    """
    needs: dict[str, int] = {}
    widen = 1.0  # the largest (result itemsize / reference itemsize) among the resizes
    for m in outcome.mismatches:
        if reshaped(m):
            slot = outcome.take_reference[m.key]
            dtype = slot.checkpoint.dtype
            needs[m.key] = resize_nbytes(slot.checkpoint, slot.reference, dtype=dtype)
            widen = max(widen, dtype.itemsize / slot.reference.element_size())
    total = sum(needs.values())
    if not total:
        return []
    allowed = (
        max_bytes
        if max_bytes is not None
        else held_nbytes(checkpoint, reference) + int((widen - 1) * held_nbytes(reference))
    )
    if total <= allowed:
        return []
    worst = max(needs, key=needs.__getitem__)
    whose = (
        "max_resize_bytes"
        if max_bytes is not None
        else "the bytes the checkpoint's and the reference's tensors hold"
    )
    return [
        (
            "raise",
            f"{len(needs)} tensor(s) resized would take {total:,} bytes, more than "
            f"{whose} ({allowed:,}): {format_keys(list(needs))}; the largest, {worst!r}, "
            f"{needs[worst]:,} bytes (an expanded or crafted reference tensor claims a shape "
            "its data does not fill). Pass max_resize_bytes=<bytes> to allow it.",
        )
    ]


def apply_policy(
    outcome: Outcome,
    policy: Policy,
    *,
    stacklevel: int,
    extra: Sequence[tuple[Action, str]] = (),
    on_shape_mismatch: OnShapeMismatch = "raise",
    renames: tuple[Any, ...] = (),
    reference: Mapping[Any, Any] | None = None,
) -> tuple[KeyDiff, tuple[str, ...]]:
    """Decide, per kind of difference, whether to stay quiet, warn or raise; the diff.

    Raises :class:`~dsdmerge.MergeError` naming every difference the policy
    rejects (and every problem the engine found: what torch would reject, what
    cannot be told); else warns once per kind of difference the policy warns about
    (``stacklevel`` as for ``warnings.warn`` from this function). Returns the
    :class:`~dsdmerge.KeyDiff` and the conflict lines.

    ``extra``: more findings (unmatched rename rules, tensors that cannot be
    resized); ``renames``: the suggested renames, for the diff and the messages;
    ``reference``: to tell a checkpoint that shares no key with it.
    """
    tied = tuple((key, source) for key, source, _ in outcome.ties)
    diff = KeyDiff(
        tuple(outcome.missing),
        tuple(outcome.unexpected),
        tuple(outcome.mismatches),
        renames=renames,
        tied=tied,
    )
    conflicts = tuple(outcome.conflicts)
    allowed_missing = matcher(policy.allow_missing)
    allowed_unexpected = matcher(policy.allow_unexpected)
    tied_keys = {key for key, _ in tied}
    missing = [k for k in diff.missing if not allowed_missing(k) and k not in tied_keys]
    unexpected = [k for k in diff.unexpected if not allowed_unexpected(k)]
    shape = [m for m in diff.mismatched if reshaped(m)]
    # a resized tensor keeps the checkpoint's dtype, as any kept tensor does: the dtype rule
    dtype = [
        m
        for m in diff.mismatched
        if m.dtype_differs and (not reshaped(m) or on_shape_mismatch == "resize")
    ]
    findings: list[tuple[Action, str]] = list(extra)
    if (
        reference is not None
        and policy.unrelated != "ignore"
        and (missing or unexpected)
        and diff.missing
        and diff.unexpected
        and _shares_nothing(diff, reference)
    ):
        findings.append((policy.unrelated, _nothing_shared(diff)))
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
    shown_ties = [(key, source) for key, source in tied if not allowed_missing(key)]
    if shown_ties:  # never refused: nothing is lost or taken from the reference
        said: Action = "warn" if policy.missing == "raise" else policy.missing
        findings.append((said, _tied_line(shown_ties)))
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
    heads = _state_heads(reference) if shape and reference is not None else ()
    state_shape = [m for m in shape if m.key.startswith(heads)] if heads else []
    model_shape = [m for m in shape if not heads or not m.key.startswith(heads)]
    if model_shape:
        findings.append(_shape_finding(model_shape, policy, on_shape_mismatch, _REJECTS))
    if state_shape:
        findings.append(_shape_finding(state_shape, policy, on_shape_mismatch, _STATE_SHAPE))
    lossy = [m for m in dtype if _drops_imaginary(m, resized=reshaped(m))]
    plain = [m for m in dtype if m not in lossy]
    if plain:
        findings.append(
            (
                policy.dtype,
                _mismatch_line(
                    policy.dtype,
                    plain,
                    "dtype",
                    "the checkpoint's dtypes are kept (resized tensors too) and torch casts "
                    "them on load",
                ),
            )
        )
    if lossy:  # never silent: a warning at least
        loud: Action = "warn" if policy.dtype == "ignore" else policy.dtype
        findings.append(
            (
                loud,
                _mismatch_line(
                    loud,
                    lossy,
                    "dtype",
                    "complex and real: the checkpoint's dtypes are kept (resized tensors too), "
                    "and the cast to the real dtype (torch's on load, or a resize's of the "
                    "reference's values) drops the imaginary part",
                ),
            )
        )
    if conflicts:  # one finding (one warning at most) for all of them
        findings.append((policy.conflict, "\n    ".join(conflicts)))
    if renames and unexpected:
        hint = rename_hint(renames)
        findings = [
            (action, text + hint if _is_key_finding(text) else text) for action, text in findings
        ]
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


def rename_hint(renames: Sequence[Any]) -> str:
    """The sentence a message about unexpected keys gets when some look renamed."""
    rules = ", ".join(f"{_raw(r.pattern)}: {r.replacement!r}" for r in renames)
    return f" Some look renamed: to rename them, pass rename={{{rules}}}."


def _raw(text: str) -> str:
    return f"r'{text}'" if "'" not in text and not text.endswith("\\") else repr(text)


def _is_key_finding(text: str) -> bool:
    return "unexpected in the checkpoint" in text


_REJECTS = "torch would reject them on load"
_STATE_SHAPE = (
    "torch's optimizers load state without checking its shape, and the next step would fail "
    "or broadcast it silently"
)


def _shape_finding(
    shape: Sequence[Mismatch], policy: Policy, choice: OnShapeMismatch, consequence: str
) -> tuple[Action, str]:
    if choice == "take_reference":
        action: Action = "warn" if policy.shape == "raise" else policy.shape
        return action, _mismatch_line(
            action,
            shape,
            "shape",
            f"{consequence}, so the reference's were taken "
            "(on_shape_mismatch='take_reference': their trained values are not kept)",
        )
    if choice == "resize":
        same_rank = [m for m in shape if len(m.checkpoint.shape) == len(m.reference.shape)]
        if not same_rank:  # the others are refused (see _unresizable)
            return "ignore", ""
        action = "ignore" if policy.missing == "ignore" else "warn"
        return action, (
            f"{len(same_rank)} tensor(s) resized (the checkpoint's overlapping slice kept, the "
            f"rest from the reference): {format_resized(map(Resized.from_mismatch, same_rank))}."
        )
    return policy.shape, _mismatch_line(
        policy.shape,
        shape,
        "shape",
        f"{consequence}. If the model grew or shrank on purpose, pass "
        "on_shape_mismatch='resize' to keep the trained slice of each tensor and of its "
        "optimizer state, or on_shape_mismatch='take_reference' to take the reference's tensors"
        if policy.shape == "raise"
        else f"{consequence}, so the reference's were taken",
    )


def _drops_imaginary(m: Mismatch, *, resized: bool) -> bool:
    """Whether keeping the checkpoint's dtype ends in a cast from complex to real.

    On load, a complex checkpoint tensor into a real parameter; in a resize, the
    reference's complex values into a real checkpoint dtype.
    """
    c, r = _is_complex(m.checkpoint.dtype), _is_complex(m.reference.dtype)
    return (c and not r) or (resized and r and not c)


def _is_complex(dtype: Any) -> bool:
    return bool(getattr(dtype, "is_complex", False))


def _shares_nothing(diff: KeyDiff, reference: Mapping[Any, Any]) -> bool:
    """Whether no key of the reference is in the checkpoint (every one of them is missing)."""
    if classify(reference) is Layout.FLAT:
        return len(diff.missing) >= len(reference)
    return len(diff.missing) >= len(flatten(reference))


# wrappers whose module prefix ends up in saved keys (DDP, torch.compile, activation
# checkpointing, FSDP1, PEFT)
_WRAPPERS = ("module.", "_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def _likely_prefix(from_keys: Sequence[str], to_keys: Sequence[str]) -> str | None:
    """A prefix that, removed from ``from_keys``, gives some of ``to_keys``."""
    targets = set(to_keys)
    counts: dict[str, int] = {}
    for key in from_keys[:1000]:
        at = 0
        for _ in range(4):  # up to four leading segments
            at = key.find(".", at) + 1
            if at <= 0:
                break
            if key[at:] in targets:
                counts[key[:at]] = counts.get(key[:at], 0) + 1
                break
    if not counts:
        for key in from_keys[:1000]:  # wrapper segments anywhere (FSDP1, checkpointing)
            stripped = key
            for w in _WRAPPERS:
                stripped = stripped.replace(w, "")
            if stripped != key and stripped in targets:
                return next(w for w in _WRAPPERS if w in key)
        return None
    return max(counts, key=lambda p: counts[p])


def _nothing_shared(diff: KeyDiff) -> str:
    text = (
        f"the checkpoint and the reference share no keys (all {len(diff.missing)} reference "
        f"key(s) are missing from the checkpoint, {len(diff.unexpected)} checkpoint key(s) "
        "are unexpected): merging would keep none of the checkpoint"
    )
    strip = _likely_prefix(diff.unexpected, diff.missing)
    add = None if strip else _likely_prefix(diff.missing, diff.unexpected)
    if strip:
        pattern = "^" + re.escape(strip)
        text += (
            f". The checkpoint's keys look like the reference's with the prefix {strip!r} "
            f"(a wrapper such as DDP or torch.compile adds one): strip it with "
            f"rename={{{pattern!r}: ''}} (CLI: --strip-prefix {strip})"
        )
    elif add:
        text += (
            f". The reference's keys look like the checkpoint's with the prefix {add!r}: "
            "pass the state dict of the unwrapped model, or add the prefix to the checkpoint"
        )
    else:
        text += " (is it the checkpoint of another model, or another part of it?)"
    return text + ". To merge anyway, allow-list every key (allow_missing, allow_unexpected)."


def _tied_line(ties: Sequence[tuple[str, str]]) -> str:
    shown = ", ".join(f"{key!r} takes {source!r}" for key, source in ties[:5])
    more = f" and {len(ties) - 5} more" if len(ties) > 5 else ""
    return (
        f"{len(ties)} key(s) missing from the checkpoint are tied in the reference (one "
        f"tensor) to a key the checkpoint has, and take its tensor so that loading keeps the "
        f"tie: {shown}{more}; pass allow_missing=[<glob>, ...] to accept them silently."
    )


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
