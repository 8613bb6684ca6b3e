"""Dot-separated paths into whole checkpoints: ``key="model"``, ``--key optim.state``.

A training checkpoint is usually one dict of parts (``{"model": ..., "optim": ...,
"step": ...}``); a path names one part, to diff or merge it against a reference of
just that part. In a nested dict the path is walked key by key, where a key may itself
hold dots (``{"model.ema": {...}}``: the longest key that exists wins) and an int
segment indexes a list or an int-keyed dict. In a flat dict (a safetensors file, a
metadata view) the part is the keys that start with the path and a dot, with that
prefix removed: what :func:`dsdmerge.flatten` of the nested part would give.

Torch-free; internal (the public faces are ``read_metadata(..., key=)``,
``load_checkpoint(..., key=)`` and the command line's ``--key``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from dsdmerge.errors import LayoutError

__all__ = ["part_of", "replace_part", "select", "select_flat", "state_dict_part", "top_level"]


def top_level(keys: Iterable[Any], /, *, limit: int = 12) -> str:
    """The first segments of flat keys, sorted, for a message: ``"model, optim, step"``."""
    firsts = sorted({str(k).split(".", 1)[0] for k in keys})
    shown = ", ".join(firsts[:limit])
    return shown + (f" ... ({len(firsts)} in all)" if len(firsts) > limit else "") or "none"


def _segments(path: str) -> list[str]:
    parts = path.split(".")
    if not path or "" in parts:
        raise LayoutError(f"key path {path!r} is empty or has an empty segment; write e.g. 'model'")
    return parts


def _find(node: Any, parts: list[str], i: int) -> tuple[Any, int] | None:
    """The child of ``node`` named by ``parts[i:j]`` for the longest ``j``, and ``j``."""
    if isinstance(node, Mapping):
        for j in range(len(parts), i, -1):
            name = ".".join(parts[i:j])
            if name in node:
                return node[name], j
            if j == i + 1 and name.isdigit() and int(name) in node:
                return node[int(name)], j
        return None
    if isinstance(node, (list, tuple)) and parts[i].isdigit() and int(parts[i]) < len(node):
        return node[int(parts[i])], i + 1
    return None


def select(tree: Mapping[Any, Any], path: str, /) -> Any:
    """The part of a nested checkpoint at ``path`` (see the module docstring).

    Does not modify its input; the part is returned as is (not copied).

    Raises:
        LayoutError: Nothing is at ``path`` (the message lists the keys there are).

    Examples:
        >>> from dsdmerge._paths import select
        >>> select({"model": {"w": 1}, "optim": {"state": {}}}, "model")
        {'w': 1}
        >>> select({"model.ema": {"w": 2}}, "model.ema.w")
        2
    """
    parts = _segments(path)
    node: Any = tree
    i = 0
    while i < len(parts):
        found = _find(node, parts, i)
        if found is None:
            where = ".".join(parts[:i]) or "the top level"
            keys: Iterable[Any] = ()
            if isinstance(node, Mapping):
                keys = node.keys()
            elif isinstance(node, (list, tuple)):
                keys = range(len(node))
            raise LayoutError(
                f"key path {path!r}: {'.'.join(parts[i:])!r} is not under {where} "
                f"(keys there: {top_level(keys)})"
            )
        node, i = found
    return node


def select_flat(flat: Mapping[str, Any], path: str, /) -> dict[str, Any]:
    """The part of a flat dict under ``path``: its keys that start with ``path.``, stripped.

    Does not modify its input; values are shared.

    Raises:
        LayoutError: No key starts with ``path.`` (``path`` may be a value's own key).

    Examples:
        >>> from dsdmerge._paths import select_flat
        >>> select_flat({"model.w": 1, "model.b": 2, "step": 3}, "model")
        {'w': 1, 'b': 2}
    """
    _segments(path)
    prefix = path + "."
    n = len(prefix)
    part = {k[n:]: v for k, v in flat.items() if k.startswith(prefix)}
    if not part:
        what = "is a value, not a part" if path in flat else "selects no key"
        raise LayoutError(f"key path {path!r} {what} (top-level keys: {top_level(flat)})")
    return part


def part_of(tree: Mapping[Any, Any], path: str, /) -> Any:
    """:func:`select` where the path is nested in ``tree``, else :func:`select_flat`.

    Examples:
        >>> from dsdmerge._paths import part_of
        >>> part_of({"model": {"w": 1}}, "model"), part_of({"model.w": 1}, "model")
        ({'w': 1}, {'w': 1})
    """
    parts = _segments(path)
    if _find(tree, parts, 0) is None and any(
        isinstance(k, str) and k.startswith(path + ".") for k in tree
    ):
        return select_flat(tree, path)
    return select(tree, path)


def state_dict_part(where: str, loaded: Mapping[Any, Any], key: str) -> Any:
    """The state dict at key path ``key`` of ``loaded`` (``where`` names the file in errors)."""
    part = part_of(loaded, key)
    if not isinstance(part, dict):
        raise LayoutError(
            f"{where}: key path {key!r} holds a value ({type(part).__name__}), not a state dict; "
            f"name a part such as {top_level(loaded)}"
        )
    return part


def replace_part(tree: Mapping[Any, Any], path: str, part: Any, /) -> dict[Any, Any]:
    """``tree`` with the part at ``path`` replaced by ``part``, in new containers.

    Nested: the containers along the path are new (dicts keep their key order), all
    else is shared. Flat (nothing nested at ``path``, but keys that start with it): the
    keys under ``path`` are replaced by ``part``'s keys, prefixed, where the first of
    them was. Does not modify its inputs.

    Examples:
        >>> from dsdmerge._paths import replace_part
        >>> replace_part({"model": {"w": 1}, "step": 3}, "model", {"w": 1, "b": 0})
        {'model': {'w': 1, 'b': 0}, 'step': 3}
        >>> replace_part({"model.w": 1, "step": 3}, "model", {"w": 1, "b": 0})
        {'model.w': 1, 'model.b': 0, 'step': 3}
    """
    parts = _segments(path)
    if _find(tree, parts, 0) is None:
        if not isinstance(part, Mapping):
            raise LayoutError(f"key path {path!r}: a flat part must be a dict")
        select_flat(tree, path)  # raises when nothing is there
        prefix = path + "."
        out: dict[Any, Any] = {}
        placed = False
        for key, value in tree.items():
            if isinstance(key, str) and key.startswith(prefix):
                if not placed:  # the part's keys go where the first key under the prefix was
                    out.update({prefix + str(k): v for k, v in part.items()})
                    placed = True
                continue
            out[key] = value
        return out
    replaced: dict[Any, Any] = _replaced(tree, parts, 0, part)
    return replaced


def _replaced(node: Any, parts: list[str], i: int, part: Any) -> Any:
    found = _find(node, parts, i)
    assert found is not None
    child, j = found
    new_child = part if j == len(parts) else _replaced(child, parts, j, part)
    if isinstance(node, Mapping):
        name = ".".join(parts[i:j])
        real = name if name in node else int(name)
        return {k: (new_child if k == real else v) for k, v in node.items()}
    items = list(node)
    items[int(parts[i])] = new_child
    return type(node)(items) if isinstance(node, tuple) else items
