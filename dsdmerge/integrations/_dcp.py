"""DCP directories, read and loaded without believing them: their claims are checked first.

torch's own reader believes a DCP directory: it unpickles ``.metadata`` without
restriction, reads whatever file and byte range a storage entry names, allocates what
a tensor record claims, and loads bytes entries with ``weights_only=False``. Here,
before DCP reads or allocates anything:

* ``.metadata`` goes through the restricted, bounded unpickler of
  :mod:`~dsdmerge.integrations._dcp_metadata`, unless ``trusted=True``;
* every storage entry names a regular file inside the directory (symlinks resolved),
  lies within its size and overlaps no other (:func:`_check_regions`), so what a load
  reads is bounded by the bytes on disk;
* tensors claim no more bytes than the data files hold (:func:`_check_claimed_bytes`),
  and the recorded nesting costs no more to rebuild than the file's size allows
  (:func:`_check_nesting_cost`);
* bytes entries load with ``weights_only=True`` and the caller's allow-list
  (:mod:`~dsdmerge.integrations._trust`).

Then DCP's own ``dcp.load`` reads the data, through a storage reader whose
``read_metadata`` returns the metadata read here (:func:`_safe_reader`).

The entry points, internal to :mod:`dsdmerge.integrations`:

* :func:`read_torch_metadata`: DCP's own ``Metadata`` object of a directory, read safely;
* :func:`read_dcp_view`: the :class:`~dsdmerge.integrations.CheckpointView` of a
  directory, with the ``Metadata`` it was built from (no tensor data read);
* :func:`dcp_load_whole`: every key, in this process, nested as recorded
  (``load_checkpoint``);
* :func:`dcp_load_into`: ``dcp.load`` into a caller's state dict (``load_dcp``).
"""

from __future__ import annotations

import collections
import io
import itertools
import operator
import os
import pickle
import stat
import warnings
from typing import Any, Final

import torch

from dsdmerge import _torch_api
from dsdmerge._gc import gc_paused
from dsdmerge.diff import TensorMeta
from dsdmerge.errors import (
    CheckpointReadError,
    DSDMergeError,
    InvalidPolicyError,
    UnsafeCheckpointError,
)
from dsdmerge.flatten import flatten
from dsdmerge.integrations._files import METADATA_FILE, detect_format, read_regular
from dsdmerge.integrations._files import reading as _reading
from dsdmerge.integrations._files import reason as _reason
from dsdmerge.integrations._trust import Trust, allowing, check_trust, load_error, resolve_global
from dsdmerge.integrations._view import UNREAD, CheckpointView, meta_nbytes
from dsdmerge.layout import Layout

__all__ = [
    "dcp_load_into",
    "dcp_load_whole",
    "dcp_part_layout",
    "read_dcp_view",
    "read_torch_metadata",
]

_METADATA_FILE: Final = METADATA_FILE


def dcp_part_layout(metadata: Any, key: str) -> Layout:
    """Whether the part of a DCP checkpoint at ``key`` was saved nested.

    A path part may itself hold dots, so the prefix of a path that spells ``key`` is
    the one whose joined length is ``len(key)``: found by adding up part lengths (one
    join per path at most, so linear in the paths' total length).
    """
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    want = len(key)
    for path in paths.values():
        if not isinstance(path, (list, tuple)) or len(path) < 3:
            continue
        total = -1
        for cut, part in enumerate(path, 1):
            total += len(part) + 1 if type(part) is str else len(str(part)) + 1
            if total >= want:
                if total == want and len(path) - cut > 1 and ".".join(map(str, path[:cut])) == key:
                    return Layout.NESTED
                break
    return Layout.FLAT


def read_dcp_view(
    where: str, *, trusted: Trust, storage_reader: Any = None
) -> tuple[CheckpointView, Any]:
    """The :class:`CheckpointView` of a DCP directory, and the ``Metadata`` it was built from.

    The metadata is read by :func:`read_torch_metadata`; the view holds every key as
    ``read_metadata`` shows it (the nesting DCP recorded, flattened), reading from the
    data files only the ``param_groups.<i>.params`` entries of a nested optimizer.
    """
    trusted = check_trust(trusted)
    if storage_reader is None and detect_format(where) != "dcp":
        raise CheckpointReadError(f"{where}: not a DCP checkpoint directory", path=where)
    # the collector is paused for the view too: with millions of records just made, each
    # of its passes would walk them all (reads in several threads share one pause)
    with _reading(where), gc_paused():
        metadata = read_torch_metadata(where, trusted=trusted, storage_reader=storage_reader)
        entries = _dcp_entries(where, metadata, trusted=trusted, storage_reader=storage_reader)
        # DCP records each saved value's path in the state dict: nested when one has two parts
        paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
        nested = any(isinstance(p, (list, tuple)) and len(p) > 1 for p in paths.values())
        layout = Layout.NESTED if nested else Layout.FLAT
        return CheckpointView(entries, path=where, format="dcp", layout=layout), metadata


def read_torch_metadata(where: str, *, trusted: Trust, storage_reader: Any = None) -> Any:
    """DCP's own ``Metadata`` object of a directory: ``.metadata``, read safely.

    Through the restricted unpickler of :mod:`~dsdmerge.integrations._dcp_metadata`
    (classes of ``trusted`` stand for storage entries), or ``pickle`` when ``trusted is
    True``. With a ``storage_reader`` and no local ``.metadata`` (a remote checkpoint), only
    ``trusted=True`` reads it: then the reader's own ``read_metadata()`` does.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    from dsdmerge.integrations import _dcp_metadata

    file = os.path.join(where, _METADATA_FILE)
    if storage_reader is not None and not os.path.isfile(file):
        if trusted is not True:
            raise CheckpointReadError(
                f"{where}: no local {_METADATA_FILE} to read safely; pass trusted=True to let "
                f"the storage reader ({type(storage_reader).__name__}) read it its own way (which "
                "may unpickle it without restriction), only if you trust this checkpoint",
                path=where,
            )
        try:
            metadata = storage_reader.read_metadata()
        except Exception as err:  # any reader's failure, reported with the path
            raise CheckpointReadError(
                f"{where}: {type(storage_reader).__name__}.read_metadata() failed: {_reason(err)}",
                path=where,
            ) from err
        if not isinstance(metadata, Metadata):
            raise CheckpointReadError(
                f"{where}: the storage reader returned a {type(metadata).__name__}, not DCP "
                "Metadata",
                path=where,
            )
        return metadata
    data = read_regular(file, where=where, what=_METADATA_FILE)
    if trusted is not True:
        classes = {}
        for name in trusted or ():
            obj = resolve_global(name)
            if isinstance(obj, type):  # a class may stand for a storage entry; see load_metadata
                classes[name] = obj
        try:
            return _dcp_metadata.load_metadata(data, where=file, trusted=classes)
        except UnsafeCheckpointError as err:
            raise UnsafeCheckpointError(f"{err} {_DCP_TRUST_HINT}.", path=where) from None
        except CheckpointReadError as err:
            raise CheckpointReadError(str(err), path=where) from None
    try:
        # trusted: the caller vouches for this checkpoint, so torch's own (unrestricted) way
        metadata = pickle.loads(data)
    except Exception as err:  # a corrupt pickle can raise almost anything
        raise CheckpointReadError(
            f"{file}: not a readable DCP metadata file (corrupt or truncated?): {_reason(err)}",
            path=where,
        ) from err
    if not isinstance(metadata, Metadata) or not isinstance(
        getattr(metadata, "state_dict_metadata", None), dict
    ):
        raise CheckpointReadError(
            f"{file}: holds a {type(metadata).__name__}, not DCP Metadata", path=where
        )
    return metadata


_DCP_TRUST_HINT: Final = (
    "Allow a storage class you trust by name with trusted=['module.Name'] (--safe-globals), "
    "or pass trusted=True only if you trust where this checkpoint came from (it runs the pickle)"
)


def _dcp_paths(metadata: Any) -> dict[str, tuple[Any, ...]]:
    """Each DCP key's path in the nested state dict (from ``planner_data`` when recorded).

    Column by column in C when every key has a well-formed path (the usual case, and
    always so after the safe reader's validation); key by key otherwise.
    """
    planner_data = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    keys = list(metadata.state_dict_metadata)
    raw: list[Any] = list(map(planner_data.get, keys))
    kinds = set(map(type, raw))
    if keys and kinds <= {tuple, list} and min(map(len, raw)) > 0:
        parts = list(itertools.chain.from_iterable(raw))
        types = set(map(type, parts))
        if (
            types <= {str, int}
            and set(map(type, map(operator.itemgetter(0), raw))) == {str}
            and (int not in types or min(p for p in parts if type(p) is int) >= 0)
        ):
            return dict(zip(keys, raw if kinds == {tuple} else map(tuple, raw), strict=True))
    out: dict[str, tuple[Any, ...]] = {}
    for key, path in zip(keys, raw, strict=True):
        if (
            isinstance(path, (tuple, list))
            and path
            and all(type(p) is str or (type(p) is int and p >= 0) for p in path)
            and type(path[0]) is str
        ):
            out[key] = tuple(path)
        else:
            out[key] = (key,)
    return out


class _Budget:
    """How many list placeholders a nested rebuild may still add (bounded by the file size)."""

    __slots__ = ("left",)

    def __init__(self, left: int) -> None:
        self.left = left


def _set_element(
    root: dict[Any, Any], path: tuple[Any, ...], value: Any, budget: _Budget | None = None
) -> None:
    """Put ``value`` at ``path`` (str keys make dicts, int keys make lists), as DCP does.

    Lists are padded with ``None`` up to an index, at most ``budget.left`` placeholders in
    all; a path through a value that is not a container of the right kind raises
    :class:`_PathConflict`.
    """
    node: Any = root
    for part, following in itertools.pairwise(path):
        empty: Any = {} if type(following) is str else []
        child = _step(node, part, budget)
        if child is None:
            child = empty
            _put(node, part, child)
        elif type(child) is not type(empty):
            raise _PathConflict(path)
        node = child
    last = path[-1]
    _step(node, last, budget)
    _put(node, last, value)


class _PathConflict(Exception):
    def __init__(self, path: tuple[Any, ...]) -> None:
        super().__init__(path)
        self.path = path


def _step(node: Any, part: Any, budget: _Budget | None) -> Any:
    if type(node) is dict:
        if type(part) is not str:
            raise _PathConflict((part,))
        return node.get(part)
    if type(node) is not list or type(part) is not int or part < 0:
        raise _PathConflict((part,))
    missing = part + 1 - len(node)
    if missing > 0:
        if budget is not None:
            if missing > budget.left:
                raise _PathConflict((part,))
            budget.left -= missing
        node.extend([None] * missing)
    return node[part]


def _put(node: Any, part: Any, value: Any) -> None:
    node[part] = value


def _is_params_entry(path: tuple[Any, ...]) -> bool:
    return (
        len(path) >= 3
        and path[-1] == "params"
        and type(path[-2]) is int
        and path[-3] == ("param_groups")
    )


def _rebuild(where: str, metadata: Any, make: Any, *, budget: int) -> dict[Any, Any]:
    """The nested state dict DCP recorded, with ``make(key, path, md)`` as each value."""
    root: dict[Any, Any] = {}
    room = _Budget(budget)
    for key, path in _dcp_paths(metadata).items():
        try:
            _set_element(root, path, make(key, path, metadata.state_dict_metadata[key]), room)
        except _PathConflict:
            raise CheckpointReadError(
                f"{where}: {_METADATA_FILE} records an impossible place for {key!r} "
                "(a path through a value, a list index too large for the file, or a key "
                "that is both a list index and a name); corrupt or crafted",
                path=where,
            ) from None
    return root


def _dcp_entries(
    where: str, metadata: Any, *, trusted: Trust, storage_reader: Any = None
) -> dict[str, Any]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    paths = _dcp_paths(metadata)
    sdm = metadata.state_dict_metadata
    keys = list(paths)
    # only paths ending in "params" can be (found in C; a Python call per key costs more)
    lasts = map(operator.itemgetter(-1), paths.values())
    maybe = itertools.compress(keys, map(operator.eq, lasts, itertools.repeat("params")))
    params = [key for key in maybe if _is_params_entry(paths[key])]
    values = _read_params(where, metadata, params, trusted=trusted, storage_reader=storage_reader)
    # TensorMetas built column by column in C (a Python call per key would cost more than
    # the rest of the view at DeepSeek-V3 scale): frozen dataclass fields set with
    # object.__setattr__, as the dataclass's own __init__ does
    records = list(map(sdm.__getitem__, keys))
    is_tensor = list(map(isinstance, records, itertools.repeat(TensorStorageMetadata)))
    tensors = list(itertools.compress(records, is_tensor))
    metas = list(map(object.__new__, itertools.repeat(TensorMeta, len(tensors))))
    shapes = list(map(tuple, map(operator.attrgetter("size"), tensors)))
    dtypes = map(operator.attrgetter("properties.dtype"), tensors)
    collections.deque(map(object.__setattr__, metas, itertools.repeat("shape"), shapes), 0)
    collections.deque(map(object.__setattr__, metas, itertools.repeat("dtype"), dtypes), 0)
    made_leaves: dict[str, Any] = dict.fromkeys(keys, UNREAD)  # DCP order, then the values
    made_leaves.update(zip(itertools.compress(keys, is_tensor), metas, strict=True))
    made_leaves.update(values)
    if _plain_paths(paths):
        # Only names, and none that can start an optimizer state dict: the flat view is
        # DCP's own keys (DCP joins a path with dots, as flatten does), so the nested
        # rebuild is skipped (a third of the time of `inspect` at DeepSeek-V3 scale).
        return made_leaves
    if trusted is not True:  # a trusted checkpoint may be remote: no local size to bound by
        _check_nesting_cost(where, paths)
    root = _rebuild(
        where, metadata, lambda k, p, m: made_leaves[k], budget=_metadata_size(where, trusted)
    )
    try:
        return flatten(root)
    except Exception as err:
        raise CheckpointReadError(
            f"{where}: the nesting recorded in {_METADATA_FILE} cannot be flattened: "
            f"{_reason(err)}",
            path=where,
        ) from err


_OPTIMIZER_PARTS: Final = frozenset({"state", "param_groups"})
_PLAIN_DEPTH: Final = 16
"""Paths deeper than this take the nested rebuild (linear) instead of the prefix check."""


def _plain_paths(paths: dict[str, tuple[Any, ...]]) -> bool:
    """Whether flattening the nesting the paths describe gives exactly DCP's own keys.

    True when every path is names only (no list index), none ``state`` or
    ``param_groups`` (no optimizer state dict to flatten its own way), each key is its
    path joined with dots (as DCP writes it), and no path runs through another's value.
    Checked column by column in C, in time linear in the paths' total length: a path
    deeper than :data:`_PLAIN_DEPTH` answers False (the nested rebuild handles it).
    """
    values = list(paths.values())
    if max(map(len, values), default=0) > _PLAIN_DEPTH:
        return False
    parts = list(itertools.chain.from_iterable(values))
    if set(map(type, parts)) - {str} or not _OPTIMIZER_PARTS.isdisjoint(parts):
        return False
    if not all(map(operator.eq, paths, map(".".join, values))):
        return False
    whole = set(values)
    for k in range(1, max(map(len, values), default=1)):
        if not whole.isdisjoint({p[:k] for p in values if len(p) > k}):
            return False
    return True


_NESTING_FACTOR: Final = 64


def _check_nesting_cost(where: str, paths: dict[str, tuple[Any, ...]]) -> None:
    """Refuse nesting whose flat keys would cost more than the file's size to build.

    Flattening a path of depth d whose key is n characters long builds d prefixes of up
    to n characters; DCP's own keys are the joined paths, so for a file DCP wrote the
    total is about (depth x the keys' length), a small multiple of the file. A crafted
    path that reuses one long string through the memo would make it quadratic.
    """
    budget = _NESTING_FACTOR * _metadata_size(where)
    cost = 0
    for path in paths.values():
        depth = len(path)
        cost += depth * (sum(len(p) if type(p) is str else 20 for p in path) + depth)
        if cost > budget:
            raise CheckpointReadError(
                f"{where}: {_METADATA_FILE} records paths whose flat keys would take more than "
                f"{_NESTING_FACTOR} times the file's size to build (nested more deeply, or with "
                "longer names, than its own keys); corrupt or crafted",
                path=where,
            )


def _metadata_size(where: str, trusted: Trust = False) -> int:
    """The local ``.metadata``'s size (at least 4 KiB): what a rebuild may allocate.

    Unbounded for a trusted checkpoint, which may be remote (read by its storage reader).
    """
    if trusted is True:
        return 1 << 62
    try:
        return max(os.stat(os.path.join(where, _METADATA_FILE)).st_size, 1 << 12)
    except OSError:
        return 1 << 12


_MAX_BYTES_ENTRY: Final = 1 << 26
"""The largest DCP bytes entry :func:`read_dcp_view` reads itself (64 MiB)."""


def _storage_stat(
    where: str, key: str, info: Any, *, what: str
) -> tuple[str, int, int, os.stat_result]:
    def bad(problem: str) -> CheckpointReadError:
        return CheckpointReadError(
            f"{where}: the storage entry of {key!r} ({what}) {problem}; corrupt or crafted",
            path=where,
        )

    rel = getattr(info, "relative_path", None)
    offset = getattr(info, "offset", None)
    length = getattr(info, "length", None)
    if type(rel) is not str or type(offset) is not int or type(length) is not int:
        raise bad("is not a file name, offset and length")
    if not rel or "\0" in rel or os.path.isabs(rel):
        raise bad(f"names {rel!r}, not a file of the checkpoint")
    root = os.path.realpath(where)
    file = os.path.realpath(os.path.join(root, rel))  # symlinks resolved
    if file == root or os.path.commonpath([root, file]) != root:
        raise bad(f"names {rel!r}, which is outside the checkpoint directory")
    try:
        info_ = os.stat(file)
    except OSError as err:
        raise bad(f"names {rel!r}, which cannot be read: {_reason(err)}") from err
    if not stat.S_ISREG(info_.st_mode):
        raise bad(f"names {rel!r}, which is not a regular file")
    if offset < 0 or length < 0 or offset + length > info_.st_size:
        raise bad(
            f"reaches bytes {offset}..{offset + length} of {rel!r}, which has {info_.st_size}"
        )
    return file, offset, length, info_


def _has_file_fields(info: Any) -> bool:
    return all(hasattr(info, f) for f in ("relative_path", "offset", "length"))


def _check_regions(
    where: str, entries: list[tuple[str, Any]], *, what: str, strict: bool = True
) -> dict[str, tuple[str, int, int]]:
    """Each entry's ``(file, offset, length)``, every one inside ``where``, none overlapping.

    DCP's writers (torch's ``FileSystemWriter`` in every release, OLMo-core's) write the
    entries of one file one after another, each starting where the previous one ended
    (``offset = stream.tell()``), so no two ranges of one file overlap; the one exception,
    ``FileSystemWriter(serialization_format=SAFETENSORS)`` (torch >= 2.8, for Hugging Face
    consolidation), records every tensor at one offset, and torch's own
    ``FileSystemReader`` cannot load that either. A crafted ``.metadata`` can point many
    entries at the same bytes; refusing overlaps bounds what a load reads and allocates
    by the bytes on disk. Files are told apart by
    device and inode, so two names (a hard link, ``./x``) of one file are one file.
    ``strict=False`` (a storage reader of the caller's): entries without a relative
    path, offset and length are left to that reader.
    """
    out: dict[str, tuple[str, int, int]] = {}
    stats: dict[str, tuple[str, os.stat_result]] = {}
    by_file: dict[tuple[int, int], list[tuple[int, int, str]]] = {}
    for key, info in entries:
        if not strict and not _has_file_fields(info):
            continue
        rel = getattr(info, "relative_path", None)
        known = stats.get(rel) if type(rel) is str else None
        if known is None:
            file, offset, length, st = _storage_stat(where, key, info, what=what)
            stats[str(rel)] = (file, st)
        else:
            file, st = known
            offset, length = getattr(info, "offset", -1), getattr(info, "length", -1)
            if (
                type(offset) is not int
                or type(length) is not int
                or offset < 0
                or length < 0
                or offset + length > st.st_size
            ):
                raise CheckpointReadError(
                    f"{where}: the storage entry of {key!r} ({what}) reaches past the end of "
                    f"{rel!r}; corrupt or crafted",
                    path=where,
                )
        out[key] = (file, offset, length)
        by_file.setdefault((st.st_dev, st.st_ino), []).append((offset, length, key))
    for ranges in by_file.values():
        ranges.sort()
        for (o1, n1, k1), (o2, _n2, k2) in itertools.pairwise(ranges):
            if o1 + n1 > o2 and n1:
                raise CheckpointReadError(
                    f"{where}: the storage entries of {k1!r} and {k2!r} ({what}) overlap (bytes "
                    f"{o2}..{min(o1 + n1, o2 + _n2)} of one data file): corrupt, crafted, or "
                    "written in DCP's safetensors format, which DCP's own FileSystemReader "
                    "cannot load either (nothing was read)",
                    path=where,
                )
    return out


def _read_params(
    where: str, metadata: Any, keys: list[str], *, trusted: Trust, storage_reader: Any
) -> dict[str, Any]:
    """The (small) ``param_groups.<i>.params`` bytes entries, each region read once.

    Their storage entries are checked first: inside the checkpoint directory, none
    larger than :data:`_MAX_BYTES_ENTRY`, and no two overlapping, so the bytes read
    (and unpickled) are at most the bytes on disk.
    """
    if not keys:
        return {}
    what = "the group membership of a nested optimizer"
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    wanted = set(keys)
    infos = {
        fqn: info
        for index, info in storage.items()
        if (fqn := getattr(index, "fqn", None)) in wanted
    }
    for key in keys:
        info = infos.get(key)
        if info is None:
            raise CheckpointReadError(
                f"{where}: {key!r} has no storage entry in .metadata", path=where
            )
        if getattr(info, "transform_descriptors", None):
            raise CheckpointReadError(
                f"{where}: {key!r} is stored with transforms {info.transform_descriptors}; "
                "read it with load_checkpoint()",
                path=where,
            )
        length = getattr(info, "length", None)
        if type(length) is int and length > _MAX_BYTES_ENTRY:
            raise CheckpointReadError(
                f"{where}: the storage entry of {key!r} ({what}) is {length} bytes, more than "
                f"the {_MAX_BYTES_ENTRY} a list of parameter ids takes; corrupt or crafted",
                path=where,
            )
    local = os.path.isdir(where)
    pairs = [(k, infos[k]) for k in keys]
    strict = storage_reader is None
    regions = _check_regions(where, pairs, what=what, strict=strict) if local else {}
    if storage_reader is not None:
        return _read_bytes_through(where, metadata, keys, storage_reader, trusted=trusted)
    out: dict[str, Any] = {}
    for key in keys:
        file, offset, length = regions[key]
        out[key] = _load_bytes_entry(
            where,
            key,
            io.BytesIO(_read_region(where, key, file, offset, length, what)),
            trusted=trusted,
        )
    return out


def _read_region(where: str, key: str, file: str, offset: int, length: int, what: str) -> bytes:
    try:
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise CheckpointReadError(f"{where}: {key!r}: not a regular file", path=where)
            f.seek(offset)
            return f.read(length)
    except OSError as err:
        if isinstance(err, CheckpointReadError):
            raise
        raise CheckpointReadError(
            f"{where}: cannot read {key!r} ({what}): {_reason(err)}", path=where
        ) from err


def _read_bytes_through(
    where: str, metadata: Any, keys: list[str], storage_reader: Any, *, trusted: Trust
) -> dict[str, Any]:
    """Bytes entries read by the caller's storage reader (``dcp.load`` of those keys only)."""
    target: dict[str, Any] = dict.fromkeys(keys)
    dcp_load_into(
        where,
        target,
        metadata,
        trusted=trusted,
        allow_partial_load=False,
        no_dist=True,
        storage_reader=storage_reader,
        flat=True,
        checked=True,  # the entries it reads (these keys only) were checked by the caller
    )
    return target


def _check_storage(where: str, metadata: Any, *, strict: bool = True) -> None:
    """Every storage entry names a file inside ``where``, within its size, none overlapping.

    See :func:`_check_regions`. DCP's own reader trusts ``relative_path``, ``offset``
    and ``length``; this runs before a directory is handed to it.
    """
    storage = metadata.storage_data
    if storage is None:
        return
    if not isinstance(storage, dict):
        raise CheckpointReadError(f"{where}: storage_data is not a dict", path=where)
    entries = [(str(getattr(index, "fqn", "?")), info) for index, info in storage.items()]
    try:
        _check_regions(where, entries, what="tensor or bytes data", strict=strict)
    except CheckpointReadError as err:
        text = str(err).removeprefix(f"{where}: ")
        raise CheckpointReadError(
            f"{where}: DCP load failed before reading any data: {text}", path=where
        ) from None


def _load_bytes_entry(where: str, key: str, data: io.BytesIO, *, trusted: Trust) -> Any:
    try:
        with allowing(trusted):
            return torch.load(data, weights_only=trusted is not True, map_location="cpu")
    except DSDMergeError:
        raise
    except Exception as err:
        wrapped = load_error(f"{where} (entry {key!r})", err, trusted=trusted)
        wrapped.path = where
        raise wrapped from err


def dcp_load_whole(where: str, *, trusted: Trust, storage_reader: Any = None) -> dict[str, Any]:
    """Every key of a DCP directory, in this process, nested as its ``planner_data`` records.

    Tensors are plain CPU tensors of the global shape, allocated only after every storage
    entry, claimed size and path was checked; then :func:`dcp_load_into` fills them.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_torch_metadata(where, trusted=trusted, storage_reader=storage_reader)
    if os.path.isdir(where):
        _check_storage(where, metadata, strict=storage_reader is None)
    _check_claimed_bytes(where, metadata)
    paths = _dcp_paths(metadata)
    if trusted is not True:
        _check_nesting_cost(where, paths)
    if max(map(len, paths.values()), default=0) > _MAX_LOAD_DEPTH:
        raise CheckpointReadError(
            f"{where}: {_METADATA_FILE} records values nested more than {_MAX_LOAD_DEPTH} deep, "
            "deeper than DCP's own loader (which recurses per level) reads; corrupt or crafted",
            path=where,
        )

    def make(key: str, path: tuple[Any, ...], md: Any) -> Any:
        if isinstance(md, TensorStorageMetadata):
            return torch.empty(tuple(md.size), dtype=md.properties.dtype)
        return md  # replaced by the loaded value, as torch's own empty-dict planner does

    root = _rebuild(where, metadata, make, budget=_metadata_size(where, trusted))
    dcp_load_into(
        where,
        root,
        metadata,
        trusted=trusted,
        allow_partial_load=False,
        no_dist=True,
        storage_reader=storage_reader,
        checked=True,
    )
    return root


_MAX_LOAD_DEPTH: Final = 256
"""The deepest nesting :func:`dcp_load_whole` hands to DCP's (recursive) loader."""

_MAX_EXPANSION: Final = 64
"""How much larger than their stored bytes transformed (compressed) tensors may claim to be."""


def _check_claimed_bytes(where: str, metadata: Any) -> None:
    """Refuse to allocate tensors larger than the data files could hold.

    With overlapping entries refused (:func:`_check_regions`), the stored lengths add up
    to at most the bytes on disk.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    claimed = 0
    for md in metadata.state_dict_metadata.values():
        if isinstance(md, TensorStorageMetadata):
            claimed += meta_nbytes(TensorMeta(tuple(md.size), md.properties.dtype))
    if not claimed:
        return
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    stored = sum(
        n for info in storage.values() if type(n := getattr(info, "length", 0)) is int and n > 0
    )
    transformed = any(getattr(info, "transform_descriptors", None) for info in storage.values())
    limit = stored * (_MAX_EXPANSION if transformed else 1)
    if claimed > limit:
        raise CheckpointReadError(
            f"{where}: {_METADATA_FILE} claims {claimed} bytes of tensors, but its data files "
            f"hold {stored}; corrupt or crafted (nothing was allocated)",
            path=where,
        )


def dcp_load_into(
    where: str,
    state_dict: dict[str, Any],
    metadata: Any,
    *,
    trusted: Trust,
    allow_partial_load: bool,
    no_dist: bool,
    process_group: Any = None,
    storage_reader: Any = None,
    flat: bool = False,
    checked: bool = False,
) -> list[tuple[Any, ...]]:
    """``dcp.load`` into ``state_dict`` with the already (safely) read ``metadata``.

    Bytes entries load with ``weights_only=not trusted``. Every storage entry is first
    checked to name a regular file inside ``where`` and bytes within it, none
    overlapping (DCP's reader trusts them). Returns the paths of the entries of
    ``state_dict`` that the checkpoint lacks (skipped under ``allow_partial_load``).
    ``storage_reader``: the caller's DCP ``StorageReader`` reads the data (its
    ``read_metadata`` is not called: it gets ``metadata``); ``flat``: ``state_dict`` is
    keyed by DCP's own keys; ``checked``: the storage entries were just checked.
    """
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    trusted = check_trust(trusted)
    reader = _safe_reader(where, metadata, storage_reader)

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            loaded = _load_bytes_entry(where, fqn, value, trusted=trusted)
            if self.flatten_state_dict:
                _set_element(self.original_state_dict, tuple(self.mappings[fqn]), loaded)
            else:  # the planner's own state_dict may be a copy (flatten_sharded_tensors)
                self.original_state_dict[fqn] = self.state_dict[fqn] = loaded

    if os.path.isdir(where) and not checked:
        _check_storage(where, metadata, strict=storage_reader is None)
    planner = Planner(allow_partial_load=allow_partial_load, flatten_state_dict=not flat)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*intent is to load in a single process")
            _torch_api.dcp_load(
                state_dict,
                storage_reader=reader,
                planner=planner,
                process_group=process_group,
                no_dist=no_dist,
            )
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - reported with the path
        cause = _unwrap(err)
        if isinstance(cause, CheckpointReadError):
            raise cause from None
        raise CheckpointReadError(
            f"{where}: DCP load failed (missing or corrupt data files, or a state dict that "
            f"does not fit the checkpoint?): {_reason(cause)}",
            path=where,
        ) from cause
    present = metadata.state_dict_metadata
    mappings = getattr(planner, "mappings", None) or {}
    return [tuple(path) for key, path in mappings.items() if key not in present]


def _safe_reader(where: str, metadata: Any, storage_reader: Any) -> Any:
    """A ``StorageReader`` whose ``read_metadata`` returns the safely read ``metadata``.

    Without ``storage_reader``: DCP's ``FileSystemReader`` on ``where``. With one: a
    wrapper that hands every call but ``read_metadata`` to it, so its own reading of the
    data (remote storage, its own file format) is used, never its unpickling of
    ``.metadata``.
    """
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.storage import StorageReader

    def give(load_id: Any) -> Any:
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = load_id
        return metadata

    if storage_reader is None:

        class Reader(FileSystemReader):
            def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
                return give(self.load_id)

        return Reader(where)
    if not isinstance(storage_reader, StorageReader):
        raise InvalidPolicyError(
            f"storage_reader must be a torch.distributed.checkpoint.StorageReader, got "
            f"{type(storage_reader).__name__}"
        )
    inner = storage_reader

    class Wrapped(StorageReader):
        def __init__(self) -> None:
            pass

        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

        def reset(self, checkpoint_id: Any = None) -> None:
            inner.reset(checkpoint_id)

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return bool(type(inner).validate_checkpoint_id(checkpoint_id))

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return give(getattr(inner, "load_id", None))

        def set_up_storage_reader(
            self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any
        ) -> None:
            # DCP passes rank= and use_collectives= only to readers whose method takes
            # **kwargs (it inspects the signature); the wrapped reader's own may not
            import inspect

            takes = "kwargs" in inspect.signature(inner.set_up_storage_reader).parameters
            inner.set_up_storage_reader(
                metadata, is_coordinator, *args, **(kwargs if takes else {})
            )

        def prepare_local_plan(self, plan: Any) -> Any:
            return inner.prepare_local_plan(plan)

        def prepare_global_plan(self, plans: Any) -> Any:
            return inner.prepare_global_plan(plans)

        def read_data(self, plan: Any, planner: Any) -> Any:
            return inner.read_data(plan, planner)

    return Wrapped()


def _unwrap(err: BaseException) -> BaseException:
    """The first rank's exception inside a DCP ``CheckpointException`` (``err`` otherwise)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict):
        for pair in failures.values():
            if isinstance(pair, tuple) and pair and isinstance(pair[0], BaseException):
                return pair[0]
    return err
