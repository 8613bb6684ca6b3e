"""A safe and fast reader for DCP ``.metadata`` pickles.

torch's ``FileSystemReader.read_metadata`` unpickles ``.metadata`` without any
restriction, and torch's weights-only unpickler cannot read it (DCP pickles with
protocol 4/5; that VM stops at the FRAME opcode) and would be several times
slower than the C unpickler anyway. This module runs CPython's C unpickler, which
is fast, and makes it safe in four layers. Each layer is needed; together they
mean that a hostile file can neither run code, nor change interpreter state, nor
make the reader allocate or compute more than a small multiple of its own size.

1. **A token grammar, checked before unpickling** (:func:`_scan`). One regular
   expression, which runs in C, walks the whole opcode stream and admits only the
   opcodes Python's pickler writes for DCP metadata. Refused outright: opcodes
   that allocate from a length field before reading the data (``BINBYTES*``,
   ``BYTEARRAY8``), explicit memo stores (``PUT``/``BINPUT``/``LONG_BINPUT``: the C
   unpickler zeroes a memo as large as the index), ``DUP``/``POP``, sets and
   frozensets, extensions, persistent ids, out-of-band buffers, ``INST``/``OBJ``/
   ``NEWOBJ_EX`` and the text-argument opcodes of protocol 0 (except ``GLOBAL``).
   Every tuple must be built by a *tuple pattern* whose elements are the tokens
   right before it: scalars, strings, memo fetches, globals, reduce calls with
   scalar arguments, or int-only tuples (tensor sizes) -- so tuples nest at most
   two deep and hold at most 1024 elements, and hashing one as a dict key costs
   little (a 10^6-deep tuple used as a key crashes CPython; a shared tuple of
   tuples 40 deep takes 2^40 steps to hash).
2. **A memo discipline** (:func:`_check_fetches`). Python's pickler memoizes every
   container but never fetches one back: DCP metadata shares strings, classes and
   dtypes, never a tuple, list or dict. A fetch of a memoized container is
   refused, so every container has one parent: nothing is copied or hashed
   twice, and no "billion laughs" structure can be built.
3. **Stand-ins instead of globals** (:class:`_Unpickler`). ``find_class`` never
   returns a real class or function of torch or pathlib. DCP's record classes
   (``Metadata``, ``TensorStorageMetadata``, ...) are replaced by private classes
   with no methods, whose metaclass refuses attribute assignment; the pickle's
   ``BUILD`` therefore lands only on fresh instances of them (``BUILD`` on a class
   or on a stand-in function fails), and only sets that instance's ``__dict__``.
   ``torch.Size`` and the dtypes are immutable C objects and are returned as
   they are; layouts and memory formats come from lookups in private tables
   (bound ``dict.__getitem__``: no attributes to set), and paths become inert
   tokens. Nothing the pickle can reach can be patched: ``pathlib.Path``,
   ``torch.serialization._get_layout`` (whose ``cache`` attribute a ``BUILD``
   could otherwise replace) and DCP's classes are never on the unpickler's stack.
4. **Validation, then conversion** (:func:`_convert`). The loaded tree is walked
   once: every record must have exactly its declared fields with values of the
   declared types (sizes are non-negative ints, offsets fit their sizes, paths are
   strings, storage entries name files by relative path ...). Only then are the
   stand-ins turned into instances of DCP's real classes (``__class__``
   assignment, no constructor runs) and ``storage_data`` rebuilt with the real
   ``MetadataIndex`` hashing.

Work is linear in the file's size: the scan runs in C over the bytes once per
pass, the unpickler's allocations follow the tokens it reads (nothing allocates
from a length field before the data is there), and the conversion visits each
object once.
"""

from __future__ import annotations

import contextlib
import gc
import io
import pathlib
import pickle
import re
import sys
import threading
from collections.abc import Iterator
from typing import Any, Final

import torch

from dsdmerge.errors import CheckpointReadError, UnsafeCheckpointError

__all__ = ["MAX_DIMS", "MAX_TUPLE", "load_metadata"]

MAX_DIMS: Final = 64
"""The most dimensions a tensor size in ``.metadata`` may have."""
MAX_TUPLE: Final = 1024
"""The most elements a tuple in ``.metadata`` may have (a planner path's depth)."""
_MAX_LONG_STRING_IN_TUPLE: Final = 1023


class _Refused(Exception):
    """A global outside the allow-list: nothing has run."""


class _Bad(Exception):
    """Structurally wrong metadata (reported as corrupt)."""


class _NotMetadata(_Bad):
    """A pickle of something else than ``Metadata`` (its type name)."""


# --------------------------------------------------------------------------------------
# layer 1: the token grammar


def _counted(op: int, lengths: range) -> bytes:
    """``op``, a 1-byte length n in ``lengths``, then n bytes.

    A two-level alternation (high nibble, then the exact length), so a match tries ~16
    branches, not 256.
    """
    by_high: dict[int, list[bytes]] = {}
    for n in lengths:
        tail = b".{%d}" % n if n else b""
        by_high.setdefault(n >> 4, []).append(re.escape(bytes([n])) + tail)
    groups = [
        b"(?=["
        + re.escape(bytes([h << 4]))
        + b"-"
        + re.escape(bytes([(h << 4) | 15]))
        + b"])"
        + b"(?:"
        + b"|".join(parts)
        + b")"
        for h, parts in sorted(by_high.items())
    ]
    return re.escape(bytes([op])) + b"(?:" + b"|".join(groups) + b")"


_TUPLE_OPS: Final = rb"\x85\x86\x87t"
_CONTAINER_OPS: Final = rb"\]\}\)\x85\x86\x87tuesa"  # their result is a container
_ARG_TOKENS = (
    rb"h.|j.{4}|K.|M..|J.{4}|G.{8}|\x80."
    rb"|"
    + _counted(0x8C, range(256))
    + rb"|"
    + _counted(0x8A, range(10))  # ints up to 2**71: offsets and lengths
    + rb"|c[^\n]{1,200}\n[^\n]{1,200}\n"
)
# Layer 1's tokens. Zero-argument opcodes: MEMOIZE MARK NONE BUILD NEWOBJ NEWTRUE NEWFALSE
# STACK_GLOBAL REDUCE STOP, the container opcodes EMPTY_LIST EMPTY_DICT EMPTY_TUPLE
# SETITEMS APPENDS SETITEM APPEND, and the tuple opcodes, which may not follow one another
# (``((((),),),)`` nests tuples; hashing a deep one as a dict key overflows the C stack)
# except in a reduce call with one tuple argument, ``(dims,)`` for torch.Size. A FRAME
# (a length hint, no meaning of its own) may not stand right before a MEMOIZE.
_TOKEN = (
    rb"(?:[\x94\(Nb\x81\x88\x89\x93R\.\]\}\)uesa]"
    rb"|[" + _TUPLE_OPS + rb"]\x94?\x85\x94?R"
    rb"|[" + _TUPLE_OPS + rb"](?!\x94?[" + _TUPLE_OPS + rb"])"
    rb"|\x95.{8}(?!\x94)"
    rb"|" + _ARG_TOKENS + rb")"
)
_GRAMMAR = re.compile(_TOKEN + rb"*+", re.DOTALL)
_TOKEN_RE = re.compile(_TOKEN, re.DOTALL)

_OPNAMES: Final = {
    op.code.encode("latin-1")[0]: op.name for op in __import__("pickletools").opcodes
}


def _scan(data: bytes) -> list[bytes]:
    """Check the token grammar; return the token-aligned segments between long strings.

    Strings with 4/8-byte length fields are checked against the bytes left and cut out
    (a string is never a memo fetch or store itself, so the memo events of the segments
    are those of the stream).
    """
    if len(data) < 2 or data[0] != 0x80 or data[1] not in (2, 3, 4, 5):
        raise _Bad("not a pickle of protocol 2-5")
    segments: list[bytes] = []
    start = pos = 2
    size = len(data)
    while True:
        found = _GRAMMAR.match(data, pos)
        end = found.end() if found else pos
        if end >= size:
            segments.append(data[start:size])
            return segments
        op = data[end]
        if op in (0x58, 0x8D):  # BINUNICODE, BINUNICODE8
            width = 4 if op == 0x58 else 8
            head = data[end + 1 : end + 1 + width]
            if len(head) < width:
                raise _Bad(f"truncated at offset {end}")
            length = int.from_bytes(head, "little")
            if length > size - (end + 1 + width):
                raise _Bad(f"a string at offset {end} is longer than the rest of the file")
            segments.append(data[start:end])
            start = pos = end + 1 + width + length
        elif _TOKEN_RE.match(data[end : end + 1024] + bytes(1024)):
            raise _Bad(f"truncated at offset {end}")  # a token cut short by the end
        elif op in (0x85, 0x86, 0x87, 0x74):
            raise _Refused(f"a tuple nested in a tuple at offset {end}")
        else:
            name = _OPNAMES.get(op, f"byte {op:#04x}")
            raise _Refused(f"pickle opcode {name} at offset {end}")


# ---- layer 2: the memo discipline (plain tokens: every MEMOIZE is its own token here)

_PLAIN = rb"[\(Nb\x81\x88\x89\x93R\.]|\x95.{8}|" + _ARG_TOKENS
# one match per MEMOIZE: b"" when it stores a scalar, string, record or global; the
# container opcode before it when it stores a container. The last match is the end.
_MEMO_EVENTS = re.compile(
    rb"(?:[" + _CONTAINER_OPS + rb"](?!\x94)|" + _PLAIN + rb")*+"
    rb"(?:([" + _CONTAINER_OPS + rb"]?)\x94|\Z)",
    re.DOTALL,
)
_NO_GET = rb"[\x94" + _CONTAINER_OPS + rb"]|" + _PLAIN
_GET1_EVENTS = re.compile(rb"(?:" + _NO_GET.replace(rb"h.|", b"") + rb")*+(?:h(.)|\Z)", re.DOTALL)
_GET4_EVENTS = re.compile(
    rb"(?:" + _NO_GET.replace(rb"|j.{4}", b"") + rb")*+(?:j(.{4})|\Z)", re.DOTALL
)


def _check_fetches(segments: list[bytes]) -> None:
    """Refuse a memo fetch of a container (layer 2); vectorized with torch."""
    kinds = bytearray()
    gets: list[bytes] = []
    longs: list[bytes] = []
    for seg in segments:
        kinds += bytes(map(len, _MEMO_EVENTS.findall(seg)[:-1]))
        gets.append(b"".join(_GET1_EVENTS.findall(seg)))
        longs.append(b"".join(_GET4_EVENTS.findall(seg)))
    if not kinds:
        return
    memo = torch.frombuffer(kinds, dtype=torch.uint8).bool()
    one = b"".join(gets)
    four = b"".join(longs)
    index = torch.cat(
        [
            torch.frombuffer(bytearray(one), dtype=torch.uint8).long() if one else _NONE,
            torch.frombuffer(bytearray(four), dtype=torch.int32).long() & 0xFFFFFFFF
            if four
            else _NONE,
        ]
    )
    if sys.byteorder == "big":  # pragma: no cover - pickle's ints are little-endian
        raise _Bad("reading DCP metadata needs a little-endian machine")
    index = index[index < len(memo)]
    if bool(memo[index].any()):
        raise _Refused("a second reference to a memoized container (DCP metadata has none)")


_NONE: Final = torch.zeros(0, dtype=torch.long)


# --------------------------------------------------------------------------------------
# layer 3: stand-ins


class _Sealed(type):
    """A metaclass whose classes refuse attribute assignment (so BUILD cannot patch them)."""

    def __setattr__(cls, name: str, value: Any) -> None:
        raise _Refused(f"setting {name!r} on a class")

    def __delattr__(cls, name: str) -> None:
        raise _Refused(f"deleting {name!r} from a class")


class _Record(metaclass=_Sealed):
    """Base of the stand-ins for DCP's record classes: instance ``__dict__`` only."""


class _Metadata(_Record):
    pass


class _TensorStorageMetadata(_Record):
    pass


class _BytesStorageMetadata(_Record):
    pass


class _ChunkStorageMetadata(_Record):
    pass


class _StorageMeta(_Record):
    pass


class _MetadataIndex(_Record):
    pass


class _StorageInfo(_Record):
    pass


class _TensorProperties(_Record):
    """``TensorProperties`` pickles a 5-tuple state: keep it for validation."""

    def __setstate__(self, state: Any) -> None:
        self.__dict__["_state"] = state


class _PathToken(tuple):  # type: ignore[type-arg]
    """What a pickled ``pathlib`` path unpickles to: its class name and parts, inert."""

    __slots__ = ()


class _PathFactory(metaclass=_Sealed):
    """A callable stand-in for a ``pathlib`` class (no ``__dict__``, nothing to set)."""

    __slots__ = ("_name",)
    _name: str

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise _Refused(f"setting {name!r} on a stand-in")

    def __call__(self, *parts: Any) -> _PathToken:
        return _PathToken((self._name, parts))


class _Call(metaclass=_Sealed):
    """A callable stand-in with no ``__dict__`` and no settable attribute."""

    __slots__ = ("_fn",)
    _fn: Any

    def __init__(self, fn: Any) -> None:
        object.__setattr__(self, "_fn", fn)

    def __setattr__(self, name: str, value: Any) -> None:
        raise _Refused(f"setting {name!r} on a stand-in")

    def __call__(self, *args: Any) -> Any:
        return self._fn(*args)


def _layout(name: Any) -> Any:
    if type(name) is not str:
        raise _Bad("a layout name is not a string")
    return _LAYOUTS[name]


def _memory_format(code: Any) -> Any:
    if type(code) is not int:
        raise _Bad("a memory format code is not an int")
    return _MEMORY_FORMATS[code]


class _Size(metaclass=_Sealed):
    """``torch.Size`` for ``REDUCE``: at most :data:`MAX_DIMS` dims, checked before copying."""

    def __new__(cls, dims: Any) -> Any:
        if type(dims) is not tuple or len(dims) > MAX_DIMS:
            raise _Bad("a tensor size is not a short tuple")
        return torch.Size(dims)


_RECORDS: Final[dict[str, type[_Record]]] = {
    "Metadata": _Metadata,
    "TensorStorageMetadata": _TensorStorageMetadata,
    "BytesStorageMetadata": _BytesStorageMetadata,
    "ChunkStorageMetadata": _ChunkStorageMetadata,
    "StorageMeta": _StorageMeta,
    "MetadataIndex": _MetadataIndex,
    "TensorProperties": _TensorProperties,
}
_LAYOUTS: Final = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
_MEMORY_FORMATS: Final = {
    0: torch.contiguous_format,
    1: torch.channels_last,
    2: torch.preserve_format,
}
_DTYPES: Final = {n: v for n, v in vars(torch).items() if isinstance(v, torch.dtype)}
_PATHS: Final = {
    name: _PathFactory(name)
    for name in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")
}


_CALL_LAYOUT: Final = _Call(_layout)
_CALL_MEMORY_FORMAT: Final = _Call(_memory_format)


def _stand_in(module: str, name: str) -> Any:
    """What ``find_class`` returns for ``module.name``; ``None`` when it is not allowed."""
    if module == "torch.distributed.checkpoint.metadata":
        if name == "_MEM_FORMAT_ENCODING":
            return _CALL_MEMORY_FORMAT
        return _RECORDS.get(name)
    if module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo":
        return _StorageInfo
    if module == "torch":
        return _Size if name == "Size" else _DTYPES.get(name)
    if module == "torch.serialization" and name == "_get_layout":
        return _CALL_LAYOUT
    if module == "pathlib":
        return _PATHS.get(name)
    return None


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _stand_in(module, name)
        if found is None:
            raise _Refused(f"{module}.{name}")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("a persistent id")


# --------------------------------------------------------------------------------------
# layer 4: validation and conversion


def _fields(obj: Any, cls: type, required: frozenset[str], optional: frozenset[str]) -> Any:
    if type(obj) is not cls:
        raise _Bad(f"expected a {cls.__name__[1:]}, found a {type(obj).__name__.lstrip('_')}")
    d = obj.__dict__
    keys = d.keys()
    if not (required <= keys and keys <= required | optional):
        raise _Bad(f"a {cls.__name__[1:]} with fields {sorted(map(repr, keys))[:8]}")
    return d


def _size(value: Any, what: str) -> Any:
    if type(value) is not torch.Size or len(value) > MAX_DIMS or (value and min(value) < 0):
        raise _Bad(f"{what} is not a tensor size")
    return value


def _opt_str(value: Any, what: str) -> None:
    if value is not None and type(value) is not str:
        raise _Bad(f"{what} is not a string")


_EMPTY: Final = frozenset[str]()
_TSM_F: Final = frozenset({"properties", "size", "chunks"})
_CHUNK_F: Final = frozenset({"offsets", "sizes"})
_MD_REQ: Final = frozenset({"state_dict_metadata"})
_MD_OPT: Final = frozenset({"planner_data", "storage_data", "storage_meta", "version"})
_MI_REQ: Final = frozenset({"fqn"})
_MI_OPT: Final = frozenset({"offset", "index"})
_SI_REQ: Final = frozenset({"relative_path", "offset", "length"})
_SI_OPT: Final = frozenset({"transform_descriptors"})
_SM_OPT: Final = frozenset({"checkpoint_id", "save_id", "load_id", "modules"})


def _convert(root: Any, *, budget: int) -> Any:
    """Validate the stand-in tree and turn it into DCP's real classes (layer 4)."""
    from torch.distributed.checkpoint import metadata as md
    from torch.distributed.checkpoint.filesystem import _StorageInfo as RealStorageInfo

    if type(root) is not _Metadata:
        raise _NotMetadata(type(root).__name__.lstrip("_"))
    top = _fields(root, _Metadata, _MD_REQ, _MD_OPT)
    sdm = top["state_dict_metadata"]
    if type(sdm) is not dict:
        raise _Bad("state_dict_metadata is not a dict")
    records: list[tuple[Any, type]] = [(root, md.Metadata)]
    for key, value in sdm.items():
        if type(key) is not str:
            raise _Bad("a state_dict_metadata key is not a string")
        kind = type(value)
        if kind is _BytesStorageMetadata:
            if value.__dict__:
                raise _Bad(f"{key!r}: a BytesStorageMetadata with fields")
            records.append((value, md.BytesStorageMetadata))
            continue
        d = _fields(value, _TensorStorageMetadata, _TSM_F, _EMPTY)
        size = _size(d["size"], f"{key!r}: size")
        props = d["properties"]
        _convert_properties(props, key, md.TensorProperties)
        chunks = d["chunks"]
        if type(chunks) is not list:
            raise _Bad(f"{key!r}: chunks is not a list")
        for chunk in chunks:
            c = _fields(chunk, _ChunkStorageMetadata, _CHUNK_F, _EMPTY)
            offsets = _size(c["offsets"], f"{key!r}: a chunk offset")
            sizes = _size(c["sizes"], f"{key!r}: a chunk size")
            if len(offsets) != len(size) or len(sizes) != len(size):
                raise _Bad(f"{key!r}: a chunk with {len(sizes)} dimensions in {len(size)}")
            if any(o + s > n for o, s, n in zip(offsets, sizes, size, strict=True)):
                raise _Bad(f"{key!r}: a chunk reaches past the tensor's size")
            records.append((chunk, md.ChunkStorageMetadata))
        records.append((value, md.TensorStorageMetadata))

    planner = top.get("planner_data")
    if planner is not None:
        _check_planner(planner, budget)
    storage = top.get("storage_data")
    items: list[tuple[Any, Any]] = []
    if storage is not None:
        if type(storage) is not dict:
            raise _Bad("storage_data is not a dict")
        for index, info in storage.items():
            i = _fields(index, _MetadataIndex, _MI_REQ, _MI_OPT)
            if type(i["fqn"]) is not str:
                raise _Bad("a storage index's fqn is not a string")
            offset = i.get("offset")
            if offset is not None:
                _size(offset, f"{i['fqn']!r}: storage offset")
            if i.get("index") is not None and type(i["index"]) is not int:
                raise _Bad(f"{i['fqn']!r}: storage index is not an int")
            s = _fields(info, _StorageInfo, _SI_REQ, _SI_OPT)
            if type(s["relative_path"]) is not str:
                raise _Bad(f"{i['fqn']!r}: relative_path is not a string")
            if type(s["offset"]) is not int or type(s["length"]) is not int:
                raise _Bad(f"{i['fqn']!r}: offset or length is not an int")
            if s["offset"] < 0 or s["length"] < 0:
                raise _Bad(f"{i['fqn']!r}: negative offset or length")
            td = s.get("transform_descriptors")
            if td is not None and (
                type(td) not in (list, tuple) or any(type(t) is not str for t in td)
            ):
                raise _Bad(f"{i['fqn']!r}: transform_descriptors are not strings")
            records.append((index, md.MetadataIndex))
            records.append((info, RealStorageInfo))
            items.append((index, info))
    meta = top.get("storage_meta")
    if meta is not None:
        m = _fields(meta, _StorageMeta, _EMPTY, _SM_OPT)
        _opt_str(m.get("save_id"), "storage_meta.save_id")
        _opt_str(m.get("load_id"), "storage_meta.load_id")
        modules = m.get("modules", [])
        if type(modules) is not list or any(type(x) is not str for x in modules):
            raise _Bad("storage_meta.modules is not a list of strings")
        cid = m.get("checkpoint_id")
        if type(cid) is _PathToken:
            name, parts = cid
            if not all(type(p) is str for p in parts) or len(parts) > MAX_TUPLE:
                raise _Bad("storage_meta.checkpoint_id is not a path")
            try:
                m["checkpoint_id"] = getattr(pathlib, name)(*parts)
            except Exception as err:  # noqa: BLE001 - e.g. a WindowsPath on Linux, as with torch
                raise _Bad(f"storage_meta.checkpoint_id: {err}") from None
        else:
            _opt_str(cid, "storage_meta.checkpoint_id")
        records.append((meta, md.StorageMeta))
    _opt_str(top.get("version"), "version")
    # every value has been checked: only now do the stand-ins become DCP's classes
    for obj, real in records:
        obj.__class__ = real
    if storage is not None:
        top["storage_data"] = dict(items)  # rehashed with MetadataIndex's own hash
    return root


def _convert_properties(props: Any, key: str, real: type) -> None:
    d = _fields(props, _TensorProperties, frozenset({"_state"}), _EMPTY)
    state = d["_state"]
    if type(state) is not tuple or len(state) != 5:
        raise _Bad(f"{key!r}: tensor properties are not a 5-tuple")
    dtype, layout, requires_grad, memory_format, pin_memory = state
    if (
        type(dtype) is not torch.dtype
        or type(layout) is not torch.layout
        or type(requires_grad) is not bool
        or type(memory_format) is not torch.memory_format
        or type(pin_memory) is not bool
    ):
        raise _Bad(f"{key!r}: tensor properties of the wrong types")
    props.__dict__ = {
        "dtype": dtype,
        "layout": layout,
        "requires_grad": requires_grad,
        "memory_format": memory_format,
        "pin_memory": pin_memory,
    }
    props.__class__ = real


def _check_planner(planner: Any, budget: int) -> None:
    if type(planner) is not dict:
        raise _Bad("planner_data is not a dict")
    total = 0
    for key, path in planner.items():
        if type(key) is not str:
            raise _Bad("a planner_data key is not a string")
        if type(path) not in (tuple, list) or not path or type(path[0]) is not str:
            raise _Bad(f"{key!r}: planner_data path is not a path")
        total += len(path)
        for part in path:
            if type(part) is int:
                if not 0 <= part <= budget:
                    raise _Bad(f"{key!r}: planner_data list index {part} is out of bounds")
            elif type(part) is not str:
                raise _Bad(f"{key!r}: planner_data path holds a {type(part).__name__}")
    if total > budget:
        raise _Bad("planner_data paths are longer than the file")


# --------------------------------------------------------------------------------------


_GC_LOCK = threading.Lock()
_gc_pausers = 0
_gc_was_enabled = False


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic collector while millions of acyclic objects are built.

    The objects the unpickler makes hold no cycles (validation refuses anything else),
    so collections during the load find nothing, but they traverse everything built so
    far: they are ~70% of ``pickle.load``'s time at DeepSeek-V3 scale. Reads in several
    threads share one pause (counted under a lock); the collector's state is restored
    when the last one ends, exactly as it was when the first began.
    """
    global _gc_pausers, _gc_was_enabled
    with _GC_LOCK:
        if _gc_pausers == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pausers += 1
    try:
        yield
    finally:
        with _GC_LOCK:
            _gc_pausers -= 1
            if _gc_pausers == 0 and _gc_was_enabled:
                gc.enable()


def load_metadata(data: bytes, *, where: str) -> Any:
    """Unpickle a DCP ``.metadata`` file's bytes safely (see the module docstring).

    Args:
        data: The file's bytes.
        where: The file's path, for error messages.

    Returns:
        A ``torch.distributed.checkpoint.metadata.Metadata``.

    Raises:
        UnsafeCheckpointError: The pickle references a global outside the
            allow-list, or uses an opcode DCP never writes (nothing has run).
        CheckpointReadError: The file is corrupt, truncated or not DCP metadata.
    """
    try:
        segments = _scan(data)
        _check_fetches(segments)
        del segments
        with _gc_paused():
            root = _Unpickler(io.BytesIO(data)).load()
            return _convert(root, budget=len(data))
    except _Refused as err:
        raise UnsafeCheckpointError(
            f"{where}: refused to unpickle: it uses {err}, which DCP metadata never holds "
            "(only DCP metadata classes, torch sizes, dtypes, layouts and paths are allowed), "
            "so unpickling it could run code or exhaust memory; nothing was run.",
            path=where,
        ) from None
    except _NotMetadata as err:
        raise CheckpointReadError(f"{where}: holds a {err}, not DCP Metadata", path=where) from None
    except _Bad as err:
        raise CheckpointReadError(
            f"{where}: not a readable DCP metadata file (corrupt, truncated or crafted?): {err}",
            path=where,
        ) from None
    except Exception as err:  # noqa: BLE001 - the C unpickler raises anything on corrupt input
        text = " ".join(str(err).split()) or type(err).__name__
        raise CheckpointReadError(
            f"{where}: not a readable DCP metadata file (corrupt or truncated?): {text[:300]}",
            path=where,
        ) from None
