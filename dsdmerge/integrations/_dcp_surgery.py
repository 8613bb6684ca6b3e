"""What :func:`~dsdmerge.integrations.load_dcp` does when it renames, converts or resizes.

Internal to :mod:`dsdmerge.integrations`. The rule: the checkpoint's view (its
``.metadata``) is renamed and converted first, exactly as ``rename=`` and ``convert=``
of :func:`dsdmerge.check` do it, and the policy decides on that view before any tensor
is read. The view is renamed and converted part by part, as the state dict passed in
is made: each of its top-level mappings (``"model"``, ``"optim"``) is one part, and its
top-level leaves are one more, a model of their own (torchtitan's manager passes its
model's keys there, next to ``"optimizer"``); a whole checkpoint renamed at once would
take those leaves for non-fqn keys such as ``"step"``. Then each key of the state dict
passed in is, by what the view says:

* *in place*: the checkpoint holds it under the same name and shape and no rule touched
  it: DCP reads it straight into the caller's tensor, as ``dcp.load`` does;
* *renamed*, *converted* or *resized* (``on_shape_mismatch="resize"``): read under its
  old name(s) into a new buffer of the checkpoint's shape and dtype, converted, then
  copied into the caller's tensor (a resized one: its overlapping leading slice, the
  rest keeps the caller's values); non-tensor values go into the result;
* *missing*, or a shape mismatch that is not resized: not read (the caller's value
  stays, and the result does not hold the key).

Keys of the checkpoint that end up unexpected are never read. The sources of a
conversion are read for the parts of the state dict (its top-level keys) that hold a
key the conversion makes, so converting a checkpoint's model and optimizer while
loading only the model reads no optimizer state.

Order, so that a refusal changes nothing: the verdict, then every check that needs no
data (the renamed and converted keys must be keys DCP stores under that flat name and
go into plain tensors; the buffers must fit the bound below), then the buffers are
read and converted (a conversion can still fail on values the view cannot show, such
as two fused parameters' hyperparameters), and only then does DCP write into the
caller's tensors, and the buffers are copied in.

The buffers take at most the bytes the caller's tensors for those keys hold plus the
bytes the checkpoint stores for the keys read (the storage entries' lengths, which the
reader checked against the files): a crafted ``.metadata`` that claims a huge shape
cannot make the call allocate it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dsdmerge._pipeline import surgery, verdict
from dsdmerge._records import Resized, TensorMeta
from dsdmerge._trees import copy_tree
from dsdmerge._verdict import reshaped
from dsdmerge.diff import KeyDiff
from dsdmerge.errors import DSDMergeError, LayoutError, MergeError, StateDictTypeError
from dsdmerge.flatten import flatten
from dsdmerge.integrations._dcp import dcp_load_into
from dsdmerge.integrations._trust import Trust
from dsdmerge.policy import Policy
from dsdmerge.resize import OnShapeMismatch, held_nbytes

if TYPE_CHECKING:
    from dsdmerge.convert import Conversions
    from dsdmerge.rename import Rules

__all__: list[str] = []


def load_changed(
    where: str,
    view: Mapping[str, Any],
    metadata: Any,
    expanded: Mapping[str, Any],
    policy: Policy,
    *,
    rename: Rules | None,
    convert: Conversions | None,
    on_shape_mismatch: OnShapeMismatch,
    trusted: Trust,
    no_dist: bool,
    process_group: Any,
    storage_reader: Any,
    stacklevel: int,
) -> tuple[dict[str, Any], KeyDiff]:
    """``load_dcp`` with renames, conversions or resizes: ``(what was read, diff)``.

    ``view`` and ``metadata`` are the checkpoint's, ``expanded`` the state dict to load
    into (``Stateful`` values already replaced by their ``state_dict()``); see the
    module docstring. ``stacklevel`` is for the policy's warnings, as for
    ``warnings.warn`` counted from this function.
    """
    import torch

    old = _distinct(view)
    parts = _parts(old, expanded)
    nested_old = _nest(old, parts)
    nested, findings = surgery(
        nested_old, policy, rename=rename, convert=None, stacklevel=stacklevel
    )
    old_of: dict[str, str] = {}  # new flat key -> the checkpoint's
    for part, sub in nested_old.items():
        new_sub = nested.get(part, {})
        if len(new_sub) != len(sub):  # a flat mapping renames key by key, in order
            raise LayoutError(f"{where}: renaming the checkpoint's keys changed how many there are")
        for a, b in zip(sub, new_sub, strict=True):
            old_of[_joined(part, b)] = _joined(part, a)
    renamed = _unnest(nested)
    converted: Mapping[str, Any] = renamed
    products: set[str] = set()
    consumed: list[str] = []
    if convert is not None:
        nested_conv, more = surgery(
            nested, policy, rename=None, convert=convert, stacklevel=stacklevel
        )
        converted = _unnest(nested_conv)
        findings = [*findings, *more]
        before = {id(v) for v in renamed.values() if type(v) is TensorMeta}
        after = {id(v) for v in converted.values() if type(v) is TensorMeta}
        products = {
            k
            for k, v in converted.items()
            if k not in renamed or (type(v) is TensorMeta and id(v) not in before)
        }
        consumed = [
            k
            for k, v in renamed.items()
            if k not in converted or (type(v) is TensorMeta and id(v) not in after)
        ]
    diff = verdict(
        converted,
        expanded,
        policy,
        stacklevel=stacklevel,
        findings=findings,
        on_shape_mismatch=on_shape_mismatch,
    )

    # what each key of the state dict passed in gets
    target_flat = flatten(expanded)
    missing = set(diff.missing)
    reshape = {m.key: m for m in diff.mismatched if reshaped(m)}
    resizing = on_shape_mismatch == "resize"
    drop: list[str] = []  # not read: missing, or a shape mismatch not resized
    fresh_of: dict[str, str] = {}  # new key -> the old key read for it (renamed, resized)
    made: list[str] = []  # new keys a conversion makes
    for key in target_flat:
        if key in missing or (key in reshape and not resizing):
            drop.append(key)
        elif key in products:
            made.append(key)
        elif key in converted:
            source = old_of[key]
            if source != key or key in reshape:
                fresh_of[key] = source
    paths = _plain_paths(expanded)
    # values that are not tensors (hyperparameters, ``param_names`` lists: DCP bytes entries,
    # not in the view) are read with the buffers and go through the same rules
    valued: list[str] = []
    if rename is not None or convert is not None:
        dropped = set(drop)
        valued = [
            k
            for k, leaf in target_flat.items()
            if k in paths
            and k in converted
            and k not in products
            and k not in dropped
            and type(converted[k]) is not TensorMeta
            and not isinstance(leaf, torch.Tensor)
        ]
        for k in valued:
            fresh_of.pop(k, None)
    surgical = [*fresh_of, *made, *valued]
    stored = metadata.state_dict_metadata
    _require_plain(where, surgical, paths)
    for key in surgical:
        leaf = target_flat[key]
        if isinstance(leaf, torch.Tensor) and type(leaf) not in (torch.Tensor, torch.nn.Parameter):
            raise StateDictTypeError(
                f"{key!r} is a {type(leaf).__name__}: load_dcp copies renamed, converted and "
                "resized tensors into plain tensors only. Load into full tensors (e.g. "
                "StateDictOptions(full_state_dict=True)), or rename/convert/resize with "
                "`dsdmerge merge` first."
            )

    # the conversion's sources, for the parts of the state dict that load something it makes
    sources = consumed
    unloaded = products.difference(target_flat)
    if made and unloaded:
        tops = {k.partition(".")[0] for k in made}
        sources = [k for k in consumed if k.partition(".")[0] in tops]
    if not made:
        sources = []
    reads = dict.fromkeys(
        [*fresh_of.values(), *(old_of[k] for k in valued), *(old_of[k] for k in sources)]
    )
    _require_dcp_keys(where, list(reads), stored)
    _check_budget(where, reads, old, metadata, [target_flat[k] for k in surgical], diff)

    # read and convert (nothing of the caller's has changed so far)
    buffers = _read(where, reads, old, metadata, trusted, no_dist, process_group, storage_reader)
    checked = bool(buffers)  # the storage entries were checked by that read
    values: dict[str, Any] = {k: buffers[source] for k, source in fresh_of.items()}
    if made or valued:
        whole = len(sources) == len(consumed)
        wanted = [*made, *valued]
        got = _converted(old, parts, buffers, policy, rename, convert, wanted, last=whole)
        if got is None:  # a conversion spans parts: read the rest of its sources too
            rest = [old_of[k] for k in consumed if old_of[k] not in buffers]
            _check_budget(
                where,
                dict.fromkeys([*reads, *rest]),
                old,
                metadata,
                [target_flat[k] for k in surgical],
                diff,
            )
            buffers.update(
                _read(where, rest, old, metadata, trusted, no_dist, process_group, storage_reader)
            )
            got = _converted(old, parts, buffers, policy, rename, convert, wanted, last=True)
        assert got is not None
        values.update(got)

    # then DCP loads the keys that are in place, and the buffers are copied in
    result = copy_tree(expanded)
    empty = _empty_ids(result)
    gone = set(drop).union(surgical)
    _remove(result, target_flat, gone)
    skipped = dcp_load_into(
        where,
        result,
        metadata,
        trusted=trusted,
        allow_partial_load=bool(diff.missing),
        no_dist=no_dist,
        process_group=process_group,
        storage_reader=storage_reader,
        checked=checked,
    )
    for path in skipped:
        _remove_path(result, path)
    resized: list[Resized] = []
    with torch.no_grad():
        for key in surgical:
            leaf, value = target_flat[key], values[key]
            if isinstance(leaf, torch.Tensor) and isinstance(value, torch.Tensor):
                if key in reshape:
                    overlap = tuple(
                        slice(0, min(a, b)) for a, b in zip(value.shape, leaf.shape, strict=True)
                    )
                    leaf[overlap].copy_(value[overlap])
                    resized.append(Resized.from_mismatch(reshape[key]))
                else:
                    leaf.copy_(value)
                value = leaf
            _put(result, paths[key], value)
    _drop_empty(result, keep=empty)
    if resized:
        diff = dataclasses.replace(diff, resized=tuple(resized))
    return result, diff


def _distinct(view: Mapping[str, Any]) -> dict[str, Any]:
    """The view as a dict whose tensor records are distinct objects (they are traced by id)."""
    out = dict(view)
    metas = [v for v in out.values() if type(v) is TensorMeta]
    if len({id(v) for v in metas}) != len(metas):
        out = {
            k: TensorMeta(v.shape, v.dtype) if type(v) is TensorMeta else v for k, v in out.items()
        }
    return out


def _parts(view: Mapping[str, Any], expanded: Mapping[str, Any]) -> set[str]:
    """The parts of the checkpoint that are renamed and converted each as a whole.

    Each top-level key of the state dict whose value is a mapping (``"model"``,
    ``"optimizer"``), and each first segment of the checkpoint's keys that heads a flat
    optimizer (``<part>.param_groups.*``) but is no key of the state dict. Everything
    else (the state dict's top-level leaves: torchtitan's manager passes its model's
    keys there) is one more part, a model state dict of its own.
    """
    leaves = {k for k, v in expanded.items() if not isinstance(v, Mapping)}
    out = {k for k, v in expanded.items() if type(k) is str and isinstance(v, Mapping)}
    for key in view:
        head, _, rest = key.partition(".")
        if head not in leaves and rest.startswith("param_groups."):
            out.add(head)
    out.discard("")
    return out


def _nest(flat: Mapping[str, Any], parts: set[str]) -> dict[str, dict[str, Any]]:
    """``{part: {key within it: value}}``, ``""`` for the keys under no part (in order)."""
    out: dict[str, dict[str, Any]] = {"": {}}
    for key, value in flat.items():
        head, dot, rest = key.partition(".")
        if dot and head in parts:
            out.setdefault(head, {})[rest] = value
        else:
            out[""][key] = value
    return out


def _joined(part: str, key: str) -> str:
    return f"{part}.{key}" if part else key


def _unnest(nested: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The flat mapping :func:`_nest` split."""
    return {_joined(part, k): v for part, sub in nested.items() for k, v in sub.items()}


def _plain_paths(tree: Mapping[str, Any]) -> dict[str, tuple[Any, ...]]:
    """``{flat key: path}`` for every leaf reached through mappings only, keys joined by dots.

    These are the keys DCP stores under their flat name; a leaf inside a list (a nested
    optimizer's ``param_groups``) has none.
    """
    out: dict[str, tuple[Any, ...]] = {}
    stack: list[tuple[tuple[Any, ...], Mapping[Any, Any]]] = [((), tree)]
    while stack:
        path, node = stack.pop()
        for k, v in node.items():
            if type(k) not in (str, int):
                continue
            if isinstance(v, Mapping):
                stack.append(((*path, k), v))
            else:
                out[".".join(map(str, (*path, k)))] = (*path, k)
    return out


def _require_plain(where: str, surgical: list[str], paths: Mapping[str, Any]) -> None:
    bad = [k for k in surgical if k not in paths]
    if bad:
        raise LayoutError(
            f"{where}: load_dcp renames, converts and resizes only keys DCP stores under the "
            f"same flat name (model state dicts, flattened optimizer state dicts); "
            f"{len(bad)} are not: {_shown(bad)}. Save the optimizer flattened "
            "(StateDictOptions(flatten_optimizer_state_dict=True)), or load the checkpoint "
            "with load_checkpoint() and merge it."
        )


def _require_dcp_keys(where: str, reads: list[str], stored: Mapping[str, Any]) -> None:
    bad = [k for k in reads if k not in stored]
    if bad:
        raise LayoutError(
            f"{where}: load_dcp reads renamed, converted and resized keys under the flat name "
            f"DCP stores them by; {len(bad)} of the checkpoint's keys have none (a nested "
            f"optimizer state dict?): {_shown(bad)}. Save the optimizer flattened "
            "(StateDictOptions(flatten_optimizer_state_dict=True)), or load the checkpoint "
            "with load_checkpoint() and merge it."
        )


def _nbytes(meta: TensorMeta) -> int:
    import torch

    n = 1
    for d in meta.shape:
        n *= int(d)
    dtype = meta.dtype
    size = dtype.itemsize if isinstance(dtype, torch.dtype) else 8
    return n * size


def _check_budget(
    where: str,
    reads: Mapping[str, Any],
    old: Mapping[str, Any],
    metadata: Any,
    into: list[Any],
    diff: KeyDiff,
) -> None:
    """Refuse buffers larger than the caller's tensors and the stored bytes together."""
    want = {k: _nbytes(old[k]) for k in reads if type(old[k]) is TensorMeta}
    total = sum(want.values())
    if not total:
        return
    lengths: dict[str, int] = {}
    for index, info in getattr(metadata, "storage_data", {}).items():
        fqn = getattr(index, "fqn", None)
        if fqn in want:
            length = getattr(info, "length", 0)
            lengths[fqn] = lengths.get(fqn, 0) + (length if type(length) is int else 0)
    allowed = held_nbytes(into) + sum(lengths.values())
    if total > allowed:
        worst = max(want, key=want.__getitem__)
        raise MergeError(
            f"{where}: reading {len(want)} renamed, converted or resized tensor(s) would take "
            f"{total:,} bytes, more than the tensors they go into and the bytes the checkpoint "
            f"stores for them hold ({allowed:,}); the largest, {worst!r}, claims "
            f"{want[worst]:,} bytes (a .metadata whose shapes its data does not fill?). "
            "Nothing was read.",
            diff=diff,
        )


def _read(
    where: str,
    keys: Any,
    old: Mapping[str, Any],
    metadata: Any,
    trusted: Trust,
    no_dist: bool,
    process_group: Any,
    storage_reader: Any,
) -> dict[str, Any]:
    """The checkpoint's values of ``keys`` (its own flat names), read into new buffers."""
    import torch

    buffers: dict[str, Any] = {
        k: torch.empty(old[k].shape, dtype=old[k].dtype) if type(old[k]) is TensorMeta else None
        for k in keys
    }
    if buffers:
        dcp_load_into(
            where,
            buffers,
            metadata,
            trusted=trusted,
            allow_partial_load=False,
            no_dist=no_dist,
            process_group=process_group,
            storage_reader=storage_reader,
            flat=True,
        )
    return buffers


def _converted(
    old: Mapping[str, Any],
    parts: set[str],
    buffers: Mapping[str, Any],
    policy: Policy,
    rename: Rules | None,
    convert: Conversions | None,
    made: list[str],
    *,
    last: bool = False,
) -> dict[str, Any] | None:
    """The values the conversion makes for ``made``, from the buffers read.

    The checkpoint is renamed and converted again with the buffers in place of their
    records (everything else stays a record, so the rules find what they found on the
    view). ``None`` when some value of ``made`` is not made from read data only (its
    sources were not all read); with ``last``, that is an error.
    """
    data = _nest({**old, **buffers}, parts)
    try:
        nested, _ = surgery(data, policy, rename=rename, convert=convert, stacklevel=1, quiet=True)
    except DSDMergeError:
        if last:
            raise
        return None
    out = _unnest(nested)
    got = {k: out[k] for k in made}
    if any(type(v) is TensorMeta or _unread(v) for v in got.values()):
        if last:  # cannot be: every source was read
            raise LayoutError("a converted value was not made from the data read")
        return None
    return got


def _remove(tree: dict[str, Any], flat: Mapping[str, Any], keys: set[str]) -> None:
    """Remove the leaves of ``keys`` from ``tree`` (a copy of the containers ``flat`` spells).

    Tensors are found by identity anywhere (mappings and lists), other values by their
    plain path; containers left empty stay until :func:`_drop_empty`.
    """
    import torch

    ids = {id(flat[k]) for k in keys if isinstance(flat.get(k), torch.Tensor)}
    stack: list[Any] = [tree]
    while stack:
        node = stack.pop()
        items = list(node.items()) if isinstance(node, dict) else []
        for k, v in items:
            if isinstance(v, torch.Tensor) and id(v) in ids:
                del node[k]
            elif isinstance(v, (dict, list)):
                stack.append(v)
        if isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))
    for path in _plain_paths(tree).values():
        key = ".".join(map(str, path))
        if key in keys:
            _remove_path(tree, path)


def _remove_path(tree: dict[str, Any], path: tuple[Any, ...]) -> None:
    node: Any = tree
    for part in path[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            return
    if isinstance(node, dict):
        node.pop(path[-1], None)


def _put(tree: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[path[-1]] = value


def _unread(value: Any) -> bool:
    return bool(getattr(type(value), "__dsdmerge_unread__", False))


def _empty_ids(tree: dict[str, Any]) -> set[int]:
    """The ids of the mappings in ``tree`` that are empty already (they are kept)."""
    out = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        for v in node.values():
            if isinstance(v, dict):
                if not v:
                    out.add(id(v))
                stack.append(v)
    return out


def _drop_empty(tree: dict[str, Any], *, keep: set[int]) -> None:
    """Remove the mappings left empty (bottom up), but those in ``keep``; the root stays."""
    order: list[tuple[dict[str, Any], Any, dict[str, Any]]] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        for k, v in node.items():
            if isinstance(v, dict):
                order.append((node, k, v))
                stack.append(v)
    for parent, k, child in reversed(order):
        if not child and id(child) not in keep:
            del parent[k]


def _shown(keys: list[str], limit: int = 5) -> str:
    text = ", ".join(map(repr, keys[:limit]))
    return text + (f" and {len(keys) - limit} more" if len(keys) > limit else "")
