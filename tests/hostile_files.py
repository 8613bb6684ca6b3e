"""Hostile checkpoint files, built in the tests: a small pickle assembler, the attacks on
checkpoint readers, hypothesis strategies for .metadata pickles, safetensors headers and torch
zip members, a canary that proves nothing was patched, and a bounded child process.

Run as a script (``python tests/hostile_files.py KIND``), it is the child of the fuzz
tests: it limits its own address space (``RLIMIT_AS``) to what the interpreter and torch
took plus a margin, then checks a hypothesis property for every example: each reader
returns a view (faithful: it equals what the file says) or raises a ``DSDMergeError``
that is not a ``MemoryError`` in disguise, in bounded time, and the canary holds.
"""

from __future__ import annotations

import json
import os
import pathlib
import resource
import struct
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

# -- a pickle assembler -------------------------------------------------------------------

PROTO4 = b"\x80\x04"
STOP = b"."
MARK = b"("
MEMO = b"\x94"
NONE = b"N"
EMPTY_DICT = b"}"
EMPTY_LIST = b"]"
EMPTY_TUPLE = b")"
TUPLE1, TUPLE2, TUPLE3, TUPLE = b"\x85", b"\x86", b"\x87", b"t"
SETITEM, SETITEMS, APPEND, APPENDS = b"s", b"u", b"a", b"e"
BUILD, REDUCE, NEWOBJ, STACK_GLOBAL = b"b", b"R", b"\x81", b"\x93"


def s(text: str) -> bytes:
    """A string: SHORT_BINUNICODE (or BINUNICODE when long)."""
    raw = text.encode()
    if len(raw) < 256:
        return b"\x8c" + bytes([len(raw)]) + raw
    return b"X" + struct.pack("<I", len(raw)) + raw


def i(n: int) -> bytes:
    """An int: BININT1/BININT2/BININT or LONG1."""
    if 0 <= n < 256:
        return b"K" + bytes([n])
    if 0 <= n < 65536:
        return b"M" + struct.pack("<H", n)
    if -(2**31) <= n < 2**31:
        return b"J" + struct.pack("<i", n)
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return (
        b"\x8a" + bytes([len(raw)]) if len(raw) < 256 else b"\x8b" + struct.pack("<i", len(raw))
    ) + raw


def g(module: str, name: str) -> bytes:
    """A global by STACK_GLOBAL."""
    return s(module) + s(name) + STACK_GLOBAL


def get(idx: int) -> bytes:
    return b"h" + bytes([idx]) if idx < 256 else b"j" + struct.pack("<I", idx)


DCP = "torch.distributed.checkpoint.metadata"


def record(cls: str, fields: dict[str, bytes], module: str = DCP) -> bytes:
    """``cls.__new__(cls)`` then BUILD with ``fields`` (values already assembled)."""
    items = b"".join(s(k) + v for k, v in fields.items())
    return g(module, cls) + EMPTY_TUPLE + NEWOBJ + EMPTY_DICT + MARK + items + SETITEMS + BUILD


def size(*dims: int) -> bytes:
    return (
        g("torch", "Size") + MARK + b"".join(map(i, dims)) + TUPLE + MEMO + TUPLE1 + MEMO + REDUCE
    )


def metadata(
    sdm: dict[str, bytes], *, planner: dict[str, bytes] | None = None, storage: bytes = NONE
) -> bytes:
    """A ``Metadata`` pickle (protocol 4) from assembled entries."""
    entries = b"".join(s(k) + v for k, v in sdm.items())
    fields = {"state_dict_metadata": EMPTY_DICT + MARK + entries + SETITEMS}
    if planner is not None:
        fields["planner_data"] = (
            EMPTY_DICT + MARK + b"".join(s(k) + v for k, v in planner.items()) + SETITEMS
        )
    fields["storage_data"] = storage
    return PROTO4 + record("Metadata", fields) + STOP


def bytes_entry() -> bytes:
    return record("BytesStorageMetadata", {})


# -- known attacks on readers ---------------------------------------------------------------


def build_on_class(
    module: str, name: str, attr: str, value: bytes = g("builtins", "frozenset")
) -> bytes:
    """``GLOBAL module.name`` + ``BUILD (None, {attr: value})``: setattr on the class itself."""
    return (
        PROTO4
        + g(module, name)
        + NONE
        + EMPTY_DICT
        + s(attr)
        + value
        + SETITEM
        + TUPLE2
        + BUILD
        + STOP
    )


def build_on_class_allowed(module: str, name: str, attr: str) -> bytes:
    """The same with an allow-listed value (``torch.float32``), so only BUILD can refuse."""
    return (
        PROTO4
        + g(module, name)
        + MEMO
        + NONE
        + EMPTY_DICT
        + MEMO
        + s(attr)
        + g("torch", "float32")
        + SETITEM
        + TUPLE2
        + MEMO
        + BUILD
        + STOP
    )


def bytearray_bomb() -> bytes:
    """``bytearray(2**31)`` in 30-odd bytes."""
    return (
        b"\x80\x04"
        + g("builtins", "bytearray")
        + b"J\x00\x00\x00\x80"
        + TUPLE1
        + MEMO
        + REDUCE
        + STOP
    )


def memo_bomb() -> bytes:
    """``LONG_BINPUT 2**26``: the C unpickler would zero a 1 GiB memo."""
    return b"\x80\x04N" + b"r" + struct.pack("<I", 2**26) + STOP


def bytes_bomb() -> bytes:
    """``BINBYTES8`` of 2**31 bytes that are not there: allocated before reading."""
    return b"\x80\x05\x8e" + struct.pack("<Q", 2**31) + STOP


def planner_bomb() -> bytes:
    """A valid Metadata whose planner_data path is ``["b", 10**8]`` (10^8 list slots)."""
    return metadata(
        {"x": bytes_entry()},
        planner={"x": EMPTY_LIST + MARK + s("b") + i(10**8) + APPENDS},
    )


def hash_bomb(levels: int = 40) -> bytes:
    """``t[k+1] = (t[k], t[k])`` through the memo, then ``{t[levels]: None}``: hashing the
    key takes 2**levels steps (the memo makes the tuples a DAG, the hash walks a tree)."""
    body = EMPTY_DICT + MEMO + NONE + TUPLE1 + MEMO  # the dict is memo 0, t[0] memo 1
    for level in range(levels):
        body += get(level + 1) + TUPLE2 + MEMO
    return PROTO4 + body + NONE + SETITEM + STOP


def deep_tuple_key(depth: int = 1_000_000) -> bytes:
    """A tuple nested ``depth`` deep, used as a dict key (hashing recurses in C)."""
    return (
        PROTO4 + EMPTY_DICT + EMPTY_TUPLE + (NONE + TUPLE2 + MEMO) * depth + NONE + SETITEM + STOP
    )


def shared_state_bomb(records: int = 20_000, fields: int = 2_000) -> bytes:
    """One big dict as the BUILD state of many records (each would copy it)."""
    state = EMPTY_DICT + MEMO + MARK + b"".join(s(f"f{k}") + NONE for k in range(fields)) + SETITEMS
    cls = g(DCP, "BytesStorageMetadata") + MEMO
    one = get(1) + EMPTY_TUPLE + NEWOBJ + get(0) + BUILD + APPEND
    return PROTO4 + state + cls + EMPTY_LIST + one * records + STOP


# -- a real DCP checkpoint and crafted storage entries --------------------------------------


def dcp_checkpoint(path: Path, sd: Any) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(path))
    return path


def edit_metadata(path: Path, edit: Any) -> None:
    """Unpickle ``path/.metadata`` (trusted: the test wrote it), edit it, write it back."""
    import pickle

    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)
    edit(md)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)


def overlapping_tensors(path: Path, count: int, numel: int = 1 << 16) -> Path:
    """A DCP checkpoint of one ``numel``-float tensor and ``count - 1`` more whose storage
    entries all point at its bytes (each ~100 bytes of ``.metadata``)."""
    import copy

    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex

    dcp_checkpoint(path, {"w0": torch.ones(numel)})

    def edit(md: Any) -> None:
        ((index, info),) = md.storage_data.items()
        for k in range(1, count):
            key = f"w{k}"
            md.state_dict_metadata[key] = copy.deepcopy(md.state_dict_metadata["w0"])
            md.planner_data[key] = (key,)
            md.storage_data[MetadataIndex(key, index.offset, index.index)] = info

    edit_metadata(path, edit)
    return path


def overlapping_params(path: Path, count: int, ids: int = 1 << 17) -> Path:
    """A nested optimizer checkpoint whose ``count`` param groups' ``params`` entries all
    point at one region: a list of ``ids`` parameter ids (~4 bytes each)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    osd = {"state": {}, "param_groups": [{"lr": 0.1, "params": list(range(ids))}]}
    dcp_checkpoint(path, {"optim": osd})

    def edit(md: Any) -> None:
        info = next(v for k, v in md.storage_data.items() if k.fqn.endswith("params"))
        for g in range(1, count):
            key = f"optim.param_groups.{g}.params"
            md.state_dict_metadata[key] = BytesStorageMetadata()
            md.planner_data[key] = ("optim", "param_groups", g, "params")
            md.storage_data[MetadataIndex(key)] = info

    edit_metadata(path, edit)
    return path


def deep_path(depth: int, keys: int = 1) -> bytes:
    """A valid ``Metadata`` whose ``keys`` bytes entries sit ``depth`` dicts deep: each
    path is ``("a",) * depth + ("k<i>",)`` (one memoized ``"a"``, two bytes per part) and
    each key the path joined with dots, as DCP writes it."""
    entries = []
    planner = []
    for n in range(keys):
        key = ".".join(["a"] * depth + [f"k{n}"])
        entries.append(s(key) + bytes_entry())
        first = s("a") + MEMO if n == 0 else get(0)  # memo 0: the first "a"
        planner.append(s(key) + MARK + first + get(0) * (depth - 1) + s(f"k{n}") + TUPLE + MEMO)
    return (
        PROTO4
        + record(
            "Metadata",
            {
                "state_dict_metadata": EMPTY_DICT + MARK + b"".join(entries) + SETITEMS,
                "planner_data": EMPTY_DICT + MARK + b"".join(planner) + SETITEMS,
                "storage_data": NONE,
            },
        )
        + STOP
    )


# -- safetensors headers -------------------------------------------------------------------


def safetensors_file(header: Any, data: bytes = b"", *, raw: bytes | None = None) -> bytes:
    body = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(body)) + body + data


# -- the canary: nothing the readers can reach was patched -----------------------------------


def canary() -> dict[str, Any]:
    """Class attributes of pathlib, DCP's classes, builtins, torch's layout cache."""
    import builtins

    import torch
    from torch.distributed.checkpoint import filesystem, metadata

    watched: dict[str, Any] = {}
    for name in ("Path", "PosixPath", "PurePath", "PurePosixPath", "WindowsPath"):
        watched[f"pathlib.{name}"] = dict(vars(getattr(pathlib, name)))
    for name in metadata.__all__:
        watched[f"dcp.{name}"] = dict(vars(getattr(metadata, name)))
    watched["dcp._StorageInfo"] = dict(vars(filesystem._StorageInfo))
    watched["builtins"] = dict(vars(builtins))
    watched["_get_layout"] = dict(vars(torch.serialization._get_layout))
    watched["torch.Size"] = dict(vars(torch.Size))
    return watched


def canary_diff(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    changed = []
    for name, attrs in before.items():
        now = after[name]
        for key in attrs.keys() | now.keys():
            if key == "cache" and name == "_get_layout":
                # torch fills the layout cache lazily; only its identity is watched
                if attrs.get(key) is not now.get(key):
                    changed.append(f"{name}.{key}")
            elif key in _LAZY and key not in attrs and not now[key]:
                continue  # an empty cache CPython adds on first use (annotations, slotnames)
            elif attrs.get(key, _GONE) is not now.get(key, _GONE):
                changed.append(f"{name}.{key}")
    return sorted(changed)


_GONE = object()
_LAZY = frozenset({"__annotations__", "__slotnames__"})


# -- a bounded child -----------------------------------------------------------------------


def vm_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))


def limit_memory(extra: int) -> None:
    """RLIMIT_AS: what this process has mapped now, plus ``extra`` bytes."""
    limit = vm_kib() * 1024 + extra
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


ROOT = Path(__file__).resolve().parents[1]


def run_child(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``python tests/hostile_files.py ARGS`` with this checkout first on the path."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    return subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


_BOUNDED_CLI = """
import os, sys, time
import torch, torch.distributed.checkpoint, safetensors.torch  # mapped before the limit
import hostile_files as hf
from dsdmerge import cli
hf.limit_memory(int(os.environ["DSDMERGE_TEST_EXTRA_BYTES"]))
start = time.perf_counter()
code = cli.main(sys.argv[1:])
with open(os.environ["DSDMERGE_TEST_SECONDS_FILE"], "w") as f:
    f.write(repr(time.perf_counter() - start))
sys.exit(code)
"""


def run_cli_bounded(
    *args: str,
    seconds: float,
    extra: int = 1 << 30,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
) -> tuple[subprocess.CompletedProcess[str], float]:
    """``dsdmerge ARGS`` in a child whose address space is capped at what the imports took
    plus ``extra`` bytes; returns the finished process and the seconds ``main`` took (the
    child is killed after ``timeout``, by default four times ``seconds``)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        timing = Path(tmp, "seconds")
        child_env = {
            **os.environ,
            "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}",
            "DSDMERGE_TEST_EXTRA_BYTES": str(extra),
            "DSDMERGE_TEST_SECONDS_FILE": str(timing),
            **(env or {}),
        }
        child_env.pop("DSDMERGE_TRACEBACK", None)
        proc = subprocess.run(
            [sys.executable, "-c", _BOUNDED_CLI, *args],
            capture_output=True,
            text=True,
            timeout=timeout or 4 * seconds,
            env=child_env,
        )
        took = float(timing.read_text()) if timing.exists() else float("inf")
    return proc, took


def read_bounded(path: Path) -> tuple[str, float]:
    """Read ``path`` with each reader: ``"ok"`` (``read_metadata`` returned a view),
    ``"refused"`` (a DSDMergeError), or what went wrong; and the seconds it took."""
    import dsdmerge as dm
    from dsdmerge.integrations import load_checkpoint, read_metadata

    start = time.perf_counter()
    outcome = "ok"
    for read in (read_metadata, load_checkpoint):
        try:
            read(path)
        except dm.DSDMergeError as err:
            cause: BaseException | None = err
            while cause is not None:
                if isinstance(cause, (MemoryError, RecursionError)):
                    return f"{read.__name__}: {type(cause).__name__} behind {err}", 0.0
                cause = cause.__cause__ or cause.__context__
            if len(str(err)) < 20 or "\n" in str(err):
                return f"{read.__name__}: a message that names nothing: {err!r}", 0.0
            if read is read_metadata:
                outcome = "refused"
        except BaseException as err:  # noqa: BLE001 - exactly what the fuzz looks for
            return f"{read.__name__}: {type(err).__name__} escaped: {str(err)[:200]}", 0.0
    return outcome, time.perf_counter() - start


def _child(kind: str, where: str) -> int:
    """Run one property in this (bounded) process; exit 1 with the reason on failure."""
    import conftest  # noqa: F401 - registers the profiles
    import fuzz_strategies as fs
    import hypothesis
    from hypothesis import given, settings

    os.chdir(where)
    fs.warm_up()  # pickling the sample files sets copyreg's __slotnames__ on DCP's classes
    before = canary()
    limit_memory(1 << 30)
    strategy = {
        "metadata": fs.metadata_files,
        "safetensors": fs.safetensors_files,
        "zip": fs.zip_files,
    }[kind]
    seen = {"ok": 0, "refused": 0}

    @settings(database=None, print_blob=True)
    @given(strategy())
    def prop(case: Any) -> None:
        path = case.write(Path(where))
        outcome, seconds = read_bounded(path)
        assert outcome in ("ok", "refused"), f"{case!r}: {outcome}"
        assert seconds < 30, f"{case!r}: {seconds:.1f} s"
        if outcome == "ok":
            case.check_view(path)
        seen[outcome] += 1
        changed = canary_diff(before, canary())
        assert not changed, f"{case!r} patched {changed}"

    try:
        prop()
    except hypothesis.errors.HypothesisException:
        raise
    print(json.dumps(seen))
    return 0


# -- the command line on hostile directories and keys ---------------------------------------


def cli_bytes(
    *args: str, encoding: str = "utf-8", errors: str = "strict"
) -> subprocess.CompletedProcess[bytes]:
    """``dsdmerge ARGS`` in this process, its stdout and stderr streams of that encoding (as
    ``PYTHONIOENCODING=ascii`` or a C locale make them), their bytes undecoded."""
    import contextlib
    import io

    from dsdmerge import cli

    out = io.TextIOWrapper(io.BytesIO(), encoding=encoding, errors=errors, newline="\n")
    err = io.TextIOWrapper(io.BytesIO(), encoding=encoding, errors=errors, newline="\n")
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(args))
        out.flush()
        err.flush()
    return subprocess.CompletedProcess(
        list(args), code, out.buffer.getvalue(), err.buffer.getvalue()
    )


_OUR_SGR = [b"\x1b[0m", b"\x1b[1m", b"\x1b[2m", *(b"\x1b[%dm" % n for n in range(30, 37))]


def raw_controls(data: bytes, *, color: bool = False) -> list[str]:
    """Characters in ``data`` that would drive a terminal (our own colours aside)."""
    if color:
        for sgr in _OUR_SGR:
            data = data.replace(sgr, b"")
    text = data.decode("utf-8", errors="replace")
    return sorted({c for c in text if not c.isprintable() and c not in "\n\ufffd"})


def _hf_links_property(case: Any, where: Path) -> str:
    """merge over a reference with hostile small files: refused by name (exit 2, nothing
    written), or OUT holds only regular files dsdmerge writes, none holding the victim."""
    from dsdmerge.integrations.writing import is_hf_file

    ckpt, ref, victim, out = case.write(where)
    proc = cli_bytes("merge", str(ckpt), str(ref), "-o", str(out))
    assert victim.read_text().startswith("LEAKED_TOKEN"), case
    if proc.returncode == 2:
        lines = proc.stderr.decode().strip().splitlines()
        assert len(lines) == 1, (case, lines)
        assert any(name in lines[0] for name in case.files), (case, lines)
        assert not out.exists(), case
        assert not case.fine, (case, lines)
        assert not [p for p in out.parent.iterdir() if p.name.startswith(".out.")], case
        return "refused"
    assert proc.returncode == 0, (case, proc.stderr)
    assert case.fine, case
    for path in out.iterdir():
        assert path.is_file(), (case, path)
        assert not path.is_symlink(), (case, path)
        assert is_hf_file(path.name), (case, path)
        assert b"LEAKED_TOKEN" not in path.read_bytes(), (case, path)
    return "ok"


def _keys_property(case: Any, where: Path) -> str:
    """Every report of hostile keys: finished, exit code as the command says, nothing raw on
    either stream; --json and OUT keep every key exactly."""
    ckpt, ref = (str(p) for p in case.write(where))
    encoding, errors = case.encoding
    color = ["--color", case.color]
    outcomes = set()
    for command, codes in (
        (["inspect", ckpt, "--stat"], {0}),
        (["diff", ckpt, ref, "--stat"], {0, 1}),
        (["check", ckpt, ref, "--policy", "strict"], {0, 1}),
        (["check", ckpt, ref], {0, 1}),
    ):
        proc = cli_bytes(*command, *color, encoding=encoding, errors=errors)
        assert proc.returncode in codes | {2}, (case, command, proc.stderr)
        if proc.returncode == 2:
            assert len(proc.stderr.splitlines()) == 1, (case, command, proc.stderr)
        else:
            assert proc.stdout.endswith(b"\n"), (case, command)
        outcomes.add(proc.returncode)
        assert not raw_controls(proc.stdout, color=case.color == "always"), (case, command)
        assert not raw_controls(proc.stderr), (case, command, proc.stderr)
    proc = cli_bytes("diff", ckpt, ref, "--json", encoding=encoding, errors=errors)
    if proc.returncode != 2:
        out = json.loads(proc.stdout)
        # exact, as far as JSON can say: two lone surrogates that form a pair read back as
        # the one character they spell (JSON strings are UTF-16 code units)
        spelled = {k: json.loads(json.dumps(k)) for k in [*case.ckpt, *case.ref]}
        assert set(out["unexpected"]) == {spelled[k] for k in set(case.ckpt) - set(case.ref)}
        assert set(out["missing"]) == {spelled[k] for k in set(case.ref) - set(case.ckpt)}
    merged = where / "merged.pt"
    proc = cli_bytes(
        "merge", ckpt, ref, "-o", str(merged), "--force", *color, encoding=encoding, errors=errors
    )
    assert not raw_controls(proc.stdout, color=case.color == "always"), case
    assert not raw_controls(proc.stderr), (case, proc.stderr)
    if proc.returncode == 0:
        import torch

        assert set(torch.load(merged, weights_only=True)) == {*case.ckpt, *case.ref, "shared.w"}
        assert proc.stdout.startswith(b"wrote "), case
        return "ok"
    assert proc.returncode in (1, 2), (case, proc.stderr)
    return "refused"


def _child_cli(kind: str, where: str) -> int:
    """The command line's properties, in this (bounded) process."""
    import conftest  # noqa: F401 - registers the profiles
    import fuzz_strategies as fs
    from hypothesis import given, settings

    os.chdir(where)
    limit_memory(1 << 30)
    strategy, check = {
        "hf_links": (fs.hf_link_dirs, _hf_links_property),
        "keys": (fs.hostile_keys, _keys_property),
    }[kind]
    seen = {"ok": 0, "refused": 0}

    @settings(database=None, print_blob=True)
    @given(strategy())
    def prop(case: Any) -> None:
        import tempfile

        with tempfile.TemporaryDirectory(dir=where) as tmp:
            start = time.perf_counter()
            seen[check(case, Path(tmp))] += 1
            assert time.perf_counter() - start < 30, case

    prop()
    print(json.dumps(seen))
    return 0


if __name__ == "__main__":
    if sys.argv[1] in ("hf_links", "keys"):
        sys.exit(_child_cli(sys.argv[1], sys.argv[2]))
    sys.exit(_child(sys.argv[1], sys.argv[2]))
