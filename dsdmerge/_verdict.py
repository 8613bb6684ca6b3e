"""The verdict: a policy applied to the findings of a comparison, worded only when shown.

The engine's :class:`~dsdmerge._records.Outcome` and the pipeline's own checks
(unmatched rename rules, tensors that cannot be resized) become
:class:`Finding` records: what kind of difference, the policy's action for it, the
keys. :func:`judge` raises :class:`~dsdmerge.MergeError` naming every finding the
policy rejects (and every problem the engine found), else warns once per finding
the policy warns about; a finding the policy ignores is never put into words.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from dsdmerge._records import KeyDiff, Mismatch, Outcome, Resized
from dsdmerge._values import short_repr
from dsdmerge.errors import DSDMergeWarning, MergeError
from dsdmerge.flatten import flatten
from dsdmerge.layout import STATE_PREFIX, Layout, classify, optimizer_sections
from dsdmerge.policy import Action, Policy, matcher
from dsdmerge.rename import Rule, unmatched_text
from dsdmerge.report import format_keys, format_mismatches, format_resized
from dsdmerge.resize import OnShapeMismatch, why_not_resizable

__all__ = [
    "Finding",
    "judge",
    "rename_hint",
    "reshaped",
    "unmatched_rename",
    "unresizable",
    "word",
]


class Finding(NamedTuple):
    """One kind of difference and what the policy does about it; words come later.

    Attributes:
        kind: ``"missing"``, ``"tied"``, ``"unexpected"``, ``"unrelated"``,
            ``"shape"``, ``"dtype"``, ``"conflict"``, ``"unmatched_rename"``,
            ``"unresizable"``, ``"resize_budget"``, or ``"text"`` (already worded).
        action: ``"ignore"``, ``"warn"`` or ``"raise"``.
        keys: The keys (for ``"shape"`` and ``"dtype"``: the mismatches; for
            ``"tied"``: ``(key, source)`` pairs; for ``"unmatched_rename"``: the rules).
        detail: What the wording needs beyond the keys (see :func:`word`).
    """

    kind: str
    action: Action
    keys: tuple[Any, ...] = ()
    detail: Any = None


def reshaped(m: Mismatch) -> bool:
    """Whether a mismatch is a real change of shape (not a 0-d against a 1-element tensor).

    A scalar kept as ``tensor(3.)`` in one place and ``tensor([3.])`` in another
    (optimizers' ``step`` across versions and options) holds the same one value.
    """
    if not m.shape_differs:
        return False
    return not (math.prod(m.checkpoint.shape) == 1 and math.prod(m.reference.shape) == 1)


def unmatched_rename(action: Action, rules: Sequence[Rule], example: str | None) -> list[Finding]:
    """The finding about rename rules that matched nothing (none when all matched)."""
    return [Finding("unmatched_rename", action, tuple(rules), example)] if rules else []


def unresizable(outcome: Outcome, *, metadata_only: bool) -> list[Finding]:
    """One finding (raised) per reason a resize cannot handle shape mismatches, before any."""
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
    return [Finding("unresizable", "raise", tuple(keys), why) for why, keys in bad.items()]


def judge(
    outcome: Outcome,
    policy: Policy,
    *,
    stacklevel: int,
    findings: Sequence[Finding | tuple[Action, str]] = (),
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

    ``findings``: more findings (unmatched rename rules, tensors that cannot be
    resized; an ``(action, text)`` pair is one already worded); ``renames``: the
    suggested renames, for the diff and the messages; ``reference``: to tell a
    checkpoint that shares no key with it.
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
    found = [f if isinstance(f, Finding) else Finding("text", f[0], (), f[1]) for f in findings]
    found.extend(_differences(diff, conflicts, policy, on_shape_mismatch, reference))
    if not outcome.problems and all(f.action == "ignore" for f in found):
        return diff, conflicts  # nothing to say: nothing is worded
    hint = rename_hint(renames) if renames and diff.unexpected else ""
    errors = [word(f, policy, hint=hint) for f in found if f.action == "raise"]
    errors.extend(outcome.problems)
    if errors:
        message = f"policy {short_repr(policy.name)} rejected the merge:\n" + "\n".join(
            f"  - {text}" for text in errors
        )
        raise MergeError(message, diff=diff, problems=tuple(errors))
    for f in found:
        if f.action == "warn":
            warnings.warn(
                DSDMergeWarning(f"dsdmerge: {word(f, policy, hint=hint)}"), stacklevel=stacklevel
            )
    return diff, conflicts


def _differences(
    diff: KeyDiff,
    conflicts: tuple[str, ...],
    policy: Policy,
    on_shape_mismatch: OnShapeMismatch,
    reference: Mapping[Any, Any] | None,
) -> list[Finding]:
    """The findings of a diff under ``policy``, in the order they are reported."""
    found: list[Finding] = []
    allowed_missing = matcher(policy.allow_missing) if policy.allow_missing else None
    allowed_unexpected = matcher(policy.allow_unexpected) if policy.allow_unexpected else None
    tied_keys = {key for key, _ in diff.tied}
    missing = [
        k
        for k in diff.missing
        if k not in tied_keys and (allowed_missing is None or not allowed_missing(k))
    ]
    unexpected = (
        list(diff.unexpected)
        if allowed_unexpected is None
        else [k for k in diff.unexpected if not allowed_unexpected(k)]
    )
    if (
        reference is not None
        and policy.unrelated != "ignore"
        and (missing or unexpected)
        and diff.missing
        and diff.unexpected
        and _shares_nothing(diff, reference)
    ):
        found.append(Finding("unrelated", policy.unrelated, (), diff))
    if missing:
        found.append(Finding("missing", policy.missing, tuple(missing)))
    shown_ties = [
        (key, source)
        for key, source in diff.tied
        if allowed_missing is None or not allowed_missing(key)
    ]
    if shown_ties:  # never refused: nothing is lost or taken from the reference
        said: Action = "warn" if policy.missing == "raise" else policy.missing
        found.append(Finding("tied", said, tuple(shown_ties)))
    if unexpected:
        found.append(Finding("unexpected", policy.unexpected, tuple(unexpected)))  # + hint
    if diff.mismatched:
        found.extend(_mismatch_findings(diff, policy, on_shape_mismatch, reference))
    if conflicts:  # one finding (one warning at most) for all of them
        found.append(Finding("conflict", policy.conflict, (), "\n    ".join(conflicts)))
    return found


def _mismatch_findings(
    diff: KeyDiff,
    policy: Policy,
    on_shape_mismatch: OnShapeMismatch,
    reference: Mapping[Any, Any] | None,
) -> list[Finding]:
    found: list[Finding] = []
    shape = [m for m in diff.mismatched if reshaped(m)]
    # a resized tensor keeps the checkpoint's dtype, as any kept tensor does: the dtype rule
    dtype = [
        m
        for m in diff.mismatched
        if m.dtype_differs and (not reshaped(m) or on_shape_mismatch == "resize")
    ]
    heads = _state_heads(reference) if shape and reference is not None else ()
    state_shape = [m for m in shape if m.key.startswith(heads)] if heads else []
    model_shape = [m for m in shape if not heads or not m.key.startswith(heads)]
    if model_shape:
        found.append(_shape_finding(model_shape, policy, on_shape_mismatch, _REJECTS))
    if state_shape:
        found.append(_shape_finding(state_shape, policy, on_shape_mismatch, _STATE_SHAPE))
    lossy = [m for m in dtype if _drops_imaginary(m, resized=reshaped(m))]
    plain = [m for m in dtype if m not in lossy]
    if plain:
        found.append(Finding("dtype", policy.dtype, tuple(plain), _PLAIN_DTYPE))
    if lossy:  # never silent: a warning at least
        loud: Action = "warn" if policy.dtype == "ignore" else policy.dtype
        found.append(Finding("dtype", loud, tuple(lossy), _LOSSY_DTYPE))
    return found


_REJECTS = "torch would reject them on load"
_STATE_SHAPE = (
    "torch's optimizers load state without checking its shape, and the next step would fail "
    "or broadcast it silently"
)
_PLAIN_DTYPE = "the checkpoint's dtypes are kept (resized tensors too) and torch casts them on load"
_LOSSY_DTYPE = (
    "complex and real: the checkpoint's dtypes are kept (resized tensors too), and the cast "
    "to the real dtype (torch's on load, or a resize's of the reference's values) drops the "
    "imaginary part"
)


def _shape_finding(
    shape: Sequence[Mismatch], policy: Policy, choice: OnShapeMismatch, consequence: str
) -> Finding:
    if choice == "take_reference":
        action: Action = "warn" if policy.shape == "raise" else policy.shape
        note = (
            f"{consequence}, so the reference's were taken "
            "(on_shape_mismatch='take_reference': their trained values are not kept)"
        )
        return Finding("shape", action, tuple(shape), note)
    if choice == "resize":
        same_rank = [m for m in shape if len(m.checkpoint.shape) == len(m.reference.shape)]
        if not same_rank:  # the others are refused (see unresizable)
            return Finding("resized", "ignore")
        action = "ignore" if policy.missing == "ignore" else "warn"
        return Finding("resized", action, tuple(same_rank))
    note = (
        f"{consequence}. If the model grew or shrank on purpose, pass "
        "on_shape_mismatch='resize' to keep the trained slice of each tensor and of its "
        "optimizer state, or on_shape_mismatch='take_reference' to take the reference's tensors"
        if policy.shape == "raise"
        else f"{consequence}, so the reference's were taken"
    )
    return Finding("shape", policy.shape, tuple(shape), note)


def word(finding: Finding, policy: Policy, *, hint: str = "") -> str:
    """The finding in words, as a warning or an error shows it.

    ``hint``: the sentence suggesting renames, added to the findings about keys.
    """
    kind, action, keys, detail = finding
    if kind == "text":
        return str(detail)
    if kind == "missing":
        what = "missing from the checkpoint (taken from the reference)"
        return _keys_line(action, keys, what, "allow_missing")
    if kind == "unexpected":
        fate = "dropped" if policy.drop_unexpected else "kept"
        what = f"unexpected in the checkpoint (not in the reference; {fate})"
        return _keys_line(action, keys, what, "allow_unexpected") + hint
    if kind == "tied":
        return _tied_line(keys)
    if kind == "unrelated":
        return _nothing_shared(detail)
    if kind == "shape":
        return _mismatch_line(keys, "shape", detail)
    if kind == "dtype":
        return _mismatch_line(keys, "dtype", detail)
    if kind == "resized":
        return (
            f"{len(keys)} tensor(s) resized (the checkpoint's overlapping slice kept, the "
            f"rest from the reference): {format_resized(map(Resized.from_mismatch, keys))}."
        )
    if kind == "conflict":
        return str(detail)
    if kind == "unmatched_rename":
        return unmatched_text(keys, detail)
    if kind == "unresizable":
        return (
            f"{len(keys)} tensor(s) cannot be resized: {format_keys(keys)}: {detail}. Pass "
            "on_shape_mismatch='take_reference' to take the reference's tensors instead."
        )
    if kind == "resize_budget":
        total, allowed, whose, worst, most = detail
        return (
            f"{len(keys)} tensor(s) resized would take {total:,} bytes, more than "
            f"{whose} ({allowed:,}): {format_keys(keys)}; the largest, {worst!r}, "
            f"{most:,} bytes (an expanded or crafted reference tensor claims a shape "
            "its data does not fill). Pass max_resize_bytes=<bytes> to allow it."
        )
    raise AssertionError(f"unknown finding kind {kind!r}")


def rename_hint(renames: Sequence[Any]) -> str:
    """The sentence a message about unexpected keys gets when some look renamed."""
    rules = ", ".join(f"{_raw(r.pattern)}: {r.replacement!r}" for r in renames)
    return f" Some look renamed: to rename them, pass rename={{{rules}}}."


def _raw(text: str) -> str:
    return f"r'{text}'" if "'" not in text and not text.endswith("\\") else repr(text)


def _drops_imaginary(m: Mismatch, *, resized: bool) -> bool:
    """Whether keeping the checkpoint's dtype ends in a cast from complex to real.

    On load, a complex checkpoint tensor into a real parameter; in a resize, the
    reference's complex values into a real checkpoint dtype.
    """
    c, r = _is_complex(m.checkpoint.dtype), _is_complex(m.reference.dtype)
    return (c and not r) or (resized and r and not c)


def _is_complex(dtype: Any) -> bool:
    return bool(getattr(dtype, "is_complex", False))


def _state_heads(reference: Mapping[Any, Any]) -> tuple[str, ...]:
    """``P + "state."`` for each flattened optimizer section ``P`` of the (flattened) reference.

    A key under one of them is optimizer state; told by the optimizer's shape
    (:func:`~dsdmerge.layout.optimizer_sections`), not by a segment named ``state``.
    """
    flat = reference if classify(reference) is Layout.FLAT else flatten(reference)
    return tuple(p + STATE_PREFIX for p in optimizer_sections(flat))


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


def _mismatch_line(items: Sequence[Mismatch], what: str, note: str) -> str:
    return (
        f"{len(items)} tensor(s) whose {what} differs between checkpoint and reference: "
        f"{format_mismatches(items)}; {note}."
    )
