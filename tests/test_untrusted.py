"""Untrusted checkpoints: reading changes nothing and reaches nothing, writing
destroys nothing. Each attacker's file is built here; a victim file or directory must
survive; the CLI's exit code and one-line message are checked."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import pathlib
import pickle
import stat
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import hostile_files as hf
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import Evil, dcp_save

import dsdmerge as dm
from dsdmerge import _torch_api, cli
from dsdmerge.integrations import CheckpointView, detect_format, load_checkpoint, read_metadata
from dsdmerge.integrations._dcp import dcp_load_into, read_dcp_view


def run_here(*args: str) -> subprocess.CompletedProcess[str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(args))
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def assert_error(proc, *words: str) -> None:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("dsdmerge: error: "), lines[0]
    for word in words:
        assert word in lines[0], lines[0]


def victim(tmp_path: Path) -> Path:
    v = tmp_path / "victim"
    v.mkdir()
    (v / "precious.txt").write_text("keep me")
    return v


def assert_victim(v: Path) -> None:
    assert (v / "precious.txt").read_text() == "keep me"


@pytest.fixture
def canary():
    before = hf.canary()
    yield
    assert hf.canary_diff(before, hf.canary()) == []


# -- 1. the .metadata unpickler changes no interpreter state ---------------------------------


@pytest.mark.parametrize(
    ("module", "name", "attr"),
    [
        ("pathlib", "Path", "exists"),
        ("pathlib", "PurePath", "_str"),
        ("torch.serialization", "_get_layout", "cache"),
        ("torch.distributed.checkpoint.metadata", "Metadata", "__eq__"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo", "relative_path"),
        ("torch", "Size", "__len__"),
    ],
)
def test_build_on_an_allowed_class_or_function_is_refused_and_patches_nothing(
    tmp_path, canary, module, name, attr
):
    for data in (
        hf.build_on_class_allowed(module, name, attr),  # BUILD (None, {attr: value})
        hf.PROTO4
        + hf.g(module, name)
        + hf.EMPTY_DICT
        + hf.s(attr)
        + hf.NONE
        + hf.SETITEM
        + hf.BUILD
        + hf.STOP,  # BUILD {attr: value}
    ):
        ckpt = tmp_path / "evil"
        ckpt.mkdir(exist_ok=True)
        (ckpt / ".metadata").write_bytes(data)
        with pytest.raises(dm.CheckpointReadError):
            read_metadata(ckpt)


def test_the_rmtree_attack_leaves_the_victim_and_pathlib_alone(tmp_path, canary):
    """The review's attack: a crafted .metadata patched pathlib, and the CLI's temp-file
    cleanup then removed an unrelated directory."""
    v = victim(tmp_path)
    evil = tmp_path / "EVIL_DIR"
    evil.mkdir()
    patch = hf.s(str(v))  # PurePath._str of every path: the victim
    (evil / ".metadata").write_bytes(
        hf.PROTO4
        + hf.g("pathlib", "PurePath")
        + hf.NONE
        + hf.EMPTY_DICT
        + hf.s("_str")
        + patch
        + hf.SETITEM
        + hf.TUPLE2
        + hf.BUILD
        + hf.g("pathlib", "Path")
        + hf.NONE
        + hf.EMPTY_DICT
        + hf.s("exists")
        + hf.g("builtins", "bool")
        + hf.SETITEM
        + hf.TUPLE2
        + hf.BUILD
        + hf.STOP
    )
    torch.save({"w": torch.zeros(2)}, tmp_path / "ckpt.pt")
    out = tmp_path / "out.pt"
    proc = run_here("merge", str(tmp_path / "ckpt.pt"), str(evil), "-o", str(out))
    assert_error(proc, "EVIL_DIR", "refused")
    assert_victim(v)
    assert not out.exists()
    assert pathlib.Path(v).exists()


# -- 2. bounded work for a small file --------------------------------------------------------


BOUNDED = textwrap.dedent(
    """
    import sys, time, pathlib
    import hostile_files as hf
    import dsdmerge as dm
    from dsdmerge.integrations import read_metadata, load_checkpoint
    read_metadata  # imports done before the limit
    import torch.distributed.checkpoint
    hf.limit_memory(512 << 20)
    ckpt = pathlib.Path(sys.argv[1])
    start = time.perf_counter()
    for read in (read_metadata, load_checkpoint):
        try:
            read(ckpt)
            print("read")
        except dm.CheckpointReadError as err:
            cause = err
            while cause is not None:
                assert not isinstance(cause, MemoryError), err
                cause = cause.__cause__ or cause.__context__
            print(type(err).__name__, str(err).splitlines()[0][:300])
    print("seconds", time.perf_counter() - start)
    """
)


def bounded_read(path: Path) -> list[str]:
    env = {**os.environ, "PYTHONPATH": f"{hf.ROOT}{os.pathsep}{hf.ROOT / 'tests'}"}
    proc = subprocess.run(
        [sys.executable, "-c", BOUNDED, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert float(lines[-1].split()[1]) < 30, lines
    return lines[:-1]


@pytest.mark.parametrize(
    ("attack", "size_at_most", "words"),
    [
        ("bytearray_bomb", 64, "builtins.bytearray"),
        ("memo_bomb", 9, "LONG_BINPUT"),
        ("bytes_bomb", 12, "BINBYTES8"),
        ("planner_bomb", 10_000, "planner_data"),
        ("hash_bomb", 1_000, "Metadata"),
        ("deep_tuple_key", 4_000_000, "Metadata"),
        ("shared_state_bomb", 1_000_000, ""),
    ],
)
def test_a_small_file_costs_bounded_memory_and_time(tmp_path, attack, size_at_most, words):
    data = getattr(hf, attack)()
    assert len(data) <= size_at_most
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(data)
    lines = bounded_read(ckpt)  # 512 MiB of address space more than the imports took
    assert len(lines) == 2, lines
    for line in lines:
        assert line.startswith(("CheckpointReadError", "UnsafeCheckpointError")), line
        assert words in line, line


# -- 3. metadata-only reads stay inside the checkpoint ----------------------------------------


def nested_optimizer_checkpoint(path: Path) -> Path:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    # fqn-keyed nested state, as DSD's get_optimizer_state_dict returns it
    dcp_save(sd, path)
    return path


def point_params_entry(ckpt: Path, **fields) -> None:
    def edit(md):
        for index, info in md.storage_data.items():
            if index.fqn.endswith("param_groups.0.params"):
                for name, value in fields.items():
                    setattr(info, name, value)

    hf.edit_metadata(ckpt, edit)


@pytest.mark.parametrize(
    "where",
    ["absolute", "dotdot", "symlink", "dev_zero", "fifo", "huge_offset", "negative", "dir"],
)
def test_params_entries_are_read_only_from_files_inside_the_checkpoint(tmp_path, where):
    secret = tmp_path / "secret.txt"
    secret.write_text("S3CR3T-" * 100)
    ckpt = nested_optimizer_checkpoint(tmp_path / "ckpt")
    assert read_metadata(ckpt)  # fine before the edit
    fields: dict = {"offset": 0, "length": 16}
    if where == "absolute":
        fields["relative_path"] = str(secret)
    elif where == "dotdot":
        fields["relative_path"] = "../secret.txt"
    elif where == "symlink":
        (ckpt / "link.distcp").symlink_to(secret)
        fields["relative_path"] = "link.distcp"
    elif where == "dev_zero":
        fields.update(relative_path="/dev/zero", length=2**40)
    elif where == "fifo":
        os.mkfifo(ckpt / "pipe.distcp")
        fields["relative_path"] = "pipe.distcp"
    elif where == "huge_offset":
        fields.update(relative_path="__0_0.distcp", offset=2**62)
    elif where == "negative":
        fields.update(relative_path="__0_0.distcp", offset=-5)
    elif where == "dir":
        (ckpt / "sub").mkdir()
        fields["relative_path"] = "sub"
    point_params_entry(ckpt, **fields)
    with pytest.raises(dm.CheckpointReadError, match=r"param_groups\.0\.params") as info:
        read_metadata(ckpt)  # a FIFO would hang here; /dev/zero would take GBs
    assert "S3CR3T" not in str(info.value)
    assert "\n" not in str(info.value)
    with pytest.raises(dm.CheckpointReadError) as info:
        load_checkpoint(ckpt)  # checked before DCP's own reader sees the directory
    assert "S3CR3T" not in str(info.value)
    assert_error(run_here("inspect", str(ckpt)), "param_groups.0.params")


def test_dcp_loads_check_every_storage_entry_before_dcp_reads(tmp_path):
    ckpt = tmp_path / "ckpt"
    dcp_save({"w": torch.ones(4), "b": torch.ones(2)}, ckpt)
    outside = tmp_path / "outside.distcp"
    outside.write_bytes((ckpt / "__0_0.distcp").read_bytes())

    def edit(md):
        for info in md.storage_data.values():
            info.relative_path = "../outside.distcp"

    hf.edit_metadata(ckpt, edit)
    read_metadata(ckpt)  # metadata only: nothing read from data files
    with pytest.raises(dm.CheckpointReadError, match="outside the checkpoint directory"):
        load_checkpoint(ckpt)
    _view, metadata = read_dcp_view(str(ckpt), trusted=False)
    target = {"w": torch.zeros(4), "b": torch.zeros(2)}
    with pytest.raises(dm.CheckpointReadError, match="outside the checkpoint directory"):
        dcp_load_into(
            str(ckpt), target, metadata, trusted=False, allow_partial_load=False, no_dist=True
        )
    assert torch.equal(target["w"], torch.zeros(4))  # nothing was loaded


def test_claimed_tensor_sizes_are_not_allocated_beyond_the_data(tmp_path):
    ckpt = tmp_path / "ckpt"
    dcp_save({"w": torch.ones(4)}, ckpt)

    def edit(md):
        md.state_dict_metadata["w"].size = torch.Size([10**6, 10**6])
        md.state_dict_metadata["w"].chunks[0].sizes = torch.Size([10**6, 10**6])
        md.state_dict_metadata["w"].chunks[0].offsets = torch.Size([0, 0])

    hf.edit_metadata(ckpt, edit)
    assert read_metadata(ckpt)["w"].shape == (10**6, 10**6)  # the claim, as a claim
    with pytest.raises(dm.CheckpointReadError, match="nothing was allocated"):
        load_checkpoint(ckpt)


# -- 4. safetensors: the library reads the header -------------------------------------------


def write_st(path: Path, header, data: bytes = b"", raw: bytes | None = None) -> Path:
    path.write_bytes(hf.safetensors_file(header, data, raw=raw))
    return path


@pytest.mark.parametrize(
    "hostile",
    [
        {"w": {"dtype": "F32", "shape": "12", "data_offsets": [0, 8]}},
        {"w": {"dtype": "F32", "shape": [10**6, 10**6], "data_offsets": [0, 4]}},
        {
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
        },
        {"w": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}},
        "utf16",
        "deep",
        "digits",
        "infinity",
    ],
)
def test_hostile_safetensors_headers_are_corrupt_not_a_plausible_report(tmp_path, hostile):
    path = tmp_path / "m.safetensors"
    data = bytes(16)
    if hostile == "utf16":
        write_st(
            path,
            None,
            data,
            raw=json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode(
                "utf-16"
            ),
        )
    elif hostile == "deep":
        write_st(path, None, data, raw=b'{"w":' + b"[" * 50_000 + b"]" * 50_000 + b"}")
    elif hostile == "digits":
        write_st(
            path,
            None,
            data,
            raw=b'{"w":{"dtype":"F32","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,4]}}',
        )
    elif hostile == "infinity":
        write_st(
            path, None, data, raw=b'{"w":{"dtype":"F32","shape":[Infinity],"data_offsets":[0,4]}}'
        )
    else:
        write_st(path, hostile, data)
    for read in (read_metadata, load_checkpoint):
        with pytest.raises(dm.CheckpointReadError, match="not a valid safetensors file"):
            read(path)
    assert_error(run_here("inspect", str(path)), "m.safetensors", "safetensors")


def test_a_suffixless_safetensors_file_whose_length_starts_with_0x80_is_safetensors(tmp_path):
    from safetensors.torch import save_file

    # find a tensor name that makes the header's length byte 0x80 (1 file in 256)
    for n in range(300):
        path = tmp_path / f"weights{n}"
        save_file({"x" * n: torch.zeros(1)}, str(path))
        if path.read_bytes()[0] == 0x80:
            break
    else:
        pytest.fail("no header of length 0x80 mod 256")
    assert detect_format(path) == "safetensors"
    assert list(read_metadata(path)) == ["x" * n]


def test_safetensors_metadata_is_shown_and_kept(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    meta = {"format": "pt", "step": "1000", "notes": "after warmup"}
    save_file({"w": torch.ones(2)}, str(tmp_path / "ckpt.safetensors"), metadata=meta)
    save_file({"w": torch.zeros(2), "b": torch.zeros(1)}, str(tmp_path / "ref.safetensors"))
    view = read_metadata(tmp_path / "ckpt.safetensors")
    assert view.metadata == meta
    view.metadata["step"] = "x"  # a copy
    assert view.metadata == meta
    proc = run_here("inspect", str(tmp_path / "ckpt.safetensors"))
    assert "metadata: format=pt, notes=after warmup, step=1000" in proc.stdout
    proc = run_here("inspect", str(tmp_path / "ckpt.safetensors"), "--json")
    assert json.loads(proc.stdout)["metadata"] == meta
    assert (
        json.loads(run_here("inspect", str(tmp_path / "ref.safetensors"), "--json").stdout)[
            "metadata"
        ]
        == {}
    )
    out = tmp_path / "merged.safetensors"
    args = [str(tmp_path / "ckpt.safetensors"), str(tmp_path / "ref.safetensors"), "-o", str(out)]
    assert run_here("merge", *args).returncode == 0
    with safe_open(str(out), framework="pt") as f:
        assert f.metadata() == meta
    assert isinstance(read_metadata(tmp_path / "ckpt.safetensors"), CheckpointView)


# -- 5. refusals say why -----------------------------------------------------------------------


class Sneaky:
    """A class outside torch's allow-list (harmless, but weights_only refuses it)."""

    def __init__(self) -> None:
        self.x = 1


class Other:
    pass


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_a_raw_pickle_calling_os_system_is_unsafe_not_corrupt(tmp_path):
    marker = tmp_path / "pwned"
    for protocol in (2, 4, 5):
        path = tmp_path / f"raw{protocol}.pt"
        path.write_bytes(pickle.dumps({"w": 1, "x": Evil(marker)}, protocol=protocol))
        for read in (read_metadata, load_checkpoint):
            with pytest.raises(dm.UnsafeCheckpointError, match=r"builtin\w*\.exec") as info:
                read(path)
            assert "corrupt" not in str(info.value)
        assert not marker.exists()
    proc = run_here("inspect", str(tmp_path / "raw4.pt"))
    assert_error(proc, "raw4.pt", "builtins.exec", "--trust", "--safe-globals")
    assert "corrupt" not in proc.stderr


def test_every_unsafe_global_is_listed(tmp_path):
    path = tmp_path / "two.pt"
    torch.save({"a": Sneaky(), "b": Other(), "w": torch.zeros(1)}, path)
    with pytest.raises(dm.UnsafeCheckpointError) as info:
        read_metadata(path)
    text = str(info.value)
    assert "test_untrusted.Other" in text, text
    assert "test_untrusted.Sneaky" in text, text
    assert "2 global(s)" in text


def test_trusted_accepts_a_list_of_globals(tmp_path):
    path = tmp_path / "one.pt"
    torch.save({"a": Sneaky(), "w": torch.zeros(1)}, path)
    with pytest.raises(dm.UnsafeCheckpointError):
        load_checkpoint(path)
    loaded = load_checkpoint(path, trusted=["test_untrusted.Sneaky"])
    assert loaded["a"].x == 1
    assert read_metadata(path, trusted=["test_untrusted.Sneaky"])["w"].shape == (1,)
    # only what is named: another class stays refused
    torch.save({"a": Sneaky(), "b": Other()}, tmp_path / "two.pt")
    with pytest.raises(dm.UnsafeCheckpointError, match=r"test_untrusted\.Other"):
        load_checkpoint(tmp_path / "two.pt", trusted=["test_untrusted.Sneaky"])
    for bad in ("Sneaky", ["no.such.Thing"], 3, "test_untrusted.Sneaky"):
        with pytest.raises(dm.InvalidPolicyError):
            load_checkpoint(path, trusted=bad)  # type: ignore[arg-type]
    torch.save({"w": torch.zeros(1)}, tmp_path / "ref.pt")
    out = tmp_path / "out.pt"
    args = [str(path), str(tmp_path / "ref.pt"), "-o", str(out)]
    assert_error(run_here("merge", *args), "Sneaky", "--safe-globals")
    proc = run_here("merge", *args, "--safe-globals", "test_untrusted.Sneaky")
    assert proc.returncode == 0, proc.stderr
    assert out.exists()


def test_every_reader_takes_trusted_in_one_type_checked_before_it_reads(tmp_path):
    import inspect

    from dsdmerge.integrations import _trust, load_dcp

    readers = {
        "read_metadata": lambda trusted: read_metadata(ckpt, trusted=trusted),
        "load_checkpoint": lambda trusted: load_checkpoint(ckpt, trusted=trusted),
        "load_dcp": lambda trusted: load_dcp(ckpt, target, trusted=trusted).state_dict,
    }
    for fn in (read_metadata, load_checkpoint, load_dcp):  # one annotation, one type
        assert inspect.signature(fn).parameters["trusted"].annotation == "Trust", fn
        assert vars(sys.modules[fn.__module__])["Trust"] is _trust.Trust, fn
    ckpt = tmp_path / "ckpt"
    dcp_save({"w": torch.ones(2), "a": Sneaky()}, ckpt)
    target = {"w": torch.zeros(2), "a": None}
    for name, read in readers.items():
        for bad in ("Sneaky", ["no.such.Thing"], [3], 3, None, "test_untrusted.Sneaky"):
            with pytest.raises(dm.InvalidPolicyError, match="trusted"):
                read(bad)
            assert torch.equal(target["w"], torch.zeros(2)), (name, bad)  # nothing was read
    # the default refuses the bytes entry; a list naming its class admits it, in every reader
    assert read_metadata(ckpt)["a"] is CheckpointView.UNREAD  # not read: nothing to refuse
    for name in ("load_checkpoint", "load_dcp"):
        with pytest.raises(dm.UnsafeCheckpointError, match=r"test_untrusted\.Sneaky"):
            readers[name](False)
        assert readers[name](("test_untrusted.Sneaky",))["a"].x == 1, name
        assert readers[name](["test_untrusted.Sneaky"])["a"].x == 1, name
    assert read_metadata(ckpt, trusted=["test_untrusted.Sneaky"])["w"].shape == (2,)


# -- 6. only DSDMergeError escapes ----------------------------------------------------------


def test_a_fifty_thousand_deep_list_in_a_torch_file(tmp_path):
    import zipfile

    path = tmp_path / "deep.pt"
    torch.save({"w": torch.zeros(1), "deep": [1]}, path)
    with zipfile.ZipFile(path) as src:
        members = [(info, src.read(info)) for info in src.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as dst:
        for info, blob in members:
            if info.filename.endswith("data.pkl"):
                at = blob.rindex(b"]")  # the list [1]: EMPTY_LIST BINPUT n BININT1 1 APPEND
                blob = blob[:at] + b"]" * 50_000 + b"a" * 49_999 + blob[at + 1 :]
            dst.writestr(info, blob)
    view = read_metadata(path)
    assert view.tensor_count == 1
    torch.save({"w": torch.zeros(1)}, tmp_path / "ref.pt")
    proc = run_here("merge", str(path), str(tmp_path / "ref.pt"), "-o", str(tmp_path / "o.pt"))
    assert_error(proc, "nested too deeply")


def test_crafted_dcp_metadata_fields_are_checkpoint_read_errors(tmp_path):
    base = tmp_path / "base"
    dcp_save({"model": {"w": torch.ones(2, 3)}, "step": 3}, base)
    edits = {
        "size_str": lambda md: setattr(md.state_dict_metadata["model.w"], "size", "23"),
        "chunks_none": lambda md: setattr(md.state_dict_metadata["model.w"], "chunks", None),
        "planner_neg": lambda md: md.planner_data.update({"model.w": ("model", -1)}),
        "planner_int_first": lambda md: md.planner_data.update({"model.w": (0, "w")}),
        "planner_conflict": lambda md: md.planner_data.update({"step": ("model", "w", "x")}),
        "storage_list": lambda md: setattr(md, "storage_data", []),
        "dtype_str": lambda md: setattr(
            md.state_dict_metadata["model.w"].properties, "dtype", "float32"
        ),
    }
    for name, edit in edits.items():
        ckpt = tmp_path / name
        ckpt.mkdir()
        for f in base.iterdir():
            (ckpt / f.name).write_bytes(f.read_bytes())
        hf.edit_metadata(ckpt, edit)
        for read in (read_metadata, load_checkpoint):
            with pytest.raises(dm.CheckpointReadError):
                read(ckpt)


def test_a_failed_dcp_write_exits_2_not_1(tmp_path, monkeypatch, capsys):
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    def broken(self, plan, planner):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", broken)
    torch.save({"w": torch.ones(2)}, tmp_path / "a.pt")
    torch.save({"w": torch.zeros(2)}, tmp_path / "b.pt")
    out = tmp_path / "merged"
    code = cli.main(["merge", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "-o", str(out)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1, err
    assert "Traceback" not in err
    assert "No space left on device" in err
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt", "b.pt"]


# -- 7. --force replaces a checkpoint, nothing else -----------------------------------------


@pytest.fixture
def pair(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "ckpt.pt")
    torch.save({"w": torch.zeros(2), "b": torch.zeros(1)}, tmp_path / "ref.pt")
    dcp_save({"w": torch.ones(2)}, tmp_path / "ckpt_dcp")
    dcp_save({"w": torch.zeros(2), "b": torch.zeros(1)}, tmp_path / "ref_dcp")
    return tmp_path


def test_force_never_replaces_a_directory_of_other_things(pair):
    runs = pair / "checkpoints"
    dcp_save({"w": torch.ones(1)}, runs / "run1")  # a parent folder with runs in it
    (runs / "notes.txt").write_text("keep")
    args = [
        str(pair / "ckpt_dcp"),
        str(pair / "ref_dcp"),
        "-o",
        str(runs),
        "--force",
        "--format",
        "dcp",
    ]
    assert_error(run_here("merge", *args), "checkpoints", "only a DCP checkpoint directory")
    assert (runs / "notes.txt").read_text() == "keep"
    assert load_checkpoint(runs / "run1")["w"].shape == (1,)
    assert sorted(p.name for p in pair.iterdir() if p.name.startswith(".")) == []


def test_force_never_replaces_a_device_or_a_link(pair, tmp_path):
    args = [str(pair / "ckpt.pt"), str(pair / "ref.pt"), "-o"]
    assert_error(run_here("merge", *args, "/dev/null", "--force"), "/dev/null", "character device")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    target = tmp_path / "target.pt"
    target.write_bytes(b"old")
    (tmp_path / "link.pt").symlink_to(target)
    assert_error(run_here("merge", *args, str(tmp_path / "link.pt"), "--force"), "symbolic link")
    assert target.read_bytes() == b"old"


def test_force_replaces_a_dcp_checkpoint_directory_even_read_only(pair):
    out = pair / "merged"
    dcp_save({"old": torch.ones(3)}, out)
    os.chmod(out, 0o555)
    args = [str(pair / "ckpt_dcp"), str(pair / "ref_dcp"), "-o", str(out), "--force"]
    proc = run_here("merge", *args)
    assert proc.returncode == 0, proc.stderr
    assert set(load_checkpoint(out)) == {"w", "b"}
    assert not [p for p in pair.iterdir() if p.name.startswith(".")]


def test_force_replaces_a_read_only_file_without_setuid_setgid_or_sticky(pair):
    out = pair / "merged.pt"
    out.write_bytes(b"old")
    os.chmod(out, 0o4444 | stat.S_ISGID | stat.S_ISVTX)  # read-only, setuid, setgid, sticky
    proc = run_here("merge", str(pair / "ckpt.pt"), str(pair / "ref.pt"), "-o", str(out), "--force")
    assert proc.returncode == 0, proc.stderr
    mode = out.stat().st_mode
    assert stat.S_IMODE(mode) == 0o444
    assert set(torch.load(out, weights_only=True)) == {"w", "b"}


def test_safetensors_outputs_keep_outs_mode(pair):
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, str(pair / "ckpt.safetensors"))
    out = pair / "merged.safetensors"
    out.write_bytes(b"old")
    os.chmod(out, 0o640)
    args = [str(pair / "ckpt.safetensors"), str(pair / "ref.pt"), "-o", str(out), "--force"]
    proc = run_here("merge", *args)
    assert proc.returncode == 0, proc.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o640
    fresh = pair / "fresh.safetensors"
    proc = run_here("merge", *args[:2], "-o", str(fresh))
    assert proc.returncode == 0, proc.stderr
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o666 & ~umask


# -- 8. the name says the format ---------------------------------------------------------------


def test_out_follows_its_name(pair):
    out = pair / "cross.pt"  # a DCP checkpoint merged into a .pt file: a torch file
    proc = run_here("merge", str(pair / "ckpt_dcp"), str(pair / "ref_dcp"), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert out.is_file()
    assert detect_format(out) == "torch"
    assert "(torch," in proc.stdout
    st = pair / "x.safetensors"
    proc = run_here("merge", str(pair / "ckpt.pt"), str(pair / "ref.pt"), "-o", str(st))
    assert proc.returncode == 0, proc.stderr
    assert set(read_metadata(st)) == {"w", "b"}
    assert read_metadata(st).format == "safetensors"
    d = pair / "as_dcp"
    proc = run_here("merge", str(pair / "ckpt.pt"), str(pair / "ref.pt"), "-o", str(d))
    assert proc.returncode == 0, proc.stderr
    assert detect_format(d) == "dcp"


@pytest.mark.parametrize(
    ("name", "fmt", "words"),
    [
        ("cross.pt", "dcp", ("says torch", "--format dcp", "directory name without a suffix")),
        ("x.safetensors", "torch", ("says safetensors", ".pt, .pth or .bin")),
        ("merged", "torch", ("says dcp",)),
        ("model.ckpt", None, ("does not say a format", "--format")),
    ],
)
def test_a_name_that_disagrees_with_the_format_is_refused(pair, name, fmt, words):
    out = pair / name
    args = [str(pair / "ckpt.pt"), str(pair / "ref.pt"), "-o", str(out)]
    if fmt:
        args += ["--format", fmt]
    assert_error(run_here("merge", *args), *words)
    assert not out.exists()
    if name == "model.ckpt":
        proc = run_here("merge", *args, "--format", "torch")
        assert proc.returncode == 0, proc.stderr
        assert detect_format(out) == "torch"


def test_output_format_is_a_pure_function():
    from dsdmerge.integrations.writing import output_format

    assert output_format(Path("a.PT")) == "torch"
    assert output_format(Path("a.bin")) == "torch"
    assert output_format(Path("dir/step-1000")) == "dcp"
    assert output_format(Path("x.ckpt"), "safetensors") == "safetensors"
    with pytest.raises(dm.CheckpointWriteError):
        output_format(Path("x.pth"), "dcp")


def test_the_flat_view_shortcut_agrees_with_rebuilding_the_nesting(tmp_path):
    from dsdmerge.integrations import _dcp as c

    sd = {"model": {"layers": {"0": {"w": torch.ones(2)}}, "head.b": torch.zeros(1)}, "step": 4}
    dcp_save(sd, tmp_path / "plain")
    _view, md = read_dcp_view(str(tmp_path / "plain"), trusted=False)
    paths = c._dcp_paths(md)
    assert c._plain_paths(paths)
    fast = c._dcp_entries(str(tmp_path / "plain"), md, trusted=False)
    slow = dm.flatten(
        c._rebuild(
            str(tmp_path / "plain"),
            md,
            lambda k, p, m: fast[k],
            budget=1 << 20,
        )
    )
    assert list(fast) == list(slow)
    # a key that is not its path joined, or a path through another's value: the long way
    assert not c._plain_paths({"x": ("a", "b")})
    assert not c._plain_paths({"a": ("a",), "a.b": ("a", "b")})
    assert not c._plain_paths({"optim.state.w": ("optim", "state", "w")})
    assert not c._plain_paths({"g.0": ("g", 0)})


def test_a_fifo_or_device_is_never_read_as_a_checkpoint(tmp_path):
    fifo = tmp_path / "ckpt.pt"
    os.mkfifo(fifo)  # opening it for reading would block until a writer came
    assert_error(run_here("inspect", str(fifo)), "ckpt.pt", "not a regular file")
    assert_error(run_here("inspect", "/dev/zero"), "/dev/zero", "not a regular file")
    dcp = tmp_path / "dcp"
    dcp.mkdir()
    os.mkfifo(dcp / ".metadata")
    with pytest.raises(dm.CheckpointReadError, match="not a regular file"):
        read_metadata(dcp)


# -- 9. reading is bounded by the bytes on disk, whatever the storage entries say ----------


BOUNDED_ONE = textwrap.dedent(
    """
    import sys, time, pathlib
    import hostile_files as hf
    import dsdmerge as dm
    from dsdmerge.integrations import read_metadata, load_checkpoint
    import torch.distributed.checkpoint
    hf.limit_memory(int(sys.argv[3]) << 20)
    ckpt = pathlib.Path(sys.argv[1])
    read = {"read_metadata": read_metadata, "load_checkpoint": load_checkpoint}[sys.argv[2]]
    kwargs = {"key": sys.argv[4]} if len(sys.argv) > 4 else {}
    start = time.perf_counter()
    try:
        read(ckpt, **kwargs)
        print("read")
    except dm.DSDMergeError as err:
        cause = err
        while cause is not None:
            assert not isinstance(cause, (MemoryError, RecursionError)), err
            cause = cause.__cause__ or cause.__context__
        print(type(err).__name__, str(err).splitlines()[0][:400])
    print("seconds", time.perf_counter() - start)
    """
)


def bounded(path: Path, read: str, *, mib: int = 512, key: str | None = None) -> str:
    """``read(path)`` in a child with ``mib`` MiB of address space more than its imports
    took; returns its one outcome line, after checking it took under 30 s."""
    env = {**os.environ, "PYTHONPATH": f"{hf.ROOT}{os.pathsep}{hf.ROOT / 'tests'}"}
    args = [sys.executable, "-c", BOUNDED_ONE, str(path), read, str(mib), *([key] if key else [])]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outcome, seconds = proc.stdout.strip().splitlines()
    assert float(seconds.split()[1]) < 30, (outcome, seconds)
    return outcome


def disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir())


def test_tensors_mapped_onto_one_region_are_refused_before_anything_is_allocated(tmp_path):
    # 4096 tensors of 256 KiB on one 256 KiB region: 1 GiB from a directory of ~0.6 MB
    ckpt = hf.overlapping_tensors(tmp_path / "ckpt", 4096)
    assert disk_bytes(ckpt) < 1 << 20
    view = read_metadata(ckpt)  # metadata only: the claims, as claims
    assert len(view) == 4096
    outcome = bounded(ckpt, "load_checkpoint", mib=256)
    assert outcome.startswith("CheckpointReadError"), outcome
    assert "overlap" in outcome, outcome
    assert "nothing was read" in outcome, outcome
    assert_error(run_here("merge", str(ckpt), str(ckpt), "-o", str(tmp_path / "o.pt")), "overlap")
    assert not (tmp_path / "o.pt").exists()


def test_two_names_of_one_data_file_are_one_file(tmp_path):
    ckpt = tmp_path / "ckpt"
    dcp_save({"a": torch.ones(4), "b": torch.ones(4)}, ckpt)
    os.link(ckpt / "__0_0.distcp", ckpt / "copy.distcp")  # a hard link: the same bytes

    def edit(md):
        infos = sorted(md.storage_data.values(), key=lambda i: i.offset)
        infos[1].relative_path, infos[1].offset = "copy.distcp", infos[0].offset

    hf.edit_metadata(ckpt, edit)
    with pytest.raises(dm.CheckpointReadError, match="overlap"):
        load_checkpoint(ckpt)


def test_param_groups_sharing_one_params_region_are_refused_in_bounded_time(tmp_path):
    # 2000 groups' params entries on one region of 131,072 ids (~0.5 MB): reading each
    # would unpickle 262 million ids (minutes and gigabytes) from a ~1 MB directory
    ckpt = hf.overlapping_params(tmp_path / "ckpt", 2000)
    assert disk_bytes(ckpt) < 2 << 20
    for read in ("read_metadata", "load_checkpoint"):
        outcome = bounded(ckpt, read, mib=512)
        assert outcome.startswith("CheckpointReadError"), outcome
        assert "overlap" in outcome, outcome
        assert "param_groups" in outcome, outcome
    assert_error(run_here("inspect", str(ckpt)), "overlap")
    assert_error(run_here("check", str(ckpt), str(ckpt)), "overlap")


def test_a_valid_nested_optimizer_view_reads_each_params_entry_once(tmp_path, monkeypatch):
    from dsdmerge.integrations import _dcp as c

    ckpt = nested_optimizer_checkpoint(tmp_path / "ckpt")
    reads = []
    real = c._read_region
    monkeypatch.setattr(c, "_read_region", lambda *a: reads.append(a[1]) or real(*a))
    view = read_metadata(ckpt)
    assert reads == ["optim.param_groups.0.params"]
    assert "optim.param_groups.1.lr" in view  # one row per parameter id the entry lists


@pytest.mark.parametrize(("depth", "keys"), [(100_000, 1), (3_000, 40)])
def test_deep_planner_paths_cost_time_linear_in_the_file(tmp_path, depth, keys):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(hf.deep_path(depth, keys))
    assert (ckpt / ".metadata").stat().st_size < 1 << 20
    for read, key in [("read_metadata", None), ("read_metadata", "a.a"), ("load_checkpoint", None)]:
        outcome = bounded(ckpt, read, mib=512, key=key)
        assert outcome.startswith("CheckpointReadError"), outcome
        assert "nested" in outcome, outcome


def test_moderately_deep_paths_still_read(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(hf.deep_path(24, 5))
    view = read_metadata(ckpt)
    assert list(view) == [".".join(["a"] * 24 + [f"k{n}"]) for n in range(5)]
    assert view.layout is dm.Layout.NESTED
    part = read_metadata(ckpt, key=".".join(["a"] * 20))
    assert list(part) == [".".join(["a"] * 4 + [f"k{n}"]) for n in range(5)]
    assert part.layout is dm.Layout.NESTED


# -- 10. named storage classes in .metadata: admitted, built without running their code ------


@dataclasses.dataclass
class OlmoLikeStorageInfo:
    """A storage entry class of another DCP writer (as OLMo-core's ``_StorageInfo``)."""

    relative_path: str
    offset: int
    length: int

    def __setstate__(self, state):  # the safe reader builds it without running this
        RAN.append(state)
        self.__dict__.update(state)


RAN: list = []


OLMO_LIKE = "test_untrusted.OlmoLikeStorageInfo"


def olmo_like_checkpoint(path: Path) -> dict:
    model = torch.nn.Linear(3, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    sgd.step()
    sd = {"model": model.state_dict(), "optim": sgd.state_dict(), "step": 3}
    dcp_save(sd, path)

    def edit(md):
        for index, info in md.storage_data.items():
            md.storage_data[index] = OlmoLikeStorageInfo(
                info.relative_path, info.offset, info.length
            )

    hf.edit_metadata(path, edit)
    return sd


class OlmoLikeReader(torch.distributed.checkpoint.FileSystemReader):
    """A storage reader that knows its writer's storage class (as OLMo-core's does)."""

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        assert all(type(v) is OlmoLikeStorageInfo for v in metadata.storage_data.values())
        self.storage_data = {
            k: _StorageInfo(v.relative_path, v.offset, v.length)
            for k, v in metadata.storage_data.items()
        }


def test_named_storage_classes_are_honoured_for_dcp_metadata(tmp_path, canary):
    ckpt = tmp_path / "ckpt"
    sd = olmo_like_checkpoint(ckpt)
    with pytest.raises(dm.UnsafeCheckpointError, match=OLMO_LIKE) as info:
        read_metadata(ckpt)
    assert "trusted=['module.Name']" in str(info.value)
    view = read_metadata(ckpt, trusted=[OLMO_LIKE])
    assert view["model.weight"] == dm.TensorMeta((2, 3), torch.float32)
    assert "optim.param_groups.1.momentum" in view  # the params entry was read: ids [0, 1]
    _view, md = read_dcp_view(str(ckpt), trusted=[OLMO_LIKE])
    assert {type(v) for v in md.storage_data.values()} == {OlmoLikeStorageInfo}
    assert RAN == []  # no code of the trusted class ran
    assert md == pickle.loads((ckpt / ".metadata").read_bytes())  # as torch's own reader
    assert RAN
    loaded = load_checkpoint(ckpt, trusted=[OLMO_LIKE], storage_reader=OlmoLikeReader(ckpt))
    assert torch.equal(loaded["model"]["weight"], sd["model"]["weight"])
    assert loaded["step"] == 3
    proc = run_here("inspect", str(ckpt), "--safe-globals", OLMO_LIKE)
    assert proc.returncode == 0, proc.stderr
    assert "model.{bias,weight}" in proc.stdout
    # only what is named: another class stays refused, and a name is not a class grant
    with pytest.raises(dm.UnsafeCheckpointError):
        read_metadata(ckpt, trusted=["test_untrusted.Sneaky"])


@pytest.mark.parametrize(
    "fields",
    [
        {"relative_path": 3},
        {"offset": -1},
        {"length": "8"},
        {"extra": 1},
        {"relative_path": ["a"]},
    ],
)
def test_a_named_storage_class_gets_only_plain_checked_fields(tmp_path, fields):
    ckpt = tmp_path / "ckpt"
    olmo_like_checkpoint(ckpt)

    def edit(md):
        info = next(iter(md.storage_data.values()))
        info.__dict__.update(fields)

    hf.edit_metadata(ckpt, edit)
    with pytest.raises(dm.CheckpointReadError, match="OlmoLikeStorageInfo"):
        read_metadata(ckpt, trusted=[OLMO_LIKE])


def test_a_named_class_is_admitted_only_as_a_storage_entry(tmp_path, canary):
    ckpt = tmp_path / "ckpt"
    olmo_like_checkpoint(ckpt)

    def edit(md):  # the trusted class where a tensor entry stands
        md.state_dict_metadata["step"] = OlmoLikeStorageInfo("x", 0, 1)

    hf.edit_metadata(ckpt, edit)
    with pytest.raises(dm.CheckpointReadError, match="an entry"):
        read_metadata(ckpt, trusted=[OLMO_LIKE])


def test_storage_reader_reads_what_the_default_reader_reads(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    ckpt = nested_optimizer_checkpoint(tmp_path / "ckpt")
    plain = load_checkpoint(ckpt)
    through = load_checkpoint(ckpt, storage_reader=FileSystemReader(str(ckpt)))
    assert list(dm.flatten(through)) == list(dm.flatten(plain))
    for key, value in dm.flatten(plain).items():
        other = dm.flatten(through)[key]
        assert torch.equal(other, value) if isinstance(value, torch.Tensor) else other == value
    assert dict(read_metadata(ckpt, storage_reader=FileSystemReader(str(ckpt)))) == dict(
        read_metadata(ckpt)
    )
    # the metadata is still read by the safe reader, never by the reader's own unpickling
    (ckpt / ".metadata").write_bytes(hf.bytearray_bomb())
    with pytest.raises(dm.UnsafeCheckpointError):
        read_metadata(ckpt, storage_reader=FileSystemReader(str(ckpt)))
    with pytest.raises(dm.InvalidPolicyError, match="StorageReader"):
        load_checkpoint(nested_optimizer_checkpoint(tmp_path / "c2"), storage_reader=object())


def test_a_remote_checkpoint_needs_trust_to_let_its_reader_read_the_metadata(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    ckpt = tmp_path / "ckpt"
    dcp_save({"w": torch.arange(3.0)}, ckpt)
    reader = FileSystemReader(str(ckpt))
    with pytest.raises(dm.CheckpointReadError, match="trusted=True"):
        read_metadata("s3://bucket/ckpt", storage_reader=reader)
    view = read_metadata("s3://bucket/ckpt", storage_reader=reader, trusted=True)
    assert view["w"] == dm.TensorMeta((3,), torch.float32)
    loaded = load_checkpoint("s3://bucket/ckpt", storage_reader=reader, trusted=True)
    assert torch.equal(loaded["w"], torch.arange(3.0))


def test_a_real_olmo_core_checkpoint_reads_with_its_storage_class_and_reader(tmp_path):
    fs = pytest.importorskip("olmo_core.distributed.checkpoint.filesystem")
    name = "olmo_core.distributed.checkpoint.filesystem._StorageInfo"
    model = torch.nn.Linear(3, 2)
    adam = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(1, 3)).sum().backward()
    adam.step()
    sd = {"model": model.state_dict(), "optim": adam.state_dict()}
    ckpt = tmp_path / "model_and_optim"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=fs.RemoteFileSystemWriter(str(ckpt), thread_count=1))
    with pytest.raises(dm.UnsafeCheckpointError, match=name.replace(".", r"\.")):
        read_metadata(ckpt)
    view = read_metadata(ckpt, trusted=[name], storage_reader=fs.RemoteFileSystemReader(ckpt))
    assert view["model.weight"] == dm.TensorMeta((2, 3), torch.float32)
    assert view["optim.state.0.exp_avg"] == dm.TensorMeta((2, 3), torch.float32)
    loaded = load_checkpoint(
        ckpt, trusted=[name], storage_reader=fs.RemoteFileSystemReader(ckpt, thread_count=1)
    )
    assert torch.equal(loaded["model"]["weight"], model.weight.detach())
    assert torch.equal(
        loaded["optim"]["state"]["0"]["exp_avg"], adam.state[model.weight]["exp_avg"]
    )
    assert loaded["optim"]["param_groups"][0]["params"] == [0, 1]


@pytest.mark.skipif(
    "strides" not in _torch_api.tensor_properties_fields(),
    reason="TensorProperties has strides since torch 2.15",
)
def test_a_strides_tuple_shared_between_tensors_reads_as_torch_reads_it(tmp_path):
    ckpt = tmp_path / "ckpt"
    dcp_save({"a": torch.ones(2, 3), "b": torch.zeros(2, 3)}, ckpt)

    def edit(md):  # one tuple object for both (a writer that copies properties shares it)
        shared = md.state_dict_metadata["a"].properties.strides
        md.state_dict_metadata["b"].properties.strides = shared

    hf.edit_metadata(ckpt, edit)
    data = (ckpt / ".metadata").read_bytes()
    assert data.count(b"\x86\x94t\x94b") == 1  # pickled once, fetched from the memo after
    _view, md = read_dcp_view(str(ckpt), trusted=False)
    assert md == pickle.loads(data)
    assert md.state_dict_metadata["b"].properties.strides == (3, 1)
    # a fetched tuple that holds more than ints is still refused
    evil = data.replace(b"K\x03K\x01\x86\x94t\x94b", b"K\x03)\x86\x94t\x94b", 1)
    (ckpt / ".metadata").write_bytes(evil)
    with pytest.raises(dm.CheckpointReadError):
        read_metadata(ckpt)
