"""Synthetic AdamW optimizer state dicts for the benchmarks (meta tensors: shapes, no memory).

A *checkpoint* and a *reference* are built separately, as after ``torch.load`` on one side and
``get_optimizer_state_dict`` on a fresh optimizer on the other: distinct key strings, distinct
tensors, distinct hyperparameter floats. The checkpoint was trained (its lr is the scheduled
5e-5) but has no state for the parameters that never got a gradient (the indexer); the fresh
reference has state for every parameter and lr 1e-3.

Each side comes in three layouts that share their leaves (so a layout costs no tensor memory):
fqn-keyed nested (``get_optimizer_state_dict``), int-id nested (``optimizer.state_dict()``) and
flat, made by torch's own ``_flatten_optim_state_dict`` (``flatten_optimizer_state_dict=True``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import _flatten_optim_state_dict

META = torch.device("meta")

# AdamW's hyperparameters in torch 2.13, in its order: 11 flat keys per parameter.
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
    gets_grad: bool  # False: no optimizer state in the checkpoint (a sparse-attention indexer)
    decay: bool  # param group 0 (weight decay) or 1 (norms: no weight decay)


def deepseek_v3_params(layers: int = 61, experts: int = 256) -> list[Param]:
    """DeepSeek-V3-scale parameters: per layer ``experts x 3`` expert projections, 4 MLA
    attention projections, 2 norms and a sparse-attention indexer that never gets a gradient;
    plus embedding, final norm and head.

    Full size: 61 x (256 x 3 + 7) + 3 = 47,278 parameters, 661,709 flat checkpoint keys
    (661,892 in the reference, which also has the 61 indexers' 3 state keys each).
    """
    dim, moe_inter, vocab = 7168, 2048, 129280
    heads, nope, rope, v_dim, kv_rank = 128, 128, 64, 128, 512
    out = [Param("embed.weight", (vocab, dim), True, True)]
    for i in range(layers):
        p = f"layers.{i}."
        out += [
            Param(p + "attn_norm.weight", (dim,), True, False),
            Param(p + "attn.wq.weight", (heads * (nope + rope), dim), True, True),
            Param(p + "attn.wkv_a.weight", (kv_rank + rope, dim), True, True),
            Param(p + "attn.wkv_b.weight", (heads * (nope + v_dim), kv_rank), True, True),
            Param(p + "attn.wo.weight", (dim, heads * v_dim), True, True),
            # its forward only returns top-k indices, so it never gets a gradient
            Param(p + "attn.indexer.weights_proj.weight", (64, dim), False, True),
            Param(p + "ffn_norm.weight", (dim,), True, False),
        ]
        for e in range(experts):
            q = f"{p}ffn.experts.{e}."
            out += [
                Param(q + "w1.weight", (moe_inter, dim), True, True),
                Param(q + "w2.weight", (dim, moe_inter), True, True),
                Param(q + "w3.weight", (moe_inter, dim), True, True),
            ]
    out.append(Param("norm.weight", (dim,), True, False))
    out.append(Param("head.weight", (vocab, dim), True, True))
    return out


def synthetic_params(n_keys: int) -> list[Param]:
    """About ``n_keys`` flat AdamW keys: blocks of 8 parameters; one in 256 never gets a grad."""
    out = []
    for i in range(max(2, round(n_keys / KEYS_PER_PARAM))):
        block, j = divmod(i, 8)
        if i % 256 == 255:
            out.append(Param(f"blocks.{block}.indexer.weight", (64, 256), False, True))
        elif j == 7:
            out.append(Param(f"blocks.{block}.norm.weight", (256,), True, False))
        else:
            shape = (256 * (1 + j % 3), 256)
            out.append(Param(f"blocks.{block}.mlp.w{j}.weight", shape, True, True))
    return out


def _new_str(s: str) -> str:
    """An equal str that is a new object: the two sides never share key objects."""
    return (s + ".")[:-1]


def _fresh(value: Any) -> Any:
    if type(value) is float:
        return float(repr(value))
    if type(value) is tuple:
        return tuple(_fresh(v) for v in value)
    return value


def _state(p: Param) -> dict[str, torch.Tensor]:
    return {
        "step": torch.empty((), dtype=torch.float32, device=META),
        "exp_avg": torch.empty(p.shape, dtype=torch.float32, device=META),
        "exp_avg_sq": torch.empty(p.shape, dtype=torch.float32, device=META),
    }


def nested(params: list[Param], *, checkpoint: bool) -> dict[str, Any]:
    """One side, fqn-keyed, as ``get_optimizer_state_dict`` returns it."""
    fqns = [_new_str(p.fqn) for p in params]
    state = {
        fqn: _state(p) for p, fqn in zip(params, fqns, strict=True) if p.gets_grad or not checkpoint
    }
    # new objects for the floats and the tuple, as after torch.load (bools and None are shared
    # singletons on both sides, as in real life)
    hyper = {k: _fresh(v) for k, v in ADAMW_HYPER.items()}
    decay: dict[str, Any] = {**hyper, "lr": _fresh(5e-5 if checkpoint else 1e-3), "params": []}
    no_decay: dict[str, Any] = {**decay, "weight_decay": _fresh(0.0), "params": []}
    for p, fqn in zip(params, fqns, strict=True):
        (decay if p.decay else no_decay)["params"].append(fqn)
    return {"state": state, "param_groups": [decay, no_decay]}


def int_ids(osd: dict[str, Any]) -> dict[str, Any]:
    """The same side as ``optimizer.state_dict()`` returns it: int ids in param-group order."""
    ids = {fqn: i for i, fqn in enumerate(f for g in osd["param_groups"] for f in g["params"])}
    return {
        "state": {ids[fqn]: entry for fqn, entry in osd["state"].items()},
        "param_groups": [
            {**g, "params": [ids[fqn] for fqn in g["params"]]} for g in osd["param_groups"]
        ],
    }


def flat(osd: dict[str, Any]) -> dict[str, Any]:
    """The same side flattened by torch itself (on a copy: torch pops ``params``)."""
    return _flatten_optim_state_dict(
        {"state": osd["state"], "param_groups": [dict(g) for g in osd["param_groups"]]}
    )


@dataclasses.dataclass
class Pair:
    """A checkpoint and a reference in every layout."""

    params: list[Param]
    nested_c: dict[str, Any]
    nested_r: dict[str, Any]
    int_c: dict[str, Any]
    int_r: dict[str, Any]
    flat_c: dict[str, Any]
    flat_r: dict[str, Any]


def pair(params: list[Param], *, with_int_ids: bool = True) -> Pair:
    nc, nr = nested(params, checkpoint=True), nested(params, checkpoint=False)
    ic, ir = (int_ids(nc), int_ids(nr)) if with_int_ids else ({}, {})
    return Pair(params, nc, nr, ic, ir, flat(nc), flat(nr))
