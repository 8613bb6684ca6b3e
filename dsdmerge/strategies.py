"""Hypothesis strategies for state dicts, to fuzz your own resume path.

This is the only dsdmerge module that imports hypothesis; install it with the
``strategies`` extra (``pip install 'dsdmerge[strategies]'``). In the style of
``hypothesis.extra.numpy``: plural names, keyword-only arguments, ``min_*`` /
``max_*`` bounds and a ``layout=`` choice, all validated when the strategy is
built (a bad argument raises :class:`hypothesis.errors.InvalidArgument` at once,
not at the first draw)::

    from hypothesis import given
    from dsdmerge.strategies import checkpoint_pairs

    @given(checkpoint_pairs(layout="flat", min_missing=1))
    def test_resume(pair):
        checkpoint, reference = pair
        merged = dsdmerge.merge(checkpoint, reference)
        ...

What they draw looks like the real thing: fqns shaped like a transformer's
(``model.layers.3.mlp.experts.1.w1.weight``); optimizer state of Adam
(``step``/``exp_avg``/``exp_avg_sq``), SGD with momentum, stateless SGD and a
Shampoo-like optimizer with nested state; several param groups with scalar and
tuple hyperparameters; nested state dicts keyed by fqn
(``get_optimizer_state_dict``) or by int id (``optimizer.state_dict()``), and
DSD's flattened form (``flatten_optimizer_state_dict=True``); tensors of several
dtypes and small shapes, and, with ``allow_meta=True``, model-sized shapes as
meta tensors (no memory). Opt-in, what real optimizers and trainers also do:
keys beside ``state`` and ``param_groups`` (heavyball's own top-level key),
optimizer-level entries in ``state`` (MADGRAD's ``state['k']``), references
whose state lacks fields the checkpoint has (a changed config, schedulefree's
empty live entries) and parameters moved to another param group.

Everything is built bottom-up from small independent draws (no filtering), so
failing examples shrink to few parameters, one group, ``()`` shapes, the first
optimizer kind and dtype in your lists.
"""

from __future__ import annotations

import dataclasses
import functools
import math
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
momentum buffer, stateless SGD (no state at all), and Shampoo-like nested state
(``factor_matrices.0``, ``preconditioner.left``, ...)."""

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Tensor dtypes drawn by default (the first is what failing examples shrink to)."""

_STATEFUL = ("adam", "sgd_momentum", "shampoo")
_LAYOUTS = ("flat", "nested")
_KEYED = ("fqn", "id")
_KINDS = ("optimizer", "model", "checkpoint")
# Shapes of real large models, drawn (as meta tensors) only with allow_meta=True.
_BIG_SHAPES = ((4096, 4096), (129280, 7168), (256, 2048, 7168), (7168,))


# --------------------------------------------------------------------------------------
# argument validation


def _check_bounds(name: str, low: object, high: object, *, floor: int = 0) -> None:
    for label, value in ((f"min_{name}", low), (f"max_{name}", high)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidArgument(f"{label}={value!r} must be an int")
        if value < floor:
            raise InvalidArgument(f"{label}={value!r} must be at least {floor}")
    assert isinstance(low, int)  # for mypy: checked above
    assert isinstance(high, int)
    if low > high:
        raise InvalidArgument(f"min_{name}={low} is greater than max_{name}={high}")


def _check_choice(name: str, value: object, choices: Sequence[str]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise InvalidArgument(f"{name}={value!r} must be one of {', '.join(map(repr, choices))}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise InvalidArgument(f"{name}={value!r} must be a bool")


def _no_optimizer_parts(kind: str, **asked: object) -> None:
    """Raise if optimizer-only options are asked of a strategy that draws no optimizer."""
    wanted = [f"{name}={value!r}" for name, value in asked.items() if value]
    if wanted:
        raise InvalidArgument(
            f"{', '.join(wanted)} needs an optimizer state dict, but kind={kind!r} draws none"
        )


def _one_or_more(name: str, value: object, one: type, what: str, noun: str) -> tuple[Any, ...]:
    """``value`` (one ``one``, or a sequence of them) as a non-empty tuple without repeats."""
    if isinstance(value, one):
        value = (value,)
    try:
        chosen = tuple(dict.fromkeys(value))  # type: ignore[call-overload]
    except TypeError:
        raise InvalidArgument(f"{name}={value!r} must be {what} or a sequence of them") from None
    if not chosen:
        raise InvalidArgument(f"{name} must name at least one {noun}")
    return chosen


def _check_optimizers(optimizers: object) -> tuple[str, ...]:
    chosen = _one_or_more("optimizers", optimizers, str, "an optimizer kind", "optimizer kind")
    for kind in chosen:
        _check_choice("optimizers", kind, OPTIMIZERS)
    return chosen


def _check_dtypes(dtypes: object) -> tuple[torch.dtype, ...]:
    chosen = _one_or_more("dtypes", dtypes, torch.dtype, "a torch dtype", "dtype")
    for dtype in chosen:
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise InvalidArgument(
                f"dtypes holds {dtype!r}; parameters and optimizer state are floating-point "
                "torch dtypes (torch.float32, torch.bfloat16, ...)"
            )
    return chosen


# --------------------------------------------------------------------------------------
# parts


def fqns(
    *, min_layers: int = 0, max_layers: int = 3, max_experts: int = 3
) -> st.SearchStrategy[str]:
    """Parameter fqns shaped like a transformer's, e.g. ``model.layers.2.mlp.experts.1.w1.weight``.

    Attention projections, a sparse-attention indexer (the parameters that never
    get a gradient), MoE experts and norms under ``model.layers.<i>``, plus the
    embedding, final norm and ``lm_head``. Shrinks towards ``model.embed.weight``.

    Args:
        min_layers: Lowest layer index drawn.
        max_layers: Highest layer index drawn.
        max_experts: Highest expert index drawn.

    Examples:
        >>> from dsdmerge.strategies import fqns
        >>> fqns().example().endswith((".weight", ".bias"))
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
    return st.one_of(top, layered)


@dataclasses.dataclass(frozen=True)
class _Param:
    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    group: int
    meta: bool = False


@dataclasses.dataclass(frozen=True)
class _Params:
    """Parameters of one model, sorted by group (the order torch numbers int ids in)."""

    params: tuple[_Param, ...]
    n_groups: int


@dataclasses.dataclass(frozen=True)
class _Config:
    """What every strategy draws its tensors and hyperparameters with."""

    dtypes: tuple[torch.dtype, ...] = DTYPES
    allow_meta: bool = False


def _tensor(
    shape: tuple[int, ...], dtype: torch.dtype, fill: float = 0.0, *, meta: bool = False
) -> torch.Tensor:
    if meta:
        return torch.empty(shape, dtype=dtype, device="meta")
    return torch.full(shape, fill, dtype=dtype)


_small_shapes = st.lists(st.integers(1, 3), max_size=2).map(tuple)


@functools.cache
def _ints(low: int, high: int) -> st.SearchStrategy[int]:
    """``st.integers(low, high)``, built (and validated by hypothesis) once."""
    return st.integers(low, high)


@functools.cache
def _choice(options: tuple[Any, ...]) -> st.SearchStrategy[Any]:
    """``st.sampled_from(options)``, built once."""
    return st.sampled_from(options)


_bools = st.booleans()
_FRESH_LRS = (1e-3, 5e-4, 5e-5)
_TRAINED_LRS = (5e-4, 5e-5, 1e-5)


@functools.cache
def _params(
    config: _Config, min_params: int, max_params: int, min_groups: int, max_groups: int
) -> st.SearchStrategy[_Params]:
    """Parameters with unique fqns, shapes, dtypes and groups; built once per arguments."""
    # enough layers that unique fqns are easy to draw (about 20 per layer)
    layers = max(3, math.ceil(3 * max_params / 20))
    names = st.lists(fqns(max_layers=layers), min_size=min_params, max_size=max_params, unique=True)
    small = _small_shapes.map(lambda s: (s, False))
    big = st.sampled_from(_BIG_SHAPES).map(lambda s: (s, True))
    shapes = st.one_of(small, big) if config.allow_meta else small
    dtypes = st.sampled_from(config.dtypes)

    @st.composite
    def build(draw: st.DrawFn) -> _Params:
        fqns_ = draw(names)
        n_groups = draw(_ints(min_groups, max(min_groups, min(max_groups, len(fqns_)))))
        out = []
        for i, name in enumerate(fqns_):
            group = i if i < n_groups else draw(_ints(0, n_groups - 1))
            (dims, meta), dtype = draw(shapes), draw(dtypes)
            out.append(_Param(name, dims, dtype, group, meta))
        return _Params(tuple(sorted(out, key=lambda p: p.group)), n_groups)

    return build()


@dataclasses.dataclass(frozen=True)
class _Hyper:
    """The hyperparameters one optimizer was built with (the same for checkpoint and reference)."""

    betas: tuple[float, float]
    eps: float
    momentum: float
    amsgrad: bool


_hypers = st.builds(
    _Hyper,
    betas=st.sampled_from(((0.9, 0.95), (0.9, 0.999))),
    eps=st.sampled_from((1e-8, 1e-6)),
    momentum=st.sampled_from((0.9, 0.99)),
    amsgrad=st.booleans(),
)


def _hyperparameters(kind: str, hyper: _Hyper, group: int, lr: float) -> dict[str, Any]:
    """Group ``group``'s hyperparameters; weight decay differs per group, as real groups do."""
    decay = round(0.01 * group, 2)
    if kind == "adam":
        return {
            "lr": lr,
            "betas": hyper.betas,
            "eps": hyper.eps,
            "weight_decay": decay,
            "amsgrad": hyper.amsgrad,
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
            "momentum": hyper.momentum if kind == "sgd_momentum" else 0,
            "dampening": 0,
            "weight_decay": decay,
            "nesterov": False,
            "maximize": False,
            "foreach": None,
        }
    return {"lr": lr, "betas": hyper.betas, "epsilon": 1e-12, "weight_decay": decay}


# Hyperparameters a newer torch added: checkpoints from an older one lack them.
_NEW_HYPERPARAMETERS = {
    "adam": "decoupled_weight_decay",
    "sgd": "foreach",
    "sgd_momentum": "foreach",
    "shampoo": "epsilon",
}


def _state(
    kind: str,
    p: _Param,
    step: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    *,
    amsgrad: bool = False,
) -> dict[Any, Any] | None:
    def t() -> torch.Tensor:
        return _tensor(shape, dtype, step, meta=p.meta)

    if kind == "sgd":
        return None
    if kind == "sgd_momentum":
        return {"momentum_buffer": t()}
    if kind == "adam":
        entry = {"step": torch.tensor(float(step)), "exp_avg": t(), "exp_avg_sq": t()}
        if amsgrad:
            entry["max_exp_avg_sq"] = t()
        return entry
    return {  # Shampoo keeps one factor matrix per dimension
        "step": torch.tensor(float(step)),
        "factor_matrices": {i: t() for i in range(max(1, len(shape)))},
        "preconditioner": {"left": t()},
    }


def _optimizer_dict(
    kind: str,
    hyper: _Hyper,
    params: Sequence[_Param],
    n_groups: int,
    *,
    stateful: set[str],
    step: int,
    lrs: Sequence[float],
    keyed: str,
    overrides: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
    lacking: str | None = None,
    amsgrad: bool = False,
) -> dict[str, Any]:
    """A nested optimizer state dict over ``params`` (fqn- or id-keyed).

    ``amsgrad``: Adam's state has ``max_exp_avg_sq`` too (``hyper.amsgrad`` is
    the caller's to set).
    """
    overrides = overrides or {}
    ids = _ids(params, keyed)
    state: dict[Any, Any] = {}
    for p in params:
        if p.fqn in stateful:
            shape, dtype = overrides.get(p.fqn, (p.shape, p.dtype))
            entry = _state(kind, p, step, shape, dtype, amsgrad=amsgrad)
            if entry is not None:
                state[ids[p.fqn]] = entry
    groups = []
    for g in range(n_groups):
        group = _hyperparameters(kind, hyper, g, lrs[g])
        if lacking is not None:
            del group[lacking]
        group["params"] = [ids[p.fqn] for p in params if p.group == g]
        groups.append(group)
    return {"state": state, "param_groups": groups}


def _ids(params: Sequence[_Param], keyed: str) -> dict[str, Any]:
    """Each parameter's id: its fqn, or (``keyed="id"``) its position, as torch numbers them."""
    return {p.fqn: (i if keyed == "id" else p.fqn) for i, p in enumerate(params)}


# An optimizer's own key beside state and param_groups (heavyball keeps one, and its load
# hook reads it back): a small mapping of scalars and a tensor.
_EXTRA_KEY = "heavyball"
_EXTRA_FIELDS = ("step", "schedule", "stochastic")
# Optimizer-level entries in ``state``, under keys that are no param id: MADGRAD's global
# ``state['k']`` (a one-element int64 tensor) and a plain step counter.
_ENTRIES = ("k", "global_step")
# Where an optimizer-level part is: on both sides, only one, or neither (the first shrinks best).
_SIDES = ("both", "checkpoint", "reference", "neither")
# What a reference lacking state fields has for a parameter the checkpoint has state for.
_FATES = ("as is", "fewer fields", "empty", "no entry")


def _extra(step: int, fields: Sequence[str]) -> dict[str, Any]:
    """The ``heavyball``-like top-level value of an optimizer at ``step``, with ``fields``."""
    values = {
        "step": step,
        "schedule": torch.full((2,), float(step)),
        "stochastic": step > 1,
    }
    return {name: values[name] for name in fields}


def _entry_value(name: str, step: int) -> Any:
    return torch.tensor([step]) if name == "k" else step


def _with_optimizer_level(
    osd: dict[str, Any],
    *,
    extra: dict[str, Any] | None,
    entries: Sequence[str],
    step: int,
    entries_first: bool,
) -> dict[str, Any]:
    """``osd`` with optimizer-level ``entries`` in its state (first or last) and ``extra``."""
    if entries:
        level = {name: _entry_value(name, step) for name in entries}
        state = osd["state"]
        osd["state"] = {**level, **state} if entries_first else {**state, **level}
    if extra is not None:
        osd[_EXTRA_KEY] = extra
    return osd


def _model_dict(
    params: Sequence[_Param],
    fill: float = 0.0,
    overrides: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
) -> dict[str, Any]:
    overrides = overrides or {}
    return {
        p.fqn: _tensor(*overrides.get(p.fqn, (p.shape, p.dtype)), fill, meta=p.meta) for p in params
    }


# --------------------------------------------------------------------------------------
# public strategies


def model_state_dicts(
    *,
    dtypes: Sequence[torch.dtype] = DTYPES,
    allow_meta: bool = False,
    min_params: int = 0,
    max_params: int = 6,
) -> st.SearchStrategy[dict[str, torch.Tensor]]:
    """Flat model state dicts ``{fqn: tensor}`` (``model.state_dict()``, safetensors files).

    Args:
        dtypes: Parameter dtypes to draw from (floating-point torch dtypes).
        allow_meta: Also draw model-sized shapes, as meta tensors.
        min_params: Fewest parameters.
        max_params: Most parameters.

    Examples:
        >>> import torch
        >>> from dsdmerge.strategies import model_state_dicts
        >>> sd = model_state_dicts(min_params=1).example()
        >>> all(isinstance(v, torch.Tensor) for v in sd.values())
        True
    """
    config = _Config(_check_dtypes(dtypes), allow_meta)
    _check_bool("allow_meta", allow_meta)
    _check_bounds("params", min_params, max_params)
    return _params(config, min_params, max_params, 1, 1).map(lambda ps: _model_dict(ps.params))


def optimizer_state_dicts(
    *,
    layout: str = "nested",
    keyed: str = "fqn",
    optimizers: Sequence[str] = OPTIMIZERS,
    dtypes: Sequence[torch.dtype] = DTYPES,
    allow_meta: bool = False,
    min_params: int = 0,
    max_params: int = 6,
    min_groups: int = 1,
    max_groups: int = 3,
    allow_extra_keys: bool = False,
    allow_optimizer_entries: bool = False,
) -> st.SearchStrategy[dict[Any, Any]]:
    """Optimizer state dicts: nested (fqn- or id-keyed) or DSD-flattened.

    Some parameters have no state (they never got a gradient), as in real
    checkpoints; each optimizer is one kind, with per-group learning rates and
    weight decays.

    Args:
        layout: ``"nested"`` or ``"flat"`` (``flatten_optimizer_state_dict=True``).
        keyed: ``"fqn"`` (``get_optimizer_state_dict``) or ``"id"``
            (``optimizer.state_dict()``); ``"id"`` needs ``layout="nested"``.
        optimizers: Optimizer kinds to draw from (see :data:`OPTIMIZERS`).
        dtypes: Parameter dtypes to draw from.
        allow_meta: Also draw model-sized shapes, as meta tensors.
        min_params: Fewest parameters.
        max_params: Most parameters.
        min_groups: Fewest param groups (at least 1; more than the parameters
            gives empty groups).
        max_groups: Most param groups.
        allow_extra_keys: Sometimes also draw a key beside ``state`` and
            ``param_groups``, as heavyball keeps: ``"heavyball"``, a small
            mapping of an int, a tensor and a bool (flattened: ``heavyball.step``, ...).
        allow_optimizer_entries: Sometimes also draw optimizer-level entries in
            ``state`` under keys that are no param id, as MADGRAD keeps: ``"k"``
            (a one-element int64 tensor) and ``"global_step"`` (an int), leaves
            rather than mappings (flattened: ``state.k``).

    Examples:
        >>> from dsdmerge.strategies import optimizer_state_dicts
        >>> sorted(optimizer_state_dicts().example())
        ['param_groups', 'state']
        >>> osd = optimizer_state_dicts(allow_extra_keys=True).example()
        >>> set(osd) <= {"state", "param_groups", "heavyball"}
        True
    """
    _check_choice("layout", layout, _LAYOUTS)
    _check_choice("keyed", keyed, _KEYED)
    if keyed == "id" and layout == "flat":
        raise InvalidArgument("keyed='id' needs layout='nested': DSD flattens fqn-keyed state")
    kinds = _check_optimizers(optimizers)
    config = _Config(_check_dtypes(dtypes), allow_meta)
    _check_bool("allow_meta", allow_meta)
    _check_bounds("params", min_params, max_params)
    _check_bounds("groups", min_groups, max_groups, floor=1)
    _check_bool("allow_extra_keys", allow_extra_keys)
    _check_bool("allow_optimizer_entries", allow_optimizer_entries)
    return _optimizers(
        config,
        kinds,
        keyed,
        min_params,
        max_params,
        min_groups,
        max_groups,
        extra_keys=allow_extra_keys,
        optimizer_entries=allow_optimizer_entries,
    ).map(flatten if layout == "flat" else lambda osd: osd)


@st.composite
def _optimizers(
    draw: st.DrawFn,
    config: _Config,
    kinds: tuple[str, ...],
    keyed: str,
    min_params: int,
    max_params: int,
    min_groups: int,
    max_groups: int,
    params: _Params | None = None,
    *,
    extra_keys: bool = False,
    optimizer_entries: bool = False,
) -> dict[Any, Any]:
    kind = draw(_choice(kinds))
    if params is None:
        params = draw(_params(config, min_params, max_params, min_groups, max_groups))
    stateful = {p.fqn for p in params.params if draw(_bools)}
    step = draw(_ints(1, 9))
    osd = _optimizer_dict(
        kind,
        draw(_hypers),
        params.params,
        params.n_groups,
        stateful=stateful,
        step=step,
        lrs=[draw(_choice(_FRESH_LRS)) for _ in range(params.n_groups)],
        keyed=keyed,
    )
    if not extra_keys and not optimizer_entries:
        return osd
    extra = None
    if extra_keys and draw(_bools):
        extra = _extra(step, [name for name in _EXTRA_FIELDS if draw(_bools)])
    entries = [name for name in _ENTRIES if optimizer_entries and draw(_bools)]
    first = bool(entries) and draw(_bools)
    return _with_optimizer_level(osd, extra=extra, entries=entries, step=step, entries_first=first)


@st.composite
def _checkpoints(
    draw: st.DrawFn,
    config: _Config,
    kinds: tuple[str, ...],
    keyed: str,
    min_params: int,
    max_params: int,
    *,
    extra_keys: bool = False,
    optimizer_entries: bool = False,
) -> dict[str, Any]:
    """``{"model": ..., "optim": ..., "step": int}`` over one set of parameters."""
    params = draw(_params(config, min_params, max_params, 1, 3))
    optim = draw(
        _optimizers(
            config,
            kinds,
            keyed,
            0,
            0,
            1,
            1,
            params=params,
            extra_keys=extra_keys,
            optimizer_entries=optimizer_entries,
        )
    )
    return {
        "model": _model_dict(params.params),
        "optim": optim,
        "step": draw(_ints(0, 10**6)),
    }


def flat_state_dicts(
    *,
    kind: str = "optimizer",
    optimizers: Sequence[str] = OPTIMIZERS,
    dtypes: Sequence[torch.dtype] = DTYPES,
    allow_meta: bool = False,
    min_params: int = 0,
    max_params: int = 6,
) -> st.SearchStrategy[dict[str, Any]]:
    """Flat state dicts: DSD-flattened optimizer dicts, model dicts, or flattened checkpoints.

    Args:
        kind: ``"optimizer"`` (``flatten_optimizer_state_dict=True``), ``"model"``
            (``{fqn: tensor}``) or ``"checkpoint"`` (a whole checkpoint,
            ``{"model": ..., "optim": ..., "step": ...}``, flattened with dots
            the way DCP's metadata spells its keys).
        optimizers: Optimizer kinds to draw from.
        dtypes: Parameter dtypes to draw from.
        allow_meta: Also draw model-sized shapes, as meta tensors.
        min_params: Fewest parameters.
        max_params: Most parameters.

    Examples:
        >>> import dsdmerge as dm
        >>> from dsdmerge.strategies import flat_state_dicts
        >>> dm.classify(flat_state_dicts().example())
        <Layout.FLAT: 'flat'>
    """
    _check_choice("kind", kind, _KINDS)
    _check_optimizers(optimizers)
    if kind == "model":
        return model_state_dicts(
            dtypes=dtypes, allow_meta=allow_meta, min_params=min_params, max_params=max_params
        )
    return nested_state_dicts(
        kind=kind,
        optimizers=optimizers,
        dtypes=dtypes,
        allow_meta=allow_meta,
        min_params=min_params,
        max_params=max_params,
    ).map(flatten)


def nested_state_dicts(
    *,
    kind: str = "optimizer",
    keyed: str = "fqn",
    optimizers: Sequence[str] = OPTIMIZERS,
    dtypes: Sequence[torch.dtype] = DTYPES,
    allow_meta: bool = False,
    min_params: int = 0,
    max_params: int = 6,
    allow_extra_keys: bool = False,
    allow_optimizer_entries: bool = False,
) -> st.SearchStrategy[dict[Any, Any]]:
    """Nested state dicts: optimizer dicts, nested model dicts, or whole checkpoints.

    Args:
        kind: ``"optimizer"`` (fqn- or id-keyed), ``"model"`` (``{"model": {fqn: tensor}}``)
            or ``"checkpoint"`` (``{"model": ..., "optim": ..., "step": int}``, model
            and optimizer over the same parameters).
        keyed: ``"fqn"`` or ``"id"``, for the optimizer parts.
        optimizers: Optimizer kinds to draw from.
        dtypes: Parameter dtypes to draw from.
        allow_meta: Also draw model-sized shapes, as meta tensors.
        min_params: Fewest parameters.
        max_params: Most parameters.
        allow_extra_keys: Sometimes give the optimizer a key beside ``state``
            and ``param_groups`` (see :func:`optimizer_state_dicts`); not for
            ``kind="model"``.
        allow_optimizer_entries: Sometimes give the optimizer's ``state``
            optimizer-level entries (see :func:`optimizer_state_dicts`); not for
            ``kind="model"``.

    Examples:
        >>> import dsdmerge as dm
        >>> from dsdmerge.strategies import nested_state_dicts
        >>> dm.classify(nested_state_dicts().example())
        <Layout.NESTED: 'nested'>
        >>> sd = nested_state_dicts(kind="checkpoint", allow_optimizer_entries=True).example()
        >>> all(isinstance(e, dict) for p, e in sd["optim"]["state"].items() if p in sd["model"])
        True
    """
    _check_choice("kind", kind, _KINDS)
    _check_choice("keyed", keyed, _KEYED)
    kinds = _check_optimizers(optimizers)
    config = _Config(_check_dtypes(dtypes), allow_meta)
    _check_bool("allow_meta", allow_meta)
    _check_bounds("params", min_params, max_params)
    _check_bool("allow_extra_keys", allow_extra_keys)
    _check_bool("allow_optimizer_entries", allow_optimizer_entries)
    levels = {"extra_keys": allow_extra_keys, "optimizer_entries": allow_optimizer_entries}
    if kind == "optimizer":
        return _optimizers(config, kinds, keyed, min_params, max_params, 1, 3, None, **levels)
    if kind == "model":
        _no_optimizer_parts(
            kind, allow_extra_keys=allow_extra_keys, allow_optimizer_entries=allow_optimizer_entries
        )
        return model_state_dicts(
            dtypes=dtypes, allow_meta=allow_meta, min_params=min_params, max_params=max_params
        ).map(lambda m: {"model": m})
    return _checkpoints(config, kinds, keyed, min_params, max_params, **levels)


def checkpoint_pairs(
    *,
    layout: str = "flat",
    kind: str = "optimizer",
    keyed: str = "fqn",
    optimizers: Sequence[str] = OPTIMIZERS,
    dtypes: Sequence[torch.dtype] = DTYPES,
    allow_meta: bool = False,
    allow_new_hyperparameters: bool = False,
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
    allow_missing_fields: bool = False,
    allow_extra_keys: bool = False,
    allow_optimizer_entries: bool = False,
    min_moved: int = 0,
    max_moved: int = 0,
) -> st.SearchStrategy[tuple[dict[Any, Any], dict[Any, Any]]]:
    """``(checkpoint, reference)`` pairs of one layout, with a controlled mix of differences.

    The reference looks like a fresh optimizer after DSD's initialisation (every
    parameter has state, ``step == 1``, the base learning rate); the checkpoint
    like a trained one (scheduled learning rates, later steps). Differences are
    counted in parameters, and each one drawn shows up in ``dsdmerge.diff``:

    * *missing*: a parameter the checkpoint lacks entirely (a new head), or whose
      state it lacks (it never got a gradient, like a sparse-attention indexer);
    * *unexpected*: a parameter only the checkpoint has (a removed module);
    * *mismatched*: a parameter whose checkpoint tensors differ from the
      reference's in shape or in dtype (a reshaped parameter under a
      Shampoo-like optimizer also has another number of factor matrices, so its
      nested state has keys the other side lacks).

    The other parameters (``min_params`` to ``max_params`` of them) are the same
    on both sides, up to the values a trained optimizer changes, and up to what
    the opt-in arguments below add: *moved* parameters (``min_moved`` to
    ``max_moved``, among the parameters both sides have, none of them
    mismatched) are in another param group in the reference than in the
    checkpoint; ``allow_missing_fields``, ``allow_extra_keys`` and
    ``allow_optimizer_entries`` add differences that are not counted in
    parameters.

    Args:
        layout: ``"flat"`` or ``"nested"``; both sides share it.
        kind: ``"optimizer"`` or ``"model"`` (``{fqn: tensor}`` flat, ``{"model": {...}}``
            nested).
        keyed: ``"fqn"`` or ``"id"`` (nested optimizers only). Id-keyed pairs have
            no new or removed parameters, as ``Optimizer.load_state_dict`` demands:
            their missing parameters are ones without state.
        optimizers: Optimizer kinds to draw from; stateless ``"sgd"`` is drawn
            only when the bounds allow a pair without tensors in its state.
        dtypes: Parameter dtypes to draw from.
        allow_meta: Also draw model-sized shapes, as meta tensors.
        allow_new_hyperparameters: Let the reference's param groups have a
            hyperparameter the checkpoint's lack, as when a newer torch added one
            (Adam's ``decoupled_weight_decay``): missing keys beyond the counted
            parameters.
        min_params: Fewest parameters without differences (besides mismatches).
        max_params: Most parameters without differences (besides mismatches).
        min_groups: Fewest param groups.
        max_groups: Most param groups.
        min_missing: Fewest missing parameters.
        max_missing: Most missing parameters.
        min_unexpected: Fewest unexpected parameters.
        max_unexpected: Most unexpected parameters.
        min_mismatched: Fewest mismatched parameters.
        max_mismatched: Most mismatched parameters.
        allow_missing_fields: Let the reference's state lack fields the
            checkpoint has for a parameter both sides have (unexpected keys
            beyond the counted parameters): a changed config (Adam checkpointed
            with ``amsgrad=True`` has ``max_exp_avg_sq``, the reference built
            with ``amsgrad=False`` has not), and, parameter by parameter, an
            entry with a field less, an empty entry ``{}`` (schedulefree's
            ``.train()`` makes those) or no entry at all (no DSD initialisation
            step). Mismatched parameters keep their reference entries.
        allow_extra_keys: Let the checkpoint, the reference or both have a key
            beside ``state`` and ``param_groups``, as heavyball keeps:
            ``"heavyball"``, a small mapping of an int, a tensor and a bool (the
            reference's may have fewer of them). Flat pairs spell it
            ``heavyball.step``, ...
        allow_optimizer_entries: Let either side's ``state`` (or both) hold
            optimizer-level entries under keys that are no param id, as MADGRAD
            keeps: ``"k"`` (a one-element int64 tensor) and ``"global_step"``
            (an int); leaves, not mappings. Flat pairs spell them ``state.k``.
        min_moved: Fewest moved parameters: in another param group in the
            reference than in the checkpoint (a bias moved from the decay group
            to the no-decay group: every group has its own weight decay). Needs
            fqn-keyed optimizers and ``max_groups >= 2``.
        max_moved: Most moved parameters.

    Examples:
        >>> import dsdmerge as dm
        >>> from dsdmerge.strategies import checkpoint_pairs
        >>> ckpt, ref = checkpoint_pairs(min_missing=1).example()
        >>> dm.classify(ckpt) == dm.classify(ref) == "flat", bool(dm.diff(ckpt, ref).missing)
        (True, True)
        >>> ckpt, ref = checkpoint_pairs(layout="nested", min_moved=1, max_moved=1).example()
        >>> groups = [{p: i for i, g in enumerate(sd["param_groups"]) for p in g["params"]}
        ...           for sd in (ckpt, ref)]
        >>> sum(groups[0][p] != i for p, i in groups[1].items() if p in groups[0])
        1
    """
    _check_choice("layout", layout, _LAYOUTS)
    _check_choice("kind", kind, ("optimizer", "model"))
    _check_choice("keyed", keyed, _KEYED)
    kinds = _check_optimizers(optimizers)
    config = _Config(_check_dtypes(dtypes), allow_meta)
    _check_bool("allow_meta", allow_meta)
    _check_bool("allow_new_hyperparameters", allow_new_hyperparameters)
    _check_bounds("params", min_params, max_params)
    _check_bounds("groups", min_groups, max_groups, floor=1)
    _check_bounds("missing", min_missing, max_missing)
    _check_bounds("unexpected", min_unexpected, max_unexpected)
    _check_bounds("mismatched", min_mismatched, max_mismatched)
    _check_bool("allow_missing_fields", allow_missing_fields)
    _check_bool("allow_extra_keys", allow_extra_keys)
    _check_bool("allow_optimizer_entries", allow_optimizer_entries)
    _check_bounds("moved", min_moved, max_moved)
    if min_mismatched > max_params:
        raise InvalidArgument(
            f"min_mismatched={min_mismatched} exceeds max_params={max_params}: mismatched "
            "parameters are among the parameters both sides have"
        )
    if min_mismatched + min_moved > max_params:
        raise InvalidArgument(
            f"min_mismatched={min_mismatched} and min_moved={min_moved} exceed "
            f"max_params={max_params}: mismatched and moved parameters are different "
            "parameters among those both sides have"
        )
    if kind == "model":
        _no_optimizer_parts(
            kind,
            allow_missing_fields=allow_missing_fields,
            allow_extra_keys=allow_extra_keys,
            allow_optimizer_entries=allow_optimizer_entries,
            min_moved=min_moved,
        )
        max_moved = 0
    if keyed == "id":
        if layout == "flat" or kind != "optimizer":
            raise InvalidArgument("keyed='id' needs layout='nested' and kind='optimizer'")
        if min_unexpected:
            raise InvalidArgument(
                "keyed='id' pairs cannot have unexpected parameters: Optimizer.load_state_dict "
                "maps int ids by position"
            )
        if min_moved:
            raise InvalidArgument(
                "keyed='id' pairs cannot have moved parameters: Optimizer.load_state_dict maps "
                "int ids by position, so a moved parameter is another parameter"
            )
        max_unexpected = max_moved = 0
    if min_moved and max_groups < 2:
        raise InvalidArgument(
            f"min_moved={min_moved} needs max_groups >= 2 (got {max_groups}): a moved "
            "parameter is in another group"
        )
    if kind == "optimizer" and (min_mismatched or (keyed == "id" and min_missing)):
        kinds = tuple(k for k in kinds if k in _STATEFUL)  # stateless SGD has no tensors
        if not kinds:
            raise InvalidArgument(
                "optimizers=('sgd',) has no state, so it can have no mismatched tensors and "
                "(keyed='id') no missing state; add a stateful optimizer kind"
            )
    return _pairs(
        config,
        layout=layout,
        kind=kind,
        keyed=keyed,
        kinds=kinds,
        allow_new_hyperparameters=allow_new_hyperparameters,
        params=(min_params, max_params),
        groups=(min_groups, max_groups),
        missing=(min_missing, max_missing),
        unexpected=(min_unexpected, max_unexpected),
        mismatched=(min_mismatched, max_mismatched),
        moved=(min_moved, max_moved if max_groups >= 2 else 0),
        missing_fields=allow_missing_fields,
        extra_keys=allow_extra_keys,
        optimizer_entries=allow_optimizer_entries,
    )


@st.composite
def _pairs(
    draw: st.DrawFn,
    config: _Config,
    *,
    layout: str,
    kind: str,
    keyed: str,
    kinds: tuple[str, ...],
    allow_new_hyperparameters: bool,
    params: tuple[int, int],
    groups: tuple[int, int],
    missing: tuple[int, int],
    unexpected: tuple[int, int],
    mismatched: tuple[int, int],
    moved: tuple[int, int],
    missing_fields: bool,
    extra_keys: bool,
    optimizer_entries: bool,
) -> tuple[dict[Any, Any], dict[Any, Any]]:
    opt_kind = draw(_choice(kinds))
    stateless = kind == "optimizer" and opt_kind not in _STATEFUL
    # Id-keyed stateless optimizers have no way to miss anything; no kind of SGD can mismatch.
    n_missing = draw(_ints(missing[0], 0 if stateless and keyed == "id" else missing[1]))
    n_unexpected = draw(_ints(*unexpected))
    most = 0 if stateless else mismatched[1]
    if moved[1]:  # mismatched and moved parameters are different ones among the shared
        most = min(most, params[1] - moved[0])
    n_mismatched = draw(_ints(mismatched[0], most))
    n_moved = draw(_ints(moved[0], min(moved[1], params[1] - n_mismatched))) if moved[1] else 0
    n_changed = n_missing + n_unexpected
    low = max(params[0], n_mismatched + n_moved) + n_changed
    if n_moved:  # two groups at least, so two parameters at least
        low = max(low, 2)
        groups = (max(2, groups[0]), groups[1])
    universe = draw(_params(config, low, max(low, params[1] + n_changed), *groups))
    names = draw(st.permutations([p.fqn for p in universe.params]))
    removed = set(names[:n_unexpected])
    missed = names[n_unexpected : n_unexpected + n_missing]
    new_params: set[str] = set()
    no_grad: set[str] = set()
    for name in missed:
        if kind == "model" or stateless:
            new_params.add(name)  # nothing to miss but the whole parameter
        elif keyed == "id" or draw(_bools):
            no_grad.add(name)  # in the optimizer, but without state
        else:
            new_params.add(name)
    shared = names[n_unexpected + n_missing :]
    overrides = {}
    by_fqn = {p.fqn: p for p in universe.params}
    for name in shared[:n_mismatched]:
        p = by_fqn[name]
        if draw(_bools):
            overrides[name] = ((*p.shape, 2), p.dtype)
        else:
            overrides[name] = (
                p.shape,
                torch.float64 if p.dtype != torch.float64 else torch.float32,
            )
    n_groups = universe.n_groups
    moved_to: dict[str, int] = {}
    for name in shared[n_mismatched : n_mismatched + n_moved]:
        old = by_fqn[name].group
        new = draw(_ints(0, n_groups - 2))
        moved_to[name] = new + (new >= old)  # any group but its old one
    ref_params = [
        dataclasses.replace(p, group=moved_to[p.fqn]) if p.fqn in moved_to else p
        for p in universe.params
        if p.fqn not in removed
    ]
    ref_params.sort(key=lambda p: p.group)  # stable: a moved parameter joins in model order
    ckpt_params = [p for p in universe.params if p.fqn not in new_params]
    if kind == "model":
        reference = _model_dict(ref_params)
        checkpoint = _model_dict(ckpt_params, 1.0, overrides)
        if layout == "nested":
            return {"model": checkpoint}, {"model": reference}
        return checkpoint, reference
    hyper = draw(_hypers)
    # a changed config: Adam checkpointed with amsgrad keeps max_exp_avg_sq; the reference has none
    amsgrad = missing_fields and opt_kind == "adam" and draw(_bools)
    reference = _optimizer_dict(
        opt_kind,
        dataclasses.replace(hyper, amsgrad=False) if amsgrad else hyper,
        ref_params,
        n_groups,
        stateful={p.fqn for p in ref_params},
        step=1,
        lrs=[1e-3] * n_groups,
        keyed=keyed,
    )
    old_torch = allow_new_hyperparameters and draw(_bools)
    step = draw(_ints(2, 9))
    checkpoint = _optimizer_dict(
        opt_kind,
        dataclasses.replace(hyper, amsgrad=True) if amsgrad else hyper,
        ckpt_params,
        n_groups,
        stateful={p.fqn for p in ckpt_params if p.fqn not in no_grad},
        step=step,
        lrs=[draw(_choice(_TRAINED_LRS)) for _ in range(n_groups)],
        keyed=keyed,
        overrides=overrides,
        lacking=_NEW_HYPERPARAMETERS[opt_kind] if old_torch else None,
        amsgrad=amsgrad,
    )
    if missing_fields:  # what the reference has for parameters the checkpoint has state for
        r_state, r_ids = reference["state"], _ids(ref_params, keyed)
        for name in shared[n_mismatched:]:
            pid = r_ids[name]
            entry = r_state.get(pid)
            fate = draw(_choice(_FATES)) if entry is not None else "as is"
            if fate == "fewer fields" and len(entry) > 1:
                del entry[draw(_choice(tuple(entry)))]
            elif fate in ("fewer fields", "empty"):
                r_state[pid] = {}
            elif fate == "no entry":
                del r_state[pid]
    if extra_keys:
        where = draw(_choice(_SIDES[:3]))
        if where != "reference":
            checkpoint[_EXTRA_KEY] = _extra(step, _EXTRA_FIELDS)
        if where != "checkpoint":
            reference[_EXTRA_KEY] = _extra(0, [f for f in _EXTRA_FIELDS if draw(_bools)])
    if optimizer_entries:
        sides = {name: draw(_choice(_SIDES)) for name in _ENTRIES}
        first = draw(_bools)
        for osd, side, at in ((checkpoint, "checkpoint", step), (reference, "reference", 1)):
            _with_optimizer_level(
                osd,
                extra=None,
                entries=[name for name, where in sides.items() if where in ("both", side)],
                step=at,
                entries_first=first,
            )
    if layout == "flat":
        return flatten(checkpoint), flatten(reference)
    return checkpoint, reference
