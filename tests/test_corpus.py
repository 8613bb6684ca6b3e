"""Checkpoints written by every supported torch, read by the installed one.

``tests/corpus/torch-<major.minor>/`` holds what ``tests/corpus/make_corpus.py`` wrote
with that torch: DCP directories, torch zip and legacy files, a safetensors file, and
``MANIFEST.json`` with what torch's own unrestricted readers saw when it wrote them.
On the installed torch, for every release in the corpus:

* the safe ``.metadata`` reader gives exactly what torch's own ``pickle.load`` gives
  (every field of every record, types included), or, where torch's own reader fails
  (a newer release's format), refuses with a ``CheckpointReadError`` that says so;
* ``load_checkpoint`` of each DCP directory gives what torch's own DCP reader loaded
  (``dcp_to_torch_save``), and ``read_metadata`` its flat keys, shapes and dtypes;
* torch and safetensors files read as ``torch.load(weights_only=True)`` and
  ``safetensors`` read them.

A new torch release is one more directory (run the script with it). A directory named
``torch-<major.minor>-py<version>`` was written under that Python: Python 3.11.0-3.11.4
pickle an Enum member by name (``getattr(cls, "NAME")``), so DCP's memory-format field
reads differently there.
"""

from __future__ import annotations

import enum
import json
import pathlib
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

import dsdmerge as dm
from dsdmerge._torch_api import torch_version
from dsdmerge.integrations import load_checkpoint, read_metadata
from dsdmerge.integrations._dcp_metadata import load_metadata

CORPUS = Path(__file__).resolve().parent / "corpus"
RELEASES = sorted(p.name for p in CORPUS.glob("torch-*") if (p / "MANIFEST.json").is_file())


def manifest(release: str) -> dict[str, Any]:
    return json.loads((CORPUS / release / "MANIFEST.json").read_text())


def cases() -> list[tuple[str, str]]:
    return [(r, c) for r in RELEASES for c in sorted(manifest(r)["cases"])]


def release_of(name: str) -> tuple[int, int]:
    """``torch-2.13`` (or ``torch-2.13-py3.11.2``: written under another Python) -> (2, 13)."""
    major, minor = name.removeprefix("torch-").split("-")[0].split(".")
    return int(major), int(minor)


def deep(obj: Any, depth: int = 0) -> Any:
    """Every field of every record, with exact types, as nested tuples."""
    assert depth < 50
    kind = type(obj)
    name = f"{kind.__module__}.{kind.__qualname__}"
    if isinstance(obj, torch.Size):
        return (name, tuple(obj))
    if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
        return (name, str(obj))
    if isinstance(obj, enum.Enum):
        return (name, obj.name)
    if isinstance(obj, pathlib.PurePath):
        return (name, str(obj))
    if isinstance(obj, dict):
        return (name, tuple((deep(k, depth + 1), deep(v, depth + 1)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return (name, tuple(deep(v, depth + 1) for v in obj))
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return (name, obj)
    fields = vars(obj)  # the instance's own fields (an old file lacks a newer field)
    return (name, tuple((k, deep(v, depth + 1)) for k, v in sorted(fields.items())))


def rebuild(plain: Any) -> Any:
    """The value ``make_corpus._plain`` described."""
    if isinstance(plain, dict):
        if "tensor" in plain:
            dtype = getattr(torch, plain["dtype"])
            return (
                torch.tensor(plain["values"], dtype=torch.float64)
                .to(dtype)
                .reshape(plain["tensor"])
            )
        if "dict" in plain:
            return {rebuild(k): rebuild(v) for k, v in plain["dict"]}
        if "list" in plain:
            return [rebuild(v) for v in plain["list"]]
        if "tuple" in plain:
            return tuple(rebuild(v) for v in plain["tuple"])
        raise AssertionError(plain)
    return plain


def same(a: Any, b: Any, where: str = "") -> None:
    """Equal structure, types and values (tensors: dtype, shape and every element)."""
    if isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor), where
        assert (a.dtype, tuple(a.shape)) == (b.dtype, tuple(b.shape)), where
        assert torch.equal(a.cpu(), b.cpu()), where
        return
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(b, dict):
        assert list(a) == list(b), where
        for k in b:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(b, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def test_the_corpus_covers_the_oldest_and_the_newest_supported_torch():
    # (files from older releases stay: the installed torch must still read them)
    from dsdmerge._torch_api import MIN_TORCH

    releases = [release_of(r) for r in RELEASES]
    assert MIN_TORCH in releases, RELEASES
    assert max(releases) >= (2, 15), RELEASES
    for release in RELEASES:
        torch_part, _, python = release.removeprefix("torch-").partition("-py")
        assert manifest(release)["torch"].startswith(torch_part), release
        assert not python or manifest(release)["python"] == python, release


@pytest.mark.parametrize(("release", "case"), cases())
def test_dcp_metadata_reads_as_torchs_own_pickle_load(release, case):
    data = (CORPUS / release / case / ".metadata").read_bytes()
    try:
        expected = pickle.loads(data)  # the corpus is ours: torch's own, unrestricted way
    except Exception:  # noqa: BLE001 - a newer release's format: refused, saying why
        assert release_of(release) > torch_version()
        with pytest.raises(dm.CheckpointReadError, match=r"torch >= \d"):
            load_metadata(data, where=case)
        return
    got = load_metadata(data, where=case)
    assert deep(got) == deep(expected)


@pytest.mark.parametrize(("release", "case"), cases())
def test_dcp_directories_load_and_view_as_torchs_own_reader_does(release, case, tmp_path):
    path = CORPUS / release / case
    recorded = manifest(release)["cases"][case]
    try:
        pickle.loads((path / ".metadata").read_bytes())
    except Exception:  # noqa: BLE001 - a newer release's format (checked above)
        pytest.skip(f"torch {torch.__version__} cannot read {release}'s DCP metadata")
    loaded = rebuild(recorded["loaded"])  # what torch's own reader loaded when it wrote it
    same(load_checkpoint(path), loaded)
    view = read_metadata(path)
    flat = dm.flatten(loaded)
    assert list(view) == list(flat)
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            assert view[key] == dm.TensorMeta.of(value), key
    # and what the installed torch's own reader loads from the same directory
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(path), str(tmp_path / "whole.pt"))
    same(load_checkpoint(path), torch.load(tmp_path / "whole.pt", weights_only=False))


@pytest.mark.parametrize(
    ("release", "name"),
    [(r, n) for r in RELEASES for n in [*sorted(manifest(r)["cases"]), "legacy"]],
)
def test_torch_files_read_as_weights_only_torch_load_does(release, name):
    path = CORPUS / release / f"{name}.pt"
    expected = torch.load(path, weights_only=True)
    same(load_checkpoint(path), expected)
    view = read_metadata(path)
    flat = dm.flatten(expected)
    assert list(view) == list(flat)
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            assert view[key] == dm.TensorMeta.of(value), key


@pytest.mark.parametrize("release", RELEASES)
def test_safetensors_files_read_as_safetensors_does(release):
    from safetensors.torch import load_file

    path = CORPUS / release / "dtypes.safetensors"
    expected = load_file(str(path))
    same(load_checkpoint(path), expected)
    view = read_metadata(path)
    assert {k: (v.shape, v.dtype) for k, v in view.items()} == {
        k: (tuple(v.shape), v.dtype) for k, v in expected.items()
    }
    assert view.metadata == {"format": "pt"}


class _GetattrOf:
    """Pickles as ``getattr(owner, name)``, the form Python 3.11.0-3.11.4 give an Enum member."""

    def __init__(self, owner: Any, name: str) -> None:
        self.owner, self.name = owner, name

    def __reduce__(self) -> Any:
        return (getattr, (self.owner, self.name))


@pytest.mark.parametrize(
    ("owner", "name"),
    [(torch.Size, "__init__"), (pathlib.Path, "home"), (torch.float32, "to")],
    ids=["size", "path", "dtype"],
)
def test_getattr_stands_only_for_a_memory_format_name(owner, name):
    data = pickle.dumps(_GetattrOf(owner, name), protocol=4)
    with pytest.raises((dm.UnsafeCheckpointError, dm.CheckpointReadError)):
        load_metadata(data, where="crafted")
