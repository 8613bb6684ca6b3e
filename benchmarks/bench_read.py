"""Reading a DCP ``.metadata`` safely, against torch's own unrestricted ``pickle.load``.

    python benchmarks/bench_read.py            # DeepSeek-V3 scale: 661,709 keys, ~160 MB
    python benchmarks/bench_read.py --quick    # 2 layers (CI smoke run, seconds)
    python benchmarks/bench_read.py --layers 16   # 172,000 keys

The file is what DCP's ``FileSystemWriter`` writes: a ``Metadata`` built from DCP's own
classes (a tensor entry with one chunk, or a bytes entry, per flat key of the
DeepSeek-V3-scale AdamW checkpoint of ``_data.py``, saved as ``{"optim": flat}``, with
its storage index and planner path) pickled with ``pickle.dump`` (protocol 4, framed).
The cases run interleaved, one of each per round, medians over the rounds:

* ``torch pickle.load``: what ``FileSystemReader.read_metadata`` does (no restriction);
* ``dsdmerge load_metadata``: the safe reader (grammar, memo poisoning, stand-ins,
  validation into DCP's real classes), from the file's bytes;
* ``dsdmerge read_metadata``: the whole metadata-only view (the above, plus the flat
  view ``inspect`` and ``diff`` use).

The targets: ``load_metadata / pickle.load <= 1.3`` and ``read_metadata / pickle.load <=
1.3`` (the whole view ``inspect`` shows, not only the unpickling).
"""

from __future__ import annotations

import argparse
import gc
import os
import pathlib
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
if str(HERE.parent) not in sys.path:  # run from a checkout without installing
    sys.path.insert(1, str(HERE.parent))

import _data  # noqa: E402

TARGET = 1.3


def build_metadata(layers: int, experts: int) -> Any:
    """A DCP ``Metadata`` of the DeepSeek-V3-scale flat AdamW checkpoint, as DCP records it."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    flat = _data.flat(_data.nested(_data.deepseek_v3_params(layers, experts), checkpoint=True))
    sdm: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, Any] = {}
    offset = 0
    for n, (key, value) in enumerate(flat.items()):
        fqn = f"optim.{key}"
        planner[fqn] = ("optim", key)
        if isinstance(value, torch.Tensor):
            shape = torch.Size(value.shape)
            chunk = ChunkStorageMetadata(torch.Size([0] * len(shape)), shape)
            sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=value.dtype), shape, [chunk])
            index = MetadataIndex(fqn, [0] * len(shape), 0)
            length = value.numel() * value.element_size() + 1024
        else:
            sdm[fqn] = BytesStorageMetadata()
            index = MetadataIndex(fqn)
            length = 600
        storage[index] = _StorageInfo(f"__{n % 2}_0.distcp", offset, length)
        offset += length
    meta = StorageMeta(pathlib.Path("/checkpoints/step-1000"), "save-id", None)
    md = Metadata(sdm, planner_data=planner, storage_data=storage, storage_meta=meta)
    if hasattr(md, "version"):  # torch >= 2.7 records a metadata version
        md.version = "1.0.0"
    return md


def write_checkpoint(where: Path, layers: int, experts: int) -> int:
    """``where/.metadata`` as FileSystemWriter writes it; returns the number of keys."""
    metadata = build_metadata(layers, experts)
    where.mkdir(parents=True, exist_ok=True)
    with open(where / ".metadata", "wb") as f:
        pickle.dump(metadata, f)  # FileSystemWriter.finish: pickle.dump, default protocol
    keys = len(metadata.state_dict_metadata)
    del metadata
    gc.collect()
    return keys


def run(*, quick: bool, rounds: int | None = None, layers: int | None = None) -> dict[str, Any]:
    from dsdmerge.integrations import read_metadata
    from dsdmerge.integrations._dcp_metadata import load_metadata

    layers, experts = (2, 256) if quick else (layers or 61, 256)
    rounds = rounds or (1 if quick else 3)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        keys = write_checkpoint(ckpt, layers, experts)
        file = ckpt / ".metadata"
        size = file.stat().st_size

        def torch_load() -> Any:
            with open(file, "rb") as f:
                return pickle.load(f)

        def safe_load() -> Any:
            return load_metadata(file.read_bytes(), where=str(file))

        def view() -> Any:
            return read_metadata(ckpt)

        cases = {
            "torch pickle.load": torch_load,
            "dsdmerge load_metadata": safe_load,
            "dsdmerge read_metadata": view,
        }
        assert safe_load() == torch_load()  # the same Metadata, field by field
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(rounds):
            for name, fn in cases.items():
                gc.collect()
                start = time.perf_counter()
                out = fn()
                times[name].append(time.perf_counter() - start)
                del out
                gc.collect()
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return {
        "layers": layers,
        "experts": experts,
        "keys": keys,
        "bytes": size,
        "rounds": rounds,
        "seconds": med,
        "all_seconds": times,
    }


def report(result: dict[str, Any]) -> str:
    s = result["seconds"]
    base = s["torch pickle.load"]
    lines = [
        f"DCP .metadata of {result['keys']:,} keys ({result['bytes'] / 2**20:.0f} MiB), "
        f"median of {result['rounds']} round(s):",
        "",
        "| read | median | / torch pickle.load |",
        "|---|---:|---:|",
    ]
    for name, sec in s.items():
        lines.append(f"| {name} | {sec:.2f} s | {sec / base:.2f} |")
    lines += ["", "| target | measured | bound | met |", "|---|---:|---:|:-:|"]
    for name, what in (
        ("dsdmerge load_metadata", "safe read"),
        ("dsdmerge read_metadata", "whole view"),
    ):
        ratio = s[name] / base
        met = "yes" if ratio <= TARGET else "NO"
        lines.append(f"| {what} / torch pickle.load | {ratio:.2f} | <= {TARGET} | {met} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 layers, 1 round (CI smoke run)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 3, quick 1)")
    ap.add_argument("--layers", type=int, default=None, help="model layers (default 61)")
    args = ap.parse_args(argv)
    load = os.getloadavg()[0]
    result = run(quick=args.quick, rounds=args.rounds, layers=args.layers)
    print(report(result))
    print(
        f"\nPython {sys.version.split()[0]}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"load average {load:.1f} at start and {os.getloadavg()[0]:.1f} at end."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
