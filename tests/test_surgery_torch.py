"""Model surgery with real models and optimizers: renamed, wrapped, grown and int-keyed resumes."""

from __future__ import annotations

import io
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from helpers import Grown
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

import dsdmerge as dm
from dsdmerge.demo import TinyModel, make_optimizer

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
NESTED = StateDictOptions()


def saved(obj):
    """``obj`` after a torch.save / torch.load(weights_only=True) round trip."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def groups(model: nn.Module):
    """Decay / no-decay groups by name, the usual trainer split."""
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
        {"params": [p for n, p in named if not n.endswith("weight")], "weight_decay": 0.0},
    ]


def step(model: nn.Module, optim, tokens: torch.Tensor) -> torch.Tensor:
    loss = model(tokens).logsumexp(-1).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


# -- (a) a refactor that renames attention projections in every layer ----------------------


class Attention(nn.Module):
    def __init__(self, dim: int, names: tuple[str, str, str]) -> None:
        super().__init__()
        self.names = names
        for name in names:
            setattr(self, name, nn.Linear(dim, dim))
        self.wo = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (getattr(self, n)(x) for n in self.names)
        att = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        return x + self.wo(att @ v)


class Net(nn.Module):
    def __init__(self, names: tuple[str, str, str], vocab: int = 12, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            nn.ModuleDict({"attn": Attention(dim, names)}) for _ in range(3)
        )
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer["attn"](x)
        return self.head(x)


OLD, NEW = ("wq", "wk", "wv"), ("q_proj", "k_proj", "v_proj")
REFACTOR = {rf"\.attn\.{o}\.": f".attn.{n}." for o, n in zip(OLD, NEW, strict=True)}


@pytest.mark.parametrize("options", [FLAT, NESTED], ids=["flat", "nested"])
def test_a_renamed_model_resumes_bit_identical_to_an_uninterrupted_run(options):
    torch.manual_seed(0)
    old = Net(OLD)
    optim = torch.optim.AdamW(groups(old), lr=1e-2)
    for _ in range(3):
        step(old, optim, torch.randint(0, 12, (2, 5)))
    ckpt = saved(
        {"model": old.state_dict(), "optim": get_optimizer_state_dict(old, optim, options=options)}
    )

    torch.manual_seed(1)  # another init: everything must come from the checkpoint
    new = Net(NEW)
    new_optim = torch.optim.AdamW(groups(new), lr=1e-2)
    d = dm.diff(ckpt["model"], new.state_dict())
    assert {(s.pattern, s.replacement) for s in d.renames} == set(REFACTOR.items())
    new.load_state_dict(dm.merge(ckpt["model"], new.state_dict(), rename=REFACTOR, policy="strict"))
    fresh = get_optimizer_state_dict(new, new_optim, options=options)
    merged = dm.merge(ckpt["optim"], fresh, rename=REFACTOR, policy="strict")
    set_optimizer_state_dict(new, new_optim, merged, options=options)

    batch = torch.randint(0, 12, (2, 5))
    assert torch.equal(step(old, optim, batch), step(new, new_optim, batch))
    new_params = dict(new.named_parameters())
    for name, p in old.named_parameters():
        renamed = name
        for o, n in zip(OLD, NEW, strict=True):
            renamed = renamed.replace(f".attn.{o}.", f".attn.{n}.")
        assert torch.equal(p, new_params[renamed]), name
        assert torch.equal(
            optim.state[p]["exp_avg_sq"], new_optim.state[new_params[renamed]]["exp_avg_sq"]
        )


# -- (b) a vocabulary that grew ---------------------------------------------------------------


class LM(nn.Module):
    def __init__(self, vocab: int, *, tied: bool, dim: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embed(tokens))))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_vocabulary_growth_keeps_old_rows_and_their_moments(tied):
    old_vocab, grown = 10, 13
    torch.manual_seed(0)
    old = LM(old_vocab, tied=tied)
    optim = torch.optim.AdamW(old.parameters(), lr=1e-2)
    for _ in range(3):
        step(old, optim, torch.randint(0, old_vocab, (4, 5)))
    ckpt = saved(
        {"model": old.state_dict(), "optim": get_optimizer_state_dict(old, optim, options=FLAT)}
    )

    torch.manual_seed(1)
    new = LM(grown, tied=tied)
    new_optim = torch.optim.AdamW(new.parameters(), lr=1e-2)
    init = {k: v.clone() for k, v in new.state_dict().items()}
    with pytest.raises(dm.MergeError, match="on_shape_mismatch='resize'"):
        dm.merge(ckpt["model"], new.state_dict())
    model_merge = dm.merge_with_diff(ckpt["model"], new.state_dict(), on_shape_mismatch="resize")
    new.load_state_dict(model_merge.state_dict)
    fresh = get_optimizer_state_dict(new, new_optim, options=FLAT)
    optim_merge = dm.merge_with_diff(ckpt["optim"], fresh, on_shape_mismatch="resize")
    set_optimizer_state_dict(new, new_optim, optim_merge.state_dict, options=FLAT)

    # weights: the old rows exactly, the new rows as the fresh model initialised them
    # (tied: the model state dict holds the shared tensor under both names; both resize)
    assert {r.key for r in model_merge.diff.resized} == {"embed.weight", "head.weight"}
    for name in ("embed.weight", "head.weight"):
        got = new.state_dict()[name]
        assert torch.equal(got[:old_vocab], ckpt["model"][name])
        assert torch.equal(got[old_vocab:], init[name][old_vocab:])
    # moments: the old rows exactly, the new rows as a fresh optimizer has them; step kept
    keys = {r.key for r in optim_merge.diff.resized}
    assert "state.embed.weight.exp_avg" in keys
    assert "state.embed.weight.exp_avg_sq" in keys
    for name, p in new.named_parameters():
        st = new_optim.state[p]
        assert torch.equal(st["step"], ckpt["optim"][f"state.{name}.step"])
        for moment in ("exp_avg", "exp_avg_sq"):
            old_m = ckpt["optim"][f"state.{name}.{moment}"]
            if st[moment].shape == old_m.shape:
                assert torch.equal(st[moment], old_m)
            else:
                assert torch.equal(st[moment][:old_vocab], old_m)
                assert torch.equal(
                    st[moment][old_vocab:], fresh[f"state.{name}.{moment}"][old_vocab:]
                )
    # training continues, new tokens included
    loss = step(new, new_optim, torch.randint(0, grown, (4, 5)))
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p).all() for p in new.parameters())
    assert new_optim.state[new.embed.weight]["step"].item() == 4


# -- (c) a torch.compile'd and a DDP-saved checkpoint into a bare model --------------------------


def trained_tiny():
    torch.manual_seed(0)
    model = TinyModel()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        step(model, optim, torch.randint(0, 16, (4, 6)))
    return model, optim


def resume_bare(model_sd, optim_sd, rules):
    bare = TinyModel()
    bare_optim = torch.optim.Adam(bare.parameters(), lr=1e-2)
    bare.load_state_dict(dm.merge(model_sd, bare.state_dict(), rename=rules, policy="strict"))
    fresh = get_optimizer_state_dict(bare, bare_optim)
    merged = dm.merge(
        optim_sd, fresh, rename=rules, policy="strict", allow_missing=["state.indexer.*"]
    )
    set_optimizer_state_dict(bare, bare_optim, merged)
    return bare, bare_optim


def assert_same_training_state(model, optim, bare, bare_optim):
    bare_params = dict(bare.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, bare_params[name]), name
        for field, value in optim.state[p].items():
            assert torch.equal(value, bare_optim.state[bare_params[name]][field]), (name, field)


def test_a_torch_compile_checkpoint_resumes_into_a_bare_model():
    model, optim = trained_tiny()
    compiled = torch.compile(model)  # never run: only its state dict keys matter here
    model_sd = saved(compiled.state_dict())
    assert all(k.startswith("_orig_mod.") for k in model_sd)
    # optimizer.state_dict() of the compiled model, keyed by its own fqns
    optim_sd = saved(dm.rekey(optim.state_dict(), compiled.named_parameters()))
    assert next(iter(optim_sd["state"])).startswith("_orig_mod.")
    assert [s.preset for s in dm.diff(model_sd, TinyModel().state_dict()).renames] == ["compile"]
    bare, bare_optim = resume_bare(model_sd, optim_sd, "compile")
    assert_same_training_state(model, optim, bare, bare_optim)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_ddp_checkpoint_resumes_into_a_bare_model():
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{_free_port()}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=60),
    )
    try:
        model, _ = trained_tiny()
        ddp = DDP(model, find_unused_parameters=True)  # the indexer gets no gradient
        optim = torch.optim.Adam(ddp.parameters(), lr=1e-2)
        for _ in range(2):
            step(ddp, optim, torch.randint(0, 16, (4, 6)))
        model_sd = saved(ddp.state_dict())
        optim_sd = saved(dm.rekey(optim.state_dict(), ddp.named_parameters()))
    finally:
        dist.destroy_process_group()
    assert all(k.startswith("module.") for k in model_sd)
    assert dm.diff(model_sd, TinyModel().state_dict()).suggested_rules == {r"^module\.": ""}
    bare, bare_optim = resume_bare(model_sd, optim_sd, "ddp")
    assert_same_training_state(model, optim, bare, bare_optim)
    # the flat DSD form of the same state renames the same way
    flat = dm.flatten(optim_sd)
    assert dm.rename(flat, "ddp") == dm.flatten(dm.rename(optim_sd, "ddp"))


# -- (d) an int-id checkpoint of a model that then grew a head ------------------------------------


def test_an_int_id_checkpoint_of_a_model_that_grew_a_head():
    torch.manual_seed(0)
    old = TinyModel()
    optim, schedule = make_optimizer(old)  # decay / no-decay groups, a decaying lr
    for _ in range(3):
        step(old, optim, torch.randint(0, 16, (4, 6)))
        schedule.step()
    scheduled_lr = optim.param_groups[0]["lr"]
    ckpt = saved(optim.state_dict())  # int ids, in param-group order

    new = Grown()  # a new head registered first: every old id now points elsewhere
    new_optim, _ = make_optimizer(new)
    with pytest.raises(ValueError, match="doesn't match the size"):
        new_optim.load_state_dict(ckpt)
    # the old model's names in the order its optimizer's groups list them
    old_names = [n for g in make_groups_names(old) for n in g]
    fqn_keyed = dm.rekey(ckpt, old_names)
    fresh = get_optimizer_state_dict(new, new_optim)
    merged = dm.merge(
        fqn_keyed, fresh, policy="strict", allow_missing=["*.new_head.*", "state.indexer.*"]
    )
    set_optimizer_state_dict(new, new_optim, merged)

    new_params = dict(new.named_parameters())
    for name, p in old.named_parameters():
        for field, value in optim.state.get(p, {}).items():
            assert torch.equal(new_optim.state[new_params[name]][field], value), (name, field)
    for g in new_optim.param_groups:
        assert g["lr"] == pytest.approx(scheduled_lr)  # the new head did not reset it
    assert new_optim.state[new.new_head.weight]["step"].item() == 1  # DSD's fresh state
    assert torch.isfinite(step(new, new_optim, torch.randint(0, 16, (4, 6))))

    # and back to int ids for Optimizer.load_state_dict of the new optimizer
    again, _ = make_optimizer(Grown())
    new_names = [n for g in make_groups_names(new) for n in g]
    again.load_state_dict(dm.rekey(merged, new_names))
    assert again.state_dict()["param_groups"] == dm.rekey(merged, new_names)["param_groups"]


def make_groups_names(model: nn.Module) -> list[list[str]]:
    """The names make_optimizer puts in each group, in order."""
    named = [n for n, _ in model.named_parameters()]
    return [
        [n for n in named if n.endswith("weight")],
        [n for n in named if not n.endswith("weight")],
    ]


def test_param_names_saved_by_torch_make_names_unnecessary():
    torch.manual_seed(0)
    old = TinyModel()
    optim = torch.optim.AdamW(old.named_parameters(), lr=1e-2)  # torch >= 2.5 keeps names
    step(old, optim, torch.randint(0, 16, (4, 6)))
    ckpt = saved(optim.state_dict())
    new = Grown()
    new_optim = torch.optim.AdamW(new.named_parameters(), lr=1e-2)
    merged = dm.merge(dm.rekey(ckpt), get_optimizer_state_dict(new, new_optim))
    set_optimizer_state_dict(new, new_optim, merged)
    new_params = dict(new.named_parameters())
    for name, p in old.named_parameters():
        for field, value in optim.state.get(p, {}).items():
            assert torch.equal(new_optim.state[new_params[name]][field], value)
