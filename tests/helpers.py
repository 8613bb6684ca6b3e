"""Helpers shared by the torch-backed tests: a grown model, DCP saving, a malicious pickle."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from dsdmerge.demo import TinyModel


class Grown(TinyModel):
    """TinyModel plus a new head registered first, so its params lead their groups."""

    def __init__(self) -> None:
        super().__init__()
        self.new_head = nn.Linear(8, 16)
        # move new_head to the front of the parameter order
        self._modules = {"new_head": self._modules.pop("new_head"), **self._modules}

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens) + self.new_head(self.embed(tokens))


def dcp_save(sd: Any, path: Path) -> None:
    """``dcp.save`` in this single process, without its "assuming a single process" warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(sd, checkpoint_id=str(path))


class Evil:
    """Unpickling this runs code: it writes ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


def rows_reordered(sd, start_fraction):
    """A flat dict whose parameters from some row on list their hyperparameters in reverse
    order (as torch writes a group whose dict orders them its own way): a table in blocks."""
    rows: dict[str, list[str]] = {}
    for key in sd:
        if key.startswith("param_groups."):
            rows.setdefault(key[len("param_groups.") :].rpartition(".")[0], []).append(key)
    fqns = list(rows)
    start = int(len(fqns) * start_fraction)
    out = {k: v for k, v in sd.items() if not k.startswith("param_groups.")}
    for i, fqn in enumerate(fqns):
        keys = rows[fqn][::-1] if i >= start else rows[fqn]
        out |= {k: sd[k] for k in keys}
    return out


def quietly(fn: Any, /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with its DSDMergeWarnings silenced (for what it returns)."""
    import dsdmerge as dm

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dm.DSDMergeWarning)
        return fn(*args, **kwargs)


def taking_reference(fn: Any, /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, on_shape_mismatch="take_reference", **kwargs)``, its warnings silenced.

    For tests that compare what a merge returns when reshaped tensors take the
    reference's (which always warns), not what it says.
    """
    return quietly(fn, *args, on_shape_mismatch="take_reference", **kwargs)
