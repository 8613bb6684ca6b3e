"""Layout conversions that carry the optimizer state: fuse, split, stack, unstack, transpose.

Model code changes its tensor layout more often than its math: q/k/v fused into one
``qkv_proj``, per-expert MoE weights stacked into one 3-D parameter, a weight stored
transposed. :func:`convert` applies conversion records (:class:`Fuse`, :class:`Split`,
:class:`Stack`, :class:`Unstack`, :class:`Transpose`, or a preset of
:data:`CONVERSION_PRESETS`) to the parameters' tensors *and* to everything the
optimizer keeps about them, so that training continues where it stopped. The rule:

* Rules apply in order, each to the result of the one before; a rule whose sources
  match no fqn anywhere in the state dict is an error, and so is a match that finds
  only some of a rule's sources (the parts of a fuse, the experts ``0..n-1`` of a stack).
* It applies to every part of the state dict that names parameters: model state
  dicts (``{fqn: tensor}``, nested or under a flattened checkpoint's prefix), optimizer
  state dicts nested and keyed by fqn (``get_optimizer_state_dict``), keyed by int id
  with the ``param_names`` torch >= 2.6 stores in each group (``optimizer.state_dict()``
  of an optimizer built from named parameters), or flattened by DSD
  (``state.<fqn>.<name>``, ``param_groups.<fqn>.<hyperparameter>``), and whole
  checkpoints holding those, nested or flattened with dots.
* Optimizer state: see :mod:`dsdmerge._convert_ops` (param-shaped tensors convert by
  the same operation, scalars must agree and are copied, anything else raises, or
  with ``nonelementwise="reset"`` leaves the target fresh, with a warning naming it).
* Param groups: the sources of a fuse or stack must hold equal hyperparameters; the
  target takes them and the first source's place (in its group's ``params``, in
  ``state``, and among a flat dict's keys); split targets take the source's values and
  place, in order. ``param_names`` lists follow. Int ids are renumbered in group
  order, as torch numbers them. (How each kind of part is read and spelled back:
  :mod:`dsdmerge._convert_parts`.)
* Converting the state of an optimizer known not to be elementwise warns once (its
  moments convert, but the dynamics of a fused tensor differ from its parts').

Everything else is left as it is, and shared by identity. Nothing is modified; an
error leaves nothing half-done.

Then the code: each rule is planned per part (its matches grouped into instances), the
instances' new values computed for every part first (model parts before optimizer
parts, whose param-shaped state needs the parameters' shapes as they were), then
committed; the output is spelled once, after the last rule.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from operator import itemgetter
from typing import Any, Literal

import torch

from dsdmerge import _convert_ops as ops
from dsdmerge._conversions import (
    CONVERSION_PRESETS,
    Conversion,
    Fuse,
    Split,
    Stack,
    Transpose,
    Unstack,
    expand,
)
from dsdmerge._convert_parts import (
    FlatNode,
    FlatOptim,
    Leafy,
    ModelPart,
    NestedOptim,
    OptimNode,
    Tree,
)
from dsdmerge._gc import gc_paused
from dsdmerge._records import TensorMeta
from dsdmerge._templates import Template
from dsdmerge._values import short_repr
from dsdmerge.errors import (
    ConversionError,
    DSDMergeError,
    DSDMergeWarning,
    LayoutError,
)
from dsdmerge.layout import (
    is_optimizer_state_dict,
    require_mapping,
)

__all__ = [
    "CONVERSION_PRESETS",
    "NONELEMENTWISE_OPTIMIZERS",
    "ConversionError",
    "Fuse",
    "Split",
    "Stack",
    "Transpose",
    "Unstack",
    "convert",
]

Nonelementwise = Literal["raise", "reset"]
_first = itemgetter(0)
_second = itemgetter(1)

# --------------------------------------------------------------------------------------
# optimizers that are not elementwise


NONELEMENTWISE_OPTIMIZERS: tuple[tuple[str, frozenset[str], str], ...] = (
    (
        "torch.optim.Adafactor",
        frozenset({"beta2_decay", "d"}),
        "factored second moments (one row and one column per matrix) and updates clipped "
        "by their own RMS",
    ),
    (
        "Muon (torch.optim.Muon, pytorch_optimizer.Muon)",
        frozenset({"ns_steps"}),
        "a Newton-Schulz orthogonalisation of each matrix's update, and a learning rate "
        "scaled by its shape",
    ),
    ("heavyball.Muon", frozenset({"heavyball_momentum"}), "orthogonalised updates per matrix"),
    (
        "torch.optim.LBFGS",
        frozenset({"history_size", "line_search_fn"}),
        "curvature pairs over all parameters flattened into one vector",
    ),
    (
        "pytorch_optimizer.Lamb",
        frozenset({"adam", "grad_averaging"}),
        "a trust ratio (weight norm over update norm) per tensor",
    ),
    (
        "pytorch_optimizer.NovoGrad",
        frozenset({"grad_averaging"}),
        "one second moment per tensor (layer-wise)",
    ),
    ("pytorch_optimizer.LARS", frozenset({"trust_coefficient"}), "a trust ratio per tensor"),
    (
        "pytorch_optimizer.AdamP / SGDP",
        frozenset({"wd_ratio", "delta"}),
        "a projection decided by each tensor's cosine similarity with its gradient",
    ),
    (
        "pytorch_optimizer.AdaFactor / CAME",
        frozenset({"eps1", "eps2"}),
        "factored second moments (one row and one column per matrix)",
    ),
    (
        "transformers.optimization.Adafactor",
        frozenset({"clip_threshold", "decay_rate", "scale_parameter"}),
        "factored second moments, and updates scaled by each tensor's RMS",
    ),
    (
        "pytorch_optimizer.Shampoo",
        frozenset({"matrix_eps"}),
        "preconditioner matrices per dimension of each tensor",
    ),
    (
        "pytorch_optimizer.ScalableShampoo",
        frozenset({"moving_average_for_momentum"}),
        "preconditioner matrices per dimension of each tensor",
    ),
    (
        "SOAP (pytorch_optimizer.SOAP, heavyball.SOAP)",
        frozenset({"shampoo_beta"}),
        "an eigenbasis preconditioner per dimension of each tensor",
    ),
    (
        "PSGD Kron (pytorch_optimizer.Kron, heavyball.PSGDKron)",
        frozenset({"max_size_triangular"}),
        "Kronecker-factored preconditioners per tensor",
    ),
)
"""Optimizers known not to be elementwise: ``(class, hyperparameter names, what differs)``.

A state dict does not name its optimizer's class: an optimizer is recognised when
one of its param groups holds all the hyperparameter names listed (the first entry
that fits wins). Their moments convert like any other param-shaped state, but a
converted tensor's updates are not its parts' updates put together, so
:func:`convert` warns once when it converts their state.
"""


def nonelementwise_kind(names: Iterable[str]) -> tuple[str, str] | None:
    """``(class, what differs)`` of the known non-elementwise optimizer these names fit."""
    have = set(names)
    for cls, marks, what in NONELEMENTWISE_OPTIMIZERS:
        if marks <= have:
            return cls, what
    return None


# --------------------------------------------------------------------------------------
# rules: matching, planning


class _Rule:
    """One record, compiled: how it is spelled in messages, what it does."""

    def __init__(self, record: Conversion, preset: str | None) -> None:
        self.record = record
        self.text = f"rule {record!r}" + (f" (preset {preset!r})" if preset else "")
        if isinstance(record, Fuse):
            self.mode, self.op = "combine", "fuse"
            self.sources: tuple[Template, ...] = record._sources
        elif isinstance(record, Stack):
            self.mode, self.op = "combine", "stack"
            self.sources = (record._source,)
        elif isinstance(record, Split):
            self.mode, self.op = "divide", "split"
            self.sources = (record._source,)
        elif isinstance(record, Unstack):
            self.mode, self.op = "divide", "unstack"
            self.sources = (record._source,)
        else:
            self.mode, self.op = "same", "transpose"
            self.sources = (record._key,)
        self.dim = getattr(record, "dim", 0)

    def context(self, spell: Any, nonelementwise: str) -> ops.Context:
        return ops.Context(self.record, self.text, spell, nonelementwise)

    def error(self, text: str, keys: Sequence[str] = ()) -> ConversionError:
        return ConversionError(f"{self.text}: {text}", rule=self.record, keys=tuple(keys))


class _Instance:
    """One match of a rule: its source fqns and (for all but an unstack) its target fqns."""

    __slots__ = ("binding", "sources", "targets")

    def __init__(self, sources: list[str], targets: list[str], binding: dict[str, str]) -> None:
        self.sources = sources
        self.targets = targets
        self.binding = binding


def _plan(rule: _Rule, fqns: list[str]) -> list[_Instance]:
    """The instances of ``rule`` among ``fqns`` (unstack targets are filled in later)."""
    record = rule.record
    if isinstance(record, Fuse):
        groups: dict[tuple[str, ...], list[str | None]] = {}
        where: dict[str, int] = {}
        k = len(record._sources)
        names = record._target.names  # each match keyed by its values in this order
        for i, source in enumerate(record._sources):
            order = [source.names.index(n) for n in names]
            for fqn, values in source.matches(fqns):
                if fqn in where:
                    raise rule.error(
                        f"{fqn} matches two of its sources ({record.sources[where[fqn]]!r} and "
                        f"{record.sources[i]!r}); make the templates more specific",
                        [fqn],
                    )
                where[fqn] = i
                key = tuple(map(values.__getitem__, order))
                found = groups.get(key)
                if found is None:
                    found = groups[key] = [None] * k
                found[i] = fqn
        out = []
        for key, found in groups.items():
            binding = dict(zip(names, key, strict=True))
            if None in found:
                have = [f for f in found if f is not None]
                lack = [
                    t.fill(binding)
                    for t, f in zip(record._sources, found, strict=True)
                    if f is None
                ]
                raise rule.error(
                    f"found {', '.join(have)} but not {', '.join(lack)}; a fuse needs every "
                    "one of its sources",
                    [*have, *lack],
                )
            out.append(_Instance(list(found), [record._target.fill(binding)], binding))  # type: ignore[arg-type]
        return out
    if isinstance(record, Stack):
        parts: dict[tuple[str, ...], dict[str, str]] = {}
        names = record._source.names
        at = names.index(record.over)
        others = names[:at] + names[at + 1 :]
        for fqn, values in record._source.matches(fqns):
            key = values[:at] + values[at + 1 :]
            by_index = parts.get(key)
            if by_index is None:
                by_index = parts[key] = {}
            by_index[values[at]] = fqn
        out = []
        for key, by_index in parts.items():
            binding = dict(zip(others, key, strict=True))
            bad: list[str] = []
            if not (all(map(str.isdecimal, by_index)) and all(map(str.isascii, by_index))) or any(
                i[0] == "0" and len(i) > 1 for i in by_index
            ):
                bad = sorted(
                    i for i in by_index if not (i.isdecimal() and i.isascii() and str(int(i)) == i)
                )
            if bad:
                raise rule.error(
                    f"{by_index[bad[0]]} has {record.over}={bad[0]!r}, not an index "
                    f"(0, 1, ...); the parts of a stack are numbered from 0",
                    [by_index[b] for b in bad],
                )
            numbers = sorted(map(int, by_index))  # distinct: every index is spelled one way
            if numbers[-1] != len(numbers) - 1:
                missing = sorted(set(range(numbers[-1] + 1)) - set(numbers))
                absent = [record._source.fill({**binding, record.over: str(m)}) for m in missing]
                raise rule.error(
                    f"{record.over} runs over {len(numbers)} indices up to {numbers[-1]} but "
                    f"{', '.join(absent[:5])}{' and more' if len(absent) > 5 else ''} "
                    f"{'is' if len(absent) == 1 else 'are'} missing; a stack needs the parts "
                    "0..n-1, every one",
                    absent,
                )
            sources = list(map(by_index.__getitem__, map(str, numbers)))
            out.append(_Instance(sources, [record._target.fill(binding)], binding))
        return out
    source = rule.sources[0]
    out = []
    for fqn, values in source.matches(fqns):
        binding = dict(zip(source.names, values, strict=True))
        if isinstance(record, Split):
            targets = [t.fill(binding) for t in record._targets]
        elif isinstance(record, Transpose):
            targets = [fqn]
        else:
            targets = []  # an unstack: once the number of parts is known
        out.append(_Instance([fqn], targets, binding))
    return out


def _unstack_targets(rule: _Rule, instance: _Instance, n: int) -> list[str]:
    record = rule.record
    assert isinstance(record, Unstack)
    return [record._target.fill({**instance.binding, record.over: str(i)}) for i in range(n)]


# --------------------------------------------------------------------------------------
# the job


class _Job:
    def __init__(self, rules: list[tuple[Conversion, str | None]], nonelementwise: str) -> None:
        self.rules = [_Rule(r, p) for r, p in rules]
        self.nonelementwise = nonelementwise
        self.models: list[ModelPart] = []
        self.optims: list[FlatOptim | NestedOptim] = []
        self.resets: list[str] = []
        self.converted: list[FlatOptim | NestedOptim] = []
        self.example: str | None = None

    # -- reading the state dict

    def build(self, root: Mapping[Any, Any]) -> Any:
        node = self._node(root, "")
        if node is not None:
            return node
        on_path = {id(root)}
        top: list[tuple[Any, Any, bool]] = []
        stack: list[tuple[Any, list[tuple[Any, Any, bool]], str, Mapping[Any, Any]]] = [
            (iter(root.items()), top, "", root)
        ]
        while stack:
            items, dest, prefix, mapping = stack[-1]
            for k, v in items:
                if not isinstance(v, Mapping):
                    dest.append((k, v, False))
                    continue
                path = f"{prefix}{k}"
                if id(v) in on_path:
                    raise LayoutError(f"cycle: the mapping at {path!r} contains itself")
                child = self._node(v, path)
                if child is not None:
                    dest.append((k, child, True))
                    continue
                inner: list[tuple[Any, Any, bool]] = []
                dest.append((k, Tree(inner), True))
                on_path.add(id(v))
                stack.append((iter(v.items()), inner, path + ".", v))
                break
            else:
                stack.pop()
                on_path.discard(id(mapping))
        return Tree(top)

    def _node(self, node: Mapping[Any, Any], path: str) -> Any:
        if is_optimizer_state_dict(node):
            part = NestedOptim(node, path)
            self.optims.append(part)
            return OptimNode(part)
        types = set(map(type, node.values()))
        if any(issubclass(tp, Mapping) for tp in types):
            return None
        if not set(map(type, node)) <= {str}:
            return Leafy(node)
        flat = FlatNode(node)
        self.models += flat.models.values()
        self.optims += flat.optims
        return flat

    # -- applying the rules

    def shape(self, fqn: str) -> tuple[int, ...] | None:
        """The parameter's shape as the model parts say it (``None``: unknown, or they differ)."""
        if len(self.models) == 1:
            return self.models[0].shape(fqn)
        shapes = {s for s in (m.shape(fqn) for m in self.models) if s is not None}
        return next(iter(shapes)) if len(shapes) == 1 else None

    def run(self) -> None:
        for rule in self.rules:
            plans = []
            for part in [*self.models, *self.optims]:
                fqns = part.fqns()
                if self.example is None and fqns:
                    self.example = fqns[0]
                instances = _plan(rule, fqns)
                if instances:
                    plans.append((part, fqns, instances))
            if not plans:
                seen = (
                    f"; fqns look like {self.example!r}"
                    if self.example is not None
                    else "; the state dict names no parameters"
                )
                raise rule.error(f"its sources match no parameter{seen}")
            shapes = {  # the sources' shapes, as the model parts say them before this rule
                s: self.shape(s)
                for part, _, instances in (plans if self.models else ())
                if not isinstance(part, ModelPart)
                for inst in instances
                for s in inst.sources
            }
            for part, fqns, instances in plans:
                if isinstance(part, ModelPart):
                    self._model(rule, part, fqns, instances)
            for part, fqns, instances in plans:
                if not isinstance(part, ModelPart):
                    self._optim(rule, part, fqns, instances, shapes)

    def _check_targets(self, rule: _Rule, fqns: list[str], instances: list[_Instance]) -> None:
        sources = {s for inst in instances for s in inst.sources}
        taken = set(fqns) - sources
        made: set[str] = set()
        for inst in instances:
            for t in inst.targets:
                if t in taken or t in made:
                    raise rule.error(
                        f"its target {t} {'already exists' if t in taken else 'is made twice'}; "
                        "a state dict holds one value per key. Drop or rename it first.",
                        [t],
                    )
                made.add(t)

    def _model(
        self, rule: _Rule, part: ModelPart, fqns: list[str], instances: list[_Instance]
    ) -> None:
        ctx = rule.context(str, self.nonelementwise)
        changes = []
        for inst in instances:
            values = [part.values[s] for s in inst.sources]
            keys = [part.before + s for s in inst.sources]
            if rule.mode == "combine":
                new = [ops.combine(rule.op, rule.dim, values, ctx, keys)]
            elif rule.mode == "same":
                record = rule.record
                assert isinstance(record, Transpose)
                new = [ops.transpose(record.dims, values[0], ctx, keys[0])]
            else:
                new = self._divide_value(rule, inst, values[0], ctx, keys[0])
            changes.append((inst.sources, inst.targets, new))
        self._check_targets(rule, fqns, instances)
        part.commit(changes)

    def _divide_value(
        self, rule: _Rule, inst: _Instance, value: Any, ctx: ops.Context, key: str
    ) -> list[Any]:
        size = ops.size_along(value, rule.dim, ctx, key)
        if rule.op == "split":
            record = rule.record
            assert isinstance(record, Split)
            parts = ops.split_sizes(size, len(record.targets), record.sizes, ctx, key)
            return ops.divide("split", rule.dim, value, parts, ctx, key)
        if not size:
            raise ctx.error(
                f"{key} has size 0 along dimension {rule.dim}: nothing to unstack", [key]
            )
        if not inst.targets:
            inst.targets = _unstack_targets(rule, inst, size)
        return ops.divide("unstack", rule.dim, value, [], ctx, key)

    def _optim(
        self,
        rule: _Rule,
        part: FlatOptim | NestedOptim,
        fqns: list[str],
        instances: list[_Instance],
        shapes: Mapping[str, tuple[int, ...] | None],
    ) -> None:
        ctx = rule.context(part.spell, self.nonelementwise)
        changes = []
        converted = False
        for inst in instances:
            states = [part.state_of(s) for s in inst.sources]
            source_shapes = [shapes.get(s) for s in inst.sources]
            if rule.mode == "combine":
                self._check_hyper(rule, part, inst.sources)
                new = ops.combine_state(rule.op, rule.dim, states, source_shapes, ctx, inst.sources)
                results: list[ops.Fields | None] | Any = new if new is ops.RESET else [new]
            elif rule.mode == "same":
                record = rule.record
                assert isinstance(record, Transpose)
                new = ops.transpose_state(
                    record.dims, states[0], source_shapes[0], ctx, inst.sources[0]
                )
                results = new if new is ops.RESET else [new]
            else:
                results = self._divide_state(rule, inst, states[0], source_shapes[0], ctx)
            if results is ops.RESET:
                self.resets.append(ctx.reset_reason)
                results = [None] * len(inst.targets)
            elif any(r is not None for r in results):
                converted = True
            changes.append((rule.mode, inst.sources, inst.targets, results))
        self._check_targets(rule, fqns, instances)
        part.commit(changes)
        if converted and part not in self.converted:
            self.converted.append(part)

    def _divide_state(
        self,
        rule: _Rule,
        inst: _Instance,
        state: ops.Fields | None,
        shape: tuple[int, ...] | None,
        ctx: ops.Context,
    ) -> Any:
        key = inst.sources[0]
        size: int | None = None
        if shape is not None:
            if not -len(shape) <= rule.dim < len(shape):
                raise ctx.error(f"{key} of shape {list(shape)} has no dimension {rule.dim}", [key])
            size = shape[rule.dim]
        elif state is not None:
            inferred = ops.infer_shape(state)
            if inferred is not None and -len(inferred) <= rule.dim < len(inferred):
                size = inferred[rule.dim]
        if rule.op == "unstack" and not inst.targets:
            if size is None:
                raise ctx.error(
                    f"how many parts {key} unstacks into cannot be told: no model state dict "
                    "beside the optimizer's says its shape, and it has no optimizer state "
                    "shaped like it. Convert the whole checkpoint (model and optimizer) at once.",
                    [key],
                )
            inst.targets = _unstack_targets(rule, inst, size)
        n = len(inst.targets)
        parts = None
        if rule.op == "split" and state is not None and size is not None:
            record = rule.record
            assert isinstance(record, Split)
            parts = ops.split_sizes(size, n, record.sizes, ctx, key)
        elif rule.op == "split" and state is not None:
            parts = None  # resolved per tensor below (equal parts or the given sizes)
        if rule.op == "split" and state is not None and parts is None:
            record = rule.record
            assert isinstance(record, Split)
            inferred = ops.infer_shape(state)
            if inferred is not None and -len(inferred) <= rule.dim < len(inferred):
                parts = ops.split_sizes(inferred[rule.dim], n, record.sizes, ctx, key)
        return ops.divide_state(
            "split" if rule.op == "split" else "unstack", rule.dim, state, shape, parts, ctx, key, n
        )

    def _check_hyper(self, rule: _Rule, part: FlatOptim | NestedOptim, sources: list[str]) -> None:
        hypers = [part.hyper_of(s) for s in sources]
        have = [h is not None for h in hypers]
        if not any(have):
            return
        if not all(have):
            listed = [s for s, h in zip(sources, have, strict=True) if h]
            unlisted = [s for s, h in zip(sources, have, strict=True) if not h]
            raise rule.error(
                f"{', '.join(listed)} {'is' if len(listed) == 1 else 'are'} in a param group but "
                f"{', '.join(unlisted)} {'is' if len(unlisted) == 1 else 'are'} in none; the "
                "parts of a fused parameter need one group's hyperparameters",
                [*listed, *unlisted],
            )
        first = hypers[0]
        assert first is not None
        plain = all(map(_is_plain, first.values))  # == on these is a bool, never a tensor
        for source, hyper in zip(sources[1:], hypers[1:], strict=True):
            assert hyper is not None
            if hyper.key is not None and hyper.key == first.key:
                continue
            if plain and hyper.names == first.names and hyper.values == first.values:
                continue  # (== on plain values; anything else by the comparison below)
            want = dict(zip(first.names, first.values, strict=True))
            got = dict(zip(hyper.names, hyper.values, strict=True))
            for name in [*want, *(k for k in got if k not in want)]:
                a, b = want.get(name, _ABSENT), got.get(name, _ABSENT)
                if a is _ABSENT or b is _ABSENT or not ops.same_scalar(a, b):
                    raise rule.error(
                        f"the parts' hyperparameter {name!r} differs ({sources[0]}: "
                        f"{_shown(a)}, {source}: {_shown(b)}); a fused parameter has one value "
                        "per hyperparameter. Put the parts in one param group (equal "
                        "hyperparameters) before converting.",
                        [sources[0], source],
                    )

    # -- after the rules

    def warn(self, stacklevel: int) -> None:
        if self.resets:
            shown = "; ".join(self.resets[:5])
            more = f"; and {len(self.resets) - 5} more" if len(self.resets) > 5 else ""
            warnings.warn(
                DSDMergeWarning(
                    f"dsdmerge: convert gave {len(self.resets)} converted parameter(s) fresh "
                    f"optimizer state (nonelementwise='reset'), as their state cannot be "
                    f"converted elementwise: {shown}{more}"
                ),
                stacklevel=stacklevel,
            )
        kinds: dict[str, str] = {}
        for part in self.converted:
            found = nonelementwise_kind(part.group_names())
            if found is not None:
                kinds.setdefault(*found)
        if kinds:
            shown = "; ".join(f"{cls}: {what}" for cls, what in kinds.items())
            warnings.warn(
                DSDMergeWarning(
                    f"dsdmerge: converted the optimizer state of an optimizer that is not "
                    f"elementwise ({shown}). Its moments convert, but a converted tensor's "
                    "updates differ from the updates its parts would have had: training goes "
                    "on from the converted state, not exactly as before the conversion."
                ),
                stacklevel=stacklevel,
            )


_ABSENT: Any = object()
_PLAIN = frozenset({float, int, bool, str, type(None)})


def _is_plain(value: Any) -> bool:
    """A value whose ``==`` is a bool: a plain scalar, or a tuple of them (``betas``)."""
    tp = type(value)
    return tp in _PLAIN or (tp is tuple and all(type(v) in _PLAIN for v in value))


def _shown(value: Any) -> str:
    return "absent" if value is _ABSENT else short_repr(value)


# --------------------------------------------------------------------------------------
# the public function


Conversions = Sequence[Conversion | str] | Conversion | str
"""What ``convert=`` takes: conversion records and preset names, in order (or one of them)."""


def convert(
    state_dict: Mapping[Any, Any],
    conversions: Conversions,
    /,
    *,
    nonelementwise: Nonelementwise = "raise",
) -> dict[Any, Any]:
    """Apply layout conversions to a state dict, optimizer state included.

    Each rule (:class:`Fuse`, :class:`Split`, :class:`Stack`, :class:`Unstack`,
    :class:`Transpose`, or the name of a preset in :data:`CONVERSION_PRESETS`) applies
    in order to every place the state dict names parameters: model state dicts,
    optimizer state dicts (nested by fqn, by int id with ``param_names``, or DSD
    flattened) and whole checkpoints holding those. Optimizer state shaped like a
    parameter converts by the parameter's operation; scalars (``step``) must agree
    across the parts and are copied to split parts; the parts of a fuse or stack must
    share their hyperparameters, and the result takes the first part's place. For an
    elementwise optimizer (Adam, AdamW, SGD, RMSprop, Adagrad, Lion, ...) with equal
    hyperparameters, training then continues exactly as it would have without the
    conversion. Converting the state of an optimizer known not to be elementwise
    (:data:`NONELEMENTWISE_OPTIMIZERS`) warns once.

    Does not modify its input; every leaf it does not convert is shared by identity,
    and every converted tensor is a new contiguous tensor.

    Args:
        state_dict: A model or optimizer state dict, or a whole checkpoint.
        conversions: A list of conversion records and preset names (or one of them).
        nonelementwise: What to do about optimizer state that is neither shaped like its
            parameter nor a scalar (Adafactor's factored moments, Shampoo's
            preconditioners): ``"raise"`` a :class:`ConversionError`, or ``"reset"``:
            leave the converted parameter without state (fresh, as a new optimizer has
            it) and warn (:class:`~dsdmerge.DSDMergeWarning`) naming it.

    Returns:
        A new state dict, in the input's layout, with the parameters converted.

    Raises:
        ConversionError: A rule matches nothing, finds only some of its parts, cannot
            combine their tensors (shapes, dtypes, devices), or meets optimizer state or
            hyperparameters it cannot carry over (naming the rule and the keys).
        LayoutError: The state dict is malformed.
        StateDictTypeError: It is not a mapping, or holds keys of a bad type.

    Examples:
        >>> import torch, dsdmerge as dm
        >>> sd = {f"attn.{n}_proj.weight": torch.ones(2, 4) for n in "qkv"}
        >>> out = dm.convert(sd, ["qkv"])
        >>> {k: tuple(v.shape) for k, v in out.items()}
        {'attn.qkv_proj.weight': (6, 4)}
        >>> osd = {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.ones(2, 3)}},
        ...        "param_groups": [{"lr": 0.1, "params": ["w"]}]}
        >>> out = dm.convert(osd, [dm.Transpose("w", dims=(0, 1))])
        >>> tuple(out["state"]["w"]["exp_avg"].shape), out["state"]["w"]["step"]
        ((3, 2), tensor(3.))
    """
    return convert_checkpoint(state_dict, conversions, nonelementwise=nonelementwise, stacklevel=3)


def convert_checkpoint(
    state_dict: Mapping[Any, Any],
    conversions: Conversions,
    /,
    *,
    nonelementwise: Nonelementwise = "raise",
    stacklevel: int,
    quiet: bool = False,
) -> dict[Any, Any]:
    """:func:`convert`, warning at ``stacklevel`` (as for ``warnings.warn``, from here).

    What ``convert=`` of :func:`~dsdmerge.merge`, :func:`~dsdmerge.diff`, ... applies
    to the checkpoint (after ``rename=``). ``quiet``: no warnings (for trials whose
    result is not handed out; no warning filter is touched, so threads are safe).
    """
    rules = expand(conversions)
    if nonelementwise not in ("raise", "reset"):
        raise ConversionError(
            f"nonelementwise must be 'raise' or 'reset', got {short_repr(nonelementwise)}"
        )
    require_mapping(state_dict, "the state dict")
    job = _Job(rules, nonelementwise)
    with gc_paused():  # many small containers, none of them cyclic (see dsdmerge._gc)
        root = job.build(state_dict)
        job.run()
        out: dict[Any, Any] = root.output()
    if not quiet:
        job.warn(stacklevel + 1)
    return out


def suggest_conversions(
    checkpoint: Mapping[str, Any],
    reference: Mapping[str, Any],
    missing: Sequence[str],
    unexpected: Sequence[str],
) -> tuple[str, ...]:
    """The presets that would turn unexpected keys of ``checkpoint`` into missing ones.

    ``checkpoint`` and ``reference`` are flat; ``missing`` and ``unexpected`` are keys
    of the reference and of the checkpoint. A preset fits when, applied to the
    unexpected keys alone (by shape: their tensors as :class:`~dsdmerge.TensorMeta`),
    it converts something and every key it makes is missing, with the reference's
    shape and dtype. Best effort: ``()`` when none fits or when unsure.
    """
    if not missing or not unexpected:
        return ()
    # a preset can fit only if a rule's sources are among the unexpected keys and its
    # targets among the missing ones: one C-level search per literal, not one per key
    had, lacks = "\0".join(unexpected), "\0".join(missing)
    names = [
        name
        for name, rules in CONVERSION_PRESETS.items()
        if any(
            any(t.literal.strip(".") in had for t in _Rule(r, name).sources)
            and any(t.literal.strip(".") in lacks for t in _targets(r))
            for r in rules
        )
    ]
    if not names:
        return ()
    view = {k: _meta(checkpoint[k]) for k in unexpected if k in checkpoint}
    missing_set = set(missing)
    found = []
    for name in names:
        try:
            converted = convert_checkpoint(view, [name], stacklevel=2, quiet=True)
        except (DSDMergeError, RecursionError):
            continue
        made = [k for k in converted if k not in view]
        if made and all(k in missing_set and _same_meta(converted[k], reference[k]) for k in made):
            found.append(name)
    return tuple(found)


def _targets(record: Conversion) -> tuple[Template, ...]:
    """The templates of what ``record`` makes."""
    if isinstance(record, Split):
        return record._targets
    if isinstance(record, Transpose):
        return (record._key,)
    return (record._target,)


def _meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return TensorMeta(tuple(value.shape), value.dtype)
    return value


def _same_meta(a: Any, b: Any) -> bool:
    a_tensor, b_tensor = ops.is_tensor(a), ops.is_tensor(b)
    if a_tensor != b_tensor:
        return False
    return not a_tensor or (tuple(a.shape) == tuple(b.shape) and str(a.dtype) == str(b.dtype))
