"""Reading checkpoints safely: metadata-only views and full loads, without running pickled code.

Four formats are understood:

* ``"dcp"``: a ``torch.distributed.checkpoint`` directory (it holds a
  ``.metadata`` file);
* ``"torch"``: a ``torch.save`` file (``.pt``, ``.pth``, ``.bin``, or any file
  that is a torch zip archive or a pickle);
* ``"safetensors"``: a ``.safetensors`` file;
* ``"hf"``: a Hugging Face model directory (``save_pretrained``: ``model.safetensors``,
  or shards listed by ``model.safetensors.index.json``), or that index file
  (see :mod:`dsdmerge.integrations._files`, which reads them without torch).

:func:`read_metadata` returns a :class:`CheckpointView`, a read-only flat
mapping of every key (spelled as :func:`dsdmerge.flatten` spells the loaded
checkpoint) to a :class:`~dsdmerge.TensorMeta`, without reading tensor data, so
a trainer can :func:`dsdmerge.diff` or :func:`dsdmerge.check` a checkpoint
against its model before loading anything. :func:`load_checkpoint` loads the
whole state dict.

Nothing here runs code from a checkpoint unless asked to with ``trusted=True``:

* torch files go through ``torch.load(weights_only=True)``; ``trusted=[...]`` adds
  the named globals to its allow-list (``torch.serialization.safe_globals``);
* a DCP ``.metadata`` file goes through :mod:`dsdmerge.integrations._dcp_metadata`,
  a restricted and bounded unpickler that admits only DCP's metadata classes,
  ``torch.Size``, dtypes, layouts, memory formats and paths, never lets the pickle
  touch a real class or function, and validates every field (torch's own
  ``FileSystemReader.read_metadata`` unpickles it without restriction);
* DCP bytes entries (non-tensor values) go through ``torch.load(weights_only=True)``
  (torch's ``DefaultLoadPlanner`` uses ``weights_only=False``), read only from
  regular files inside the checkpoint directory, within their size;
* safetensors headers are read and validated by the ``safetensors`` library.

Anything outside those allow-lists raises :class:`~dsdmerge.UnsafeCheckpointError`
before it runs, naming what it needed; anything malformed raises
:class:`~dsdmerge.CheckpointReadError`. No other exception leaves these readers.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import io
import itertools
import math
import operator
import os
import pickle
import re
import stat
import warnings
from collections.abc import ItemsView, Iterator, KeysView, Mapping, Sequence, ValuesView
from typing import Any, ClassVar, Final

import torch

from dsdmerge import _torch_api
from dsdmerge._gc import gc_paused
from dsdmerge._paths import part_of, select_flat, top_level
from dsdmerge.diff import TensorMeta, dtype_name
from dsdmerge.errors import (
    CheckpointReadError,
    DSDMergeError,
    InvalidPolicyError,
    LayoutError,
    UnsafeCheckpointError,
)
from dsdmerge.flatten import flatten
from dsdmerge.integrations._files import (
    DTYPES,
    METADATA_FILE,
    ZIP_MAGIC,
    CheckpointFormat,
    HFLayout,
    detect_format,
    hf_header,
    hf_layout,
    read_regular,
    safetensors_header,
)
from dsdmerge.integrations._files import reading as _reading
from dsdmerge.integrations._files import reason as _reason
from dsdmerge.layout import Layout, classify

__all__ = [
    "CheckpointFormat",
    "CheckpointView",
    "Trust",
    "detect_format",
    "load_checkpoint",
    "read_metadata",
]

_ZIP_MAGIC: Final = ZIP_MAGIC
_METADATA_FILE: Final = METADATA_FILE
_TRUST_HINT: Final = (
    "Pass trusted=True only if you trust where this checkpoint came from (it runs the pickle)"
)


class _Unread:
    """The type of :attr:`CheckpointView.UNREAD`: a non-tensor value that was not read."""

    __slots__ = ()
    __dsdmerge_unread__: ClassVar[bool] = True  # dsdmerge.diff never compares it as a value
    _instance: ClassVar[_Unread | None] = None

    def __new__(cls) -> _Unread:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "<not read>"

    def __reduce__(self) -> str:
        return "UNREAD"


UNREAD: Final = _Unread()


# --------------------------------------------------------------------------------------
# the view


class CheckpointView(Mapping[str, Any]):
    """A read-only, flat, metadata-only view of a checkpoint.

    Maps every flat key (as :func:`dsdmerge.flatten` spells the loaded
    checkpoint) to a :class:`~dsdmerge.TensorMeta` for tensors. Non-tensor
    values are the values themselves for torch files (``torch.load`` had to
    read them anyway) and :attr:`UNREAD`, one shared placeholder object, for DCP
    bytes entries, whose values live in the data files. Pass it as the
    ``checkpoint`` (or ``reference``) of :func:`dsdmerge.diff` or
    :func:`dsdmerge.check`.

    Attributes:
        path: The checkpoint path, as a string.
        format: ``"dcp"``, ``"torch"`` or ``"safetensors"``.
        tensor_count: How many tensors the checkpoint holds.
        nbytes: Their total size in bytes, per the metadata: global sizes for
            sharded DCP tensors and for DTensors in a per-rank torch file (what
            the tensors describe, not what this file stores); views sharing a
            storage count once per view.
        dtypes: ``{dtype name: number of tensors}``, e.g. ``{"float32": 10}``.
        layout: The :class:`~dsdmerge.Layout` the checkpoint was saved in (the
            view itself is always flat): nested for a torch file holding
            ``optimizer.state_dict()`` or ``{"model": ..., "optim": ...}``, or a
            DCP directory of nested state; flat for safetensors.
        metadata: The file's own string metadata: a safetensors header's
            ``__metadata__`` (e.g. ``{"format": "pt", "step": "1000"}``); empty for
            other formats. A new dict each time.
        UNREAD: The placeholder for DCP non-tensor values (identical everywhere,
            so two of them always compare equal).

    Examples:
        >>> import tempfile, torch, dsdmerge as dm
        >>> from dsdmerge.integrations import read_metadata
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     torch.save({"w": torch.zeros(2, 3), "epoch": 4}, f"{tmp}/ckpt.pt")
        ...     view = read_metadata(f"{tmp}/ckpt.pt")
        >>> dict(view), view.format, view.nbytes
        ({'w': TensorMeta(shape=(2, 3), dtype=torch.float32), 'epoch': 4}, 'torch', 24)
        >>> view.layout
        <Layout.FLAT: 'flat'>
    """

    __slots__ = (
        "_dtypes",
        "_entries",
        "_format",
        "_layout",
        "_metadata",
        "_nbytes",
        "_path",
        "_tensor_count",
    )

    UNREAD: ClassVar[Any] = UNREAD

    def __init__(
        self,
        entries: dict[str, Any],
        *,
        path: str,
        format: CheckpointFormat,
        layout: Layout = Layout.FLAT,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        self._entries = entries
        self._metadata = dict(metadata or {})
        self._path = path
        self._format: CheckpointFormat = format
        self._layout = layout
        values = entries.values()
        metas = [v for v in values if type(v) is TensorMeta]  # the common case, in C
        for value in values:
            if type(value) in (list, tuple):
                metas.extend(tensor_metas(value))
        # column by column (a Python statement per tensor costs a tenth of a second at
        # DeepSeek-V3 scale): element counts, then each distinct dtype's item size once
        dtype_of = list(map(operator.attrgetter("dtype"), metas))
        numels = map(math.prod, map(operator.attrgetter("shape"), metas))
        by_dtype = collections.Counter(dtype_of)
        sizes = {d: _itemsize(d) for d in by_dtype}
        self._tensor_count = len(metas)
        self._nbytes: int = sum(map(operator.mul, numels, map(sizes.__getitem__, dtype_of)))
        dtypes: dict[str, int] = {}
        for dtype, n in by_dtype.items():
            name = dtype_name(dtype)
            dtypes[name] = dtypes.get(name, 0) + n
        self._dtypes = dict(sorted(dtypes.items()))

    @property
    def path(self) -> str:
        """The checkpoint path."""
        return self._path

    @property
    def format(self) -> CheckpointFormat:
        """``"dcp"``, ``"torch"`` or ``"safetensors"``."""
        return self._format

    @property
    def layout(self) -> Layout:
        """The layout the checkpoint was saved in (the view itself is flat)."""
        return self._layout

    @property
    def metadata(self) -> dict[str, str]:
        """The file's string metadata (safetensors ``__metadata__``), a new dict each time."""
        return dict(self._metadata)

    @property
    def tensor_count(self) -> int:
        """How many tensors the checkpoint holds."""
        return self._tensor_count

    @property
    def nbytes(self) -> int:
        """Total tensor bytes, per the metadata."""
        return self._nbytes

    @property
    def dtypes(self) -> dict[str, int]:
        """``{dtype name: number of tensors}``, sorted by name (a new dict each time)."""
        return dict(self._dtypes)

    def __getitem__(self, key: str) -> Any:
        return self._entries[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def keys(self) -> KeysView[str]:
        """The flat keys, in checkpoint order."""
        return self._entries.keys()

    def values(self) -> ValuesView[Any]:
        """The values (``TensorMeta`` for tensors)."""
        return self._entries.values()

    def items(self) -> ItemsView[str, Any]:
        """``(flat key, value)`` pairs."""
        return self._entries.items()

    def __repr__(self) -> str:
        return (
            f"CheckpointView({self._path!r}, format={self._format!r}, {len(self)} keys, "
            f"{self._tensor_count} tensors, {self._nbytes} bytes)"
        )


def tensor_metas(value: Any) -> Iterator[TensorMeta]:
    """The TensorMetas in ``value`` and in the lists and tuples it holds, at any depth.

    Iterative and cycle-safe: a crafted torch file can hold a 50,000-deep or cyclic list.
    """
    stack = [value]
    seen: set[int] = set()
    while stack:
        item = stack.pop()
        if type(item) is TensorMeta:
            yield item
        elif type(item) in (list, tuple) and id(item) not in seen:
            seen.add(id(item))
            stack.extend(reversed(item))


def _itemsize(dtype: Any) -> int:
    itemsize = getattr(dtype, "itemsize", None)
    return int(itemsize) if isinstance(itemsize, int) else 0


def meta_nbytes(meta: TensorMeta) -> int:
    """The bytes a tensor of this shape and dtype takes (0 for a dtype without an itemsize)."""
    numel = math.prod(meta.shape)
    itemsize = getattr(meta.dtype, "itemsize", None)
    return numel * itemsize if isinstance(itemsize, int) else 0


# --------------------------------------------------------------------------------------
# formats


def read_metadata(
    path: str | os.PathLike[str],
    /,
    *,
    trusted: Trust = False,
    key: str | None = None,
    storage_reader: Any = None,
) -> CheckpointView:
    """Read a checkpoint's keys, shapes and dtypes without reading tensor data.

    * DCP directory: the ``.metadata`` file only, through a restricted unpickler
      (see the module docstring); the nesting DCP recorded in it is rebuilt and
      flattened as :func:`dsdmerge.flatten` would flatten the loaded checkpoint.
      The one exception: a *nested* optimizer state dict saved through DCP keeps
      its group membership only in its ``param_groups.<i>.params`` bytes entries,
      so those small lists are read (safely) from the data files; flattened
      optimizer state dicts need nothing but ``.metadata``.
    * torch file: ``torch.load(weights_only=True, mmap=True, map_location="meta")``,
      which reads the pickle but no tensor storage (files saved with
      ``_use_new_zipfile_serialization=False`` cannot be memory-mapped and are
      read whole).
    * safetensors file: the header, read and validated by the ``safetensors``
      library (``safe_open``); its ``__metadata__`` is the view's ``metadata``.

    * Hugging Face model directory (``save_pretrained``: ``model.safetensors``, or
      shards and ``model.safetensors.index.json``; or the index file itself): every
      shard's header, checked against the index (each key in the shard the index
      says, and in no other); the index's ``"metadata"`` and the first shard's
      ``__metadata__`` are the view's ``metadata``.

    Does not modify the checkpoint.

    Args:
        path: The checkpoint file or directory.
        trusted: ``False`` (default): nothing outside the allow-lists loads.
            A list of ``"module.Name"`` globals: those too, in torch files and DCP
            bytes entries (torch's ``safe_globals``), and the classes among them as
            storage entries of a DCP ``.metadata`` (another writer's ``_StorageInfo``,
            built without running its code). ``True``: unpickle without restriction
            (runs any code the pickle holds); only for checkpoints whose origin you trust.
        key: A dot-separated path to one part of a whole checkpoint (``"model"``,
            ``"optim"``, ``"optim.state"``): the view is of that part only, keyed
            as :func:`dsdmerge.flatten` of the part would be.
        storage_reader: A DCP ``StorageReader`` for a directory written by another
            storage writer (OLMo-core's ``RemoteFileSystemReader``): it reads the
            ``param_groups`` entries a nested optimizer needs; ``.metadata`` is still
            read by the safe reader when ``path`` holds one (with ``trusted=True`` and
            no local ``.metadata``, by the reader's own ``read_metadata()``).

    Returns:
        A :class:`CheckpointView`.

    Raises:
        CheckpointReadError: The path is missing, corrupt, truncated or of an
            unknown format.
        UnsafeCheckpointError: A pickle references something outside the
            allow-list (nothing in it has run).
        LayoutError: Nothing is at ``key`` (the message lists what is there).

    Examples:
        >>> import tempfile, torch, dsdmerge as dm
        >>> from dsdmerge.integrations import read_metadata
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     torch.save({"model": {"w": torch.zeros(2)}, "step": 3}, f"{tmp}/ckpt.pt")
        ...     view = read_metadata(f"{tmp}/ckpt.pt", key="model")
        >>> dm.diff(view, {"w": torch.zeros(2), "head": torch.zeros(3)}).missing
        ('head',)
    """
    trust = _check_trust(trusted)
    where = str(path)
    with _reading(where):
        fmt = "dcp" if storage_reader is not None else detect_format(path)
        if fmt == "dcp":
            view, metadata = read_dcp_metadata(where, trusted=trust, storage_reader=storage_reader)
            if key is None:
                return view
            return CheckpointView(
                select_flat(view, key),
                path=where,
                format=fmt,
                layout=_dcp_part_layout(metadata, key),
            )
        if fmt == "torch":
            entries, layout = _torch_entries(where, trusted=trust, key=key)
            return CheckpointView(entries, path=where, format=fmt, layout=layout)
        if fmt == "hf":
            hf_entries, metadata, _shards = hf_header(hf_layout(where), where=where)
            st_entries = {k: TensorMeta(s, _torch_dtype(c)) for k, (s, c) in hf_entries.items()}
        else:
            st_entries, metadata = _safetensors_header(where)
        if key is not None:
            st_entries = select_flat(st_entries, key)
        return CheckpointView(st_entries, path=where, format=fmt, metadata=metadata)


def _dcp_part_layout(metadata: Any, key: str) -> Layout:
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


def read_dcp_metadata(
    where: str, *, trusted: Trust, storage_reader: Any = None
) -> tuple[CheckpointView, Any]:
    """The view of a DCP directory and its (safely unpickled) ``Metadata`` object."""
    trusted = _check_trust(trusted)
    if storage_reader is None and detect_format(where) != "dcp":
        raise CheckpointReadError(f"{where}: not a DCP checkpoint directory", path=where)
    # the collector is paused for the view too: with millions of records just made, each
    # of its passes would walk them all (reads in several threads share one pause)
    with _reading(where), gc_paused():
        metadata = _read_dcp_metadata(where, trusted=trusted, storage_reader=storage_reader)
        entries = _dcp_entries(where, metadata, trusted=trusted, storage_reader=storage_reader)
        # DCP records each saved value's path in the state dict: nested when one has two parts
        paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
        nested = any(isinstance(p, (list, tuple)) and len(p) > 1 for p in paths.values())
        layout = Layout.NESTED if nested else Layout.FLAT
        return CheckpointView(entries, path=where, format="dcp", layout=layout), metadata


def load_checkpoint(
    path: str | os.PathLike[str],
    /,
    *,
    trusted: Trust = False,
    key: str | None = None,
    storage_reader: Any = None,
) -> dict[str, Any]:
    """Load a whole checkpoint, tensors included, without running pickled code.

    * torch file: ``torch.load(weights_only=True, mmap=True, map_location="cpu")``
      (tensors are memory-mapped, read on first use).
    * safetensors file: ``safetensors.torch.load_file`` (needs the
      ``safetensors`` extra).
    * DCP directory: every key, in this process only (no collectives even when
      ``torch.distributed`` is initialised), through ``dcp.load`` with a reader
      whose ``.metadata`` goes through the restricted unpickler and a planner
      that loads bytes entries with ``weights_only=True``. The nesting is
      rebuilt from the metadata's ``planner_data`` (dicts, and lists such as
      ``param_groups``); tensors are plain CPU tensors of the global shape, not
      DTensors; a checkpoint written by a planner that recorded no nesting
      comes back flat, keyed as in its metadata.
    * Hugging Face model directory (or its index file): every shard, after the
      index was checked against the shards' headers; one flat dict.

    Args:
        path: The checkpoint file or directory.
        trusted: ``False`` (default): nothing outside the allow-lists loads.
            A list of ``"module.Name"`` globals: those too, in torch files and DCP
            bytes entries (torch's ``safe_globals``), and the classes among them as
            storage entries of a DCP ``.metadata`` (another writer's ``_StorageInfo``,
            built without running its code). ``True``: unpickle without restriction
            (runs any code the pickle holds); only for checkpoints whose origin you trust.
        key: A dot-separated path to one part of a whole checkpoint
            (``"model"``, ``"optim"``): only that part is returned (the whole file
            is still read).
        storage_reader: A DCP ``StorageReader`` that reads the data of a directory
            written by another storage writer (OLMo-core's ``RemoteFileSystemReader``,
            whose data files hold ``torch.save`` archives): every entry is still
            checked first (inside ``path``, within its file, none overlapping), and
            ``.metadata`` is read as without it. What the reader does with the data is
            its own (OLMo-core's unpickles tensors with ``weights_only=False``).

    Returns:
        The state dict, nested as saved.

    Raises:
        CheckpointReadError: The path is missing, corrupt, truncated or of an
            unknown format, or ``safetensors`` is not installed for a
            safetensors file.
        UnsafeCheckpointError: A pickle references something outside the
            allow-list (nothing in it has run).

    Examples:
        >>> import tempfile, torch
        >>> from dsdmerge.integrations import load_checkpoint
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     torch.save({"model": {"w": torch.ones(2)}, "step": 7}, f"{tmp}/ckpt.pt")
        ...     sd = load_checkpoint(f"{tmp}/ckpt.pt")
        ...     sd["model"]["w"].tolist(), sd["step"]
        ([1.0, 1.0], 7)
    """
    trust = _check_trust(trusted)
    where = str(path)
    with _reading(where):
        fmt = "dcp" if storage_reader is not None else detect_format(path)
        if fmt == "dcp":
            loaded = _dcp_load(where, trusted=trust, storage_reader=storage_reader)
        elif fmt == "torch":
            loaded = _torch_load(where, trusted=trust, map_location="cpu")
            if not isinstance(loaded, dict):
                raise CheckpointReadError(
                    f"{where}: holds a {type(loaded).__name__}, not a state dict", path=where
                )
        elif fmt == "hf":
            loaded = _hf_load(where)
        else:
            loaded = _safetensors_load(where)
        return loaded if key is None else state_dict_part(where, loaded, key)


def state_dict_part(where: str, loaded: Mapping[Any, Any], key: str) -> Any:
    """The state dict at key path ``key`` of ``loaded`` (``where`` names the file in errors)."""
    part = part_of(loaded, key)
    if not isinstance(part, dict):
        raise LayoutError(
            f"{where}: key path {key!r} holds a value ({type(part).__name__}), not a state dict; "
            f"name a part such as {top_level(loaded)}"
        )
    return part


# --------------------------------------------------------------------------------------
# torch files

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


def _check_trust(trusted: Any) -> Trust:
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
        _resolve_global(name)
    return tuple(names)


def _resolve_global(name: str) -> Any:
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
def _allowing(trusted: Trust) -> Iterator[None]:
    """``torch.serialization.safe_globals`` for a list of globals; nothing otherwise.

    torch keeps that allow-list in a module global, so loads with extra globals are
    serialized (:func:`dsdmerge._torch_api.safe_globals`: other threads' ``torch.load``
    calls would see them meanwhile).
    """
    if isinstance(trusted, bool) or not trusted:
        yield
        return
    objects = [_resolve_global(name) for name in trusted]
    with _torch_api.safe_globals(objects):
        yield


def _torch_load(where: str, *, trusted: Trust, map_location: str) -> Any:
    _import_dtensor()
    try:
        return _torch_load_file(where, trusted=trusted, map_location=map_location, mmap=True)
    except _MmapUnsupported:
        pass
    # a legacy (non-zip) torch.save file: cannot be memory-mapped, so it is read whole
    return _torch_load_file(where, trusted=trusted, map_location=map_location, mmap=False)


class _MmapUnsupported(Exception):
    pass


def _torch_load_file(where: str, *, trusted: Trust, map_location: str, mmap: bool) -> Any:
    try:
        with _allowing(trusted), warnings.catch_warnings():
            # torch's note that a pickle protocol other than 2 "might not be supported": the
            # file is then either read faithfully or refused with a reason, so it says nothing
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(
                where, weights_only=trusted is not True, mmap=mmap, map_location=map_location
            )
    except RecursionError as err:
        raise CheckpointReadError(
            f"{where}: not a readable torch checkpoint: nested too deeply to load", path=where
        ) from err
    except RuntimeError as err:
        if mmap and "mmap can only be used" in str(err):
            raise _MmapUnsupported from None
        raise _torch_error(where, err, trusted=trusted, file=where) from err
    except Exception as err:  # anything else a corrupt file makes torch raise
        raise _torch_error(where, err, trusted=trusted, file=where) from err


def _torch_error(
    where: str, err: BaseException, *, trusted: Trust, file: str | None = None
) -> CheckpointReadError:
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
        with _allowing(trusted):
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


def _import_dtensor() -> None:
    """Import ``torch.distributed.tensor``: ``weights_only`` loads admit DTensors only then."""
    with contextlib.suppress(ImportError):  # a torch built without distributed support
        import torch.distributed.tensor  # noqa: F401


def _torch_entries(
    where: str, *, trusted: Trust, key: str | None = None
) -> tuple[dict[str, Any], Layout]:
    loaded = _torch_load(where, trusted=trusted, map_location="meta")
    if not isinstance(loaded, Mapping):
        raise CheckpointReadError(
            f"{where}: holds a {type(loaded).__name__}, not a state dict", path=where
        )
    if key is not None:
        loaded = state_dict_part(where, loaded, key)
    entries = {key: _to_meta(value) for key, value in flatten(loaded).items()}
    return entries, classify(loaded)


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return TensorMeta.of(value)
    if type(value) in (list, tuple) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_to_meta(v) for v in value)
    return value


# --------------------------------------------------------------------------------------
# safetensors


def _torch_dtype(code: str) -> Any:
    """The torch dtype of a safetensors dtype code (the code itself when torch lacks it)."""
    name = DTYPES.get(code, ("", 0))[0]
    dtype = getattr(torch, name, None) if name else None
    return dtype if isinstance(dtype, torch.dtype) else code


def _safetensors_header(where: str) -> tuple[dict[str, Any], dict[str, str]]:
    """Keys as :class:`TensorMeta`, and ``__metadata__``, read by the ``safetensors`` library."""
    entries, metadata = safetensors_header(where)
    return {k: TensorMeta(shape, _torch_dtype(code)) for k, (shape, code) in entries.items()}, (
        metadata
    )


def _safetensors_load(where: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    _safetensors_header(where)  # a clear error for a corrupt header
    try:
        return dict(load_file(where, device="cpu"))
    except Exception as err:  # safetensors raises its own error types
        raise CheckpointReadError(
            f"{where}: not a readable safetensors file (corrupt or truncated?): {_reason(err)}",
            path=where,
        ) from err


def _hf_load(where: str) -> dict[str, Any]:
    """Every tensor of a Hugging Face directory, shard by shard (the index checked first)."""
    layout = hf_layout(where)
    hf_header(layout, where=where)  # a clear error for a bad shard or an index that disagrees
    out: dict[str, Any] = {}
    for shard in layout.shards:
        out.update(_safetensors_load(os.path.join(layout.directory, shard)))
    return out


def hf_shards(
    path: str | os.PathLike[str], /
) -> tuple[HFLayout, dict[str, str], dict[str, dict[str, str]]]:
    """A Hugging Face directory's layout, each key's shard and each shard's ``__metadata__``.

    What ``dsdmerge merge`` needs to write a result in the same sharded layout.
    """
    where = str(path)
    with _reading(where):
        layout = hf_layout(where)
        _entries, _metadata, shard_of = hf_header(layout, where=where)
        from safetensors import safe_open

        metadata: dict[str, dict[str, str]] = {}
        for shard in layout.shards:
            with safe_open(os.path.join(layout.directory, shard), framework="numpy") as f:
                metadata[shard] = dict(f.metadata() or {})
        return layout, shard_of, metadata


# --------------------------------------------------------------------------------------
# DCP


def _read_dcp_metadata(where: str, *, trusted: Trust, storage_reader: Any = None) -> Any:
    """``.metadata``, through the safe reader unless ``trusted is True``.

    With a ``storage_reader`` and no local ``.metadata`` (a remote checkpoint), only
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
            obj = _resolve_global(name)
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
"""The largest DCP bytes entry :func:`read_metadata` reads itself (64 MiB)."""


def _storage_file(where: str, key: str, info: Any, *, what: str) -> tuple[str, int, int]:
    """``(file, offset, length)`` of a storage entry, checked to stay inside ``where``.

    The file must be a regular file inside the checkpoint directory once symlinks are
    resolved, and ``offset + length`` within its size.
    """
    file, offset, length, _st = _storage_stat(where, key, info, what=what)
    return file, offset, length


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
    run_dcp_load(
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
        with _allowing(trusted):
            return torch.load(data, weights_only=trusted is not True, map_location="cpu")
    except DSDMergeError:
        raise
    except Exception as err:
        wrapped = _torch_error(f"{where} (entry {key!r})", err, trusted=trusted)
        wrapped.path = where
        raise wrapped from err


def _dcp_load(where: str, *, trusted: Trust, storage_reader: Any = None) -> dict[str, Any]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = _read_dcp_metadata(where, trusted=trusted, storage_reader=storage_reader)
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
    run_dcp_load(
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
"""The deepest nesting :func:`load_checkpoint` hands to DCP's (recursive) loader."""

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


def run_dcp_load(
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

    trusted = _check_trust(trusted)
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
