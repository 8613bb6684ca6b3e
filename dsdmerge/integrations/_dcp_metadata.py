"""A safe and fast reader for DCP ``.metadata`` pickles.

torch's ``FileSystemReader.read_metadata`` unpickles ``.metadata`` without any
restriction, and torch's weights-only unpickler cannot read it (DCP pickles with
protocol 4/5; that VM stops at the FRAME opcode) and would be several times slower
than the C unpickler anyway. This module runs CPython's C unpickler, which is fast,
and makes it safe in four layers. Each is needed; together they mean a crafted file
can neither run code, nor change interpreter state, nor make the reader allocate or
compute much more than its own size.

1. **A token grammar, checked first** (:data:`_TOKEN`, one regular expression that
   runs in C over the whole stream). Only the opcodes Python's pickler writes for
   DCP metadata pass, in the order it writes them. Refused outright: opcodes that
   allocate from a length field before the data is read (``BINBYTES*``,
   ``BYTEARRAY8``), explicit memo stores (``PUT``/``BINPUT``/``LONG_BINPUT``: the C
   unpickler zeroes a memo as large as the index, 1 GiB for a 9-byte file),
   ``DUP``/``POP``, sets and frozensets, extensions, persistent ids, out-of-band
   buffers, ``INST``/``OBJ``/``NEWOBJ_EX`` and the text opcodes of protocol 0 but
   ``GLOBAL``; ints longer than 9 bytes; a MEMOIZE anywhere but after an object
   the pickler memoizes; tuple opcodes directly on a tuple (``((((),),),)``) but
   for ``(dims,)`` and for the strides that end a ``TensorProperties`` state
   (torch >= 2.15); strings longer than the rest of the file.
2. **No container is referenced twice** (:func:`_rewrite`). The pickler memoizes
   every container but DCP metadata never fetches one back (it shares strings,
   classes and dtypes). Each ``<container opcode> MEMOIZE`` is rewritten to
   ``<container opcode> <poison> MEMOIZE POP``, so the memo holds ``False`` (for a
   tuple) or ``()`` (for a list or dict) where it held the container: a DCP-written
   file unpickles to the same objects, and a crafted one that fetches a container
   gets a value that validation refuses where it lands. So no tuple is shared (a
   "billion laughs" of tuples 40 deep takes 2^40
   steps to hash as a dict key, in any unpickler) and no dict is copied into a
   million records by ``BUILD``. The same ``re.split`` drops FRAMEs (read-ahead
   hints) and re-checks the grammar.
3. **Stand-ins instead of globals** (:class:`_Unpickler`). ``find_class`` never
   returns a real class or function of torch or pathlib. DCP's record classes are
   replaced by private classes with no methods whose metaclass refuses attribute
   assignment, so the pickle's ``BUILD`` lands only on fresh instances of them and
   only sets that instance's ``__dict__`` (``BUILD`` on a class, or on a stand-in
   callable, which has no ``__dict__``, fails). ``torch.Size`` calls go through a
   stand-in that checks the argument first; dtypes are immutable C objects; layouts
   and memory formats come from private tables; paths become inert tokens.
   Nothing the pickle can reach can be patched: ``pathlib.Path``,
   ``torch.serialization._get_layout`` (whose ``cache`` attribute a ``BUILD`` could
   replace for the whole process) and DCP's classes are never on the stack.
4. **Validation, then conversion** (:func:`_convert`). The result is checked column
   by column: every record has exactly its declared fields with values of the
   declared types (sizes non-negative, at most :data:`MAX_DIMS` dims, chunks of the
   tensor's rank, paths of strings and list indices within the file's size, storage
   entries a relative path, offset and length ...). Only then do the stand-ins
   become instances of DCP's real classes (``__class__`` assignment: no constructor
   runs) and ``storage_data`` is rebuilt with ``MetadataIndex``'s own hash.

Two more measures bound the work. CPython hashes a tuple recursively in C, and
layer 1 cannot stop all nesting (``((t, 1), 2)`` built element by element is plain
pickle): a dict key nested 10^6 deep overflows an 8 MiB stack. The unpickler runs
in a thread whose stack fits tuples nested as deep as the file has tuples
(:func:`_load_deep`). And the cyclic garbage collector is paused while the
acyclic result is built (:func:`dsdmerge._gc.gc_paused`): its passes over millions of new
objects are most of ``pickle.load``'s time at DeepSeek-V3 scale.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import itertools
import operator
import pathlib
import pickle
import platform
import re
import threading
from collections.abc import Mapping
from typing import Any, Final

import torch

from dsdmerge._gc import gc_paused
from dsdmerge._text import shown_name
from dsdmerge._torch_api import (
    TENSOR_PROPERTIES_BASE,
    storage_info_class,
    tensor_properties_fields,
)
from dsdmerge.errors import CheckpointReadError, UnsafeCheckpointError

__all__ = ["MAX_DIMS", "MAX_TUPLE", "load_metadata"]

MAX_DIMS: Final = 64
"""The most dimensions a tensor size in ``.metadata`` may have."""
MAX_TUPLE: Final = 1024
"""The most parts a pickled ``pathlib`` path in ``.metadata`` may have."""


class _Refused(Exception):
    """A global outside the allow-list: nothing has run."""


class _Bad(Exception):
    """Structurally wrong metadata (reported as corrupt)."""


class _NotMetadata(_Bad):
    """A pickle of something else than ``Metadata`` (its type name)."""


class _Newer(_Bad):
    """Metadata in a format only a newer torch reads (torch's own reader fails on it too)."""


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
_MEMOIZED_OPS: Final = rb"\]\}\x85\x86\x87t"  # containers the pickler memoizes at birth
_ARG_TOKENS = (
    rb"h.|j.{4}|K.|M..|J.{4}|G.{8}|\x80."
    rb"|"
    + _counted(0x8C, range(256))
    + rb"|"
    + _counted(0x8A, range(10))  # ints up to 2**71: offsets and lengths
    + rb"|c[^\n]{1,200}\n[^\n]{1,200}\n"
)
# Layer 1's tokens: the opcodes Python's pickler writes for DCP metadata, in the order
# it writes them. A MEMOIZE follows only a scalar, string, global, call result or
# record, or right after the opcode that made a container (which the pickler always
# memoizes); every non-empty tuple is memoized; tuple opcodes do not follow one another
# (``((((),),),)`` nests tuples) except in a reduce call with one tuple argument,
# ``(dims,)`` for torch.Size, and a tuple that ends a BUILD state (``(..., strides)``,
# TensorProperties since torch 2.15); a FRAME (a length hint) does not stand before a MEMOIZE.
_TOKEN_ALTS = (
    rb"[\(Nb\x81\x88\x89\x93R\.\]\}]"
    rb"|[\)uesa](?!\x94)"
    rb"|\x94(?!\x94)"
    rb"|[" + _TUPLE_OPS + rb"]\x94\x85\x94R"
    rb"|[" + _TUPLE_OPS + rb"]\x94(?=t\x94b)"
    rb"|[" + _TUPLE_OPS + rb"]\x94(?![" + _TUPLE_OPS + rb"])"
    rb"|\x95.{8}(?!\x94)"
    rb"|" + _ARG_TOKENS
)
_TOKEN = rb"(?:" + _TOKEN_ALTS + rb")"

# Every run of tokens is a possessive repetition ``(?:...)*+``: it keeps no backtracking
# state, so a run of 10^7 tokens takes constant memory and linear time (a greedy ``*``, or
# an atomic group ``(?>(?:...)*)``, keeps ~140 bytes of the regex engine's stack per token:
# 2.7 GiB for a 20 MiB file of NONE opcodes). CPython 3.11.0 to 3.11.4 match it wrongly
# (python/cpython#100061 and #106052, both fixed in 3.11.5): when the last attempt of the
# repeated pattern fails part way through a token (``)`` whose lookahead sees a MEMOIZE,
# a string cut short), the match goes on from where that attempt stopped, not from where
# it began, so the run swallows part of a token, every later token is misaligned and the
# file is refused. So each run's alternation ends with ``(?!)``, which never matches and
# which the engine tries last, from the token's start (it skips an alternative that starts
# with a literal or a set without trying it; this one starts with a lookahead): a failed
# attempt then ends where it began, and the bug has nothing to carry. On a fixed Python it
# changes nothing. Keep capture groups out of the runs (#101955: 3.11.7, 3.12.1 and 3.13.0
# raise SystemError on a possessive repeat of an alternation that holds a group).
# :func:`_grammar_fault` checks both patterns at import.
_LAST_RESORT: Final = rb"|(?!)"
_GRAMMAR = re.compile(rb"(?:" + _TOKEN_ALTS + _LAST_RESORT + rb")*+", re.DOTALL)
_TOKEN_RE = re.compile(_TOKEN, re.DOTALL)

_OPNAMES: Final = {
    op.code.encode("latin-1")[0]: op.name for op in __import__("pickletools").opcodes
}


def _scan(data: bytes) -> list[bytes]:
    """Check the token grammar (layer 1); return the stream cut into token-aligned pieces.

    Strings with 4/8-byte length fields are checked against the bytes left and become
    pieces of their own (the regular expression cannot skip a counted field); the
    other pieces are runs of ordinary tokens, which :func:`_rewrite` processes.
    """
    if len(data) < 2 or data[0] != 0x80 or data[1] not in (2, 3, 4, 5):
        raise _Bad("not a pickle of protocol 2-5")
    pieces: list[bytes] = [data[:2]]
    start = pos = 2
    size = len(data)
    while True:
        found = _GRAMMAR.match(data, pos)
        end = found.end() if found else pos
        if end >= size:
            pieces.append(data[start:size])
            return pieces
        op = data[end]
        if op in (0x58, 0x8D):  # BINUNICODE, BINUNICODE8
            width = 4 if op == 0x58 else 8
            head = data[end + 1 : end + 1 + width]
            if len(head) < width:
                raise _Bad(f"truncated at offset {end}")
            length = int.from_bytes(head, "little")
            stop = end + 1 + width + length
            if stop > size:
                raise _Bad(f"a string at offset {end} is longer than the rest of the file")
            if data[stop : stop + 2] == b"\x94\x94":
                raise _Refused(f"pickle opcode MEMOIZE twice at offset {stop}")
            pieces.append(data[start:end])
            pieces.append(b"L" + data[end:stop])  # marked: copied as it is
            start = pos = stop
        elif _TOKEN_RE.match(data[end : end + 1024] + bytes(1024)):
            raise _Bad(f"truncated at offset {end}")  # a token cut short by the end
        elif op in (0x85, 0x86, 0x87, 0x74):
            raise _Refused(f"a tuple opcode at offset {end} in a place DCP never writes one")
        else:
            name = _OPNAMES.get(op, f"byte {op:#04x}")
            raise _Refused(f"pickle opcode {name} at offset {end}")


# ---- layer 2: the memo discipline
#
# Python's pickler memoizes every container it writes but never fetches one back (DCP
# metadata shares strings, classes and dtypes, never a tuple, list or dict). So each
# ``<container opcode> MEMOIZE`` is rewritten to ``<container opcode> EMPTY_TUPLE MEMOIZE
# POP``: the memo slot holds ``()`` instead of the container. A legitimate file unpickles
# to the same objects; a crafted one that fetches a container gets ``()``, which
# validation refuses wherever it lands, and can never share a tuple (the "billion laughs"
# of tuples that take 2^40 steps to hash as a dict key) or a dict (a BUILD state copied
# into a million records). FRAMEs are dropped (they only tell a reader how much to read
# ahead, and the rewrite moves their boundaries).
#
# One ``re.split`` does it: its pattern takes a run of tokens and then one event (a
# memoized container, a FRAME, or the end), so every match starts where the previous
# one ended and the tokens stay aligned.

# the same grammar as _TOKEN, with each memoized container and each FRAME an event
_RUN = (
    rb"((?:[\(Nb\x81\x88\x89\x93R\.]|[\]\}](?!\x94)|[\)uesa](?!\x94)|\x94(?!\x94)|"
    + _ARG_TOKENS
    + _LAST_RESORT  # see _GRAMMAR: possessive runs on Python 3.11.0-3.11.4
    + rb")*+)"
)
_EVENTS = re.compile(
    _RUN
    + rb"(?:(["
    + _TUPLE_OPS
    + rb"])\x94(?=\x85\x94R|t\x94b|(?!["
    + _TUPLE_OPS
    + rb"]))"
    + rb"|([\]\}])\x94(?!\x94)|(\x95).{8}(?!\x94)|\Z|(.))",  # (.): a token it refuses
    re.DOTALL,
)
# Streams on which a possessive run that goes on from where a failed attempt stopped
# (CPython 3.11.0-3.11.4 without _LAST_RESORT) ends elsewhere: the token it must stop
# before, where the run must end, the byte the split must refuse there
_PROBES: Final = (
    (b"N)\x94.", 1, b")"),  # CLOSE: its lookahead fails after the ")" is read
    (b"K\x01\x8c\x05ab", 2, b"\x8c"),  # a string cut short
    (b"N\x8a\x0b" + bytes(11), 1, b"\x8a"),  # an int longer than any DCP writes
)


def _grammar_fault(grammar: re.Pattern[bytes], events: re.Pattern[bytes]) -> str | None:
    """What ``grammar`` and ``events`` get wrong on :data:`_PROBES` (``None``: nothing).

    Cheap (a few matches of a dozen bytes), so checked once at import: a regular
    expression engine that misreads the grammar would refuse every file, or worse.
    """
    for data, end, refused in _PROBES:
        found = grammar.match(data)
        if found is None or found.end() != end:
            return f"ends a run of {data!r} at {found and found.end()}, not {end}"
        parts = events.split(data)
        if parts[1:6] != [data[:end], None, None, None, refused]:
            return f"splits {data!r} into {parts[:6]!r}"
    return None


_GRAMMAR_FAULT: Final = _grammar_fault(_GRAMMAR, _EVENTS)


# a tuple's slot holds False (no value a tuple may be: a fetched tuple is refused wherever it
# lands, even where an empty tuple would pass); a list's or dict's holds ()
_POISON_TUPLE: Final[dict[Any, bytes]] = {
    bytes([c]): bytes([c]) + b"\x89\x940" for c in b"\x85\x86\x87t"
}
# after a list or dict; None: a FRAME (dropped) or the end
_POISON_OTHER: Final[dict[Any, bytes]] = {b"]": b"])\x940", b"}": b"})\x940", None: b""}


def _frames(data: bytes) -> int:
    """How many FRAMEs the stream is made of, each length checked (``-1``: unframed).

    Python's pickler (protocol 4+) writes a chain of frames, each starting where the
    previous one ends. torch's reader fails on a frame longer than the file; this
    reader drops frames, so it checks them here, to refuse what torch cannot read.
    """
    if data[2:3] != b"\x95":
        return -1
    pos, size, count = 2, len(data), 0
    while pos < size:
        if data[pos] != 0x95 or pos + 9 > size:
            return -2  # not a plain chain: counted by the careful scan
        length = int.from_bytes(data[pos + 1 : pos + 9], "little")
        if length > size - pos - 9:
            raise _Bad(f"a frame at offset {pos} is longer than the rest of the file")
        pos += 9 + length
        count += 1
    return count


def _rewrite(pieces: list[bytes], *, frames: int = -2, careful: bool = False) -> tuple[bytes, int]:
    """The stream with container memo slots poisoned and FRAMEs dropped; its tuple count.

    Also the grammar check of layer 1 for each piece: a token the grammar refuses
    leaves bytes between two matches, and :class:`_Misaligned` is raised.
    ``careful``: a ``TensorProperties`` strides tuple made of ints only keeps its memo
    slot (a writer may share one tuple between tensors; a flat tuple of ints cannot
    nest, so sharing it costs nothing). Tried only when the fast pass found a fetched
    strides tuple, since it tokenizes the run before each strides tuple in Python.
    """
    out: list[bytes] = [pieces[0]]
    tuples = frame_events = 0
    for piece in pieces[1:]:
        if piece[:1] == b"L":
            out.append(piece[1:])
            continue
        # per event: [gap, run, tuple op, list/dict op, FRAME, refused token] (the groups
        # that did not take part are None), then the last gap. A refused token is an event
        # of its own, so the split never restarts inside a token (which would cost a scan
        # of the rest of the stream per byte).
        parts = _EVENTS.split(piece)
        if parts[5::6].count(None) != len(parts) // 6 or any(parts[0::6]):
            raise _Misaligned
        frame_events += len(parts[4::6]) - parts[4::6].count(None)
        tuple_ops = parts[2::6]
        tuples += len(tuple_ops) - tuple_ops.count(None)
        joined: list[bytes] = [b""] * (2 * len(tuple_ops))
        joined[0::2] = parts[1::6]  # the runs, unchanged
        joined[1::2] = map(
            _POISON_TUPLE.get, tuple_ops, map(_POISON_OTHER.__getitem__, parts[3::6])
        )
        if careful:
            _keep_int_strides(joined, parts[1::6], tuple_ops)
        del parts
        out.append(b"".join(joined))
    if frames >= 0 and frame_events != frames:
        # a frame that starts inside a token, or a FRAME opcode inside a frame: torch's
        # reader fails on such a stream, so this one refuses it too
        raise _Bad("its frames do not follow its opcodes")
    return b"".join(out), tuples


_INT_TOKEN: Final = re.compile(rb"K.|M..|J.{4}|\x8a.*", re.DOTALL)
_STRIDES_ARITY: Final = {b"\x85": 1, b"\x86": 2, b"\x87": 3}


def _keep_int_strides(joined: list[bytes], runs: list[bytes], ops: list[Any]) -> None:
    """Unpoison each tuple that ends a BUILD state (``... strides) BUILD``) and holds ints only.

    A strides tuple is the tuple event right before the state tuple's own ``t`` event
    (whose run is empty) and the ``b`` that starts the run after it. Its elements are
    the last tokens of its run (the run starts at an event, so it is token-aligned):
    ``n`` of them for TUPLE1-3, all after the run's last MARK for TUPLE.
    """
    for i in range(len(ops) - 2):
        op = ops[i]
        if op is None or ops[i + 1] != b"t" or runs[i + 1] or not runs[i + 2].startswith(b"b"):
            continue
        tokens = _TOKEN_RE.findall(runs[i])
        if op == b"t":
            if b"(" not in tokens:
                continue
            items = tokens[len(tokens) - tokens[::-1].index(b"(") :]
        else:
            n = _STRIDES_ARITY[op]
            items = tokens[-n:] if len(tokens) >= n else [b""]
        if all(map(_INT_TOKEN.fullmatch, items)):
            joined[2 * i + 1] = op + b"\x94"


class _SharedStrides(Exception):
    """A ``TensorProperties`` strides tuple was fetched from the memo (read carefully)."""


class _Misaligned(Exception):
    """The one-pass rewrite met a token it does not know: check with :func:`_scan`."""


_STACK_PER_LEVEL: Final = 128  # bytes of C stack one level of hashing a nested tuple takes (~80)
_MAX_STACK: Final = 1 << 31


def _load_deep(stream: bytes, tuples: int, trusted: Mapping[str, type[_Trusted]]) -> Any:
    """Unpickle in a thread whose C stack fits hashing tuples nested ``tuples`` deep.

    Layer 1 stops most nesting, not all of it (``((t, 1), 2)`` built element by element
    is legal pickle), and CPython hashes a tuple recursively in C: a dict key nested
    10^6 deep overflows an 8 MiB stack. Nesting cannot be deeper than there are tuples.
    """
    need = (16 << 20) + _STACK_PER_LEVEL * tuples
    if need > _MAX_STACK:
        raise _Bad(
            f"{tuples} tuples: more than this reader's C stack ({_MAX_STACK >> 20} MiB) fits"
        )
    result: list[Any] = []

    def run() -> None:
        try:
            # buffered: without FRAMEs the unpickler would call read() once per opcode
            reader = io.BufferedReader(io.BytesIO(stream), 1 << 16)
            result.append(_Unpickler(reader, trusted).load())
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
            result.append(err)

    with _STACK_LOCK:
        old = threading.stack_size(max(need, 1 << 20))
        try:
            worker = threading.Thread(target=run, name="dsdmerge-dcp-metadata")
            worker.start()
        finally:
            threading.stack_size(old)
    worker.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


_STACK_LOCK = threading.Lock()


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


class _PathToken(metaclass=_Sealed):
    """What a pickled ``pathlib`` path unpickles to: its class name and parts, inert."""

    __slots__ = ("name", "parts")
    name: str
    parts: tuple[Any, ...]

    def __init__(self, name: str, parts: tuple[Any, ...]) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "parts", parts)

    def __setattr__(self, name: str, value: Any) -> None:
        raise _Refused(f"setting {name!r} on a stand-in")


class _PathFactory(metaclass=_Sealed):
    """A callable stand-in for a ``pathlib`` class (no ``__dict__``, nothing to set)."""

    __slots__ = ("_name",)
    _name: str

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise _Refused(f"setting {name!r} on a stand-in")

    def __call__(self, *parts: Any) -> _PathToken:
        return _PathToken(self._name, parts)


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
# Python 3.11.0-3.11.4 pickle an Enum member by name, ``getattr(cls, "NAME")``, where other
# versions write ``cls(value)``: DCP's ``_MEM_FORMAT_ENCODING`` member in every
# TensorProperties. ``builtins.getattr`` stands for exactly that lookup and nothing else
# (the real getattr is never called).
_MEMORY_FORMAT_NAMES: Final = {
    "TORCH_CONTIGUOUS_FORMAT": 0,
    "TORCH_CHANNELS_LAST": 1,
    "TORCH_PRESERVE_FORMAT": 2,
}


def _enum_member(owner: Any, name: Any) -> Any:
    if owner is not _CALL_MEMORY_FORMAT or type(name) is not str:
        raise _Refused("builtins.getattr other than a DCP memory format's name")
    if name not in _MEMORY_FORMAT_NAMES:
        raise _Bad("an unknown memory format name")
    return _MEMORY_FORMATS[_MEMORY_FORMAT_NAMES[name]]


_CALL_ENUM_MEMBER: Final = _Call(_enum_member)


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
    if module == "builtins" and name == "getattr":
        return _CALL_ENUM_MEMBER
    return None


class _Trusted(_Record):
    """Base of the stand-ins for classes the caller trusted by name (one subclass each)."""

    real: Any = None  # the caller's class (set when the stand-in class is made)


def _trusted_stand_ins(trusted: Mapping[str, type]) -> dict[str, type[_Trusted]]:
    """A fresh stand-in class per trusted ``module.Name`` class (inert, like DCP's)."""
    made: dict[str, type[_Trusted]] = {}
    for name, real in trusted.items():
        made[name] = _Sealed(f"_{real.__name__}", (_Trusted,), {"real": real})  # type: ignore[assignment]
    return made


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: Any, trusted: Mapping[str, type[_Trusted]]) -> None:
        super().__init__(file)
        self._trusted = trusted

    def find_class(self, module: str, name: str) -> Any:
        found = _stand_in(module, name)
        if found is None:
            found = self._trusted.get(f"{module}.{name}")
        if found is None:
            raise _Refused(shown_name(f"{module}.{name}"))
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


def _opt_str(value: Any, what: str) -> None:
    if value is not None and type(value) is not str:
        raise _Bad(f"{what} is not a string")


# The checks below run column by column through C-level builtins (``map``, ``set``,
# ``operator``), not one Python statement per record: at DeepSeek-V3 scale there are
# millions of records, and a per-record loop would cost more than the unpickling.


_vars: Final = operator.attrgetter("__dict__")  # C speed, unlike a Python function


def _all_of(values: Any, types: frozenset[type], what: str) -> None:
    found = set(map(type, values))
    if not found <= types:
        names = sorted(t.__name__.lstrip("_") for t in found - types)
        raise _Bad(f"{what}: found {', '.join(names[:3])}")


def _records(objs: list[Any], cls: type, fields: frozenset[str], what: str) -> list[Any]:
    """The ``__dict__`` of each record, checked to be ``cls`` with exactly ``fields``."""
    _all_of(objs, frozenset({cls}), what)
    dicts = list(map(_vars, objs))
    if not all(map(operator.eq, map(dict.keys, dicts), itertools.repeat(fields))):
        raise _Bad(f"{what}: a record without exactly the fields {sorted(fields)}")
    return dicts


def _sizes(values: list[Any], what: str) -> None:
    _all_of(values, frozenset({torch.Size}), what)
    if max(map(len, values), default=0) > MAX_DIMS:
        raise _Bad(f"{what}: more than {MAX_DIMS} dimensions")
    if min(map(min, filter(None, values)), default=0) < 0:
        raise _Bad(f"{what}: a negative size")


def _become(objs: Any, real: type) -> None:
    collections.deque(map(setattr, objs, itertools.repeat("__class__"), itertools.repeat(real)), 0)


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
_TP_TYPES: Final = (torch.dtype, torch.layout, bool, torch.memory_format, bool)


def _properties(states: list[Any]) -> tuple[tuple[str, ...], list[Any]]:
    """Check ``TensorProperties`` states; return the installed torch's fields and states.

    The states come back as the installed torch's ``__setstate__`` would complete them.

    Every torch pickles ``(dtype, layout, requires_grad, memory format, pin_memory)``;
    torch >= 2.15 adds ``strides`` (``None`` or a tuple of ints) and reads a 5-field state
    with ``strides=None``. A torch without ``strides`` fails on a 6-field state (so does
    this reader, saying why).
    """
    fields = tensor_properties_fields()
    _all_of(states, frozenset({tuple}), "tensor properties")
    lengths = set(map(len, states))
    if lengths - {5, 6}:
        raise _Bad("tensor properties are not a 5- or 6-tuple")
    for column, kind, name in zip(
        zip(*states, strict=False), _TP_TYPES, TENSOR_PROPERTIES_BASE, strict=False
    ):
        _all_of(column, frozenset({kind}), f"tensor properties' {name}")
    if fields == TENSOR_PROPERTIES_BASE:
        if 6 in lengths:
            raise _Newer(
                f"tensor properties with strides, which torch >= 2.15 writes and this torch "
                f"({torch.__version__}) cannot read (its own DCP reader fails on them too); "
                "read it with torch >= 2.15"
            )
        return fields, states
    if fields != (*TENSOR_PROPERTIES_BASE, "strides"):
        raise _Newer(
            f"this torch's ({torch.__version__}) DCP TensorProperties has the fields "
            f"{list(fields)}, which this version of dsdmerge does not know; upgrade dsdmerge"
        )
    strides = list(map(operator.itemgetter(5), filter(_six, states)))
    if False in strides:  # a poisoned slot: a strides tuple the writer shared
        raise _SharedStrides
    _all_of(strides, frozenset({tuple, type(None)}), "tensor properties' strides")
    given = list(filter(None, strides))
    if max(map(len, given), default=0) > MAX_DIMS:
        raise _Bad(f"tensor properties' strides: more than {MAX_DIMS} dimensions")
    numbers = list(itertools.chain.from_iterable(given))
    _all_of(numbers, frozenset({int}), "tensor properties' strides")
    if min(numbers, default=0) < 0:
        raise _Bad("tensor properties' strides: a negative stride")
    if 5 in lengths:  # what __setstate__ does with a state written by torch <= 2.14
        states = [t if len(t) == 6 else (*t, None) for t in states]
    return fields, states


def _six(state: tuple[Any, ...]) -> bool:
    return len(state) == 6


def _convert(root: Any, *, budget: int, trusted: frozenset[type[_Trusted]] = frozenset()) -> Any:
    """Validate the stand-in tree and turn it into DCP's real classes (layer 4)."""
    from torch.distributed.checkpoint import metadata as md

    RealStorageInfo = storage_info_class()

    if type(root) is not _Metadata:
        raise _NotMetadata(type(root).__name__.lstrip("_"))
    top = _fields(root, _Metadata, _MD_REQ, _MD_OPT)
    sdm = top["state_dict_metadata"]
    if type(sdm) is not dict:
        raise _Bad("state_dict_metadata is not a dict")
    _all_of(sdm, frozenset({str}), "a state_dict_metadata key")
    values = list(sdm.values())
    _all_of(values, frozenset({_TensorStorageMetadata, _BytesStorageMetadata}), "an entry")
    plain = [v for v in values if type(v) is _BytesStorageMetadata]
    if any(map(len, map(_vars, plain))):
        raise _Bad("a BytesStorageMetadata with fields")
    tensors = [v for v in values if type(v) is _TensorStorageMetadata]
    tsm = _records(tensors, _TensorStorageMetadata, _TSM_F, "a tensor entry")
    props = list(map(operator.itemgetter("properties"), tsm))
    sizes = list(map(operator.itemgetter("size"), tsm))
    chunk_lists = list(map(operator.itemgetter("chunks"), tsm))
    _sizes(sizes, "a tensor size")
    states = list(
        map(
            operator.itemgetter("_state"),
            _records(props, _TensorProperties, _TP_F, "tensor properties"),
        )
    )
    fields, states = _properties(states)
    _all_of(chunk_lists, frozenset({list}), "a tensor's chunks")
    chunks = list(itertools.chain.from_iterable(chunk_lists))
    cd = _records(chunks, _ChunkStorageMetadata, _CHUNK_F, "a chunk")
    offsets = list(map(operator.itemgetter("offsets"), cd))
    extents = list(map(operator.itemgetter("sizes"), cd))
    _sizes(offsets, "a chunk offset")
    _sizes(extents, "a chunk size")
    ndims = list(
        itertools.chain.from_iterable(map(itertools.repeat, map(len, sizes), map(len, chunk_lists)))
    )
    if list(map(len, offsets)) != ndims or list(map(len, extents)) != ndims:
        raise _Bad("a chunk with another number of dimensions than its tensor")

    planner = top.get("planner_data")
    if planner is not None:
        _check_planner(planner, budget)
    storage = top.get("storage_data")
    if storage is not None:
        if type(storage) is not dict:
            raise _Bad("storage_data is not a dict")
        indexes = list(storage)
        infos = list(storage.values())
        _all_of(indexes, frozenset({_MetadataIndex}), "a storage index")
        _all_of(infos, frozenset({_StorageInfo}) | trusted, "a storage entry")
        idx = list(map(_vars, indexes))
        custom = [v for v in infos if type(v) is not _StorageInfo] if trusted else []
        if custom:
            _check_trusted(custom)
        if not all(map(operator.le, map(dict.keys, idx), itertools.repeat(_MI_REQ | _MI_OPT))):
            raise _Bad("a storage index with other fields")
        if not all(map(operator.contains, map(dict.keys, idx), itertools.repeat("fqn"))):
            raise _Bad("a storage index without an fqn")
        _all_of(map(operator.itemgetter("fqn"), idx), frozenset({str}), "a storage index's fqn")
        offsets_ = list(map(dict.get, idx, itertools.repeat("offset")))
        _all_of(offsets_, frozenset({torch.Size, type(None)}), "a storage offset")
        _sizes(list(filter(None, offsets_)), "a storage offset")
        hints = map(dict.get, idx, itertools.repeat("index"))
        _all_of(hints, frozenset({int, type(None)}), "a storage index hint")
        info = list(map(_vars, [v for v in infos if type(v) is _StorageInfo] if custom else infos))
        if not all(map(operator.le, map(dict.keys, info), itertools.repeat(_SI_REQ | _SI_OPT))):
            raise _Bad("a storage entry with other fields")
        if not all(map(operator.le, itertools.repeat(_SI_REQ), map(dict.keys, info))):
            raise _Bad("a storage entry without a relative_path, offset and length")
        _all_of(
            map(operator.itemgetter("relative_path"), info), frozenset({str}), "a relative_path"
        )
        numbers = list(map(operator.itemgetter("offset"), info))
        numbers += map(operator.itemgetter("length"), info)
        _all_of(numbers, frozenset({int}), "a storage offset or length")
        if min(numbers, default=0) < 0:
            fqn = next(
                i.__dict__["fqn"]
                for i, d in storage.items()
                if type(d) is _StorageInfo and min(d.__dict__["offset"], d.__dict__["length"]) < 0
            )
            raise _Bad(f"the storage entry of {fqn!r} has a negative offset or length")
        descriptors = list(
            filter(None, map(dict.get, info, itertools.repeat("transform_descriptors")))
        )
        for td in descriptors:
            if type(td) not in (list, tuple) or any(type(t) is not str for t in td):
                raise _Bad("transform_descriptors are not strings")
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
            name, parts = cid.name, cid.parts
            if not all(type(p) is str for p in parts) or len(parts) > MAX_TUPLE:
                raise _Bad("storage_meta.checkpoint_id is not a path")
            try:
                m["checkpoint_id"] = getattr(pathlib, name)(*parts)
            except Exception as err:  # noqa: BLE001 - e.g. a WindowsPath on Linux, as with torch
                raise _Bad(f"storage_meta.checkpoint_id: {err}") from None
        else:
            _opt_str(cid, "storage_meta.checkpoint_id")
    _opt_str(top.get("version"), "version")

    # every value has been checked: only now do the stand-ins become DCP's classes
    collections.deque(
        map(
            setattr,
            props,
            itertools.repeat("__dict__"),
            map(dict, map(zip, itertools.repeat(fields), states)),
        ),
        0,
    )
    _become(props, md.TensorProperties)
    _become(chunks, md.ChunkStorageMetadata)
    _become(tensors, md.TensorStorageMetadata)
    _become(plain, md.BytesStorageMetadata)
    if storage is not None:
        _become(indexes, md.MetadataIndex)
        if custom:
            dcp_infos = [v for v in infos if type(v) is _StorageInfo]
            for cls in {type(v) for v in custom}:
                try:
                    _become([v for v in custom if type(v) is cls], cls.real)
                except TypeError as err:
                    raise _Bad(
                        f"{_name(cls.real)} cannot be built without running its code: {err}"
                    ) from None
        else:
            dcp_infos = infos
        _become(dcp_infos, RealStorageInfo)
        top["storage_data"] = dict(zip(indexes, infos, strict=True))  # MetadataIndex's own hash
    if meta is not None:
        _become([meta], md.StorageMeta)
    _become([root], md.Metadata)
    return root


_TP_F: Final = frozenset({"_state"})
_PLAIN: Final[frozenset[type]] = frozenset({str, int, float, bool, type(None)})
_DCP_FIELD_TYPES: Final = (("relative_path", str), ("offset", int), ("length", int))


def _name(cls: type) -> str:
    return shown_name(f"{cls.__module__}.{cls.__qualname__}")


def _check_trusted(objs: list[Any]) -> None:
    """Storage entries of classes the caller trusted: plain fields, DCP's typed as DCP's."""
    for cls in {type(v) for v in objs}:
        real = cls.real
        name = _name(real)
        dicts = [v.__dict__ for v in objs if type(v) is cls]
        keys = set(itertools.chain.from_iterable(dicts))
        _all_of(keys, frozenset({str}), f"a field name of {name}")
        if dataclasses.is_dataclass(real):
            allowed = {f.name for f in dataclasses.fields(real)}
            if not keys <= allowed:
                raise _Bad(f"a {name} with fields {sorted(keys - allowed)[:8]} it does not have")
        values = itertools.chain.from_iterable(map(dict.values, dicts))
        _all_of(values, _PLAIN, f"a field of {name}")
        for field, kind in _DCP_FIELD_TYPES:
            column = [d[field] for d in dicts if field in d]
            _all_of(column, frozenset({kind}), f"{name}.{field}")
            if kind is int and min(column, default=0) < 0:
                raise _Bad(f"a {name} with a negative {field}")


def _check_planner(planner: Any, budget: int) -> None:
    if type(planner) is not dict:
        raise _Bad("planner_data is not a dict")
    _all_of(planner, frozenset({str}), "a planner_data key")
    paths = list(planner.values())
    _all_of(paths, frozenset({tuple, list}), "a planner_data path")
    if min(map(len, paths), default=1) < 1:
        raise _Bad("an empty planner_data path")
    _all_of(map(operator.itemgetter(0), paths), frozenset({str}), "a planner_data path's start")
    total = sum(map(len, paths))
    if total > budget:
        raise _Bad("planner_data paths are longer than the file")
    parts = list(itertools.chain.from_iterable(paths))
    _all_of(parts, frozenset({str, int}), "a planner_data path part")
    ints = [p for p in parts if type(p) is int]
    if ints and (min(ints) < 0 or max(ints) > budget):
        raise _Bad("a planner_data list index out of bounds")


# --------------------------------------------------------------------------------------


def load_metadata(data: bytes, *, where: str, trusted: Mapping[str, type] | None = None) -> Any:
    """Unpickle a DCP ``.metadata`` file's bytes safely (see the module docstring).

    Args:
        data: The file's bytes.
        where: The file's path, for error messages.
        trusted: ``{"module.Name": class}``: storage-entry classes a storage writer other
            than DCP's own pickled (OLMo-core's ``_StorageInfo``), admitted where DCP's
            ``_StorageInfo`` stands and built the same restricted way: a stand-in first,
            its fields checked to be plain values (strings, numbers, ``None``; the
            dataclass fields of ``class`` when it is one), and only then made an
            instance of ``class`` by ``__class__`` assignment (no code of it runs).

    Returns:
        A ``torch.distributed.checkpoint.metadata.Metadata``.

    Raises:
        UnsafeCheckpointError: The pickle references a global outside the
            allow-list, or uses an opcode DCP never writes (nothing has run).
        CheckpointReadError: The file is corrupt, truncated or not DCP metadata.
    """
    if _GRAMMAR_FAULT is not None:
        raise CheckpointReadError(
            f"{where}: DCP metadata cannot be read safely on Python {platform.python_version()}: "
            f"its re module misreads this reader's token grammar (it {_GRAMMAR_FAULT}); "
            "use another Python (3.11.5 or newer)",
            path=where,
        )
    try:
        try:  # usually one pass; a long string or a refused token needs the careful scan
            if len(data) < 2 or data[0] != 0x80 or data[1] not in (2, 3, 4, 5):
                raise _Bad("not a pickle of protocol 2-5")
            frames = _frames(data)
            stream, tuples = _rewrite([data[:2], data[2:]], frames=frames)
        except _Misaligned:
            stream, tuples = _rewrite(_scan(data), frames=_frames(data))
        stand_ins = _trusted_stand_ins(trusted or {})
        classes = frozenset(stand_ins.values())
        with gc_paused():
            root = _load_deep(stream, tuples, stand_ins)
            del stream
            try:
                return _convert(root, budget=len(data), trusted=classes)
            except _SharedStrides:
                del root
            stream, tuples = _rewrite(_scan(data), frames=_frames(data), careful=True)
            root = _load_deep(stream, tuples, stand_ins)
            del stream
            try:
                return _convert(root, budget=len(data), trusted=classes)
            except _SharedStrides:
                raise _Bad("a tensor's strides are a fetched tuple that is not only ints") from None
    except _Refused as err:
        raise UnsafeCheckpointError(
            f"{where}: refused to unpickle: it uses {err}, which DCP metadata never holds "
            "(only DCP metadata classes, torch sizes, dtypes, layouts, paths and the storage "
            "classes named in trusted=[...] are allowed), "
            "so unpickling it could run code or exhaust memory; nothing was run.",
            path=where,
        ) from None
    except _NotMetadata as err:
        raise CheckpointReadError(f"{where}: holds a {err}, not DCP Metadata", path=where) from None
    except _Newer as err:
        raise CheckpointReadError(f"{where}: {err}", path=where) from None
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
