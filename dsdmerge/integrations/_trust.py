"""What a pickle in a checkpoint may load: ``trusted=``, and the refusal that names what it needed.

One rule for every reader (torch files, DCP bytes entries, DCP ``.metadata``): nothing
outside an allow-list loads unless the caller says so, and the caller says so in one
type, :data:`Trust`, checked by :func:`check_trust` before anything is read:

* ``False`` (the default): torch's ``weights_only`` allow-list only;
* a list of ``"module.Name"`` globals: those too (torch's ``safe_globals``), each
  resolved now, so a name that does not exist is the caller's error before any read;
* ``True``: unpickle without restriction (runs any code the pickle holds).

A refused pickle becomes an :class:`~dsdmerge.UnsafeCheckpointError` naming every
global it needed (:func:`load_error`, found statically, never by running it); any other
failure of ``torch.load`` a :class:`~dsdmerge.CheckpointReadError`.

Internal to :mod:`dsdmerge.integrations`: :mod:`~dsdmerge.integrations.checkpoints` and
:mod:`~dsdmerge.integrations._dcp` read through it.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import pickle
import re
from collections.abc import Iterator, Sequence
from typing import Any, Final

from dsdmerge import _torch_api
from dsdmerge.errors import CheckpointReadError, InvalidPolicyError, UnsafeCheckpointError
from dsdmerge.integrations._files import ZIP_MAGIC
from dsdmerge.integrations._files import reason as _reason

__all__ = ["Trust", "allowing", "check_trust", "load_error", "resolve_global"]

_ZIP_MAGIC: Final = ZIP_MAGIC
_TRUST_HINT: Final = (
    "Pass trusted=True only if you trust where this checkpoint came from (it runs the pickle)"
)


_UNSAFE_MARKERS: Final = (
    "global",
    "safe_globals",
    "blocked",
    "allowlist",
    "can only create new object",
    "can only build",
    "trying to call reduce",
)

Trust = bool | Sequence[str]
"""``trusted=``: ``False`` (the default: nothing outside the allow-lists), ``True``
(unpickle without restriction) or a list of ``"module.Name"`` globals to allow on top
of torch's ``weights_only`` allow-list (``torch.serialization.safe_globals``)."""


def check_trust(trusted: Any) -> Trust:
    """``trusted`` checked and made immutable: a bool, or a tuple of resolved global names.

    Raises :class:`~dsdmerge.InvalidPolicyError` for anything else (a string, a number,
    a name without a module, a name that cannot be imported).
    """
    if trusted is True or trusted is False:
        return bool(trusted)
    if isinstance(trusted, str) or not isinstance(trusted, Sequence):
        raise InvalidPolicyError(
            f"trusted must be True, False or a list of 'module.Name' globals, got {trusted!r}"
        )
    names = list(trusted)
    bad = sorted(repr(n) for n in names if type(n) is not str or "." not in n.strip("."))
    if bad:
        raise InvalidPolicyError(
            f"trusted globals must be 'module.Name' strings; got {', '.join(bad[:5])}"
        )
    for name in names:  # a name that does not resolve is the caller's mistake: say so now
        resolve_global(name)
    return tuple(names)


def resolve_global(name: str) -> Any:
    """The object ``module.Name`` names (imports ``module``: the caller named it)."""
    module, _, attr = name.rpartition(".")
    try:
        obj: Any = importlib.import_module(module)
        return getattr(obj, attr)
    except (ImportError, AttributeError) as err:
        # nested names such as module.Outer.Inner
        parts = name.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
                for part in parts[cut:]:
                    obj = getattr(obj, part)
                return obj
            except (ImportError, AttributeError):
                continue
        raise InvalidPolicyError(f"trusted global {name!r} cannot be found: {err}") from None


@contextlib.contextmanager
def allowing(trusted: Trust) -> Iterator[None]:
    """``torch.serialization.safe_globals`` for a list of globals; nothing otherwise.

    torch keeps that allow-list in a module global, so loads with extra globals are
    serialized (:func:`dsdmerge._torch_api.safe_globals`: other threads' ``torch.load``
    calls would see them meanwhile).
    """
    if isinstance(trusted, bool) or not trusted:
        yield
        return
    objects = [resolve_global(name) for name in trusted]
    with _torch_api.safe_globals(objects):
        yield


def load_error(
    where: str, err: BaseException, *, trusted: Trust, file: str | None = None
) -> CheckpointReadError:
    """``torch.load``'s failure on ``where`` as the error dsdmerge raises.

    An :class:`~dsdmerge.UnsafeCheckpointError` naming the globals outside the allow-list
    when the pickle needed some (listed from ``file``, read statically, when given); a
    :class:`~dsdmerge.CheckpointReadError` otherwise.
    """
    # torch re-raises the weights-only unpickler's error with advice to load with
    # weights_only=False (wrong advice for a file from elsewhere); the original is the context.
    original = err.__context__ if isinstance(err.__context__, Exception) else err
    text = str(original)
    unsafe = _unsafe_globals(file, trusted) if file is not None else []
    if unsafe or (
        isinstance(err, pickle.UnpicklingError) and any(m in text.lower() for m in _UNSAFE_MARKERS)
    ):
        if not unsafe:
            found = re.search(r"GLOBAL (\S+)", text)
            unsafe = [found.group(1)] if found else []
        from dsdmerge._text import shown_name

        what = (
            f"needs {len(unsafe)} global(s) outside torch's weights_only allow-list: "
            f"{', '.join(map(shown_name, unsafe[:20]))}{' ...' if len(unsafe) > 20 else ''}"
            if unsafe
            else "holds something outside torch's weights_only allow-list"
        )
        return UnsafeCheckpointError(
            f"{where}: refused to load: its pickle {what}, so loading it could run code; "
            f"nothing was run. Allow named globals with trusted=['module.Name', ...] if you "
            f"trust them, or {_TRUST_HINT[0].lower()}{_TRUST_HINT[1:]}.",
            path=where,
        )
    return CheckpointReadError(
        f"{where}: not a readable torch checkpoint (corrupt or truncated?): {_reason(original)}",
        path=where,
    )


def _unsafe_globals(file: str, trusted: Trust) -> list[str]:
    """Every global the torch file's pickle names that ``weights_only`` would refuse."""
    try:
        with allowing(trusted):
            with open(file, "rb") as f:
                zipped = f.read(4) == _ZIP_MAGIC
            if zipped:
                return _torch_api.unsafe_globals_in_checkpoint(file)
            with open(file, "rb") as f:
                data = f.read(_MAX_GLOBAL_SCAN)
            allowed = _torch_api.weights_only_allowed_globals()
            return sorted(g for g in _pickle_globals(data) if g not in allowed)
    except Exception:  # noqa: BLE001 - a listing is a courtesy; the refusal stands
        return []


_MAX_GLOBAL_SCAN: Final = 1 << 26


def _pickle_globals(data: bytes) -> set[str]:
    """The ``module.name`` globals of the (first) pickle in ``data``, found statically."""
    import pickletools

    found: set[str] = set()
    strings: list[Any] = []
    memo: dict[int, Any] = {}
    for op, arg, _pos in pickletools.genops(io.BytesIO(data)):
        name = op.name
        if name in ("GLOBAL", "INST"):
            module, _, attr = str(arg).partition(" ")
            found.add(f"{module}.{attr}")
        elif name == "STACK_GLOBAL" and len(strings) >= 2:
            found.add(f"{strings[-2]}.{strings[-1]}")
        if isinstance(arg, str) and "UNICODE" in name:
            strings.append(arg)
        elif name in ("MEMOIZE",) and strings:
            memo[len(memo)] = strings[-1]
        elif name in ("BINGET", "LONG_BINGET", "GET") and isinstance(arg, int):
            strings.append(memo.get(arg))
        elif name == "STOP":
            break
    return found
