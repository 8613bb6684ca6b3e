"""The exceptions and the warning dsdmerge raises.

Every error dsdmerge raises for bad input or a policy violation is a
:class:`DSDMergeError`. Each subclass also subclasses the builtin it is closest
to, so existing ``except ValueError`` / ``except TypeError`` handlers keep
working::

    DSDMergeError(Exception)
    ├── LayoutError(DSDMergeError, ValueError)         malformed or ambiguous structure
    ├── StateDictTypeError(DSDMergeError, TypeError)   not a state dict, or a bad key type
    ├── MergeError(DSDMergeError, ValueError)          a difference the policy, or torch, rejects
    ├── InvalidPolicyError(DSDMergeError, ValueError)  a policy name, action or allow-list
    ├── PatternError(DSDMergeError, ValueError)        a key pattern text that does not parse
    ├── RenameError(DSDMergeError, ValueError)         a bad rename rule, or two keys renamed to one
    ├── ConversionError(DSDMergeError, ValueError)     a layout conversion that cannot apply
    ├── CheckpointReadError(DSDMergeError, OSError)    a checkpoint that cannot be read
    │   └── UnsafeCheckpointError                      a pickle that would run code: refused
    └── CheckpointWriteError(DSDMergeError, OSError)   a checkpoint that cannot be written

    DSDMergeWarning(UserWarning)                        a difference the policy reports
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dsdmerge.diff import KeyDiff

__all__ = [
    "CheckpointReadError",
    "ConversionError",
    "CheckpointWriteError",
    "DSDMergeError",
    "DSDMergeWarning",
    "InvalidPolicyError",
    "LayoutError",
    "MergeError",
    "PatternError",
    "RenameError",
    "StateDictTypeError",
    "UnsafeCheckpointError",
]


class DSDMergeError(Exception):
    """Base class of every error dsdmerge raises for bad input or a policy violation.

    Attributes:
        diff: The :class:`~dsdmerge.KeyDiff` that led to the error, or ``None``
            when the error is not about a difference between two state dicts.

    Examples:
        >>> import dsdmerge as dm
        >>> try:
        ...     dm.classify([1, 2])
        ... except dm.DSDMergeError as err:
        ...     print(type(err).__name__)
        StateDictTypeError
    """

    diff: KeyDiff | None

    def __init__(self, message: str, *, diff: KeyDiff | None = None) -> None:
        super().__init__(message)
        self.diff = diff


class LayoutError(DSDMergeError, ValueError):
    """A state dict whose structure is malformed or cannot be converted losslessly.

    Raised for flat keys that collide, for a mapping that mixes nested optimizer
    sections with flattened keys, for cycles, and for flat keys that
    :func:`~dsdmerge.unflatten` cannot place.
    """


class StateDictTypeError(DSDMergeError, TypeError):
    """An argument that is not a state dict, or a key of a type a state dict cannot hold."""


class MergeError(DSDMergeError, ValueError):
    """A difference between checkpoint and reference that must not be merged.

    Raised when the policy says ``"raise"`` for a difference that is not
    allow-listed (``policy="strict"``), for tensor shape mismatches under every
    built-in policy, and for optimizer group layouts that
    ``torch.optim.Optimizer.load_state_dict`` would reject.

    Attributes:
        diff: The full :class:`~dsdmerge.KeyDiff` of the two state dicts.
        problems: One line per rejected difference, in the order reported.
    """

    problems: tuple[str, ...]

    def __init__(
        self, message: str, *, diff: KeyDiff | None = None, problems: tuple[str, ...] = ()
    ) -> None:
        super().__init__(message, diff=diff)
        self.problems = problems


class InvalidPolicyError(DSDMergeError, ValueError):
    """A policy name, action or allow-list that is not valid."""


class PatternError(DSDMergeError, ValueError):
    """A key pattern text that :func:`dsdmerge.report.parse_pattern` cannot read."""


class RenameError(DSDMergeError, ValueError):
    r"""A rename rule that is not valid, or a rename that would map two keys to one.

    Attributes:
        keys: For a collision, the two original keys (or fqns), sorted; else ``()``.
        target: For a collision, the key both would be renamed to; else ``""``.

    Examples:
        >>> import dsdmerge as dm
        >>> try:
        ...     dm.rename({"a.w": 1, "b.w": 2}, {r"^[ab]\.": ""})
        ... except dm.RenameError as err:
        ...     err.keys, err.target
        (('a.w', 'b.w'), 'w')
    """

    keys: tuple[str, ...]
    target: str

    def __init__(self, message: str, *, keys: tuple[str, ...] = (), target: str = "") -> None:
        super().__init__(message)
        self.keys = keys
        self.target = target


class ConversionError(DSDMergeError, ValueError):
    """A layout conversion that is not valid, or that cannot be applied to this state dict.

    Raised by the conversion records (:class:`~dsdmerge.Fuse`, :class:`~dsdmerge.Split`,
    ...) for a bad template or argument, and by :func:`~dsdmerge.convert` when a rule
    matches nothing, finds only some of its sources, meets tensors it cannot combine,
    or optimizer state or hyperparameters it cannot carry over. Nothing is converted
    when it is raised: the input is never modified.

    Attributes:
        rule: The rule the error is about (a conversion record), or ``None``.
        keys: The fqns (or keys) the error is about, in the order the message names them.

    Examples:
        >>> import dsdmerge as dm
        >>> try:
        ...     dm.convert({"a.w": 1}, [dm.Transpose("b.w", dims=(0, 1))])
        ... except dm.ConversionError as err:
        ...     err.rule, err.keys
        (Transpose('b.w', dims=(0, 1)), ())
    """

    rule: object
    keys: tuple[str, ...]

    def __init__(self, message: str, *, rule: object = None, keys: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.rule = rule
        self.keys = keys


class CheckpointReadError(DSDMergeError, OSError):
    """A checkpoint that cannot be read: missing, corrupt or truncated, or of an unknown format.

    Raised by :mod:`dsdmerge.integrations.checkpoints`; the message names the
    path and the problem on one line.

    Attributes:
        path: The path that could not be read, as given.
    """

    path: str

    def __init__(self, message: str, *, path: str = "") -> None:
        super().__init__(message)
        self.path = path


class UnsafeCheckpointError(CheckpointReadError):
    """A pickle that references something outside the allow-list, so loading it would run code.

    Raised *before* anything in the pickle runs: for a torch file that
    ``torch.load(weights_only=True)`` refuses, a DCP ``.metadata`` holding
    anything but DCP metadata classes, torch sizes and dtypes, or a DCP bytes
    entry that is not plain data. Pass ``trusted=True`` only for checkpoints
    whose origin you trust.
    """


class CheckpointWriteError(DSDMergeError, OSError):
    """A checkpoint that cannot be written, or a destination that may not be replaced.

    Raised by :mod:`dsdmerge.integrations.writing` before anything is replaced; the
    message names the destination and the problem on one line.

    Attributes:
        path: The destination, as given.
    """

    path: str

    def __init__(self, message: str, *, path: str = "") -> None:
        super().__init__(message)
        self.path = path


class DSDMergeWarning(UserWarning):
    """A difference the policy merged but asked to be told about (``policy="warn"``)."""
