"""Model surgery through the resume helpers: rename= and on_shape_mismatch= on resume_model /
resume_optimizer, and int-id checkpoints keyed by torch's param_names."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

import dsdmerge as dm
from dsdmerge.integrations import resume_model, resume_optimizer

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class LM(nn.Module):
    def __init__(self, vocab: int = 10, dim: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.embed(ids))


class Wrapper(nn.Module):
    """What DDP's state dict keys look like: everything under ``module.``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.module = inner

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.module(ids)


def train(model, optim, steps=3, vocab=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randint(0, vocab, (8,), generator=g)).square().mean().backward()
        optim.step()
        optim.zero_grad()


def test_a_ddp_checkpoint_resumes_into_a_bare_model_with_the_preset():
    torch.manual_seed(0)
    wrapped = Wrapper(LM())
    optim = torch.optim.AdamW(wrapped.parameters(), lr=0.01)
    train(wrapped, optim)
    model_sd = {k: v.clone() for k, v in wrapped.state_dict().items()}
    optim_sd = copy.deepcopy(get_optimizer_state_dict(wrapped, optim, options=FLAT))
    assert next(iter(model_sd)).startswith("module.")
    train(wrapped, optim, steps=1, seed=1)
    final = {k.removeprefix("module."): v for k, v in wrapped.state_dict().items()}

    model = LM()
    optim2 = torch.optim.AdamW(model.parameters(), lr=0.5)
    with pytest.raises(dm.MergeError, match=r"prefix 'module\.'"):
        resume_model(model, model_sd)  # without the rule: refused, naming the prefix
    resume_model(model, model_sd, rename="ddp", policy="strict")
    resume_optimizer(model, optim2, optim_sd, rename="ddp", policy="strict")
    train(model, optim2, steps=1, seed=1)
    assert all(torch.equal(v, final[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("layout", ["flat", "nested", "int"])
def test_vocabulary_growth_keeps_the_trained_rows_and_their_moments(layout):
    torch.manual_seed(0)
    small = LM(vocab=10)
    optim = torch.optim.AdamW(small.parameters(), lr=0.01)
    train(small, optim)
    saved_model = {k: v.clone() for k, v in small.state_dict().items()}
    if layout == "int":
        saved = copy.deepcopy(optim.state_dict())
    else:
        options = FLAT if layout == "flat" else None
        saved = copy.deepcopy(get_optimizer_state_dict(small, optim, options=options))
    trained = optim.state[small.embed.weight]

    torch.manual_seed(1)
    big = LM(vocab=12)
    new_rows = big.embed.weight[10:].detach().clone()
    optim2 = torch.optim.AdamW(big.parameters(), lr=0.01)
    snap = [p.detach().clone() for p in big.parameters()]
    with pytest.raises(dm.MergeError, match="shape"):
        resume_model(big, saved_model)
    assert all(torch.equal(a, b) for a, b in zip(snap, big.parameters(), strict=True))
    diff = resume_model(big, saved_model, on_shape_mismatch="resize")
    assert [r.key for r in diff.resized] == ["embed.weight"]
    assert torch.equal(big.embed.weight[:10], saved_model["embed.weight"])
    assert torch.equal(big.embed.weight[10:], new_rows)  # new rows: the model's own init
    odiff = resume_optimizer(big, optim2, saved, on_shape_mismatch="resize")
    assert len(odiff.resized) == 2  # exp_avg and exp_avg_sq
    state = optim2.state[big.embed.weight]
    for name in ("exp_avg", "exp_avg_sq"):
        assert state[name].shape == (12, 4)
        assert torch.equal(state[name][:10], trained[name])
        assert not state[name][10:].any()  # fresh moments for the new rows
    assert torch.equal(state["step"], trained["step"])
    train(big, optim2, vocab=12)  # training continues


def test_an_int_id_checkpoint_with_param_names_survives_a_new_head():
    torch.manual_seed(0)
    model = LM()
    optim = torch.optim.AdamW(model.named_parameters(), lr=0.01)  # torch >= 2.5: param_names
    train(model, optim)
    saved = copy.deepcopy(optim.state_dict())
    assert "param_names" in saved["param_groups"][0]

    class Grown(LM):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(4, 3)

    grown = Grown()
    grown.load_state_dict(model.state_dict(), strict=False)
    optim2 = torch.optim.AdamW(grown.parameters(), lr=0.5)
    diff = resume_optimizer(
        grown, optim2, saved, policy="strict", allow_missing=["state.head.*", "param_groups.head.*"]
    )
    assert {k.split(".")[1] for k in diff.missing} == {"head"}
    assert optim2.param_groups[0]["lr"] == 0.01
    sd = optim2.state_dict()["state"]
    assert torch.equal(sd[0]["exp_avg"], saved["state"][0]["exp_avg"])  # embed.weight
    assert grown.head.weight not in optim2.state  # fresh


def test_rename_on_an_int_id_checkpoint_without_names_says_how_to_rekey():
    model = LM()
    optim = torch.optim.AdamW(model.parameters())
    saved = {"state": {}, "param_groups": [{**optim.state_dict()["param_groups"][0]}]}
    with pytest.raises(dm.LayoutError, match="rekey"):
        resume_optimizer(model, optim, saved, rename="ddp")
