"""The options of a merge: one frozen value, validated once, when it is made.

Every public entry point (:func:`~dsdmerge.merge`, :func:`~dsdmerge.check`, the
resume helpers, the load hooks) turns its keyword arguments into one
:class:`MergeOptions` (:meth:`MergeOptions.of`) and hands it down; nothing below
validates them again. As torch's ``StateDictOptions``: a frozen dataclass that checks
itself in ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Literal

from dsdmerge._values import short_repr
from dsdmerge.policy import (
    DEFAULT,
    NAMED,
    InvalidPolicyError,
    Policy,
    PolicyName,
    resolve_policy,
)
from dsdmerge.rename import Rule, Rules, compile_rules
from dsdmerge.resize import SHAPE_CHOICES, OnShapeMismatch

if TYPE_CHECKING:
    from dsdmerge.convert import Conversions

__all__ = ["FRESH_CHOICES", "Fresh", "MergeOptions"]

Fresh = Literal["reference", "as_fresh"]
"""How a parameter without checkpointed optimizer state is merged: with the
reference's state (``"reference"``) or without state, to start fresh (``"as_fresh"``)."""

FRESH_CHOICES: tuple[Fresh, ...] = ("reference", "as_fresh")


@dataclasses.dataclass(frozen=True)
class MergeOptions:
    """Everything a merge is asked to do besides its two state dicts, validated.

    Attributes:
        policy: The resolved :class:`~dsdmerge.Policy` (allow-lists folded in).
        rename: The compiled rename rules, or ``None``.
        convert: The layout conversions, or ``None``.
        on_shape_mismatch: ``"raise"``, ``"take_reference"`` or ``"resize"``.
        fresh: ``"reference"`` or ``"as_fresh"``.
        max_resize_bytes: The most bytes the resizes may allocate, or ``None``.

    Raises:
        InvalidPolicyError: ``policy`` is not a Policy, or ``on_shape_mismatch``,
            ``fresh`` or ``max_resize_bytes`` is not one of its values.

    Examples:
        >>> from dsdmerge._options import MergeOptions
        >>> MergeOptions.of("strict", allow_missing="idx.*").policy.allow_missing
        ('idx.*',)
    """

    policy: Policy = DEFAULT
    rename: tuple[Rule, ...] | None = None
    convert: Conversions | None = None
    on_shape_mismatch: OnShapeMismatch = "raise"
    fresh: Fresh = "reference"
    max_resize_bytes: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.policy, Policy):
            raise InvalidPolicyError(
                f"MergeOptions.policy must be a dsdmerge.Policy, got {short_repr(self.policy)}"
            )
        if self.fresh not in FRESH_CHOICES:
            raise InvalidPolicyError(
                f"fresh must be 'reference' or 'as_fresh', got {short_repr(self.fresh)}"
            )
        if self.on_shape_mismatch not in SHAPE_CHOICES:
            raise InvalidPolicyError(
                f"on_shape_mismatch must be one of {', '.join(map(repr, SHAPE_CHOICES))}, got "
                f"{short_repr(self.on_shape_mismatch)}"
            )
        size = self.max_resize_bytes
        if size is not None and (type(size) is not int or size < 0):
            raise InvalidPolicyError(
                f"max_resize_bytes must be a number of bytes (an int >= 0) or None, got "
                f"{short_repr(size)}"
            )

    @classmethod
    def of(
        cls,
        policy: PolicyName | Policy = "default",
        *,
        allow_missing: str | Iterable[str] = (),
        allow_unexpected: str | Iterable[str] = (),
        rename: Rules | None = None,
        convert: Conversions | None = None,
        on_shape_mismatch: OnShapeMismatch = "raise",
        fresh: Fresh = "reference",
        max_resize_bytes: int | None = None,
    ) -> MergeOptions:
        """The options from the keyword arguments the public functions take.

        Raises:
            InvalidPolicyError: A bad policy, allow-list, ``on_shape_mismatch``,
                ``fresh`` or ``max_resize_bytes``.
            RenameError: A rename rule is not valid.
        """
        no_globs = (  # the defaults, told by type (== on an odd value could raise)
            type(allow_missing) is tuple is type(allow_unexpected)
            and not allow_missing
            and not allow_unexpected
        )
        # a name alone is its policy as it is (what resolve_policy returns for it)
        resolved = NAMED.get(policy) if type(policy) is str and no_globs else None
        if resolved is None:
            resolved = resolve_policy(
                policy, allow_missing=allow_missing, allow_unexpected=allow_unexpected
            )
        return cls(
            resolved,
            None if rename is None else compile_rules(rename),
            convert,
            on_shape_mismatch,
            fresh,
            max_resize_bytes,
        )
