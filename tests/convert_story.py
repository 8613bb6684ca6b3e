"""The layout-conversion story: a split model trains, converts, and goes on as a fused one.

The split model has what real checkpoints have before a layout change: q/k/v projections
with biases, a dense MLP's gate/up/down projections, per-expert MoE weights and a head
stored as ``nn.Linear`` keeps it. The fused model has the same parameters in the new
layout: ``qkv_proj`` (weight and bias), ``gate_up_proj``, the stacked experts of
transformers v5 (``experts.gate_up_proj``: experts x 2*hidden x dim, ``experts.down_proj``)
and the head transposed. ``CONVERSIONS`` turns one layout into the other.

The oracle is written here with torch alone: :func:`fuse_by_hand` fuses the split model's
tensors (``torch.cat`` / ``torch.stack`` / ``.t()``), and :func:`fused_state_by_hand` does
the same to every tensor of the optimizer state shaped like its parameter (scalars from
the first part). The fused model steps on the split model's gradients fused by hand,
so that what is compared is the optimizer's continuation, not the rounding of two
different matmul layouts.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

import dsdmerge as dm

N_STEPS = 3
D, H, E, C, V = 4, 6, 3, 5, 8
CONVERSIONS: list[Any] = [
    "stack_experts",
    "qkv",
    "gate_up",
    dm.Transpose("head.weight", dims=(0, 1)),
]

# --------------------------------------------------------------------------------------
# the two models


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(D, D)
        self.k_proj = nn.Linear(D, D)
        self.v_proj = nn.Linear(D, D)
        self.o_proj = nn.Linear(D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        att = torch.softmax(q @ k.transpose(-1, -2) / D**0.5, dim=-1)
        return self.o_proj(att @ v)


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(D, H, bias=False)
        self.up_proj = nn.Linear(D, H, bias=False)
        self.down_proj = nn.Linear(H, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Moe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList([Mlp() for _ in range(E)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(self.router(x), dim=-1)
        return sum(weights[..., e : e + 1] * expert(x) for e, expert in enumerate(self.experts))


class Block(nn.Module):
    def __init__(self, moe: bool) -> None:
        super().__init__()
        self.attn = Attn()
        self.mlp = Moe() if moe else Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class SplitModel(nn.Module):
    """The layout before: separate projections, one module per expert."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList([Block(moe=False), Block(moe=True)])
        self.head = nn.Linear(D, C, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class _Params(nn.Module):
    """A module that holds parameters of given shapes (the fused layout's leaves)."""

    def __init__(self, **shapes: tuple[int, ...]) -> None:
        super().__init__()
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.zeros(shape)))


class FusedModel(nn.Module):
    """The layout after: ``qkv_proj``, ``gate_up_proj``, stacked experts, a transposed head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList()
        for moe in (False, True):
            block = nn.Module()
            block.attn = nn.Module()
            block.attn.qkv_proj = nn.Linear(D, 3 * D)
            block.attn.o_proj = nn.Linear(D, D, bias=False)
            if moe:
                block.mlp = nn.Module()
                block.mlp.router = nn.Linear(D, E, bias=False)
                block.mlp.experts = _Params(gate_up_proj=(E, 2 * H, D), down_proj=(E, D, H))
            else:
                block.mlp = nn.Module()
                block.mlp.gate_up_proj = nn.Linear(D, 2 * H, bias=False)
                block.mlp.down_proj = nn.Linear(H, D, bias=False)
            self.layers.append(block)
        self.head = _Params(weight=(D, C))


def fuse_by_hand(split: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The split model's tensors (params, grads, or one optimizer field) in the fused layout."""
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def take(*names: str) -> list[torch.Tensor]:
        used.update(names)
        return [split[n] for n in names]

    for i in range(2):
        a = f"layers.{i}.attn."
        for leaf in ("weight", "bias"):
            out[f"{a}qkv_proj.{leaf}"] = torch.cat(take(*(f"{a}{n}_proj.{leaf}" for n in "qkv")))
    m = "layers.0.mlp."
    out[f"{m}gate_up_proj.weight"] = torch.cat(take(f"{m}gate_proj.weight", f"{m}up_proj.weight"))
    x = "layers.1.mlp.experts."
    gates = torch.stack(take(*(f"{x}{e}.gate_proj.weight" for e in range(E))))
    ups = torch.stack(take(*(f"{x}{e}.up_proj.weight" for e in range(E))))
    out[f"{x}gate_up_proj"] = torch.cat([gates, ups], dim=1)
    out[f"{x}down_proj"] = torch.stack(take(*(f"{x}{e}.down_proj.weight" for e in range(E))))
    out["head.weight"] = take("head.weight")[0].t().contiguous()
    for name, value in split.items():
        if name not in used:
            out[name] = value
    return out


def fused_sources() -> dict[str, list[str]]:
    """Each fused parameter: the split parameters it is made of (the first gives its scalars)."""
    out: dict[str, list[str]] = {}
    for i in range(2):
        a = f"layers.{i}.attn."
        for leaf in ("weight", "bias"):
            out[f"{a}qkv_proj.{leaf}"] = [f"{a}{n}_proj.{leaf}" for n in "qkv"]
    m = "layers.0.mlp."
    out[f"{m}gate_up_proj.weight"] = [f"{m}gate_proj.weight", f"{m}up_proj.weight"]
    x = "layers.1.mlp.experts."
    out[f"{x}gate_up_proj"] = [f"{x}{e}.{n}_proj.weight" for n in ("gate", "up") for e in range(E)]
    out[f"{x}down_proj"] = [f"{x}{e}.down_proj.weight" for e in range(E)]
    return out


def _fields(entry: Any, path: tuple[Any, ...] = ()) -> dict[tuple[Any, ...], Any]:
    if isinstance(entry, Mapping) and entry:
        out: dict[tuple[Any, ...], Any] = {}
        for k, v in entry.items():
            out.update(_fields(v, (*path, k)))
        return out
    return {path: entry}


def fused_state_by_hand(
    split_state: Mapping[str, Any], split_params: Mapping[str, torch.Tensor]
) -> dict[str, Any]:
    """Per-parameter optimizer state (by name) fused by hand: every tensor shaped like its
    parameter through :func:`fuse_by_hand`, every other value from the first part that has it."""
    sources = fused_sources()
    out: dict[str, Any] = {}
    for name in fuse_by_hand(split_params):
        parts = sources.get(name, [name])
        entries = [_fields(split_state[s]) if s in split_state else None for s in parts]
        if all(e is None for e in entries):
            continue
        assert all(e is not None for e in entries), f"state for some parts of {name} only"
        paths = list(dict.fromkeys(p for e in entries for p in e))  # type: ignore[union-attr]
        entry: dict[Any, Any] = {}
        for path in paths:
            values = {s: e[path] for s, e in zip(parts, entries, strict=True) if path in e}  # type: ignore[operator,index]
            shaped = len(values) == len(parts) and all(
                isinstance(v, torch.Tensor) and v.dim() and v.shape == split_params[s].shape
                for s, v in values.items()
            )
            value = (
                fuse_by_hand({**split_params, **values})[name]
                if shaped
                else next(iter(values.values()))
            )
            node = entry
            for k in path[:-1]:
                node = node.setdefault(k, {})
            node[path[-1]] = value
        out[name] = entry
    return out


# --------------------------------------------------------------------------------------
# optimizers


@dataclasses.dataclass(frozen=True)
class Spec:
    id: str
    make: Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
    package: str | None = None
    train_eval: bool = False
    before: Callable[[Any], None] | None = None

    def __str__(self) -> str:
        return self.id


def _torch(name: str, variant: str = "", **kwargs: Any) -> Spec:
    cls = getattr(torch.optim, name)
    return Spec(
        f"torch.{name}" + (f"-{variant}" if variant else ""),
        lambda groups: cls(groups, **kwargs),
    )


def _third(package: str, name: str, variant: str = "", **kwargs: Any) -> Spec:
    train_eval = kwargs.pop("train_eval", False)
    before = kwargs.pop("before", None)

    def make(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        return getattr(__import__(package), name)(groups, **kwargs)

    return Spec(
        f"{package}.{name}" + (f"-{variant}" if variant else ""),
        make,
        package,
        train_eval,
        before,
    )


def _heavyball_eager(monkeypatch: Any) -> None:
    import heavyball.utils

    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    monkeypatch.setattr(heavyball.utils, "compile_mode", None)
    monkeypatch.setattr(heavyball.utils, "compile_mode_recommended_to_none", None)


NO_FOREACH = {"foreach": False}
# Elementwise optimizers whose updates are the same whatever tensor an element sits in, bit
# for bit. Not here: pytorch_optimizer.MADGRAD is elementwise too, but its cube root
# (torch.pow) rounds differently in the vectorized body of a CPU kernel and in its scalar
# tail, so a fused tensor's elements differ from its parts' in the last bit
# (test_madgrad_continues_up_to_rounding).
SPECS: tuple[Spec, ...] = (
    _torch("Adam", **NO_FOREACH),
    _torch("Adam", "amsgrad", amsgrad=True, **NO_FOREACH),
    _torch("AdamW", **NO_FOREACH),
    _torch("SGD", "momentum", momentum=0.9, **NO_FOREACH),
    _torch("SGD", "nesterov", momentum=0.9, nesterov=True, **NO_FOREACH),
    _torch("RMSprop", **NO_FOREACH),
    _torch("RMSprop", "centered-momentum", centered=True, momentum=0.9, **NO_FOREACH),
    _torch("Adagrad", **NO_FOREACH),
    _torch("Adamax", **NO_FOREACH),
    _torch("NAdam", **NO_FOREACH),
    _torch("RAdam", **NO_FOREACH),
    _torch("Adadelta", **NO_FOREACH),
    _torch("ASGD", **NO_FOREACH),
    _torch("Rprop", **NO_FOREACH),
    _third("pytorch_optimizer", "Lion", lr=1e-3, **NO_FOREACH),
    _third("pytorch_optimizer", "AdaBelief", **NO_FOREACH),
    _third("pytorch_optimizer", "Adan", **NO_FOREACH),
    _third("pytorch_optimizer", "ADOPT", **NO_FOREACH),
    _third("pytorch_optimizer", "LaProp", **NO_FOREACH),
    _third("pytorch_optimizer", "Tiger", **NO_FOREACH),
    _third("pytorch_optimizer", "ScheduleFreeAdamW", train_eval=True, **NO_FOREACH),
    _third("pytorch_optimizer", "ScheduleFreeSGD", train_eval=True, **NO_FOREACH),
    _third("schedulefree", "AdamWScheduleFree", train_eval=True, foreach=False),
    _third("schedulefree", "SGDScheduleFree", train_eval=True, foreach=False),
    _third("schedulefree", "RAdamScheduleFree", train_eval=True, foreach=False),
    _third("heavyball", "AdamW", before=_heavyball_eager),
    _third("heavyball", "LaProp", before=_heavyball_eager),
    _third("heavyball", "SFAdamW", before=_heavyball_eager, train_eval=True),
)

# --------------------------------------------------------------------------------------
# runs


def groups_for(model: nn.Module) -> list[dict[str, Any]]:
    """Named-parameter groups (so that ``optimizer.state_dict()`` has ``param_names``):
    matrices with weight decay, the rest without; two learning rates."""
    named = list(model.named_parameters())
    return [
        {"params": [(n, p) for n, p in named if p.dim() >= 2], "lr": 1e-2, "weight_decay": 0.01},
        {"params": [(n, p) for n, p in named if p.dim() < 2], "lr": 5e-3, "weight_decay": 0.0},
    ]


@dataclasses.dataclass
class Run:
    spec: Spec
    model: nn.Module
    optim: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR


def build(spec: Spec, fused: bool) -> Run:
    torch.manual_seed(0)
    model = FusedModel() if fused else SplitModel()
    optim = spec.make(groups_for(model))
    sched = torch.optim.lr_scheduler.LambdaLR(optim, [lambda s: 0.5**s, lambda s: 0.8**s])
    if spec.train_eval:
        optim.train()  # type: ignore[attr-defined]
    return Run(spec, model, optim, sched)


def seed(i: int) -> None:
    torch.manual_seed(2000 + i)
    np.random.seed(2000 + i)
    random.seed(2000 + i)


def split_grads(run: Run, i: int) -> dict[str, torch.Tensor]:
    """Forward and backward of step ``i`` on the split model; its gradients by name."""
    gen = torch.Generator().manual_seed(1000 + i)
    tokens = torch.randint(0, V, (2, 5), generator=gen)
    target = torch.randint(0, C, (2, 5), generator=gen)
    run.optim.zero_grad(set_to_none=True)
    logits = run.model(tokens)
    nn.functional.cross_entropy(logits.reshape(-1, C), target.reshape(-1)).backward()
    # copies: some optimizers change the gradients in place (weight decay added to them)
    return {n: p.grad.clone() for n, p in run.model.named_parameters()}  # type: ignore[union-attr]


def step_split(run: Run, i: int) -> dict[str, torch.Tensor]:
    grads = split_grads(run, i)
    seed(i)
    run.optim.step()
    run.sched.step()
    return grads


def step_fused(run: Run, i: int, grads: Mapping[str, torch.Tensor]) -> None:
    """Step ``i`` of the fused model on the split model's gradients, fused by hand."""
    fused = fuse_by_hand(grads)
    for name, p in run.model.named_parameters():
        p.grad = fused[name].clone()
    seed(i)
    run.optim.step()
    run.optim.zero_grad(set_to_none=True)
    run.sched.step()


def before_save(run: Run) -> None:
    if run.spec.train_eval:
        run.optim.eval()  # type: ignore[attr-defined]


def after_save(run: Run) -> None:
    if run.spec.train_eval:
        run.optim.train()  # type: ignore[attr-defined]


def by_name(optim_sd: Mapping[str, Any]) -> dict[str, Any]:
    """``optimizer.state_dict()``'s per-parameter state keyed by the groups' ``param_names``."""
    names = {
        pid: name
        for g in optim_sd["param_groups"]
        for pid, name in zip(g["params"], g["param_names"], strict=True)
    }
    return {names[k]: v for k, v in optim_sd["state"].items() if k in names}


def groups_without_params(optim_sd: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optim_sd["param_groups"]]


def expected_groups(split_sd: Mapping[str, Any], fused: nn.Module) -> list[dict[str, Any]]:
    """The split optimizer's groups with the fused model's names (in its order)."""
    named = [n for n, _ in fused.named_parameters()]
    shapes = dict(fused.named_parameters())
    out = []
    for g, want_matrix in zip(split_sd["param_groups"], (True, False), strict=True):
        group = {k: v for k, v in g.items() if k != "params"}
        group["param_names"] = [n for n in named if (shapes[n].dim() >= 2) == want_matrix]
        out.append(group)
    return out
