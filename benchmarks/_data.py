"""Synthetic optimizer state dicts for the benchmarks (meta tensors: shapes, no memory).

Every builder returns a *checkpoint* and a *reference* that are built separately: distinct key
string objects and distinct tensor objects on each side, as after ``torch.load`` on one side
and ``get_optimizer_state_dict`` on the other. The checkpoint was trained (scheduled lr,
``step`` state) but lacks the state of the parameters that never got a gradient (the indexer);
the reference is a fresh optimizer, whose every parameter has state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

META = torch.device("meta")

# AdamW's hyperparameters in torch 2.13, in its order (11 per parameter in the flat form).
ADAMW_HYPER: dict[str, Any] = {
    "lr": 1e-3,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 0.01,
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": True,
}
STATE_NAMES = ("step", "exp_avg", "exp_avg_sq")
KEYS_PER_PARAM = len(STATE_NAMES) + len(ADAMW_HYPER)  # 14


@dataclasses.dataclass(frozen=True)
class Param:
    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    gets_grad: bool  # False: no optimizer state in the checkpoint (a sparse-attention indexer)
    decay: bool  # param group 0 (weight decay) or 1 (norms: no weight decay)


def deepseek_v3_params(layers: int = 61, experts: int = 256) -> list[Param]:
    """DeepSeek-V3-scale parameters: ``layers x experts x 3`` expert projections, MLA attention
    (4 projections), 2 norms and a sparse-attention indexer per layer, embedding, norm, head.

    61 x (256 x 3 + 7) + 3 = 47,278 parameters; as flattened AdamW state 661,709 keys.
    """
    dim, moe_inter, vocab = 7168, 2048, 129280
    heads, nope, rope, v_dim, kv_rank = 128, 128, 64, 128, 512
    bf16 = torch.bfloat16
    out = [Param("embed.weight", (vocab, dim), bf16, True, True)]
    for i in range(layers):
        p = f"layers.{i}."
        out += [
            Param(p + "attn_norm.weight", (dim,), bf16, True, False),
            Param(p + "attn.wq.weight", (heads * (nope + rope), dim), bf16, True, True),
            Param(p + "attn.wkv_a.weight", (kv_rank + rope, dim), bf16, True, True),
            Param(p + "attn.wkv_b.weight", (heads * (nope + v_dim), kv_rank), bf16, True, True),
            Param(p + "attn.wo.weight", (dim, heads * v_dim), bf16, True, True),
            # never gets a gradient: its forward only returns top-k indices
            Param(p + "attn.indexer.weights_proj.weight", (64, dim), bf16, False, True),
            Param(p + "ffn_norm.weight", (dim,), bf16, True, False),
        ]
        for e in range(experts):
            q = f"{p}ffn.experts.{e}."
            out += [
                Param(q + "w1.weight", (moe_inter, dim), bf16, True, True),
                Param(q + "w2.weight", (dim, moe_inter), bf16, True, True),
                Param(q + "w3.weight", (moe_inter, dim), bf16, True, True),
            ]
    out += [
        Param("norm.weight", (dim,), bf16, True, False),
        Param("head.weight", (vocab, dim), bf16, True, True),
    ]
    return out


def synthetic_params(n_keys: int) -> list[Param]:
    """About ``n_keys`` flat AdamW keys: blocks of 8 params, one in 256 never gets a gradient."""
    n = max(2, round(n_keys / KEYS_PER_PARAM))
    out = []
    for i in range(n):
        block, j = divmod(i, 8)
        if i % 256 == 255:
            fqn = f"blocks.{block}.indexer.weight"
            out.append(Param(fqn, (64, 256), torch.float32, False, True))
        elif j == 7:
            out.append(Param(f"blocks.{block}.norm.weight", (256,), torch.float32, True, False))
        else:
            shape = (256 * (1 + j % 3), 256)
            out.append(Param(f"blocks.{block}.mlp.w{j}.weight", shape, torch.float32, True, True))
    return out


def _new_str(s: str) -> str:
    """An equal str that is a new object (keys on the two sides are never shared)."""
    return (s + ".")[:-1]


def _state(p: Param) -> dict[str, torch.Tensor]:
    return {
        "step": torch.empty((), dtype=torch.float32, device=META),
        "exp_avg": torch.empty(p.shape, dtype=torch.float32, device=META),
        "exp_avg_sq": torch.empty(p.shape, dtype=torch.float32, device=META),
    }


def _groups(params: list[Param], lr: float, ids: Iterator[Any]) -> list[dict[str, Any]]:
    decay = {**ADAMW_HYPER, "lr": lr, "params": []}
    no_decay = {**ADAMW_HYPER, "lr": lr, "weight_decay": 0.0, "params": []}
    for p, pid in zip(params, ids, strict=True):
        (decay if p.decay else no_decay)["params"].append(pid)
    return [decay, no_decay]


def nested(params: list[Param], *, checkpoint: bool, int_ids: bool = False) -> dict[str, Any]:
    """``get_optimizer_state_dict`` (fqn-keyed) or ``optimizer.state_dict()`` (``int_ids``)."""
    ids = [i if int_ids else _new_str(p.fqn) for i, p in enumerate(params)]
    state = {
        pid: _state(p) for p, pid in zip(params, ids, strict=True) if p.gets_grad or not checkpoint
    }
    lr = 5e-5 if checkpoint else 1e-3
    return {"state": state, "param_groups": _groups(params, lr, iter(ids))}


def flat(params: list[Param], *, checkpoint: bool) -> dict[str, Any]:
    """The flattened DSD form (``flatten_optimizer_state_dict=True``), built directly."""
    out: dict[str, Any] = {}
    for p in params:
        if p.gets_grad or not checkpoint:
            for name, value in _state(p).items():
                out[f"state.{p.fqn}.{name}"] = value
    lr = 5e-5 if checkpoint else 1e-3
    for group in _groups(params, lr, iter([p.fqn for p in params])):
        hyper = [(k, v) for k, v in group.items() if k != "params"]
        for fqn in group["params"]:
            for k, v in hyper:
                out[f"param_groups.{fqn}.{k}"] = v
    return out


def pair_flat(params: list[Param]) -> tuple[dict[str, Any], dict[str, Any]]:
    return flat(params, checkpoint=True), flat(params, checkpoint=False)


def pair_nested(
    params: list[Param], *, int_ids: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    return (
        nested(params, checkpoint=True, int_ids=int_ids),
        nested(params, checkpoint=False, int_ids=int_ids),
    )
