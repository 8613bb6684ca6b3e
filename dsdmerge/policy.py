"""Merge policies: what to do about each kind of difference.

A :class:`Policy` is a frozen value with one action per situation. The three
built-in policies are :data:`DEFAULT`, :data:`WARN` and :data:`STRICT`; build a
custom one with :class:`Policy` directly or with :meth:`Policy.replace`.

==================================  ================  ================  ============
situation                           ``default``       ``warn``          ``strict``
==================================  ================  ================  ============
missing key                         backfilled        backfilled +      error
                                                      warning
missing key tied in the reference   takes that        takes it +        takes it +
to a key the checkpoint has         key's tensor      warning           warning
unexpected key                      kept              kept + warning    error
tensor shape mismatch               error             error             error
... ``on_shape_mismatch="resize"``  resized           resized +         resized +
                                                      warning           warning
... ``"take_reference"``            reference's +     reference's +     reference's
                                    warning           warning           + warning
tensor dtype mismatch (resized      checkpoint's      kept + warning    error
tensors too)                        dtype kept
... complex to real                 kept + warning    kept + warning    error
group members disagree on a         settled +         settled +         error
hyperparameter (conflict)           warning           warning
... a moved parameter               takes its new     same + warning    error
                                    group's value +
                                    warning
... a backfilled key of such a      the value most    same + warning    error
group (ambiguous)                   members hold +
                                    warning
no key shared (unrelated)           error             error             error
rename rule that matches no key     warning           warning           error
==================================  ================  ================  ============

Keys matching ``allow_missing`` / ``allow_unexpected`` (fnmatch globs over flat
keys, or exact patterns as reports print them, ``layers.{0..5}.indexer.{bias,weight}``)
are backfilled / kept without a word under every policy. What a merge returns never
depends on an action, only whether it goes on quietly, warns or raises. How groups
are settled, moved parameters found and tied keys told: :mod:`dsdmerge._groups`,
:func:`dsdmerge._tensors.tied`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
import warnings
from collections.abc import Callable, Iterable
from typing import Literal, get_args

from dsdmerge._text import short_repr
from dsdmerge.errors import InvalidPolicyError, PatternError
from dsdmerge.report import pattern_alternatives, range_regex

__all__ = [
    "DEFAULT",
    "STRICT",
    "WARN",
    "Action",
    "InvalidPolicyError",
    "Policy",
    "PolicyName",
    "resolve_policy",
]

Action = Literal["ignore", "warn", "raise"]
"""What a policy does about a difference: ``"ignore"`` it, ``"warn"`` (a
:class:`~dsdmerge.DSDMergeWarning`) or ``"raise"`` (a :class:`~dsdmerge.MergeError`)."""

_ACTIONS = get_args(Action)

PolicyName = Literal["default", "warn", "strict"]
"""The built-in policies by name. Every ``policy=`` takes one of them or a :class:`Policy`,
typed ``PolicyName | Policy`` so that a type checker catches ``policy="stric"``."""


def _globs(value: str | Iterable[str], name: str) -> tuple[str, ...]:
    items: Iterable[object] = (value,) if isinstance(value, str) else value
    try:
        globs = tuple(items)
    except TypeError:
        raise InvalidPolicyError(
            f"{name} must be a glob or an iterable of globs, got {type(value).__name__}"
        ) from None
    for glob in globs:
        if not isinstance(glob, str):
            raise InvalidPolicyError(f"{name} holds {short_repr(glob)}, which is not a str glob")
    return globs  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True)
class Policy:
    """What a merge does about each kind of difference.

    Every action is ``"ignore"``, ``"warn"`` or ``"raise"``. A missing key that
    is not raised is backfilled from the reference (a key tied to one the
    checkpoint has takes its tensor, never refused: ``missing``'s action, a
    warning at most); an unexpected key that is not raised is kept (or dropped,
    with ``drop_unexpected``); a dtype mismatch that is not raised keeps the
    checkpoint's dtype (torch casts it on load; one that drops an imaginary part
    is warned about at least); a shape mismatch that is not raised takes the
    reference's tensor, since torch would reject the checkpoint's; a param group
    whose checkpoint members disagree is settled (see the module docstring) whatever
    ``conflict`` says.

    Attributes:
        missing: For keys in the reference but not in the checkpoint.
        unexpected: For keys in the checkpoint but not in the reference.
        shape: Deprecated, goes in the next release: what happens to tensors whose
            shapes differ is ``on_shape_mismatch=``'s one setting (``"raise"``,
            ``"take_reference"`` with a warning, or ``"resize"``). Until then
            ``"warn"`` or ``"ignore"`` here takes the reference's tensors, as
            ``on_shape_mismatch="take_reference"`` does, and warns that it is
            deprecated.
        dtype: For tensors whose dtypes differ.
        conflict: For checkpoint members of one param group that disagree on a
            hyperparameter (torch silently uses the first member's value), a
            parameter moved to another group among them: warned by default.
        unrelated: For a checkpoint that shares no key with the reference (a
            wrapper's prefix such as DDP's ``module.``, or another model): a
            merge would keep none of it. Not raised when allow-lists cover every
            differing key.
        allow_missing: fnmatch globs over flat keys, or patterns as reports print
            them; matching missing keys are backfilled without a word.
        allow_unexpected: fnmatch globs over flat keys, or patterns as reports
            print them; matching unexpected keys are kept without a word.
        drop_unexpected: Leave unexpected keys out of the result instead of
            keeping them (for a strict ``load_state_dict``).
        name: A label for messages.

    Examples:
        >>> import dsdmerge as dm
        >>> p = dm.STRICT.replace(allow_missing=["*.indexer.*"])
        >>> p.missing, p.allow_missing
        ('raise', ('*.indexer.*',))
    """

    missing: Action = "ignore"
    unexpected: Action = "ignore"
    shape: Action = "raise"
    dtype: Action = "ignore"
    conflict: Action = "warn"
    unrelated: Action = "raise"
    unmatched_rename: Action = "warn"
    allow_missing: tuple[str, ...] = ()
    allow_unexpected: tuple[str, ...] = ()
    drop_unexpected: bool = False
    name: str = "custom"

    def __post_init__(self) -> None:
        for field in (
            "missing",
            "unexpected",
            "shape",
            "dtype",
            "conflict",
            "unrelated",
            "unmatched_rename",
        ):
            action = getattr(self, field)
            if action not in _ACTIONS:
                raise InvalidPolicyError(
                    f"Policy.{field} must be one of {', '.join(map(repr, _ACTIONS))}, "
                    f"got {short_repr(action)}"
                )
        if self.shape != "raise":  # one setting per situation: on_shape_mismatch's
            warnings.warn(
                f"Policy(shape={self.shape!r}) is deprecated and goes in the next release: "
                "pass on_shape_mismatch='take_reference' to take the reference's tensors "
                "(or 'resize' to keep the trained slice)",
                DeprecationWarning,
                stacklevel=3,
            )
        for field in ("allow_missing", "allow_unexpected"):
            object.__setattr__(self, field, _globs(getattr(self, field), field))
        if not isinstance(self.drop_unexpected, bool):
            raise InvalidPolicyError("Policy.drop_unexpected must be a bool")

    def replace(self, **changes: object) -> Policy:
        """A copy of this policy with some fields changed (``name`` becomes ``"custom"``).

        Examples:
            >>> import dsdmerge as dm
            >>> dm.DEFAULT.replace(unexpected="warn").unexpected
            'warn'
        """
        changes.setdefault("name", "custom")
        try:
            return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
        except TypeError as err:
            raise InvalidPolicyError(f"Policy has no such field: {err}") from None

    def allows_missing(self, key: str) -> bool:
        """Whether ``key`` matches one of :attr:`allow_missing`."""
        return matcher(self.allow_missing)(key)

    def allows_unexpected(self, key: str) -> bool:
        """Whether ``key`` matches one of :attr:`allow_unexpected`."""
        return matcher(self.allow_unexpected)(key)


def matcher(globs: Iterable[str]) -> Callable[[str], bool]:
    """Whether a key matches one of ``globs``, through one compiled regex.

    Each entry is an fnmatch glob (case-sensitive, ``*`` crosses dots) and, when it
    parses as one, also an exact pattern as reports print them
    (``layers.{0..5}.indexer.{bias,weight}``: see :mod:`dsdmerge.report`), in which
    ``*`` and ``?`` still work as in a glob (``layers.{3,5}.experts.{8..11}.*``): a key
    matches if it matches either reading, so a pattern copied from a report allows
    exactly its keys.

    Examples:
        >>> from dsdmerge.policy import matcher
        >>> allowed = matcher(["layers.{0..2}.indexer.{bias,weight}", "ema.*"])
        >>> allowed("layers.1.indexer.bias"), allowed("layers.3.indexer.bias"), allowed("ema.w")
        (True, False, True)
        >>> matcher(["layers.{3,5}.experts.{8..11}.*"])("layers.5.experts.9.w1.weight")
        True
    """
    alternatives = []
    for glob in globs:
        alternatives.append(fnmatch.translate(glob))
        exact = pattern_regex(glob)
        if exact is not None:
            alternatives.append(exact)
    if not alternatives:
        return _never
    pattern = re.compile("|".join(f"(?:{a})" for a in alternatives))
    return lambda key: pattern.match(key) is not None


def pattern_regex(text: str) -> str | None:
    """The regex of a report's pattern text, or ``None`` when ``text`` is not one.

    Only texts with a brace group or an escape are read as patterns (a plain text
    means the same as a glob without wildcards). Ranges are matched as ranges, never
    expanded: the regex grows with the text, not with the numbers a range holds.
    """
    if "{" not in text and "\\" not in text:
        return None

    try:
        segments = pattern_alternatives(text)
    except PatternError:
        return None
    return (
        r"\.".join("(?:" + "|".join(map(_alternative_regex, alts)) + ")" for alts in segments)
        + r"\Z"
    )


def _alternative_regex(alternative: str | tuple[str, str]) -> str:
    if isinstance(alternative, str):
        return _glob_part(alternative)
    return range_regex(*alternative)


def _glob_part(text: str) -> str:
    """An alternative of a pattern as a regex: ``*`` and ``?`` as in a glob, the rest literal."""
    return "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in text)


def _never(key: str) -> bool:
    return False


DEFAULT = Policy(name="default")
"""Backfill missing keys, keep unexpected ones and dtype mismatches, raise on shape mismatches,
warn about param groups whose members disagree."""

WARN = Policy(missing="warn", unexpected="warn", dtype="warn", name="warn")
"""Like :data:`DEFAULT`, plus one summarised :class:`~dsdmerge.DSDMergeWarning` per kind of
difference."""

STRICT = Policy(
    missing="raise",
    unexpected="raise",
    dtype="raise",
    conflict="raise",
    unmatched_rename="raise",
    name="strict",
)
"""Raise a :class:`~dsdmerge.MergeError` on any difference that is not allow-listed."""

NAMED = {"default": DEFAULT, "warn": WARN, "strict": STRICT}
"""The policies a name stands for (``policy="strict"``)."""


def resolve_policy(
    policy: PolicyName | Policy,
    /,
    *,
    allow_missing: str | Iterable[str] = (),
    allow_unexpected: str | Iterable[str] = (),
) -> Policy:
    """Turn a policy name (or a :class:`Policy`) plus extra allow-lists into a :class:`Policy`.

    Does not modify its inputs.

    Args:
        policy: ``"default"``, ``"warn"``, ``"strict"`` or a :class:`Policy`.
        allow_missing: Globs added to the policy's ``allow_missing``.
        allow_unexpected: Globs added to the policy's ``allow_unexpected``.

    Returns:
        The policy to apply.

    Raises:
        InvalidPolicyError: Unknown name, or an allow-list that is not globs.

    Examples:
        >>> import dsdmerge as dm
        >>> dm.resolve_policy("strict", allow_missing="*.indexer.*").allow_missing
        ('*.indexer.*',)
    """
    if isinstance(policy, Policy):
        base = policy
    elif isinstance(policy, str) and policy in NAMED:
        base = NAMED[policy]
    else:
        raise InvalidPolicyError(
            f"unknown policy {short_repr(policy)}: use 'default', 'warn', 'strict' or a "
            "dsdmerge.Policy"
        )
    extra_missing = _globs(allow_missing, "allow_missing")
    extra_unexpected = _globs(allow_unexpected, "allow_unexpected")
    if not extra_missing and not extra_unexpected:
        return base
    return dataclasses.replace(
        base,
        allow_missing=base.allow_missing + extra_missing,
        allow_unexpected=base.allow_unexpected + extra_unexpected,
    )
