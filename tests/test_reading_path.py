"""What a newcomer reads tracing ``dm.merge``: the layers in order, few hops between modules.

The trace is ``sys.setprofile``'s call events in dsdmerge's modules: a *hop* is a call
into another module than the previous call's. The case is the one dsdmerge exists for:
a flat AdamW checkpoint (DSD's ``flatten_optimizer_state_dict=True``) that lacks the
state of a head that never got a gradient, merged over the fresh optimizer's.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

import dsdmerge as dm

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
# The layers a merge goes through, in the order it enters them.
LAYERS = [
    "dsdmerge.merge",
    "dsdmerge._options",
    "dsdmerge._pipeline",
    "dsdmerge._engine",
    "dsdmerge._verdict",
]
# The bound a newcomer's trace keeps to (docs/development.md, "The reading path").
MOST_HOPS = 20


def _pair() -> tuple[dict[str, Any], dict[str, Any]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    optim = torch.optim.AdamW(model.parameters())
    model[0](torch.randn(1, 2)).sum().backward()  # the head gets no gradient
    optim.step()
    ckpt = get_optimizer_state_dict(model, optim, options=FLAT)
    resumed = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    fresh = torch.optim.AdamW(resumed.parameters())
    return ckpt, get_optimizer_state_dict(resumed, fresh, options=FLAT)


def _trace(ckpt: dict[str, Any], ref: dict[str, Any]) -> list[str]:
    modules: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            name = frame.f_globals.get("__name__", "")
            if name.startswith("dsdmerge") and (not modules or modules[-1] != name):
                modules.append(name)

    old = sys.getprofile()
    sys.setprofile(profile)
    try:
        dm.merge(ckpt, ref)
    finally:
        sys.setprofile(old)
    return modules


def test_a_flat_merge_reads_through_the_layers_in_order_in_few_hops():
    ckpt, ref = _pair()
    merged = dm.merge(ckpt, ref)  # warm: lazy imports and caches out of the trace
    assert merged.keys() == ref.keys()
    modules = _trace(ckpt, ref)
    assert len(modules) - 1 <= MOST_HOPS, modules
    firsts = [modules.index(layer) for layer in LAYERS]
    assert firsts == sorted(firsts), modules
