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
