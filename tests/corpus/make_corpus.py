"""Write the checkpoint corpus of the installed torch: ``tests/corpus/torch-<major.minor>/``.

    python tests/corpus/make_corpus.py            # with the torch to add (any venv)
    python tests/corpus/make_corpus.py --out DIR  # somewhere else

Each case is one small state dict written the ways torch writes checkpoints: a DCP
directory (``dcp.save``, one process), a torch zip file (``torch.save``) and, for flat
tensor dicts, a safetensors file. ``MANIFEST.json`` records the torch that wrote them
and, per DCP case, what torch's own unrestricted reader (``pickle.load`` of
``.metadata``, ``dcp_to_torch_save``) saw, so ``tests/test_corpus.py`` can check the
safe readers against it on every other torch too. A new torch release is one more run
of this script (and one more directory); nothing else changes.

Only torch, safetensors and the standard library are used: this script runs in a bare
virtualenv with the torch to record (the package under test is not imported).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

HERE = Path(__file__).resolve().parent


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def _trained(opt_cls: Any, **kw: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model()
    opt = opt_cls(model.parameters(), **kw)
    for _ in range(2):
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def cases() -> dict[str, dict[str, Any]]:
    """The state dicts of the corpus, by case name."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model, adam = _trained(torch.optim.AdamW, lr=1e-3)
    flat_optim = get_optimizer_state_dict(
        model, adam, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    sgd_model, sgd = _trained(torch.optim.SGD, lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    dtypes = {
        "f32": torch.randn(2, 3, generator=g),
        "bf16": torch.randn(4, generator=g).to(torch.bfloat16),
        "f16": torch.randn(1, 2, 1, generator=g).half(),
        "i64": torch.arange(5),
        "i8": torch.tensor([-1, 2], dtype=torch.int8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "five_d": torch.ones(1, 2, 1, 2, 1),
        "transposed": torch.arange(6.0).reshape(2, 3).t(),
    }
    return {
        # a model state dict and a few non-tensor values (bytes entries)
        "model": {
            "model": get_model_state_dict(model),
            "step": 7,
            "name": "run-1",
            "lrs": [0.1, 0.01],
        },
        # nested optimizer state (int ids, param_groups lists): params bytes entries
        "optim_nested": {"model": sgd_model.state_dict(), "optim": sgd.state_dict()},
        # DSD's flattened optimizer state dict, as torchtitan saves it
        "optim_flat": {"model": get_model_state_dict(model), "optim": flat_optim},
        # every common dtype, a 0-d, an empty, a 5-d and a non-contiguous tensor
        "dtypes": dtypes,
    }


def _plain(value: Any) -> Any:
    """A JSON description of a value (tensors: shape, dtype and the values)."""
    if isinstance(value, torch.Tensor):
        return {
            "tensor": list(value.shape),
            "dtype": str(value.dtype).removeprefix("torch."),
            "values": value.float().flatten().tolist(),
        }
    if isinstance(value, dict):
        return {"dict": [[_plain(k), _plain(v)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return {type(value).__name__: [_plain(v) for v in value]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return {"repr": repr(value)}


def _metadata_summary(md: Any) -> dict[str, Any]:
    """What torch's own ``pickle.load`` of ``.metadata`` gives, in JSON."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = {}
    for key, value in md.state_dict_metadata.items():
        if isinstance(value, TensorStorageMetadata):
            props = value.properties
            entries[key] = {
                "size": list(value.size),
                "dtype": str(props.dtype).removeprefix("torch."),
                "chunks": [[list(c.offsets), list(c.sizes)] for c in value.chunks],
                "strides": list(s) if (s := getattr(props, "strides", None)) is not None else None,
            }
        else:
            entries[key] = {"bytes": True}
    storage = [
        [
            k.fqn,
            list(k.offset) if k.offset is not None else None,
            k.index,
            v.relative_path,
            v.offset,
            v.length,
        ]
        for k, v in (md.storage_data or {}).items()
    ]
    planner = {k: list(v) for k, v in (md.planner_data or {}).items()}
    return {
        "state_dict_metadata": entries,
        "storage_data": storage,
        "planner_data": planner,
        "version": getattr(md, "version", None),
    }


def write(out: Path) -> Path:
    """Write every case under ``out`` (replaced if it exists); return the manifest path."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    manifest: dict[str, Any] = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "pickle_protocol": pickle.DEFAULT_PROTOCOL,
        "cases": {},
    }
    cwd = os.getcwd()
    os.chdir(out)  # DCP records the checkpoint_id it was given: a relative path
    try:
        for name, sd in cases().items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.save(sd, checkpoint_id=Path(name))
            torch.save(sd, f"{name}.pt")
            with open(Path(name) / ".metadata", "rb") as f:
                md = pickle.load(f)  # the files were just written here: torch's own way
            with tempfile.TemporaryDirectory() as tmp:
                dcp_to_torch_save(name, f"{tmp}/whole.pt")
                whole = torch.load(f"{tmp}/whole.pt", weights_only=False)
            manifest["cases"][name] = {
                "metadata": _metadata_summary(md),
                "loaded": _plain(whole),  # what torch's own DCP reader loads
            }
        from safetensors.torch import save_file

        flat = {k: v.contiguous() for k, v in cases()["dtypes"].items()}
        save_file(flat, "dtypes.safetensors", metadata={"format": "pt"})
        torch.save(flat, "legacy.pt", _use_new_zipfile_serialization=False)
    finally:
        os.chdir(cwd)
    path = out / "MANIFEST.json"
    path.write_text(json.dumps(manifest, sort_keys=True) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    ap.add_argument("--out", type=Path, default=HERE / f"torch-{version}")
    args = ap.parse_args(argv)
    print(write(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
