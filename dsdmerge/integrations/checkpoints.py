"""Reading checkpoints safely: metadata-only views and full loads, without running pickled code.

Three formats are understood:

* ``"dcp"``: a ``torch.distributed.checkpoint`` directory (it holds a
  ``.metadata`` file);
* ``"torch"``: a ``torch.save`` file (``.pt``, ``.pth``, ``.bin``, or any file
  that is a torch zip archive or a pickle);
* ``"safetensors"``: a ``.safetensors`` file.

:func:`read_metadata` returns a :class:`CheckpointView`, a read-only flat
mapping of every key (spelled as :func:`dsdmerge.flatten` spells the loaded
checkpoint) to a :class:`~dsdmerge.TensorMeta`, without reading tensor data, so
a trainer can :func:`dsdmerge.diff` or :func:`dsdmerge.check` a checkpoint
against its model before loading anything. :func:`load_checkpoint` loads the
whole state dict.

Nothing here runs code from a checkpoint unless asked to with ``trusted=True``:

* torch files go through ``torch.load(weights_only=True)``;
* a DCP ``.metadata`` file goes through a restricted unpickler that admits only
  the DCP metadata classes, ``torch.Size``, dtypes, layouts and memory formats,
  and ``pathlib`` paths (torch's own ``FileSystemReader.read_metadata`` unpickles
  it without restriction);
* DCP bytes entries (non-tensor values) go through ``torch.load(weights_only=True)``
  (torch's ``DefaultLoadPlanner`` uses ``weights_only=False``);
* safetensors headers are JSON, parsed here, so :func:`read_metadata` does not
  need the ``safetensors`` package (:func:`load_checkpoint` does: install the
  ``safetensors`` extra).

Anything outside those allow-lists raises :class:`~dsdmerge.UnsafeCheckpointError`
before it runs.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import itertools
import json
import os
import pathlib
import pickle
import re
import struct
import warnings
from collections.abc import ItemsView, Iterator, KeysView, Mapping, ValuesView
from typing import Any, ClassVar, Final, Literal

import torch

from dsdmerge.diff import TensorMeta, dtype_name
from dsdmerge.errors import CheckpointReadError, UnsafeCheckpointError
from dsdmerge.flatten import flatten
from dsdmerge.layout import Layout, classify

__all__ = [
    "CheckpointFormat",
    "CheckpointView",
    "detect_format",
    "load_checkpoint",
    "read_metadata",
]

CheckpointFormat = Literal["dcp", "torch", "safetensors"]
"""The checkpoint formats :func:`detect_format` tells apart."""

_TORCH_SUFFIXES: Final = frozenset({".pt", ".pth", ".bin"})
_ZIP_MAGIC: Final = b"PK\x03\x04"
_METADATA_FILE: Final = ".metadata"
_MAX_SAFETENSORS_HEADER: Final = 100_000_000  # the limit the safetensors library enforces
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
        UNREAD: The placeholder for DCP non-tensor values (identical everywhere,
            so two of them always compare equal).

    Example:
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

    __slots__ = ("_dtypes", "_entries", "_format", "_layout", "_nbytes", "_path", "_tensor_count")

    UNREAD: ClassVar[Any] = UNREAD

    def __init__(
        self,
        entries: dict[str, Any],
        *,
        path: str,
        format: CheckpointFormat,
        layout: Layout = Layout.FLAT,
    ) -> None:
        self._entries = entries
        self._path = path
        self._format: CheckpointFormat = format
        self._layout = layout
        count = 0
        nbytes = 0
        dtypes: dict[str, int] = {}
        for value in entries.values():
            for meta in _metas(value):
                count += 1
                nbytes += _nbytes(meta)
                name = dtype_name(meta.dtype)
                dtypes[name] = dtypes.get(name, 0) + 1
        self._tensor_count = count
        self._nbytes = nbytes
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


def _metas(value: Any) -> Iterator[TensorMeta]:
    if type(value) is TensorMeta:
        yield value
    elif type(value) in (list, tuple):
        for item in value:
            yield from _metas(item)


def _nbytes(meta: TensorMeta) -> int:
    numel = 1
    for n in meta.shape:
        numel *= n
    itemsize = getattr(meta.dtype, "itemsize", None)
    return numel * itemsize if isinstance(itemsize, int) else 0


# --------------------------------------------------------------------------------------
# formats


def detect_format(path: str | os.PathLike[str], /) -> CheckpointFormat:
    """Tell which kind of checkpoint ``path`` is, from its name and first bytes.

    A directory holding a ``.metadata`` file is ``"dcp"``; a ``.safetensors``
    file is ``"safetensors"``; a ``.pt``/``.pth``/``.bin`` file, or any file
    that starts like a torch zip archive or a pickle, is ``"torch"``; a file
    whose first bytes are a safetensors header is ``"safetensors"``. Reads at
    most the first 9 bytes of a file.

    Args:
        path: A file or directory.

    Returns:
        ``"dcp"``, ``"torch"`` or ``"safetensors"``.

    Raises:
        CheckpointReadError: ``path`` does not exist, cannot be read, or is none
            of the three formats.

    Example:
        >>> import tempfile, torch
        >>> from dsdmerge.integrations import detect_format
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     torch.save({"w": torch.zeros(1)}, f"{tmp}/weights")  # no suffix: sniffed
        ...     detect_format(f"{tmp}/weights")
        'torch'
    """
    p = pathlib.Path(path)
    where = str(path)
    try:
        if p.is_dir():
            if (p / _METADATA_FILE).is_file():
                return "dcp"
            raise CheckpointReadError(
                f"{where}: a directory without a {_METADATA_FILE} file is not a DCP checkpoint "
                "(was the save interrupted?)",
                path=where,
            )
        if not p.exists():
            raise CheckpointReadError(f"{where}: no such file or directory", path=where)
        suffix = p.suffix.lower()
        if suffix == ".safetensors":
            return "safetensors"
        if suffix in _TORCH_SUFFIXES:
            return "torch"
        with p.open("rb") as f:
            head = f.read(9)
    except OSError as err:
        if isinstance(err, CheckpointReadError):
            raise
        raise CheckpointReadError(f"{where}: cannot be read: {_reason(err)}", path=where) from err
    if head.startswith(_ZIP_MAGIC) or head[:1] == b"\x80":
        return "torch"
    if len(head) == 9 and head[8:9] == b"{":
        return "safetensors"
    raise CheckpointReadError(
        f"{where}: unknown checkpoint format (not a DCP directory, a torch zip/pickle or "
        "safetensors; name it .pt, .pth, .bin or .safetensors if it is one of them)",
        path=where,
    )


def read_metadata(path: str | os.PathLike[str], /, *, trusted: bool = False) -> CheckpointView:
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
    * safetensors file: the JSON header, parsed here (no ``safetensors`` needed).

    Does not modify the checkpoint.

    Args:
        path: The checkpoint file or directory.
        trusted: Unpickle without restriction (runs any code the pickle holds).
            Only for checkpoints whose origin you trust.

    Returns:
        A :class:`CheckpointView`.

    Raises:
        CheckpointReadError: The path is missing, corrupt, truncated or of an
            unknown format.
        UnsafeCheckpointError: A pickle references something outside the
            allow-list (nothing in it has run).

    Example:
        >>> import tempfile, torch, dsdmerge as dm
        >>> from dsdmerge.integrations import read_metadata
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     torch.save({"w": torch.zeros(2)}, f"{tmp}/ckpt.pt")
        ...     view = read_metadata(f"{tmp}/ckpt.pt")
        >>> dm.diff(view, {"w": torch.zeros(2), "head": torch.zeros(3)}).missing
        ('head',)
    """
    fmt = detect_format(path)
    where = str(path)
    if fmt == "dcp":
        return read_dcp_metadata(where, trusted=trusted)[0]
    if fmt == "torch":
        entries, layout = _torch_entries(where, trusted=trusted)
        return CheckpointView(entries, path=where, format=fmt, layout=layout)
    return CheckpointView(_safetensors_entries(where), path=where, format=fmt)


def read_dcp_metadata(where: str, *, trusted: bool) -> tuple[CheckpointView, Any]:
    """The view of a DCP directory and its (safely unpickled) ``Metadata`` object."""
    if detect_format(where) != "dcp":
        raise CheckpointReadError(f"{where}: not a DCP checkpoint directory", path=where)
    metadata = _read_dcp_metadata(where, trusted=trusted)
    entries = _dcp_entries(where, metadata, trusted=trusted)
    # DCP records each saved value's path in the state dict: nested when one has two parts
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    nested = any(isinstance(p, (list, tuple)) and len(p) > 1 for p in paths.values())
    layout = Layout.NESTED if nested else Layout.FLAT
    return CheckpointView(entries, path=where, format="dcp", layout=layout), metadata


def load_checkpoint(path: str | os.PathLike[str], /, *, trusted: bool = False) -> dict[str, Any]:
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

    Args:
        path: The checkpoint file or directory.
        trusted: Unpickle without restriction (runs any code the pickle holds).
            Only for checkpoints whose origin you trust.

    Returns:
        The state dict, nested as saved.

    Raises:
        CheckpointReadError: The path is missing, corrupt, truncated or of an
            unknown format, or ``safetensors`` is not installed for a
            safetensors file.
        UnsafeCheckpointError: A pickle references something outside the
            allow-list (nothing in it has run).

    Example:
        >>> import tempfile, torch
        >>> from dsdmerge.integrations import load_checkpoint
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     torch.save({"model": {"w": torch.ones(2)}, "step": 7}, f"{tmp}/ckpt.pt")
        ...     sd = load_checkpoint(f"{tmp}/ckpt.pt")
        ...     sd["model"]["w"].tolist(), sd["step"]
        ([1.0, 1.0], 7)
    """
    fmt = detect_format(path)
    where = str(path)
    if fmt == "dcp":
        return _dcp_load(where, trusted=trusted)
    if fmt == "torch":
        loaded = _torch_load(where, trusted=trusted, map_location="cpu")
        if not isinstance(loaded, dict):
            raise CheckpointReadError(
                f"{where}: holds a {type(loaded).__name__}, not a state dict", path=where
            )
        return loaded
    return _safetensors_load(where)


def _reason(err: BaseException | str) -> str:
    """One line describing ``err``."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 300 else text[:297] + "..."


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


def _torch_load(where: str, *, trusted: bool, map_location: str) -> Any:
    _import_dtensor()
    try:
        return _torch_load_file(where, trusted=trusted, map_location=map_location, mmap=True)
    except RuntimeError as err:
        if "mmap can only be used" not in str(err):
            raise _torch_error(where, err) from err
    # a legacy (non-zip) torch.save file: cannot be memory-mapped, so it is read whole
    try:
        return _torch_load_file(where, trusted=trusted, map_location=map_location, mmap=False)
    except RuntimeError as err:
        raise _torch_error(where, err) from err


def _torch_load_file(where: str, *, trusted: bool, map_location: str, mmap: bool) -> Any:
    try:
        return torch.load(where, weights_only=not trusted, mmap=mmap, map_location=map_location)
    except pickle.UnpicklingError as err:
        raise _torch_error(where, err) from err
    except RuntimeError:
        raise
    except Exception as err:  # anything else a corrupt file makes torch raise
        raise _torch_error(where, err) from err


def _torch_error(where: str, err: BaseException) -> CheckpointReadError:
    # torch re-raises the weights-only unpickler's error with advice to load with
    # weights_only=False (wrong advice for a file from elsewhere); the original is the context.
    original = err.__context__ if isinstance(err.__context__, Exception) else err
    text = str(original)
    if isinstance(err, pickle.UnpicklingError) and any(m in text.lower() for m in _UNSAFE_MARKERS):
        found = re.search(r"GLOBAL (\S+)", text)
        what = f"references {found.group(1)}, which is" if found else "holds something"
        return UnsafeCheckpointError(
            f"{where}: refused to load: its pickle {what} outside torch's weights_only "
            f"allow-list, so loading it would run code; nothing was run. {_TRUST_HINT}.",
            path=where,
        )
    return CheckpointReadError(
        f"{where}: not a readable torch checkpoint (corrupt or truncated?): {_reason(original)}",
        path=where,
    )


def _import_dtensor() -> None:
    """Import ``torch.distributed.tensor``: ``weights_only`` loads admit DTensors only then."""
    with contextlib.suppress(ImportError):  # a torch built without distributed support
        import torch.distributed.tensor  # noqa: F401


def _torch_entries(where: str, *, trusted: bool) -> tuple[dict[str, Any], Layout]:
    loaded = _torch_load(where, trusted=trusted, map_location="meta")
    if not isinstance(loaded, Mapping):
        raise CheckpointReadError(
            f"{where}: holds a {type(loaded).__name__}, not a state dict", path=where
        )
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

_SAFETENSORS_DTYPES: Final[dict[str, str]] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "C64": "complex64",
    "C128": "complex128",
}


def _safetensors_entries(where: str) -> dict[str, Any]:
    """Parse the header: 8 bytes little-endian length, then that many bytes of JSON."""

    def bad(problem: str) -> CheckpointReadError:
        return CheckpointReadError(
            f"{where}: not a valid safetensors file (corrupt or truncated?): {problem}", path=where
        )

    try:
        with open(where, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise bad(f"{size} bytes, too short for a header")
            (length,) = struct.unpack("<Q", head)
            if length > _MAX_SAFETENSORS_HEADER or 8 + length > size:
                raise bad(f"header length {length} does not fit the file's {size} bytes")
            raw = f.read(length)
    except OSError as err:
        if isinstance(err, CheckpointReadError):
            raise
        raise CheckpointReadError(f"{where}: cannot be read: {_reason(err)}", path=where) from err
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise bad(f"header is not JSON: {_reason(err)}") from err
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    data_size = size - 8 - length
    entries: dict[str, Any] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_code = info["dtype"]
            shape = tuple(int(n) for n in info["shape"])
            begin, end = (int(n) for n in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as err:
            raise bad(f"entry {name!r} lacks a dtype, shape or data_offsets") from err
        if not 0 <= begin <= end <= data_size or any(n < 0 for n in shape):
            raise bad(f"entry {name!r} points outside the file's {data_size} data bytes")
        torch_name = _SAFETENSORS_DTYPES.get(dtype_code)
        dtype = getattr(torch, torch_name, None) if torch_name else None
        entries[name] = TensorMeta(shape, dtype if isinstance(dtype, torch.dtype) else dtype_code)
    return entries


def _safetensors_load(where: str) -> dict[str, Any]:
    try:
        from safetensors.torch import load_file
    except ImportError as err:
        raise CheckpointReadError(
            f"{where}: loading safetensors tensors needs the safetensors package; "
            "pip install 'dsdmerge[safetensors]' (read_metadata works without it)",
            path=where,
        ) from err
    _safetensors_entries(where)  # a clear error for a corrupt header
    try:
        return dict(load_file(where, device="cpu"))
    except Exception as err:  # safetensors raises its own error types
        raise CheckpointReadError(
            f"{where}: not a readable safetensors file (corrupt or truncated?): {_reason(err)}",
            path=where,
        ) from err


# --------------------------------------------------------------------------------------
# DCP


class _Refused(Exception):
    """Raised inside the restricted unpickler for a global outside the allow-list."""


_PATH_CLASSES: Final = frozenset(
    {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"}
)
_BUILTINS: Final = frozenset({"set", "frozenset", "complex", "slice", "bytearray"})


def _dcp_allowed(module: str, name: str) -> Any:
    """The object ``module.name`` if the DCP metadata allow-list admits it, else ``None``."""
    if module == "torch.distributed.checkpoint.metadata" and name in {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    }:
        from torch.distributed.checkpoint import metadata

        return getattr(metadata, name, None)
    if module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo":
        from torch.distributed.checkpoint import filesystem

        return getattr(filesystem, name, None)
    if module == "torch":
        if name == "Size":
            return torch.Size
        value = torch.__dict__.get(name)
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            return value
        return None
    if module == "torch.serialization" and name == "_get_layout":
        return torch.serialization._get_layout
    if module == "pathlib" and name in _PATH_CLASSES:
        return getattr(pathlib, name)
    if module == "builtins" and name in _BUILTINS:
        return getattr(builtins, name)
    return None


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only what a DCP ``.metadata`` pickle needs; see :func:`_dcp_allowed`."""

    def find_class(self, module: str, name: str) -> Any:
        found = _dcp_allowed(module, name)
        if found is None:
            raise _Refused(f"{module}.{name}")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused(f"persistent id {pid!r}")


def _read_dcp_metadata(where: str, *, trusted: bool) -> Any:
    from torch.distributed.checkpoint.metadata import Metadata

    file = os.path.join(where, _METADATA_FILE)
    try:
        with open(file, "rb") as f:
            # trusted: the caller vouches for this checkpoint, so torch's own (unrestricted) way
            metadata = pickle.load(f) if trusted else _MetadataUnpickler(f).load()
    except _Refused as err:
        raise UnsafeCheckpointError(
            f"{file}: refused to unpickle: it references {err}, which is not a DCP metadata "
            f"class, torch size or dtype, so unpickling it could run code; nothing was run. "
            f"{_TRUST_HINT}.",
            path=where,
        ) from None
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


def _dcp_paths(metadata: Any) -> dict[str, tuple[Any, ...]]:
    """Each DCP key's path in the nested state dict (from ``planner_data`` when recorded)."""
    planner_data = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    out: dict[str, tuple[Any, ...]] = {}
    for key in metadata.state_dict_metadata:
        path = planner_data.get(key)
        if (
            isinstance(path, (tuple, list))
            and path
            and all(type(p) in (str, int) for p in path)
            and type(path[0]) is str
        ):
            out[key] = tuple(path)
        else:
            out[key] = (key,)
    return out


def _set_element(root: dict[Any, Any], path: tuple[Any, ...], value: Any) -> None:
    """Put ``value`` at ``path`` (str keys make dicts, int keys make lists), as DCP does."""
    node: Any = root
    for part, following in itertools.pairwise(path):
        empty: Any = {} if type(following) is str else []
        if isinstance(node, dict):
            child = node.get(part)
            if child is None:
                child = node[part] = empty
        else:
            while len(node) <= part:
                node.append(None)
            child = node[part]
            if child is None:
                child = node[part] = empty
        node = child
    last = path[-1]
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
    node[last] = value


def _is_params_entry(path: tuple[Any, ...]) -> bool:
    return (
        len(path) >= 3
        and path[-1] == "params"
        and type(path[-2]) is int
        and path[-3] == ("param_groups")
    )


def _dcp_entries(where: str, metadata: Any, *, trusted: bool) -> dict[str, Any]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    root: dict[Any, Any] = {}
    for key, path in _dcp_paths(metadata).items():
        md = metadata.state_dict_metadata[key]
        if isinstance(md, TensorStorageMetadata):
            value: Any = TensorMeta(tuple(int(n) for n in md.size), md.properties.dtype)
        elif _is_params_entry(path):
            value = _dcp_read_bytes(where, metadata, key, trusted=trusted)
        else:
            value = UNREAD
        _set_element(root, path, value)
    try:
        return flatten(root)
    except Exception as err:
        raise CheckpointReadError(
            f"{where}: the nesting recorded in {_METADATA_FILE} cannot be flattened: "
            f"{_reason(err)}",
            path=where,
        ) from err


def _dcp_read_bytes(where: str, metadata: Any, key: str, *, trusted: bool) -> Any:
    """Read one (small) bytes entry straight from its data file, safely."""
    info = next(
        (v for k, v in (metadata.storage_data or {}).items() if getattr(k, "fqn", None) == key),
        None,
    )
    if info is None:
        raise CheckpointReadError(f"{where}: {key!r} has no storage entry in .metadata", path=where)
    if getattr(info, "transform_descriptors", None):
        raise CheckpointReadError(
            f"{where}: {key!r} is stored with transforms {info.transform_descriptors}; "
            "read it with load_checkpoint()",
            path=where,
        )
    file = os.path.join(where, str(info.relative_path))
    try:
        with open(file, "rb") as f:
            f.seek(int(info.offset))
            data = f.read(int(info.length))
    except OSError as err:
        raise CheckpointReadError(
            f"{where}: cannot read {key!r} (the group membership of a nested optimizer) from "
            f"{info.relative_path}: {_reason(err)}",
            path=where,
        ) from err
    return _load_bytes_entry(where, key, io.BytesIO(data), trusted=trusted)


def _load_bytes_entry(where: str, key: str, data: io.BytesIO, *, trusted: bool) -> Any:
    try:
        return torch.load(data, weights_only=not trusted, map_location="cpu")
    except Exception as err:
        wrapped = _torch_error(f"{where} (entry {key!r})", err)
        wrapped.path = where
        raise wrapped from err


def _dcp_load(where: str, *, trusted: bool) -> dict[str, Any]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = _read_dcp_metadata(where, trusted=trusted)
    root: dict[str, Any] = {}
    for key, path in _dcp_paths(metadata).items():
        md = metadata.state_dict_metadata[key]
        if isinstance(md, TensorStorageMetadata):
            value: Any = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        else:
            value = md  # replaced by the loaded value, as torch's own empty-dict planner does
        _set_element(root, path, value)
    run_dcp_load(where, root, metadata, trusted=trusted, allow_partial_load=False, no_dist=True)
    return root


def run_dcp_load(
    where: str,
    state_dict: dict[str, Any],
    metadata: Any,
    *,
    trusted: bool,
    allow_partial_load: bool,
    no_dist: bool,
    process_group: Any = None,
) -> list[tuple[Any, ...]]:
    """``dcp.load`` into ``state_dict`` with the already (safely) read ``metadata``.

    Bytes entries load with ``weights_only=not trusted``. Returns the paths of the
    entries of ``state_dict`` that the checkpoint lacks (skipped under
    ``allow_partial_load``).
    """
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import load

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            loaded = _load_bytes_entry(where, fqn, value, trusted=trusted)
            if self.flatten_state_dict:
                _set_element(self.original_state_dict, tuple(self.mappings[fqn]), loaded)
            else:
                self.state_dict[fqn] = loaded

    planner = Planner(allow_partial_load=allow_partial_load)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*intent is to load in a single process")
            load(
                state_dict,
                storage_reader=Reader(where),
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


def _unwrap(err: BaseException) -> BaseException:
    """The first rank's exception inside a DCP ``CheckpointException`` (``err`` otherwise)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict):
        for pair in failures.values():
            if isinstance(pair, tuple) and pair and isinstance(pair[0], BaseException):
                return pair[0]
    return err
