"""Every public function of dsdmerge as a call on (a, b), for the hostile-input suite."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import dsdmerge as dm

LOOSE = dm.Policy(conflict="warn", drop_unexpected=True)
SHAPES = {"on_shape_mismatch": "take_reference"}


def _quiet(fn: Callable[[], Any]) -> Any:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    others = [w for w in caught if not issubclass(w.category, dm.DSDMergeWarning)]
    assert not others, f"non-dsdmerge warnings escaped: {[str(w.message) for w in others]}"
    return out


def _flat_of(a: Any) -> Any:
    try:
        return dm.flatten(a)
    except dm.DSDMergeError:
        return a


CALLS: dict[str, Callable[[Any, Any], Any]] = {
    "classify(a)": lambda a, b: dm.classify(a),
    "is_optimizer_state_dict(a)": lambda a, b: dm.is_optimizer_state_dict(a),
    "flatten(a)": lambda a, b: dm.flatten(a),
    "unflatten(a)": lambda a, b: dm.unflatten(a),
    "unflatten(flatten(a))": lambda a, b: dm.unflatten(_flat_of(a)),
    "unflatten(a, like=b)": lambda a, b: dm.unflatten(a, like=b),
    "unflatten(flatten(a), like=b)": lambda a, b: dm.unflatten(_flat_of(a), like=b),
    "unflatten(flatten(a), like=a)": lambda a, b: dm.unflatten(_flat_of(a), like=a),
    "diff(a, b)": lambda a, b: dm.diff(a, b),
    "str(diff(a, b))": lambda a, b: str(dm.diff(a, b)),
    "diff(a, b).to_dict()": lambda a, b: dm.diff(a, b).to_dict(),
    "diff(flatten(a), b)": lambda a, b: dm.diff(_flat_of(a), b),
    "merge(a, b)": lambda a, b: _quiet(lambda: dm.merge(a, b)),
    "merge(a, b, warn)": lambda a, b: _quiet(lambda: dm.merge(a, b, policy="warn")),
    "merge(a, b, strict)": lambda a, b: dm.merge(a, b, policy="strict"),
    "merge(a, b, loose)": lambda a, b: _quiet(lambda: dm.merge(a, b, policy=LOOSE, **SHAPES)),
    "merge(flatten(a), b, loose)": lambda a, b: _quiet(
        lambda: dm.merge(_flat_of(a), b, policy=LOOSE, **SHAPES)
    ),
    "merge_with_diff(a, b, warn)": lambda a, b: _quiet(
        lambda: dm.merge_with_diff(a, b, policy="warn")
    ),
    "check(a, b, strict)": lambda a, b: dm.check(a, b, policy="strict"),
    "check(a, b, warn)": lambda a, b: _quiet(lambda: dm.check(a, b, policy="warn")),
    # model surgery
    "rename(a, add a prefix)": lambda a, b: _quiet(lambda: dm.rename(a, {r"^": "module."})),
    "rename(a, ddp)": lambda a, b: _quiet(lambda: dm.rename(a, "ddp")),
    "rename(flatten(a), a segment)": lambda a, b: _quiet(
        lambda: dm.rename(_flat_of(a), {r"(?<![^.])w": "v"})
    ),
    "diff(a, b, rename)": lambda a, b: _quiet(lambda: dm.diff(a, b, rename={r"^": "x."})),
    "merge(a, b, rename, strict)": lambda a, b: dm.merge(
        a, b, policy="strict", rename={r"^x\.": ""}
    ),
    "merge_with_diff(a, b, resize)": lambda a, b: _quiet(
        lambda: dm.merge_with_diff(a, b, policy="warn", on_shape_mismatch="resize")
    ),
    "check(a, b, resize)": lambda a, b: _quiet(
        lambda: dm.check(a, b, policy="warn", on_shape_mismatch="resize")
    ),
    # layout conversions (a rule that matches nothing is a ConversionError too)
    "convert(a, transpose every fqn)": lambda a, b: _quiet(
        lambda: dm.convert(a, [dm.Transpose("{K*}", dims=(0, -1))], nonelementwise="reset")
    ),
    "convert(a, split every fqn)": lambda a, b: _quiet(
        lambda: dm.convert(a, [dm.Split("{K*}", ["{K*}.x", "{K*}.y"])], nonelementwise="reset")
    ),
    "convert(a, fuse)": lambda a, b: dm.convert(a, [dm.Fuse(["{P*}.{W}", "{P*}.w"], "{P*}.{W}.f")]),
    "convert(a, stack)": lambda a, b: dm.convert(
        a, [dm.Stack("{P*}.{I}.{W}", "{P*}.{W}", over="I")]
    ),
    "convert(flatten(a), stack)": lambda a, b: dm.convert(
        _flat_of(a), [dm.Stack("{P*}.{I}.{W}", "{P*}.{W}", over="I")]
    ),
    "rekey(a)": lambda a, b: dm.rekey(a),
    "rekey(a, names)": lambda a, b: dm.rekey(a, [f"p{i}" for i in range(3)]),
}
