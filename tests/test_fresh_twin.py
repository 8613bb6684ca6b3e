"""The throwaway twin a resume asks for an optimizer's fresh state: one stand-in per kind.

A meta step costs about a millisecond a tensor, so the twin steps one parameter per
shape, dtype, layout and grad flag in each group, and every parameter of that kind reads
its fresh state from that one. An optimizer that keeps its parameters in a list of its
own, which its step walks, must not see one stand-in many times.
"""

from __future__ import annotations

import torch

from dsdmerge.integrations._fresh import fresh_states, twin


def _layers() -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList([torch.nn.Linear(3, 3) for _ in range(4)] + [torch.nn.Linear(3, 2)])


def test_a_meta_twin_steps_one_parameter_per_kind_in_each_group():
    layers = _layers()
    weights = [m.weight for m in layers]
    biases = [m.bias for m in layers]
    opt = torch.optim.AdamW([{"params": weights}, {"params": biases, "lr": 0.5}])
    tw, stand_in = twin(opt, kind="meta", one_per_kind=True)
    # weights: [3, 3] x4 and [2, 3]; biases: [3] x4 and [2]
    assert [len(g["params"]) for g in tw.param_groups] == [2, 2]
    assert len({id(stand_in[id(w)]) for w in weights[:4]}) == 1
    assert stand_in[id(weights[0])] is not stand_in[id(weights[4])]
    assert all(stand_in[id(p)].device.type == "meta" for p in weights + biases)
    assert [g["lr"] for g in tw.param_groups] == [g["lr"] for g in opt.param_groups]
    fresh = fresh_states(opt, kind="meta", every_param=True)
    assert set(fresh) == {id(p) for p in weights + biases}
    for p in weights + biases:
        assert fresh[id(p)]["exp_avg"].shape == p.shape
    assert not opt.state  # the live optimizer is untouched


class OwnList(torch.optim.Optimizer):
    """Keeps its parameters in a list of its own, and its step walks that list."""

    def __init__(self, params) -> None:
        super().__init__(params, {"lr": 0.1})
        self.every = [p for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        for p in self.every:
            entry = self.state[p]
            entry["visits"] = entry.get("visits", 0) + 1
            entry["buf"] = torch.zeros_like(p)


def test_an_optimizer_that_walks_its_own_list_sees_each_parameter_once():
    layers = _layers()
    opt = OwnList([m.weight for m in layers])
    fresh = fresh_states(opt, kind="meta", every_param=True)
    assert {id(m.weight) for m in layers} <= set(fresh)
    assert [fresh[id(m.weight)]["visits"] for m in layers] == [1] * 5
    tw, _ = twin(opt, kind="meta", one_per_kind=True)
    assert len({id(p) for p in tw.every}) == 5  # its own list: a stand-in each
    assert [len(g["params"]) for g in tw.param_groups] == [2]  # its group: one per kind
