"""Hypothesis strategies for state dicts, to fuzz your own resume path.

This is the only dsdmerge module that imports hypothesis; install it with the
``strategies`` extra (``pip install 'dsdmerge[strategies]'``). Strategies are
built bottom-up from small parts (module paths, shapes, dtypes, optimizer
kinds), so they shrink towards small, readable state dicts::

    from hypothesis import given
    from dsdmerge.strategies import checkpoint_pairs

    @given(checkpoint_pairs(layout="flat"))
    def test_resume(pair):
        checkpoint, reference = pair
        merged = dsdmerge.merge(checkpoint, reference)
        ...

Every strategy takes keyword-only arguments: ``min_*`` / ``max_*`` bounds and a
``layout=`` (``"flat"`` or ``"nested"``), validated up front with
:class:`hypothesis.errors.InvalidArgument`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from dsdmerge.flatten import flatten

__all__ = [
    "DTYPES",
    "OPTIMIZERS",
    "checkpoint_pairs",
    "flat_state_dicts",
    "fqns",
    "model_state_dicts",
    "nested_state_dicts",
    "optimizer_state_dicts",
]

OPTIMIZERS = ("adam", "sgd_momentum", "sgd", "shampoo")
"""Optimizer kinds: Adam-like (``step``, ``exp_avg``, ``exp_avg_sq``), SGD with a
momentum buffer, stateless SGD, and Shampoo-like nested state."""

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Tensor dtypes the strategies draw from."""

_LAYOUTS = ("flat", "nested")
_KEYED = ("fqn", "id")
_KINDS = ("optimizer", "model", "checkpoint")


# --------------------------------------------------------------------------------------
# argument validation


def _check_bounds(name: str, low: int, high: int | None, *, floor: int = 0) -> None:
    for label, value in ((f"min_{name}", low), (f"max_{name}", high)):
        if value is None and label.startswith("max"):
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidArgument(f"{label}={value!r} must be an int")
        if value < floor:
            raise InvalidArgument(f"{label}={value!r} must be at least {floor}")
    if high is not None and low > high:
        raise InvalidArgument(f"min_{name}={low} is greater than max_{name}={high}")


def _check_choice(name: str, value: Any, choices: Sequence[Any]) -> None:
    if value not in choices:
        raise InvalidArgument(f"{name}={value!r} must be one of {', '.join(map(repr, choices))}")


def _check_optimizers(optimizers: Sequence[str]) -> tuple[str, ...]:
    if isinstance(optimizers, str):
        optimizers = (optimizers,)
    chosen = tuple(optimizers)
    if not chosen:
        raise InvalidArgument("optimizers must name at least one optimizer kind")
    for kind in chosen:
        _check_choice("optimizers", kind, OPTIMIZERS)
    return chosen


# --------------------------------------------------------------------------------------
# parts


def fqns(
    *, min_layers: int = 0, max_layers: int = 3, max_experts: int = 3
) -> st.SearchStrategy[str]:
    """Parameter fqns shaped like a transformer's, e.g. ``model.layers.2.mlp.experts.1.w1.weight``.

    Args:
        min_layers: Lowest layer index drawn.
        max_layers: Highest layer index drawn.
        max_experts: Highest expert index drawn (experts appear in MLP fqns).

    Example:
        >>> from dsdmerge.strategies import fqns
        >>> isinstance(fqns().example(), str)
        True
    """
    _check_bounds("layers", min_layers, max_layers)
    _check_bounds("experts", 0, max_experts)
    layer = st.integers(min_layers, max_layers)
    expert = st.integers(0, max_experts)
    leaf = st.sampled_from(("weight", "bias"))
    block = st.one_of(
        st.builds("attn.{}.weight".format, st.sampled_from(("wq", "wk", "wv", "wo"))),
        st.builds("attn.indexer.proj.{}".format, leaf),
        st.builds("mlp.experts.{}.{}.weight".format, expert, st.sampled_from(("w1", "w2", "w3"))),
        st.builds("{}.weight".format, st.sampled_from(("input_norm", "post_norm"))),
    )
    layered = st.builds("model.layers.{}.{}".format, layer, block)
    top = st.sampled_from(("model.embed.weight", "model.norm.weight", "lm_head.weight"))
    return st.one_of(layered, top)


_shapes = st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple)


@dataclasses.dataclass(frozen=True)
class _Param:
    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    group: int


def _tensor(shape: tuple[int, ...], dtype: torch.dtype, fill: float = 0.0) -> torch.Tensor:
    return torch.full(shape, fill, dtype=dtype)


def _hyperparameters(kind: str, group: int, lr: float) -> dict[str, Any]:
    """Group ``group``'s hyperparameters; weight decay differs per group, as real groups do."""
    decay = round(0.01 * group, 2)
    if kind == "adam":
        return {
            "lr": lr,
            "betas": (0.9, 0.95),
            "eps": 1e-8,
            "weight_decay": decay,
            "amsgrad": False,
            "foreach": None,
            "maximize": False,
            "capturable": False,
            "differentiable": False,
            "fused": None,
            "decoupled_weight_decay": True,
        }
    if kind in ("sgd", "sgd_momentum"):
        return {
            "lr": lr,
            "momentum": 0.9 if kind == "sgd_momentum" else 0,
            "dampening": 0,
            "weight_decay": decay,
            "nesterov": False,
            "maximize": False,
            "foreach": None,
        }
    return {"lr": lr, "betas": (0.9, 0.999), "epsilon": 1e-12, "weight_decay": decay}


def _state(
    kind: str,
    p: _Param,
    step: int,
    shape: tuple[int, ...] | None = None,
    dtype: torch.dtype | None = None,
) -> dict[Any, Any] | None:
    shape = p.shape if shape is None else shape
    dtype = p.dtype if dtype is None else dtype
    if kind == "sgd":
        return None
    if kind == "sgd_momentum":
        return {"momentum_buffer": _tensor(shape, dtype, step)}
    if kind == "adam":
        return {
            "step": torch.tensor(float(step)),
            "exp_avg": _tensor(shape, dtype, step),
            "exp_avg_sq": _tensor(shape, dtype, step),
        }
    return {
        "step": torch.tensor(float(step)),
        "factor_matrices": {0: _tensor(shape, dtype, step), 1: _tensor(shape, dtype, step)},
        "preconditioner": {"left": _tensor(shape, dtype, step)},
    }


@st.composite
def _params(
    draw: st.DrawFn, min_params: int, max_params: int, min_groups: int, max_groups: int
) -> list[_Param]:
    names = draw(st.lists(fqns(), min_size=min_params, max_size=max_params, unique=True))
    n_groups = draw(st.integers(min_groups, max(min_groups, min(max_groups, len(names)))))
    out = []
    for i, name in enumerate(names):
        group = i if i < n_groups else draw(st.integers(0, max(n_groups - 1, 0)))
        out.append(_Param(name, draw(_shapes), draw(st.sampled_from(DTYPES)), group))
    return sorted(out, key=lambda p: p.group) if n_groups else out


def _optimizer_dict(
    kind: str,
    params: Sequence[_Param],
    n_groups: int,
    *,
    stateful: set[str],
    step: int,
    lrs: Sequence[float],
    keyed: str,
    overrides: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
) -> dict[str, Any]:
    """A nested optimizer state dict over ``params`` (fqn- or id-keyed)."""
    overrides = overrides or {}
    ids = {p.fqn: (i if keyed == "id" else p.fqn) for i, p in enumerate(params)}
    state: dict[Any, Any] = {}
    for p in params:
        if p.fqn in stateful:
            shape, dtype = overrides.get(p.fqn, (p.shape, p.dtype))
            entry = _state(kind, p, step, shape, dtype)
            if entry is not None:
                state[ids[p.fqn]] = entry
    groups = []
    for g in range(n_groups):
        members = [ids[p.fqn] for p in params if p.group == g]
        groups.append({**_hyperparameters(kind, g, lrs[g]), "params": members})
    return {"state": state, "param_groups": groups}


# --------------------------------------------------------------------------------------
# public strategies


def model_state_dicts(
    *, min_params: int = 0, max_params: int = 6
) -> st.SearchStrategy[dict[str, Any]]:
    """Flat model state dicts ``{fqn: tensor}`` with small shapes and mixed dtypes.

    Example:
        >>> from dsdmerge.strategies import model_state_dicts
        >>> all(isinstance(k, str) for k in model_state_dicts().example())
        True
    """
    _check_bounds("params", min_params, max_params)
    return _params(min_params, max_params, 0, 0).map(
        lambda ps: {p.fqn: _tensor(p.shape, p.dtype) for p in ps}
    )


def optimizer_state_dicts(
    *,
    layout: str = "nested",
    keyed: str = "fqn",
    optimizers: Sequence[str] = OPTIMIZERS,
    min_params: int = 0,
    max_params: int = 6,
    min_groups: int = 1,
    max_groups: int = 3,
) -> st.SearchStrategy[dict[Any, Any]]:
    """Optimizer state dicts: nested (fqn- or id-keyed) or DSD-flattened.

    Some parameters have no state (never got a gradient), as in real checkpoints.

    Args:
        layout: ``"nested"`` or ``"flat"`` (``flatten_optimizer_state_dict=True``).
        keyed: ``"fqn"`` (``get_optimizer_state_dict``) or ``"id"``
            (``optimizer.state_dict()``); nested layout only.
        optimizers: Optimizer kinds to draw from (see :data:`OPTIMIZERS`).
        min_params: Fewest parameters.
        max_params: Most parameters.
        min_groups: Fewest param groups (at least 1).
        max_groups: Most param groups.

    Example:
        >>> from dsdmerge.strategies import optimizer_state_dicts
        >>> sorted(optimizer_state_dicts().example())
        ['param_groups', 'state']
    """
    _check_choice("layout", layout, _LAYOUTS)
    _check_choice("keyed", keyed, _KEYED)
    if keyed == "id" and layout == "flat":
        raise InvalidArgument("keyed='id' needs layout='nested': DSD flattens fqn-keyed state")
    kinds = _check_optimizers(optimizers)
    _check_bounds("params", min_params, max_params)
    _check_bounds("groups", min_groups, max_groups, floor=1)

    @st.composite
    def build(draw: st.DrawFn) -> dict[Any, Any]:
        kind = draw(st.sampled_from(kinds))
        params = draw(_params(min_params, max_params, min_groups, max_groups))
        n_groups = max([p.group for p in params], default=min_groups - 1) + 1
        n_groups = max(n_groups, 1)
        stateful = {p.fqn for p in params if draw(st.booleans())}
        lrs = [draw(st.sampled_from((1e-3, 5e-4, 5e-5))) for _ in range(n_groups)]
        osd = _optimizer_dict(
            kind,
            params,
            n_groups,
            stateful=stateful,
            step=draw(st.integers(1, 9)),
            lrs=lrs,
            keyed=keyed,
        )
        return flatten(osd) if layout == "flat" else osd

    return build()


def flat_state_dicts(
    *, kind: str = "optimizer", min_params: int = 0, max_params: int = 6
) -> st.SearchStrategy[dict[str, Any]]:
    """Flat state dicts: DSD-flattened optimizer dicts, model dicts, or flattened checkpoints.

    Args:
        kind: ``"optimizer"``, ``"model"`` or ``"checkpoint"`` (model + optimizer + scalars).
        min_params: Fewest parameters.
        max_params: Most parameters.

    Example:
        >>> import dsdmerge as dm
        >>> from dsdmerge.strategies import flat_state_dicts
        >>> dm.classify(flat_state_dicts().example())
        <Layout.FLAT: 'flat'>
    """
    _check_choice("kind", kind, _KINDS)
    return nested_state_dicts(kind=kind, min_params=min_params, max_params=max_params).map(flatten)


def nested_state_dicts(
    *, kind: str = "optimizer", keyed: str = "fqn", min_params: int = 0, max_params: int = 6
) -> st.SearchStrategy[dict[Any, Any]]:
    """Nested state dicts: optimizer dicts, nested model dicts, or whole checkpoints.

    Args:
        kind: ``"optimizer"`` (fqn- or id-keyed), ``"model"`` (``{"model": {fqn: tensor}}``)
            or ``"checkpoint"`` (``{"model": ..., "optim": ..., "step": int}``).
        keyed: ``"fqn"`` or ``"id"``, for the optimizer parts.
        min_params: Fewest parameters.
        max_params: Most parameters.

    Example:
        >>> import dsdmerge as dm
        >>> from dsdmerge.strategies import nested_state_dicts
        >>> dm.classify(nested_state_dicts().example())
        <Layout.NESTED: 'nested'>
    """
    _check_choice("kind", kind, _KINDS)
    _check_choice("keyed", keyed, _KEYED)
    _check_bounds("params", min_params, max_params)
    optim = optimizer_state_dicts(keyed=keyed, min_params=min_params, max_params=max_params)
    model = model_state_dicts(min_params=min_params, max_params=max_params)
    if kind == "optimizer":
        return optim
    if kind == "model":
        return model.map(lambda m: {"model": m})
    return st.builds(
        lambda m, o, s: {"model": m, "optim": o, "step": s}, model, optim, st.integers(0, 10**6)
    )


def checkpoint_pairs(
    *,
    layout: str = "flat",
    kind: str = "optimizer",
    keyed: str = "fqn",
    optimizers: Sequence[str] = OPTIMIZERS,
    min_params: int = 1,
    max_params: int = 6,
    min_groups: int = 1,
    max_groups: int = 3,
    min_missing: int = 0,
    max_missing: int = 2,
    min_unexpected: int = 0,
    max_unexpected: int = 2,
    min_mismatched: int = 0,
    max_mismatched: int = 1,
) -> st.SearchStrategy[tuple[dict[Any, Any], dict[Any, Any]]]:
    """``(checkpoint, reference)`` pairs of one layout, with a controlled mix of differences.

    The reference looks like a fresh optimizer after DSD's initialisation (every
    parameter has state, ``step == 1``, the base learning rate); the checkpoint
    like a trained one (scheduled learning rates, later steps). Differences, by
    parameter:

    * *missing*: a parameter the checkpoint lacks entirely (a new head) or whose
      state it lacks (it never got a gradient, like a sparse-attention indexer);
    * *unexpected*: a parameter only the checkpoint has (a removed module);
    * *mismatched*: a parameter whose checkpoint tensors differ in shape or dtype.

    Args:
        layout: ``"flat"`` or ``"nested"``; both sides share it.
        kind: ``"optimizer"`` or ``"model"`` (flat ``{fqn: tensor}``, or
            ``{"model": {...}}`` nested).
        keyed: ``"fqn"`` or ``"id"`` (nested optimizers only; id-keyed pairs have
            no new or removed parameters, as ``Optimizer.load_state_dict`` demands).
        optimizers: Optimizer kinds to draw from.
        min_params: Fewest parameters shared by both sides.
        max_params: Most parameters shared by both sides.
        min_groups: Fewest param groups.
        max_groups: Most param groups.
        min_missing: Fewest missing parameters.
        max_missing: Most missing parameters.
        min_unexpected: Fewest unexpected parameters.
        max_unexpected: Most unexpected parameters.
        min_mismatched: Fewest mismatched parameters.
        max_mismatched: Most mismatched parameters.

    Example:
        >>> import dsdmerge as dm
        >>> from dsdmerge.strategies import checkpoint_pairs
        >>> ckpt, ref = checkpoint_pairs().example()
        >>> dm.classify(ckpt) == dm.classify(ref) == "flat"
        True
    """
    _check_choice("layout", layout, _LAYOUTS)
    _check_choice("kind", kind, ("optimizer", "model"))
    _check_choice("keyed", keyed, _KEYED)
    kinds = _check_optimizers(optimizers)
    _check_bounds("params", min_params, max_params)
    _check_bounds("groups", min_groups, max_groups, floor=1)
    _check_bounds("missing", min_missing, max_missing)
    _check_bounds("unexpected", min_unexpected, max_unexpected)
    _check_bounds("mismatched", min_mismatched, max_mismatched)
    if min_mismatched > max_params:
        raise InvalidArgument(f"min_mismatched={min_mismatched} exceeds max_params={max_params}")
    if keyed == "id":
        if layout == "flat" or kind != "optimizer":
            raise InvalidArgument("keyed='id' needs layout='nested' and kind='optimizer'")
        if min_unexpected:
            raise InvalidArgument("keyed='id' pairs cannot have unexpected parameters")
        max_unexpected = 0
    if min_missing > max_params and keyed == "id":
        raise InvalidArgument("keyed='id' pairs can only miss state of shared parameters")

    @st.composite
    def build(draw: st.DrawFn) -> tuple[dict[Any, Any], dict[Any, Any]]:
        opt_kind = draw(st.sampled_from(kinds))
        n_missing = draw(st.integers(min_missing, max_missing))
        n_unexpected = draw(st.integers(min_unexpected, max_unexpected))
        low = max(min_params + n_missing + n_unexpected, min_mismatched, 1)
        high = max(low, max_params + n_missing + n_unexpected)
        universe = draw(_params(low, high, min_groups, max_groups))
        n_groups = max(p.group for p in universe) + 1
        fq = [p.fqn for p in universe]
        shuffled = draw(st.permutations(fq))
        unexpected = set(shuffled[:n_unexpected])
        rest = shuffled[n_unexpected:]
        new_params: set[str] = set()
        no_grad: set[str] = set()
        for name in rest[:n_missing]:
            if keyed == "id" or opt_kind == "sgd" or draw(st.booleans()):
                (no_grad if keyed == "id" or kind == "optimizer" else new_params).add(name)
            else:
                new_params.add(name)
        if kind == "model":
            new_params |= no_grad
            no_grad = set()
        shared = [f for f in rest[n_missing:] if f not in new_params]
        n_mismatched = draw(
            st.integers(min(min_mismatched, len(shared)), min(max_mismatched, len(shared)))
        )
        mismatched = set(shared[:n_mismatched])
        overrides = {}
        for p in universe:
            if p.fqn in mismatched:
                if draw(st.booleans()):
                    overrides[p.fqn] = ((*p.shape, 2), p.dtype)
                else:
                    other = torch.float64 if p.dtype != torch.float64 else torch.float32
                    overrides[p.fqn] = (p.shape, other)
        ref_params = [p for p in universe if p.fqn not in unexpected]
        ckpt_params = [p for p in universe if p.fqn not in new_params]
        if kind == "model":
            reference = {p.fqn: _tensor(p.shape, p.dtype) for p in ref_params}
            checkpoint = {
                p.fqn: _tensor(*overrides.get(p.fqn, (p.shape, p.dtype)), fill=1.0)
                for p in ckpt_params
            }
            if layout == "nested":
                return {"model": checkpoint}, {"model": reference}
            return checkpoint, reference
        lrs = [draw(st.sampled_from((5e-4, 5e-5, 1e-5))) for _ in range(n_groups)]
        reference = _optimizer_dict(
            opt_kind,
            ref_params,
            n_groups,
            stateful={p.fqn for p in ref_params},
            step=1,
            lrs=[1e-3] * n_groups,
            keyed=keyed,
        )
        checkpoint = _optimizer_dict(
            opt_kind,
            ckpt_params,
            n_groups,
            stateful={p.fqn for p in ckpt_params if p.fqn not in no_grad},
            step=draw(st.integers(2, 9)),
            lrs=lrs,
            keyed=keyed,
            overrides=overrides,
        )
        if layout == "flat":
            return flatten(checkpoint), flatten(reference)
        return checkpoint, reference

    return build()
