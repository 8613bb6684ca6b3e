"""Reading checkpoints safely: every format, metadata only, malicious and corrupt files."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from helpers import Evil, dcp_save

import dsdmerge as dm
from dsdmerge.integrations import (
    CheckpointView,
    detect_format,
    load_checkpoint,
    read_metadata,
)


def nested_sd() -> dict:
    torch.manual_seed(0)
    return {
        "model": {"w": torch.randn(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16)},
        "optim": {
            "state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.randn(3, 4)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w", "b"]}],
        },
        "epoch": 3,
    }


def flat_optim_sd() -> dict:
    """What torchtitan saves: a model state dict and a flattened DSD optimizer state dict."""
    torch.manual_seed(0)
    return {
        "model": {"w": torch.randn(3, 4), "indexer.w": torch.randn(4)},
        "optim": {
            "state.w.step": torch.tensor(2.0),
            "state.w.exp_avg": torch.randn(3, 4),
            "param_groups.w.lr": 5e-5,
            "param_groups.indexer.w.lr": 5e-5,
        },
    }


def assert_same(a, b) -> None:
    fa, fb = dm.flatten(a), dm.flatten(b)
    assert list(fa) == list(fb)
    for key, value in fa.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, fb[key]), key
            assert value.dtype == fb[key].dtype, key
        else:
            assert value == fb[key], key


def assert_view_matches(view: CheckpointView, sd) -> None:
    flat = dm.flatten(sd)
    assert list(view) == list(flat)
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            assert view[key] == dm.TensorMeta.of(value), key
    assert not dm.diff(view, sd)
    tensors = [v for v in flat.values() if isinstance(v, torch.Tensor)]
    assert view.tensor_count == len(tensors)
    assert view.nbytes == sum(t.numel() * t.element_size() for t in tensors)


def rchar() -> int:
    """Bytes this process has read through read()-like syscalls so far (Linux)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


needs_proc_io = pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux")


# --------------------------------------------------------------------------------------
# formats


def test_detect_format(tmp_path):
    torch.save({"w": torch.zeros(1)}, tmp_path / "a.pt")
    shutil.copy(tmp_path / "a.pt", tmp_path / "noext")
    torch.save({"w": torch.zeros(1)}, tmp_path / "legacy", _use_new_zipfile_serialization=False)
    (tmp_path / "x.safetensors").write_bytes(b"")
    dcp_save({"w": torch.zeros(1)}, tmp_path / "dcp")
    assert detect_format(tmp_path / "a.pt") == "torch"
    assert detect_format(tmp_path / "noext") == "torch"
    assert detect_format(str(tmp_path / "legacy")) == "torch"
    assert detect_format(tmp_path / "x.safetensors") == "safetensors"
    assert detect_format(tmp_path / "dcp") == "dcp"
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(dm.CheckpointReadError, match=r"notes\.txt: unknown checkpoint format"):
        detect_format(tmp_path / "notes.txt")
    with pytest.raises(dm.CheckpointReadError, match="no such file or directory"):
        detect_format(tmp_path / "nope.pt")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(dm.CheckpointReadError, match=r"without a \.metadata file"):
        detect_format(tmp_path / "empty_dir")


def test_checkpoint_read_error_is_an_oserror_naming_the_path(tmp_path):
    with pytest.raises(OSError, match="no such file") as info:
        read_metadata(tmp_path / "missing.pt")
    err = info.value
    assert isinstance(err, dm.CheckpointReadError)
    assert isinstance(err, dm.DSDMergeError)
    assert str(tmp_path / "missing.pt") in str(err)
    assert "\n" not in str(err)
    assert err.path == str(tmp_path / "missing.pt")


def test_torch_file_roundtrip(tmp_path):
    sd = nested_sd()
    torch.save(sd, tmp_path / "ckpt.pt")
    view = read_metadata(tmp_path / "ckpt.pt")
    assert view.format == "torch"
    assert view.path == str(tmp_path / "ckpt.pt")
    assert_view_matches(view, sd)
    assert view["optim.param_groups.w.lr"] == 0.1  # cheap, safe non-tensor values are known
    assert view["epoch"] == 3
    assert view.dtypes == {"bfloat16": 1, "float32": 3}
    assert_same(load_checkpoint(tmp_path / "ckpt.pt"), sd)


def test_legacy_torch_file(tmp_path):
    sd = nested_sd()
    torch.save(sd, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    assert_view_matches(read_metadata(tmp_path / "old.pt"), sd)
    assert_same(load_checkpoint(tmp_path / "old.pt"), sd)


def test_dcp_roundtrip_nested_optimizer(tmp_path):
    sd = nested_sd()
    dcp_save(sd, tmp_path / "ckpt")
    view = read_metadata(tmp_path / "ckpt")
    assert view.format == "dcp"
    # group membership comes from the (small, safely read) params entries: same spelling as
    # dsdmerge.flatten of the loaded checkpoint
    assert_view_matches(view, sd)
    assert view["optim.param_groups.b.lr"] is CheckpointView.UNREAD
    assert view["epoch"] is view["optim.param_groups.w.betas"]  # one shared placeholder
    loaded = load_checkpoint(tmp_path / "ckpt")
    assert_same(loaded, sd)
    assert loaded["optim"]["param_groups"] == sd["optim"]["param_groups"]


def test_dcp_roundtrip_flattened_optimizer(tmp_path):
    sd = flat_optim_sd()
    dcp_save(sd, tmp_path / "ckpt")
    assert_view_matches(read_metadata(tmp_path / "ckpt"), sd)
    assert_same(load_checkpoint(tmp_path / "ckpt"), sd)


def test_safetensors_roundtrip(tmp_path):
    sd = nested_sd()["model"]
    safetensors_torch = pytest.importorskip("safetensors.torch")
    safetensors_torch.save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    view = read_metadata(tmp_path / "model.safetensors")
    assert view.format == "safetensors"
    assert_view_matches(view, sd)
    assert_same(load_checkpoint(tmp_path / "model.safetensors"), sd)


def test_view_is_read_only_and_accepted_by_diff_and_check(tmp_path):
    sd = flat_optim_sd()
    dcp_save(sd, tmp_path / "ckpt")
    view = read_metadata(tmp_path / "ckpt")
    with pytest.raises(TypeError):
        view["model.w"] = 1  # type: ignore[index]
    with pytest.raises(AttributeError):
        view.nbytes = 0  # type: ignore[misc]
    reference = {"model": {**sd["model"], "head": torch.zeros(2)}, "optim": dict(sd["optim"])}
    reference["model"]["w"] = torch.zeros(3, 5)
    d = dm.diff(view, reference)
    assert d.missing == ("model.head",)
    assert d.mismatched_keys == ("model.w",)
    with pytest.raises(dm.MergeError, match=r"model\.w"):
        dm.check(view, reference, policy=dm.DEFAULT, allow_missing=["model.head"])
    reference["model"]["w"] = torch.zeros(3, 4)
    # param_groups values are all the same placeholder: no group conflict is invented
    assert dm.check(view, reference, policy="strict", allow_missing=["model.head"]).missing == (
        "model.head",
    )
    assert dm.diff(reference, view).unexpected == ("model.head",)


# --------------------------------------------------------------------------------------
# no tensor bytes


def test_dcp_metadata_needs_no_data_files(tmp_path):
    sd = flat_optim_sd()
    dcp_save(sd, tmp_path / "ckpt")
    for data in (tmp_path / "ckpt").glob("*.distcp"):
        data.unlink()
    view = read_metadata(tmp_path / "ckpt")  # .metadata only
    assert_view_matches(view, sd)
    with pytest.raises(dm.CheckpointReadError, match="DCP load failed"):
        load_checkpoint(tmp_path / "ckpt")


@needs_proc_io
@pytest.mark.parametrize("fmt", ["torch", "safetensors", "dcp"])
def test_metadata_reads_no_tensor_bytes(tmp_path, fmt):
    sd = {"big": torch.zeros(2048, 2048), "small": torch.ones(3)}  # 16 MiB
    path = tmp_path / {"torch": "big.pt", "safetensors": "big.safetensors", "dcp": "big"}[fmt]
    if fmt == "torch":
        torch.save(sd, path)
    elif fmt == "safetensors":
        pytest.importorskip("safetensors.torch").save_file(sd, path)
    else:
        dcp_save(sd, path)
    read_metadata(path)  # warm up imports
    before = rchar()
    view = read_metadata(path)
    read = rchar() - before
    assert view.nbytes == 2048 * 2048 * 4 + 12
    assert read < 256 * 1024, f"read {read} bytes for metadata"


# --------------------------------------------------------------------------------------
# malicious pickles


def test_malicious_torch_file_is_refused_before_it_runs(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"w": torch.zeros(2), "payload": Evil(marker)}, tmp_path / "evil.pt")
    for read in (read_metadata, load_checkpoint):
        with pytest.raises(dm.UnsafeCheckpointError, match="trusted=True") as info:
            read(tmp_path / "evil.pt")
        assert str(tmp_path / "evil.pt") in str(info.value)
        assert "\n" not in str(info.value)
        assert not marker.exists()
    # the payload is live: trusting the file runs it
    load_checkpoint(tmp_path / "evil.pt", trusted=True)
    assert marker.exists()


def test_malicious_dcp_metadata_is_refused_before_it_runs(tmp_path):
    from torch.distributed.checkpoint.metadata import Metadata

    marker = tmp_path / "pwned"
    ckpt = tmp_path / "ckpt"
    dcp_save({"w": torch.zeros(2)}, ckpt)
    with open(ckpt / ".metadata", "rb") as f:
        metadata: Metadata = pickle.load(f)
    metadata.planner_data = {"w": ("w",), "x": Evil(marker)}
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    for read in (read_metadata, load_checkpoint):
        with pytest.raises(dm.UnsafeCheckpointError, match=r"builtins\.exec.*trusted=True"):
            read(ckpt)
        assert not marker.exists()
    # torch's own reader would have run it
    from torch.distributed.checkpoint import FileSystemReader

    FileSystemReader(str(ckpt)).read_metadata()
    assert marker.exists()


def test_malicious_dcp_bytes_entry_is_refused_before_it_runs(tmp_path):
    marker = tmp_path / "pwned"
    dcp_save({"w": torch.zeros(2), "payload": Evil(marker)}, tmp_path / "ckpt")
    assert not marker.exists()
    view = read_metadata(tmp_path / "ckpt")  # metadata only: the bytes are never read
    assert view["payload"] is CheckpointView.UNREAD
    with pytest.raises(dm.UnsafeCheckpointError, match=r"'payload'.*trusted=True"):
        load_checkpoint(tmp_path / "ckpt")
    assert not marker.exists()
    load_checkpoint(tmp_path / "ckpt", trusted=True)
    assert marker.exists()


# --------------------------------------------------------------------------------------
# corrupt files


def truncate(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize("keep", [0.0, 0.5, 0.95])
def test_truncated_torch_file(tmp_path, keep):
    torch.save(nested_sd(), tmp_path / "ckpt.pt")
    truncate(tmp_path / "ckpt.pt", keep)
    for read in (read_metadata, load_checkpoint):
        with pytest.raises(dm.CheckpointReadError, match="not a readable torch checkpoint") as info:
            read(tmp_path / "ckpt.pt")
        assert type(info.value) is dm.CheckpointReadError  # corrupt, not "unsafe"


@pytest.mark.filterwarnings("ignore:Detected pickle protocol 4")
def test_garbage_torch_file(tmp_path):
    (tmp_path / "ckpt.pt").write_bytes(b"\x80\x04garbage" * 10)
    with pytest.raises(dm.CheckpointReadError, match=r"ckpt\.pt: not a readable torch"):
        read_metadata(tmp_path / "ckpt.pt")


def test_corrupt_safetensors(tmp_path):
    path = tmp_path / "m.safetensors"
    pytest.importorskip("safetensors.torch").save_file({"w": torch.zeros(64)}, path)
    good = path.read_bytes()
    # the safetensors library reads the header: its reasons, on one line
    for data, match in [
        (good[:5], "header too small"),
        (good[:20], "invalid header length"),
        (good[:8] + b"x" * (len(good) - 8), "invalid JSON"),
        (good[: len(good) - 16], "not fully covered"),
    ]:
        path.write_bytes(data)
        with pytest.raises(dm.CheckpointReadError, match=match):
            read_metadata(path)
        with pytest.raises(dm.CheckpointReadError):
            load_checkpoint(path)


@pytest.mark.parametrize("keep", [0.0, 0.5])
def test_truncated_dcp_metadata(tmp_path, keep):
    dcp_save(nested_sd(), tmp_path / "ckpt")
    truncate(tmp_path / "ckpt" / ".metadata", keep)
    for read in (read_metadata, load_checkpoint):
        with pytest.raises(dm.CheckpointReadError, match="not a readable DCP metadata") as info:
            read(tmp_path / "ckpt")
        assert type(info.value) is dm.CheckpointReadError


def test_dcp_metadata_that_is_not_metadata(tmp_path):
    dcp_save({"w": torch.zeros(1)}, tmp_path / "ckpt")
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps({"w": 1}))
    with pytest.raises(dm.CheckpointReadError, match="not DCP Metadata"):
        read_metadata(tmp_path / "ckpt")


def test_torch_file_that_is_not_a_state_dict(tmp_path):
    torch.save([torch.zeros(1)], tmp_path / "list.pt")
    with pytest.raises(dm.CheckpointReadError, match="holds a list, not a state dict"):
        read_metadata(tmp_path / "list.pt")
    with pytest.raises(dm.CheckpointReadError, match="holds a list, not a state dict"):
        load_checkpoint(tmp_path / "list.pt")


def test_views_know_the_layout_the_checkpoint_was_saved_in(tmp_path):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    saved = {
        "model.pt": (model.state_dict(), dm.Layout.FLAT),
        "optim.pt": (opt.state_dict(), dm.Layout.NESTED),
        "whole.pt": ({"model": model.state_dict(), "optim": opt.state_dict()}, dm.Layout.NESTED),
    }
    for name, (sd, _) in saved.items():
        torch.save(sd, tmp_path / name)
    dcp_save({"model": model.state_dict()}, tmp_path / "dcp_nested")
    dcp_save(dict(model.state_dict()), tmp_path / "dcp_flat")
    expected = {name: layout for name, (_, layout) in saved.items()}
    expected |= {"dcp_nested": dm.Layout.NESTED, "dcp_flat": dm.Layout.FLAT}
    for name, layout in expected.items():
        view = read_metadata(tmp_path / name)
        assert view.layout is layout, name
        assert dm.classify(view) is dm.Layout.FLAT  # the view itself is always flat


def test_the_checkpoints_modules_old_internal_names_warn_and_still_work(tmp_path):
    import warnings

    from dsdmerge import _paths
    from dsdmerge.integrations import _dcp, _files, _view, checkpoints

    moved = {
        "read_dcp_metadata": _dcp.read_dcp_view,
        "run_dcp_load": _dcp.dcp_load_into,
        "hf_shards": _files.hf_shards,
        "tensor_metas": _view.tensor_metas,
        "meta_nbytes": _view.meta_nbytes,
        "state_dict_part": _paths.state_dict_part,
    }
    for name, new in moved.items():
        match = f"dsdmerge.integrations.checkpoints.{name} is internal"
        with pytest.warns(DeprecationWarning, match=match):
            assert getattr(checkpoints, name) is new
    dcp_save({"w": torch.ones(2)}, tmp_path)
    with pytest.warns(DeprecationWarning, match="read_dcp_metadata is internal"):
        read_dcp_metadata = checkpoints.read_dcp_metadata
    view, metadata = read_dcp_metadata(str(tmp_path), trusted=False)
    assert dict(view) == {"w": _view.TensorMeta((2,), torch.float32)}
    assert list(metadata.state_dict_metadata) == ["w"]
    with pytest.raises(AttributeError):
        checkpoints.no_such_name  # noqa: B018
    # what stays: the public names, and the placeholder older pickles of a view name here
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert checkpoints.CheckpointView is _view.CheckpointView
        assert pickle.loads(pickle.dumps(checkpoints.UNREAD)) is _view.UNREAD
