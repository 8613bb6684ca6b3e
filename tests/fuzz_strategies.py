"""Hypothesis strategies for hostile checkpoint files (used by tests/hostile_files.py).

Each strategy draws a *case*: bytes for one file (or a DCP directory), a bounded repr,
``write(dir) -> path`` and ``check_view(path)``, which checks a successful read is
faithful to what the file says.

* ``metadata_files``: DCP ``.metadata`` pickles, mutated from a real one (byte flips,
  opcode snippets spliced in, cuts) or synthesized from snippets: every opcode with
  small and huge arguments, allow-listed globals with hostile arguments, globals
  outside the list, BUILD on classes and functions, memo tricks (fetches and stores
  of any index), huge integers, deep nesting, and the known attacks on readers.
* ``safetensors_files``: headers built from a valid one with hostile fields.
* ``zip_files``: torch zip archives whose members are mutated.
"""

from __future__ import annotations

import functools
import io
import itertools
import json
import pickle
import struct
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import hostile_files as hf
import torch
from hypothesis import strategies as st

# -- snippets -----------------------------------------------------------------------------

_ALLOWED_GLOBALS = [
    (hf.DCP, name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "MetadataIndex",
        "_MEM_FORMAT_ENCODING",
    )
] + [
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch", "float32"),
    ("torch", "bfloat16"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "Path"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePath"),
]
_OTHER_GLOBALS = [
    ("os", "system"),
    ("builtins", "exec"),
    ("builtins", "bytearray"),
    ("builtins", "getattr"),
    ("torch", "strided"),
    ("pathlib", "Path.exists"),
    ("shutil", "rmtree"),
]
_SCALARS = [
    hf.NONE,
    b"\x88",
    b"\x89",
    hf.i(0),
    hf.i(7),
    hf.i(300),
    hf.i(-5),
    hf.i(2**40),
    hf.i(-(2**63)),
    hf.i(10**30),
    hf.i(2**100000),  # LONG4, 12 KB
    hf.s(""),
    hf.s("w"),
    hf.s("torch.strided"),
    hf.s("x" * 300),
    b"G" + struct.pack(">d", float("inf")),
    b"G" + struct.pack(">d", float("nan")),
]


def _opcode_with_args(draw: st.DrawFn) -> bytes:
    """Any opcode byte followed by arguments of any length (mostly garbage)."""
    op = draw(st.integers(0, 255))
    arg = draw(
        st.one_of(
            st.just(b""),
            st.binary(max_size=9),
            st.sampled_from(
                [
                    struct.pack("<I", 2**26),
                    struct.pack("<I", 2**31),
                    struct.pack("<Q", 2**31),
                    struct.pack("<Q", 2**62),
                    b"\xff\xff\xff\xff",
                    b"os\nsystem\n",
                    b"builtins\nexec\n",
                    b"12345678901234567890\n",
                ]
            ),
        )
    )
    return bytes([op]) + arg


@st.composite
def _snippet(draw: st.DrawFn) -> bytes:
    kind = draw(
        st.sampled_from(
            [
                "opcode",
                "scalar",
                "global",
                "other_global",
                "reduce",
                "build_class",
                "memo",
                "nest",
                "record",
                "attack",
            ]
        )
    )
    if kind == "opcode":
        return _opcode_with_args(draw)
    if kind == "scalar":
        return draw(st.sampled_from(_SCALARS))
    if kind == "global":
        return hf.g(*draw(st.sampled_from(_ALLOWED_GLOBALS))) + draw(
            st.sampled_from([b"", hf.MEMO])
        )
    if kind == "other_global":
        module, name = draw(st.sampled_from(_OTHER_GLOBALS))
        text = draw(st.booleans())
        return (b"c" + f"{module}\n{name}\n".encode()) if text else hf.g(module, name)
    if kind == "reduce":  # an allow-listed callable with hostile arguments
        callee = hf.g(*draw(st.sampled_from(_ALLOWED_GLOBALS)))
        args = b"".join(draw(st.lists(st.sampled_from(_SCALARS), max_size=3)))
        return callee + hf.MARK + args + hf.TUPLE + hf.REDUCE
    if kind == "build_class":  # BUILD on a class or function: patches it in plain pickle
        module, name = draw(st.sampled_from(_ALLOWED_GLOBALS))
        attr = draw(st.sampled_from(["exists", "_str", "cache", "__init__", "fqn", "x"]))
        return hf.build_on_class_allowed(module, name, attr)[2:-1]
    if kind == "memo":
        idx = draw(st.sampled_from([0, 1, 2, 5, 255, 256, 4096, 2**26, 2**31]))
        op = draw(st.sampled_from([b"\x94", b"h", b"j", b"q", b"r", b"g", b"p"]))
        if op == b"\x94":
            return op
        if op in (b"h", b"q"):
            return op + bytes([idx % 256])
        if op in (b"j", b"r"):
            return op + struct.pack("<I", idx % 2**32)
        return op + str(idx).encode() + b"\n"
    if kind == "nest":
        depth = draw(st.sampled_from([2, 50, 1000, 100_000]))
        shape = draw(st.sampled_from(["tuple1", "tuple2", "list", "dict"]))
        if shape == "tuple1":
            return hf.EMPTY_TUPLE + (hf.TUPLE1 + hf.MEMO) * depth
        if shape == "tuple2":
            return hf.EMPTY_TUPLE + (hf.NONE + hf.TUPLE2 + hf.MEMO) * depth
        if shape == "list":
            return hf.EMPTY_LIST * depth + hf.APPEND * (depth - 1)
        return (hf.EMPTY_DICT + hf.s("k")) * depth + hf.NONE + hf.SETITEM * depth
    if kind == "record":
        return hf.record(
            draw(
                st.sampled_from(["TensorStorageMetadata", "BytesStorageMetadata", "MetadataIndex"])
            ),
            {
                draw(
                    st.sampled_from(["size", "fqn", "chunks", "__class__", "__dict__", "x"])
                ): draw(st.sampled_from([*_SCALARS, hf.size(2, 3), hf.size(2**62)]))
            },
        )
    attack = draw(
        st.sampled_from(["bytearray", "memo", "bytes", "planner", "hash", "deep", "shared"])
    )
    return {
        "bytearray": hf.bytearray_bomb,
        "memo": hf.memo_bomb,
        "bytes": hf.bytes_bomb,
        "planner": hf.planner_bomb,
        "hash": functools.partial(hf.hash_bomb, 30),
        "deep": functools.partial(hf.deep_tuple_key, 200_000),
        "shared": functools.partial(hf.shared_state_bomb, 2000, 200),
    }[attack]()[2:-1]


# -- a real checkpoint to mutate ------------------------------------------------------------


@functools.cache
def _real_dcp() -> tuple[bytes, dict[str, bytes]]:
    """``.metadata`` and data files of a small nested optimizer checkpoint."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    with tempfile.TemporaryDirectory() as tmp:
        hf.dcp_checkpoint(Path(tmp) / "c", {"model": model.state_dict(), "optim": opt.state_dict()})
        files = {p.name: p.read_bytes() for p in (Path(tmp) / "c").iterdir()}
    return files.pop(".metadata"), files


def warm_up() -> None:
    """Build the sample files (and with them every cache pickling fills) ahead of time."""
    _real_dcp()
    _real_zip()
    from safetensors.torch import save_file

    from dsdmerge.integrations import load_checkpoint, read_metadata

    with tempfile.TemporaryDirectory() as tmp:
        paths = [
            MetadataCase(".metadata", _real_dcp()[0], "real").write(Path(tmp)),
            ZipCase("zip", _real_zip(), "real").write(Path(tmp)),
            Path(tmp, "m.safetensors"),
        ]
        save_file({"a": torch.zeros(2)}, str(paths[-1]), metadata={"format": "pt"})
        for path in paths:
            read_metadata(path)
            load_checkpoint(path)


@functools.cache
def _synth_valid() -> bytes:
    """A Metadata as DCP pickles it (protocol 4), of tensors, bytes entries and paths."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    sdm: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, Any] = {}
    for k in range(4):
        key = f"layers.{k}.w"
        shape = torch.Size([2, k + 1])
        chunk = ChunkStorageMetadata(torch.Size([0, 0]), shape)
        sdm[key] = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), shape, [chunk])
        storage[MetadataIndex(key, [0, 0], 0)] = _StorageInfo("__0_0.distcp", 0, 4)
        planner[key] = ("layers", k, "w")
    sdm["step"] = BytesStorageMetadata()
    storage[MetadataIndex("step")] = _StorageInfo("__0_0.distcp", 0, 4)
    planner["step"] = ("step",)
    md = Metadata(sdm, planner_data=planner, storage_data=storage)
    if hasattr(md, "version"):  # torch >= 2.7 records a metadata version
        md.version = "1.0.0"
    return pickle.dumps(md, protocol=4)


class _Case:
    def __init__(self, name: str, data: bytes, how: str) -> None:
        self.name = name
        self.data = data
        self.how = how

    def __repr__(self) -> str:
        head = self.data[:120]
        return f"{type(self).__name__}({self.how}, {len(self.data)} bytes, {head!r}...)"


class MetadataCase(_Case):
    overlap = False  # storage entries whose byte ranges overlap: every load must refuse

    def write(self, where: Path) -> Path:
        target = Path(tempfile.mkdtemp(dir=where))
        for name, blob in _real_dcp()[1].items():
            (target / name).write_bytes(blob)
        (target / ".metadata").write_bytes(self.data)
        return target

    def check_view(self, path: Path) -> None:
        # the safe reader accepted it: then torch's own unrestricted read gives the same
        from dsdmerge.integrations._dcp import read_dcp_view

        ours = read_dcp_view(str(path), trusted=False)[1]
        theirs = pickle.loads(self.data)
        assert ours == theirs, f"{self!r}: the safe reader's Metadata differs from pickle's"
        if self.overlap:
            import dsdmerge as dm
            from dsdmerge.integrations import load_checkpoint

            try:
                load_checkpoint(path)
            except dm.CheckpointReadError as err:
                if "overlap" not in str(err):
                    raise AssertionError(f"{self!r}: refused, not for the overlap: {err}") from err
            else:
                raise AssertionError(f"{self!r}: overlapping storage entries were loaded")


def _overlaps(ranges: list[tuple[str, int, int]]) -> bool:
    spans = sorted((rel, o, o + n) for rel, o, n in ranges if n)
    return any(a[0] == b[0] and a[2] > b[1] for a, b in itertools.pairwise(spans))


@st.composite
def _storage_ranges(draw: st.DrawFn) -> MetadataCase:
    """The real checkpoint with some storage entries moved: overlapping or not, in range or
    past the end of the data file."""
    real, files = _real_dcp()
    md = pickle.loads(real)  # the test's own file
    size = len(files["__0_0.distcp"])
    infos = list(md.storage_data.values())
    for info in draw(st.lists(st.sampled_from(infos), min_size=1, max_size=len(infos))):
        if draw(st.booleans()):  # onto another entry's bytes, whole or in part
            other = draw(st.sampled_from(infos))
            info.offset = other.offset + draw(st.integers(0, max(other.length - 1, 0)))
            info.length = draw(st.integers(0, other.length + 8))
        else:
            info.offset = draw(st.integers(0, size + 4))
            info.length = draw(st.integers(0, size + 4))
    case = MetadataCase(".metadata", pickle.dumps(md, protocol=4), "ranges")
    in_file = all(i.offset + i.length <= size for i in infos)
    case.overlap = in_file and _overlaps([(i.relative_path, i.offset, i.length) for i in infos])
    return case


@st.composite
def metadata_files(draw: st.DrawFn) -> MetadataCase:
    real, _ = _real_dcp()
    how = draw(
        st.sampled_from(["valid", "rename", "flip", "splice", "cut", "synth", "wrap", "ranges"])
    )
    if how == "ranges":  # storage entries moved onto each other's bytes (or not)
        return draw(_storage_ranges())
    if how == "valid":  # DCP's own file, or one written the way DCP writes them
        return MetadataCase(".metadata", draw(st.sampled_from([real, _synth_valid()])), how)
    if how == "rename":  # a key renamed in place: still valid, and the view must follow
        old = b"\x8c\x0cmodel.weight"
        new = b"\x8c\x0c" + draw(st.text("abcdefghijklmnop.", min_size=12, max_size=12)).encode()
        return MetadataCase(".metadata", real.replace(old, new), how)
    if how == "flip":
        data = bytearray(real)
        for _ in range(draw(st.integers(1, 4))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        return MetadataCase(".metadata", bytes(data), how)
    if how == "splice":
        at = draw(st.integers(2, len(real) - 1))
        cut = draw(st.integers(0, 8))
        return MetadataCase(".metadata", real[:at] + draw(_snippet()) + real[at + cut :], how)
    if how == "cut":
        return MetadataCase(".metadata", real[: draw(st.integers(0, len(real)))], how)
    body = b"".join(draw(st.lists(_snippet(), min_size=1, max_size=6)))
    if how == "wrap":  # hostile parts inside an otherwise valid Metadata
        entry = hf.bytes_entry()
        return MetadataCase(
            ".metadata",
            hf.metadata({"w": entry}, planner={"w": body + hf.s("w") + hf.TUPLE1}),
            how,
        )
    return MetadataCase(".metadata", hf.PROTO4 + body + hf.STOP, how)


# -- safetensors ----------------------------------------------------------------------------


class SafetensorsCase(_Case):
    def write(self, where: Path) -> Path:
        path = Path(tempfile.mkdtemp(dir=where)) / "model.safetensors"
        path.write_bytes(self.data)
        return path

    def check_view(self, path: Path) -> None:
        from safetensors.torch import load_file

        from dsdmerge.integrations import read_metadata

        view = read_metadata(path)
        loaded = load_file(str(path))
        assert list(view) == list(loaded), self
        for key, tensor in loaded.items():
            assert view[key].shape == tuple(tensor.shape), (self, key)
            assert view[key].dtype == tensor.dtype, (self, key)


_HOSTILE_VALUES = [
    "12",
    [2, "3"],
    [10**12],
    [-1],
    [2**64],
    [1] * 100,
    None,
    ["F32"],
    {"a": 1},
    float("inf"),
    "<5000 digits>",
]


@st.composite
def safetensors_files(draw: st.DrawFn) -> SafetensorsCase:
    header: dict[str, Any] = {
        "__metadata__": {"format": "pt", "step": "7"},
        "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
        "b": {"dtype": "BF16", "shape": [3], "data_offsets": [16, 22]},
    }
    data = bytes(22)
    how = draw(st.sampled_from(["valid", "field", "metadata", "deep", "raw", "length", "utf16"]))
    if how == "field":
        name = draw(st.sampled_from(["a", "b"]))
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        header[name][field] = draw(st.sampled_from([*_HOSTILE_VALUES, "F64", "U8", "F8_E4M3"]))
    elif how == "metadata":
        header["__metadata__"] = draw(st.sampled_from([{"format": 1}, ["pt"], {"x": None}, "pt"]))
    elif how == "deep":
        depth = draw(st.sampled_from([100, 10_000, 200_000]))
        raw = ("[" * depth + "]" * depth).encode()
        return SafetensorsCase(
            "st", hf.safetensors_file(None, data, raw=b'{"a":' + raw + b"}"), how
        )
    elif how == "raw":
        raw = draw(
            st.sampled_from([b"{", b"[]", b'{"a": Infinity}', b'{"a": NaN}', b"\xff\xfe{\x00"])
        )
        return SafetensorsCase("st", hf.safetensors_file(None, data, raw=raw), how)
    elif how == "length":
        body = json.dumps(header).encode()
        length = draw(st.sampled_from([0, 1, len(body) + 1, 2**40, 2**63]))
        return SafetensorsCase("st", struct.pack("<Q", length) + body + data, how)
    elif how == "utf16":
        body = json.dumps(header).encode("utf-16")
        return SafetensorsCase("st", hf.safetensors_file(None, data, raw=body), how)
    body = json.dumps(header).replace('"<5000 digits>"', "7" * 5000).encode()
    return SafetensorsCase("st", hf.safetensors_file(None, data, raw=body), how)


# -- torch zip members ----------------------------------------------------------------------


class ZipCase(_Case):
    def write(self, where: Path) -> Path:
        path = Path(tempfile.mkdtemp(dir=where)) / "ckpt.pt"
        path.write_bytes(self.data)
        return path

    def check_view(self, path: Path) -> None:
        import dsdmerge as dm
        from dsdmerge.integrations import read_metadata

        view = read_metadata(path)
        loaded = torch.load(path, weights_only=True, map_location="meta")
        assert list(view) == list(dm.flatten(loaded)), self


@functools.cache
def _real_zip() -> bytes:
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(2, 3), "opt": {"lr": 0.1, "betas": (0.9, 0.99)}}, buf)
    return buf.getvalue()


@st.composite
def zip_files(draw: st.DrawFn) -> ZipCase:
    real = _real_zip()
    src = zipfile.ZipFile(io.BytesIO(real))
    members = {info.filename: src.read(info) for info in src.infolist()}
    name = draw(st.sampled_from(sorted(members)))
    how = draw(st.sampled_from(["flip", "splice", "cut", "drop"]))
    blob = bytearray(members[name])
    if how == "flip" and blob:
        for _ in range(draw(st.integers(1, 3))):
            blob[draw(st.integers(0, len(blob) - 1))] = draw(st.integers(0, 255))
    elif how == "splice" and name.endswith(".pkl"):
        at = draw(st.integers(0, len(blob)))
        blob[at:at] = draw(_snippet())
    elif how == "cut":
        del blob[draw(st.integers(0, len(blob))) :]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for member, data in members.items():
            if how == "drop" and member == name:
                continue
            dst.writestr(member, bytes(blob) if member == name else data)
    return ZipCase("zip", out.getvalue(), f"{how} {name}")


# -- Hugging Face directories with links ------------------------------------------------------

SECRET = "LEAKED_TOKEN=do-not-copy-me"
_SMALL = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "modeling_custom.py",
]
_KINDS = [
    "regular",
    "link_inside",
    "link_inside_chain",
    "link_outside_abs",
    "link_outside_rel",
    "link_outside_chain",
    "link_dangling",
    "link_to_dir",
    "link_proc",
    "fifo",
    "dir",
]
_FINE = {"regular", "link_inside", "link_inside_chain"}


class HFLinksCase:
    """A checkpoint and a reference Hugging Face directory, the reference's small files of
    the drawn kinds (regular, links in and out of it, FIFOs ...), and a victim outside."""

    def __init__(self, files: dict[str, str], hub: bool) -> None:
        self.files = files
        self.hub = hub

    def __repr__(self) -> str:
        return f"HFLinksCase({self.files!r}, hub={self.hub})"

    @property
    def fine(self) -> bool:
        """Whether a merge may copy every small file (all regular, inside the directory)."""
        return all(kind in _FINE for kind in self.files.values())

    def write(self, where: Path) -> tuple[Path, Path, Path, Path]:
        """``(checkpoint, reference, victim, out)``."""
        import os

        from safetensors.torch import save_file

        root = Path(tempfile.mkdtemp(dir=where))
        victim = root / "home" / "secret.txt"
        victim.parent.mkdir()
        victim.write_text(SECRET)
        ckpt = root / "ckpt"
        ckpt.mkdir()
        save_file({"w": torch.ones(2)}, str(ckpt / "model.safetensors"))
        if self.hub:  # models--org--name/snapshots/<rev>, every file linked into blobs
            ref = root / "models--org--name" / "snapshots" / "rev"
            blobs = root / "models--org--name" / "blobs"
            blobs.mkdir(parents=True)
        else:
            ref = root / "ref"
            blobs = None
        ref.mkdir(parents=True)
        save_file({"w": torch.zeros(2), "b": torch.zeros(1)}, str(ref / "model.safetensors"))
        (ref / "real_target.json").write_text('{"inside": true}')
        for name, kind in self.files.items():
            path = ref / name
            if kind == "regular":
                if blobs is not None:
                    (blobs / name).write_text('{"blob": 1}')
                    path.symlink_to(os.path.relpath(blobs / name, ref))
                else:
                    path.write_text('{"regular": 1}')
            elif kind == "link_inside":
                path.symlink_to("real_target.json")
            elif kind == "link_inside_chain":
                (ref / f"{name}.hop").symlink_to("real_target.json")
                path.symlink_to(f"{name}.hop")
            elif kind == "link_outside_abs":
                path.symlink_to(victim)
            elif kind == "link_outside_rel":
                path.symlink_to(os.path.relpath(victim, ref))
            elif kind == "link_outside_chain":
                (ref / f"{name}.hop").symlink_to(victim)
                path.symlink_to(f"{name}.hop")
            elif kind == "link_dangling":
                path.symlink_to("no_such_file.json")
            elif kind == "link_to_dir":
                path.symlink_to(".")
            elif kind == "link_proc":
                path.symlink_to("/proc/self/environ")
            elif kind == "fifo":
                os.mkfifo(path)
            elif kind == "dir":
                path.mkdir()
        return ckpt, ref, victim, root / "out"


@st.composite
def hf_link_dirs(draw: st.DrawFn) -> HFLinksCase:
    names = draw(st.lists(st.sampled_from(_SMALL), min_size=1, max_size=4, unique=True))
    weights = st.sampled_from(["regular"] * 6 + _KINDS)  # mostly fine, so both outcomes come
    return HFLinksCase({n: draw(weights) for n in names}, draw(st.booleans()))


# -- keys a terminal or a stream cannot take as they are ------------------------------------

_NASTY = st.sampled_from(
    [
        *map(chr, range(0x00, 0x20)),
        "\x7f",
        *map(chr, range(0x80, 0xA0)),
        "\u202a",
        "\u202e",
        "\u2066",
        "\u2069",
        "\u2028",
        "\u200b",
        "\ufeff",
        "\ud800",
        "\udc80",
        "\udfff",
        "é",
        "层",
        "\U0001f600",
        "\x1b[2J",
        "\x1b]0;title\x07",
        "\r",
        "\n",
    ]
)
_PLAIN = st.sampled_from(["layers", "0", "1", "w", "attn", "policy 'strict' accepts", "."])


class KeysCase:
    """A checkpoint and a reference whose keys hold control characters, bidirectional
    overrides, lone surrogates and non-ASCII text; the streams' encoding; colour or not."""

    def __init__(
        self, ckpt: list[str], ref: list[str], encoding: tuple[str, str], color: str
    ) -> None:
        self.ckpt, self.ref, self.encoding, self.color = ckpt, ref, encoding, color

    def __repr__(self) -> str:
        return f"KeysCase({self.ckpt!r}, {self.ref!r}, {self.encoding}, {self.color})"

    def write(self, where: Path) -> tuple[Path, Path]:
        root = Path(tempfile.mkdtemp(dir=where))
        torch.save({k: torch.zeros(1) for k in [*self.ckpt, "shared.w"]}, root / "ckpt.pt")
        torch.save({k: torch.zeros(1) for k in [*self.ref, "shared.w"]}, root / "ref.pt")
        return root / "ckpt.pt", root / "ref.pt"


_KEY = st.lists(st.one_of(_NASTY, _PLAIN), min_size=1, max_size=8).map("".join)


@st.composite
def hostile_keys(draw: st.DrawFn) -> KeysCase:
    ckpt = draw(st.lists(_KEY, min_size=1, max_size=5, unique=True))
    ref = draw(st.lists(_KEY, max_size=3, unique=True))
    ckpt = [k for k in ckpt if k != "shared.w"] or ["x\x1b"]
    ref = [k for k in ref if k != "shared.w"]
    encoding = draw(
        st.sampled_from([("ascii", "strict"), ("utf-8", "surrogateescape"), ("utf-8", "strict")])
    )
    return KeysCase(ckpt, ref, encoding, draw(st.sampled_from(["never", "always"])))
