"""Which checkpoint a path is, and the files of safetensors checkpoints, without importing torch.

Internal to :mod:`dsdmerge.integrations`; :mod:`~dsdmerge.integrations.checkpoints` builds
its views and loads on it, and the command line reads safetensors headers and Hugging Face
directories through it directly, so that ``dsdmerge inspect model.safetensors`` never pays
for importing torch.

A *Hugging Face model directory* is what ``save_pretrained`` writes: ``config.json`` and
either one ``model.safetensors`` or shards ``model-0000N-of-0000M.safetensors`` listed by
``model.safetensors.index.json`` (``{"metadata": {...}, "weight_map": {key: shard}}``).
Which weights are read is what transformers reads (``modeling_utils``: a
``model.safetensors`` first, else the index); a directory holding both says so in a
:class:`~dsdmerge.DSDMergeWarning`. Headers are read and validated by the ``safetensors``
library (``safe_open``; never a tensor byte); the index is checked against them: every
shard it names is a plain file name of the directory (no sub-directory, no absolute name,
no ``..``: as ``save_pretrained`` writes them, and as ``dsdmerge merge`` writes them back)
and a regular file (symlinks are followed, as the Hugging Face hub cache links each file
to its blob), and each key is in the shard the index says and in no other.
(torch's ``HuggingFaceStorageReader`` reads every ``*.safetensors`` file of a directory
whatever the index says, and imports torch, so it is not used here.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import stat
import struct
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, Final, Literal

from dsdmerge.errors import CheckpointReadError, DSDMergeError, DSDMergeWarning

__all__ = [
    "DTYPES",
    "CheckpointFormat",
    "HFLayout",
    "detect_format",
    "hf_header",
    "hf_shards",
    "header_stats",
    "hf_layout",
    "plain_name",
    "read_regular",
    "reading",
    "reason",
    "safetensors_header",
]

CheckpointFormat = Literal["dcp", "torch", "safetensors", "hf"]
"""The checkpoint formats :func:`detect_format` tells apart."""

METADATA_FILE: Final = ".metadata"
HF_INDEX: Final = "model.safetensors.index.json"
HF_SINGLE: Final = "model.safetensors"
INDEX_SUFFIX: Final = ".safetensors.index.json"
TORCH_SUFFIXES: Final = frozenset({".pt", ".pth", ".bin"})
ZIP_MAGIC: Final = b"PK\x03\x04"

DTYPES: Final[dict[str, tuple[str, int]]] = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U64": ("uint64", 8),
    "U32": ("uint32", 4),
    "U16": ("uint16", 2),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "F8_E8M0": ("float8_e8m0fnu", 1),
    "C64": ("complex64", 8),
    "C128": ("complex128", 16),
}
"""safetensors dtype codes: ``code -> (torch dtype name, bytes per element)``."""

Entries = dict[str, tuple[tuple[int, ...], str]]
"""``{key: (shape, safetensors dtype code)}``, in file order."""


def reason(err: BaseException | str) -> str:
    """One line describing ``err``."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 300 else text[:297] + "..."


@contextlib.contextmanager
def reading(where: str) -> Iterator[None]:
    """The readers' last line: whatever a crafted file provokes leaves as a CheckpointReadError."""
    try:
        yield
    except DSDMergeError:
        raise
    except Exception as err:  # RecursionError, MemoryError, a library's own error ...
        raise CheckpointReadError(
            f"{where}: cannot be read (corrupt or crafted?): {type(err).__name__}: {reason(err)}",
            path=where,
        ) from err


# --------------------------------------------------------------------------------------
# formats


def detect_format(path: str | os.PathLike[str], /) -> CheckpointFormat:
    """Tell which kind of checkpoint ``path`` is, from its name and first bytes.

    A directory holding a ``.metadata`` file is ``"dcp"``; a Hugging Face model
    directory (``model.safetensors.index.json`` or ``model.safetensors``, or a single
    other ``*.safetensors.index.json`` or ``*.safetensors``) and a
    ``*.safetensors.index.json`` file are ``"hf"``; a ``.safetensors`` file is
    ``"safetensors"``; a ``.pt``/``.pth``/``.bin`` file, or any file that starts
    like a torch zip archive or a pickle, is ``"torch"``; a file whose first bytes
    are a safetensors header is ``"safetensors"``. Reads at most the first 9 bytes
    of a file.

    Args:
        path: A file or directory.

    Returns:
        ``"dcp"``, ``"torch"``, ``"safetensors"`` or ``"hf"``.

    Raises:
        CheckpointReadError: ``path`` does not exist, cannot be read, or is none
            of the formats.

    Examples:
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
            if (p / METADATA_FILE).is_file():
                return "dcp"
            if os.path.lexists(p / METADATA_FILE):
                raise CheckpointReadError(
                    f"{where}: its {METADATA_FILE} is not a regular file", path=where
                )
            _hf_files(where)  # raises, saying what the directory lacks
            return "hf"
        if not p.exists():
            raise CheckpointReadError(f"{where}: no such file or directory", path=where)
        # never block on a FIFO or read a device: only regular files are checkpoints
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise CheckpointReadError(
                    f"{where}: not a regular file (a checkpoint is a file or a directory)",
                    path=where,
                )
            name = p.name.lower()
            if name.endswith(INDEX_SUFFIX):
                return "hf"
            suffix = p.suffix.lower()
            if suffix == ".safetensors":
                return "safetensors"
            if suffix in TORCH_SUFFIXES:
                return "torch"
            head = f.read(9)
    except OSError as err:
        if isinstance(err, CheckpointReadError):
            raise
        raise CheckpointReadError(f"{where}: cannot be read: {reason(err)}", path=where) from err
    if head.startswith(ZIP_MAGIC):
        return "torch"
    # a safetensors header first: its 8-byte length starts with 0x80 in 1 file of 256
    if len(head) == 9 and head[8:9] == b"{":
        (length,) = struct.unpack("<Q", head[:8])
        if 8 + length <= info.st_size:
            return "safetensors"
    if head[:1] == b"\x80":
        return "torch"
    raise CheckpointReadError(
        f"{where}: unknown checkpoint format (not a DCP or Hugging Face directory, a torch "
        "zip/pickle or safetensors; name it .pt, .pth, .bin or .safetensors if it is one of "
        "them)",
        path=where,
    )


def _hf_files(directory: str) -> tuple[str | None, str | None]:
    """``(index file name, single weights file name)`` of a Hugging Face directory.

    Raises:
        CheckpointReadError: The directory is not one (the message says what it holds).
    """
    try:
        names = sorted(os.listdir(directory))
    except OSError as err:
        raise CheckpointReadError(
            f"{directory}: cannot be listed: {reason(err)}", path=directory
        ) from err
    if HF_SINGLE in names:  # transformers reads it first, even beside an index
        if HF_INDEX in names:
            warnings.warn(
                f"{directory}: holds both {HF_SINGLE} and {HF_INDEX}; reading {HF_SINGLE}, "
                "as transformers does (the index and its shards are not read)",
                DSDMergeWarning,
                stacklevel=3,
            )
        return None, HF_SINGLE
    if HF_INDEX in names:
        return HF_INDEX, None
    indexes = [n for n in names if n.endswith(INDEX_SUFFIX)]
    weights = [n for n in names if n.endswith(".safetensors")]
    if len(indexes) == 1:
        return indexes[0], None
    if not indexes and len(weights) == 1:
        return None, weights[0]
    if len(indexes) > 1 or len(weights) > 1:
        several = indexes if len(indexes) > 1 else weights
        raise CheckpointReadError(
            f"{directory}: holds several {'indexes' if len(indexes) > 1 else 'safetensors files'}"
            f" ({', '.join(several[:5])}{' ...' if len(several) > 5 else ''}) and no "
            f"{HF_INDEX}; pass the one to read",
            path=directory,
        )
    bins = [n for n in names if n in ("pytorch_model.bin", "pytorch_model.bin.index.json")]
    hint = f" (it holds {bins[0]}: pass a .bin file itself)" if bins else ""
    raise CheckpointReadError(
        f"{directory}: a directory without a {METADATA_FILE} file is not a DCP checkpoint "
        f"(was the save interrupted?), and without {HF_INDEX} or {HF_SINGLE} it is not a "
        f"Hugging Face model directory{hint}",
        path=directory,
    )


# --------------------------------------------------------------------------------------
# safetensors headers


def safetensors_header(file: str, /, *, where: str | None = None) -> tuple[Entries, dict[str, str]]:
    """Keys, shapes, dtype codes and ``__metadata__`` of a safetensors file.

    Read by the ``safetensors`` library (``safe_open``), which validates the header
    as it does before loading anything (JSON, dtypes, shapes matching
    ``data_offsets``, offsets contiguous and inside the file); no tensor data is
    read, and torch is not imported (the header is opened for NumPy).

    Raises:
        CheckpointReadError: Not a valid safetensors file.
    """
    from safetensors import safe_open

    where = where or file
    try:
        with safe_open(file, framework="numpy") as f:
            keys = f.offset_keys() if hasattr(f, "offset_keys") else f.keys()
            entries: Entries = {}
            for name in keys:
                part = f.get_slice(name)
                entries[name] = (tuple(int(n) for n in part.get_shape()), str(part.get_dtype()))
            metadata = dict(f.metadata() or {})
    except Exception as err:  # safetensors raises its own error types  # noqa: BLE001
        raise CheckpointReadError(
            f"{where}: not a valid safetensors file (corrupt or truncated?): {reason(err)}",
            path=where,
        ) from None
    return entries, metadata


# --------------------------------------------------------------------------------------
# Hugging Face directories


@dataclasses.dataclass(frozen=True)
class HFLayout:
    """The files of a Hugging Face model directory.

    Attributes:
        directory: The directory.
        index: The index file's name, or ``None`` for a single weights file.
        shards: The weights files' names: each shard once, sorted (HF's zero-padded
            names sort in shard order).
        weight_map: The index's ``{key: shard}`` (``None`` without an index).
        metadata: The index's ``"metadata"`` (e.g. ``{"total_size": 1234}``).
    """

    directory: str
    index: str | None
    shards: tuple[str, ...]
    weight_map: dict[str, str] | None
    metadata: dict[str, Any]


def hf_layout(path: str | os.PathLike[str], /) -> HFLayout:
    """The layout of a Hugging Face model directory, or of the directory of an index file.

    Every shard the index names must be a regular file inside the directory once
    symlinks are resolved.

    Raises:
        CheckpointReadError: Not a Hugging Face directory, an unreadable or malformed
            index, or a shard outside the directory or missing.
    """
    where = str(path)
    p = pathlib.Path(path)
    if p.is_dir():
        directory = where
        index, single = _hf_files(directory)
    else:
        directory = str(p.parent)
        index, single = p.name, None
    if index is None:
        assert single is not None
        _inside(directory, single, where=where, what="the weights file")
        return HFLayout(directory, None, (single,), None, {})
    data = read_regular(os.path.join(directory, index), where=where, what=index)
    try:
        parsed = json.loads(data)
    except (ValueError, RecursionError) as err:
        raise CheckpointReadError(
            f"{where}: {index} is not valid JSON: {reason(err)}", path=where
        ) from None
    weight_map = parsed.get("weight_map") if isinstance(parsed, dict) else None
    if not isinstance(weight_map, dict) or not all(
        type(k) is str and type(v) is str for k, v in weight_map.items()
    ):
        raise CheckpointReadError(
            f'{where}: {index} has no "weight_map" of key names to shard file names',
            path=where,
        )
    metadata = parsed.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise CheckpointReadError(f'{where}: {index}\'s "metadata" is not an object', path=where)
    shards = tuple(sorted(set(weight_map.values())))
    for shard in shards:
        _inside(directory, shard, where=where, what=f"the shard {index} names")
    return HFLayout(directory, index, shards, dict(weight_map), dict(metadata))


def _inside(directory: str, name: str, *, where: str, what: str) -> str:
    """The path of ``name``, checked to name a regular file of ``directory``.

    The name must be a plain file name of the directory (no sub-directory, not
    absolute, no ``..``), as ``save_pretrained`` writes shards and as ``dsdmerge
    merge`` writes them back; symlinks are followed (the Hugging Face hub cache is made
    of them, pointing into its ``blobs``), to regular files only.
    """
    if not plain_name(name):
        raise CheckpointReadError(
            f"{where}: {what} {name!r} is not a file name inside the directory (shards are "
            "plain file names of it, as save_pretrained writes them); corrupt or crafted",
            path=where,
        )
    file = os.path.join(directory, name)
    try:
        mode = os.stat(file).st_mode
    except OSError as err:
        raise CheckpointReadError(
            f"{where}: {what} {name!r} cannot be read: {reason(err)}", path=where
        ) from err
    if not stat.S_ISREG(mode):
        raise CheckpointReadError(f"{where}: {what} {name!r} is not a regular file", path=where)
    return file


def plain_name(name: str, /) -> bool:
    """Whether ``name`` is a plain file name: no directory part, not ``.``/``..``, no NUL.

    Examples:
        >>> from dsdmerge.integrations._files import plain_name
        >>> plain_name("model-00001-of-00002.safetensors"), plain_name("a/m.safetensors")
        (True, False)
    """
    return (
        bool(name)
        and name not in (".", "..")
        and "\0" not in name
        and "/" not in name
        and os.sep not in name
        and (os.altsep is None or os.altsep not in name)
    )


def read_regular(file: str, *, where: str, what: str) -> bytes:
    """The bytes of ``file`` if it is a regular file (never blocks on a FIFO or a device)."""
    try:
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as err:
        raise CheckpointReadError(
            f"{where}: cannot read {what}: {reason(err)}", path=where
        ) from err
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointReadError(f"{where}: {what} is not a regular file", path=where)
        try:
            return f.read(info.st_size)
        except OSError as err:
            raise CheckpointReadError(
                f"{where}: cannot read {what}: {reason(err)}", path=where
            ) from err


def hf_header(
    layout: HFLayout, /, *, where: str | None = None
) -> tuple[Entries, dict[str, str], dict[str, str]]:
    """Every key of a Hugging Face directory with its shape and dtype code, from the headers.

    Returns:
        ``(entries, metadata, shard_of)``: the entries shard by shard, in file order;
        the metadata shown for the directory (the index's ``"metadata"``, values as
        JSON text where they are not strings, then the first shard's
        ``__metadata__``); and each key's shard.

    Raises:
        CheckpointReadError: A shard is not valid safetensors, a key is in two shards,
            or the index and the shards disagree about where a key is.
    """
    from dsdmerge.report import format_keys

    where = where or layout.directory
    entries: Entries = {}
    shard_of: dict[str, str] = {}
    metadata: dict[str, str] = {
        str(k): v if type(v) is str else json.dumps(v) for k, v in layout.metadata.items()
    }
    for shard in layout.shards:
        file = os.path.join(layout.directory, shard)
        part, shard_metadata = safetensors_header(file, where=f"{where} ({shard})")
        twice = [k for k in part if k in shard_of]
        if twice:
            raise CheckpointReadError(
                f"{where}: {len(twice)} key(s) are in two shards ({format_keys(twice, limit=3)} "
                f"in {shard_of[twice[0]]} and {shard}); corrupt or crafted",
                path=where,
            )
        for k, v in shard_metadata.items():
            metadata.setdefault(k, v)
        entries.update(part)
        shard_of.update(dict.fromkeys(part, shard))
    if layout.weight_map is not None:
        index = layout.index
        elsewhere = [k for k, s in shard_of.items() if layout.weight_map.get(k) != s]
        if elsewhere:
            raise CheckpointReadError(
                f"{where}: {len(elsewhere)} key(s) of the shards are not where {index} says "
                f"({format_keys(elsewhere, limit=3)}); corrupt, or shards of another save",
                path=where,
            )
        lacking = [k for k in layout.weight_map if k not in shard_of]
        if lacking:
            raise CheckpointReadError(
                f"{where}: {len(lacking)} key(s) {index} lists are in no shard "
                f"({format_keys(lacking, limit=3)}); truncated or incomplete download?",
                path=where,
            )
    return entries, metadata, shard_of


def hf_shards(
    path: str | os.PathLike[str], /
) -> tuple[HFLayout, dict[str, str], dict[str, dict[str, str]]]:
    """A Hugging Face directory's layout, each key's shard and each shard's ``__metadata__``.

    What ``dsdmerge merge`` needs to write a result in the same sharded layout.
    """
    where = str(path)
    with reading(where):
        layout = hf_layout(where)
        _entries, _metadata, shard_of = hf_header(layout, where=where)
        from safetensors import safe_open

        metadata: dict[str, dict[str, str]] = {}
        for shard in layout.shards:
            with safe_open(os.path.join(layout.directory, shard), framework="numpy") as f:
                metadata[shard] = dict(f.metadata() or {})
        return layout, shard_of, metadata


def header_stats(entries: Mapping[str, tuple[tuple[int, ...], str]]) -> tuple[int, dict[str, int]]:
    """``(bytes, {dtype name: tensors})`` of header entries (unknown dtype codes: 0 bytes)."""
    nbytes = 0
    dtypes: dict[str, int] = {}
    for shape, code in entries.values():
        name, size = DTYPES.get(code, (code, 0))
        numel = 1
        for n in shape:
            numel *= n
        nbytes += numel * size
        dtypes[name] = dtypes.get(name, 0) + 1
    return nbytes, dict(sorted(dtypes.items()))
