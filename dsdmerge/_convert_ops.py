"""One conversion on one parameter's values: its tensors, and its optimizer state.

The rule, per instance of a rule (the sources and targets of one match):

* Model tensors go through the torch operation the rule names (``cat``, ``stack``,
  ``split``, ``unbind``, ``transpose``). The sources of a fuse or stack must have one
  dtype and one device (``torch.cat`` would promote dtypes silently). Every result is
  a new contiguous tensor (a split or unbind piece is copied out of its source, so a
  result never aliases the input's storage and saves as what it is).
  :class:`~dsdmerge.TensorMeta` values (metadata-only views) convert by shape alone.
* A parameter's optimizer state is its per-parameter entry, read as leaves at paths
  (nested state such as heavyball's ``{0: {"exp_avg": ...}}`` too). Each leaf is one of:

  - *param-shaped*: a tensor of the parameter's shape (with at least one dimension):
    converted by the same operation as the parameter;
  - *scalar*: a 0-d tensor or any non-tensor value (``step``): equal across the
    sources of a fuse or stack (a source without it says nothing), copied to every
    split target (tensors cloned, so that two parameters never share a ``step`` that
    the optimizer increments in place);
  - *other*: any other tensor (Adafactor's factored rows and columns, Shampoo's
    preconditioners) or a sequence holding tensors (PSGD's factors): it cannot be
    converted elementwise. ``nonelementwise="raise"`` refuses; ``"reset"`` gives the
    targets no state (fresh), which the caller reports.

  The parameter's shape comes from a model state dict beside the optimizer's when
  there is one; else from the entry itself, when its non-scalar tensors share one
  shape (else it is unknown, and they are all *other*).
* A fuse or stack needs state for every source or for none.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable, Sequence
from operator import attrgetter, itemgetter
from typing import Any

import torch

from dsdmerge._records import TensorMeta
from dsdmerge._text import dtype_name, short_repr
from dsdmerge._values import freeze
from dsdmerge.errors import ConversionError

__all__: list[str] = []

Fields = list[tuple[Hashable, Any]]
"""A parameter's optimizer state as ``(path, leaf)`` pairs, in order."""

PARAM, SCALAR, OTHER = "param-shaped", "scalar", "other"
RESET: Any = object()
"""What a state conversion returns under ``nonelementwise="reset"`` for state it cannot convert."""


class Context:
    """What a message about one instance names, and how paths are spelled."""

    def __init__(
        self,
        rule: object,
        rule_text: str,
        spell: Callable[[Hashable], str],
        nonelementwise: str,
    ) -> None:
        self.rule = rule
        self.rule_text = rule_text
        self.spell = spell
        self.nonelementwise = nonelementwise
        self.reset_reason = ""

    def error(self, text: str, keys: Sequence[str]) -> ConversionError:
        return ConversionError(f"{self.rule_text}: {text}", rule=self.rule, keys=tuple(keys))


# --------------------------------------------------------------------------------------
# tensors


def is_tensor(value: object) -> bool:
    """A value the operations take: a torch tensor or a :class:`TensorMeta`."""
    return isinstance(value, (torch.Tensor, TensorMeta))


def _describe(value: Any) -> str:
    if is_tensor(value):
        return f"{dtype_name(value.dtype)}{list(value.shape)}"
    return short_repr(value)


def _as_meta(value: TensorMeta) -> torch.Tensor:
    dtype = value.dtype if isinstance(value.dtype, torch.dtype) else torch.float32
    return torch.empty(value.shape, dtype=dtype, device="meta")


def _records_of(results: list[torch.Tensor], dtype: Any) -> list[TensorMeta]:
    return [TensorMeta(tuple(int(n) for n in t.shape), dtype) for t in results]


def _run(
    fn: Callable[[list[torch.Tensor]], list[torch.Tensor]],
    values: Sequence[Any],
    ctx: Context,
    keys: Sequence[str],
    what: str,
) -> list[Any]:
    """``fn`` on the tensors (TensorMeta by shape, through meta tensors), errors as ours."""
    metas = [v for v in values if type(v) is TensorMeta]
    tensors = [_as_meta(v) if type(v) is TensorMeta else v for v in values]
    try:
        with torch.no_grad():
            out = fn(tensors)
    except (RuntimeError, IndexError, TypeError, ValueError) as err:
        raise ctx.error(f"cannot {what} {_shown(keys, values)}: {err}", keys) from None
    if metas:
        return _records_of(out, metas[0].dtype)
    return out


def _shown(keys: Sequence[str], values: Sequence[Any], limit: int = 4) -> str:
    """The first few ``key dtype[shape]``, for messages (a stack may have hundreds of parts)."""
    text = ", ".join(
        f"{k} {_describe(v)}" for k, v in zip(keys[:limit], values[:limit], strict=True)
    )
    return text + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def _alike(values: Sequence[Any], ctx: Context, keys: Sequence[str], what: str) -> None:
    """One dtype and one device for the values a fuse or stack combines."""
    if not set(map(type, values)) <= _TENSOR_TYPES:
        for v, key in zip(values, keys, strict=True):
            if not is_tensor(v):
                raise ctx.error(
                    f"{key} is {short_repr(v)}, not a tensor; only tensors can be {what}", keys
                )
    dtypes = set(map(str, set(map(_dtype, values))))
    devices = set(map(str, {v.device for v in values if isinstance(v, torch.Tensor)}))
    if len(dtypes) > 1 or len(devices) > 1:
        odd = [
            i
            for i, v in enumerate(values)
            if str(v.dtype) != str(values[0].dtype)
            or (
                isinstance(v, torch.Tensor)
                and str(v.device) != str(getattr(values[0], "device", ""))
            )
        ]
        picked = [0, *odd[:3]]
        shown = ", ".join(
            f"{keys[i]} {_describe(values[i])}"
            + (f" on {values[i].device}" if len(devices) > 1 else "")
            for i in picked
        )
        raise ctx.error(
            f"the parts have different dtypes or devices ({shown}); cast them to one first "
            "(torch.cat would promote the dtype silently)",
            [keys[i] for i in picked],
        )


_TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter, TensorMeta})
_dtype = attrgetter("dtype")


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format)


def _combined_shape(
    kind: str,
    dim: int,
    shapes: list[tuple[int, ...]],
    ctx: Context,
    keys: Sequence[str],
    values: Sequence[Any],
) -> tuple[int, ...]:
    """The shape ``torch.cat`` / ``torch.stack`` would give, for metadata.

    Computed here rather than by torch: its meta kernels for ``cat`` and ``stack`` run in
    Python, several checks per part, and a stack of 256 experts pays for each.
    """
    first = shapes[0]
    ndim = len(first) + (kind == "stack")
    if kind == "fuse" and not first:
        raise ctx.error(f"cannot concatenate 0-d tensors ({_shown(keys, values)})", keys)
    if not -ndim <= dim < ndim:
        raise ctx.error(
            f"cannot {'concatenate' if kind == 'fuse' else 'stack'} along {dim}: "
            f"{_shown(keys, values)} have no such dimension",
            keys,
        )
    d = dim % ndim
    if kind == "stack":
        if any(s != first for s in shapes):
            bad = next(i for i, s in enumerate(shapes) if s != first)
            raise ctx.error(
                f"cannot stack along {dim}: the parts have different shapes "
                f"({_shown([keys[0], keys[bad]], [values[0], values[bad]])})",
                [keys[0], keys[bad]],
            )
        return (*first[:d], len(shapes), *first[d:])
    rest = first[:d] + first[d + 1 :]
    for i, s in enumerate(shapes):
        if len(s) != len(first) or s[:d] + s[d + 1 :] != rest:
            raise ctx.error(
                f"cannot concatenate along {dim}: the parts differ in another dimension "
                f"({_shown([keys[0], keys[i]], [values[0], values[i]])})",
                [keys[0], keys[i]],
            )
    return (*first[:d], sum(s[d] for s in shapes), *first[d + 1 :])


def combine(kind: str, dim: int, values: Sequence[Any], ctx: Context, keys: Sequence[str]) -> Any:
    """``torch.cat`` (``kind="fuse"``) or ``torch.stack`` of ``values`` along ``dim``."""
    _alike(values, ctx, keys, "fused" if kind == "fuse" else "stacked")
    types = set(map(type, values))
    if TensorMeta in types or (
        types <= {torch.Tensor, torch.nn.Parameter} and all(map(_is_meta, values))
    ):
        shape = _combined_shape(
            kind, dim, list(map(tuple, map(_shape_of, values))), ctx, keys, values
        )
        first = values[0]
        if type(first) is TensorMeta:
            return TensorMeta(shape, first.dtype)
        return torch.empty(shape, dtype=first.dtype, device="meta")
    if kind == "fuse":
        return _run(lambda ts: [torch.cat(ts, dim)], values, ctx, keys, f"concatenate along {dim}")[
            0
        ]
    return _run(lambda ts: [torch.stack(ts, dim)], values, ctx, keys, f"stack along {dim}")[0]


def size_along(value: Any, dim: int, ctx: Context, key: str) -> int:
    """``value.shape[dim]``, or a :class:`ConversionError` naming ``key``."""
    if not is_tensor(value):
        raise ctx.error(f"{key} is {short_repr(value)}, not a tensor", [key])
    shape = tuple(value.shape)
    if not -len(shape) <= dim < len(shape):
        raise ctx.error(f"{key} {_describe(value)} has no dimension {dim}", [key])
    return int(shape[dim])


def split_sizes(
    size: int, n: int, sizes: tuple[int, ...] | None, ctx: Context, key: str
) -> list[int]:
    """The sizes of the ``n`` parts of a dimension of ``size``."""
    if sizes is None:
        if size % n:
            raise ctx.error(
                f"{key} has size {size} along the split dimension, which does not divide into "
                f"{n} equal parts; pass sizes=[...]",
                [key],
            )
        return [size // n] * n
    if sum(sizes) != size:
        raise ctx.error(
            f"sizes {list(sizes)} add up to {sum(sizes)}, but {key} has size {size} along the "
            "split dimension",
            [key],
        )
    return list(sizes)


def divide(kind: str, dim: int, value: Any, parts: list[int], ctx: Context, key: str) -> list[Any]:
    """``torch.split`` into ``parts`` (``kind="split"``) or ``torch.unbind``, each piece new."""
    if kind == "split":
        return _run(
            lambda ts: [_contiguous(p) for p in torch.split(ts[0], parts, dim)],
            [value],
            ctx,
            [key],
            f"split along {dim}",
        )
    return _run(
        lambda ts: [_contiguous(p) for p in torch.unbind(ts[0], dim)],
        [value],
        ctx,
        [key],
        f"unbind along {dim}",
    )


def transpose(dims: tuple[int, int], value: Any, ctx: Context, key: str) -> Any:
    """``value`` with ``dims`` swapped, as a new contiguous tensor."""
    if not is_tensor(value):
        raise ctx.error(f"{key} is {short_repr(value)}, not a tensor", [key])
    ndim = len(value.shape)
    a, b = dims
    if not (-ndim <= a < ndim and -ndim <= b < ndim) or a % ndim == b % ndim:
        raise ctx.error(
            f"{key} {_describe(value)} has no two distinct dimensions {dims} to swap", [key]
        )
    return _run(
        lambda ts: [_contiguous(ts[0].transpose(a, b))], [value], ctx, [key], f"transpose {dims}"
    )[0]


# --------------------------------------------------------------------------------------
# optimizer state


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in value.shape)


def _holds_tensor(value: Any) -> bool:
    """Whether a list or tuple holds a tensor at any depth (cycles and depth bounded)."""
    stack, seen, budget = [value], set(), 4096
    while stack and budget > 0:
        node = stack.pop()
        if type(node) not in (list, tuple) or id(node) in seen:
            continue
        seen.add(id(node))
        budget -= len(node)
        for item in node:
            if is_tensor(item):
                return True
            stack.append(item)
    return False


def infer_shape(fields: Fields) -> tuple[int, ...] | None:
    """The one shape the entry's non-scalar tensors share, or ``None`` (none, or several)."""
    shapes = {_shape(v) for _, v in fields if is_tensor(v) and len(v.shape)}
    return next(iter(shapes)) if len(shapes) == 1 else None


def kind_of(value: Any, shape: tuple[int, ...] | None) -> str:
    """:data:`PARAM`, :data:`SCALAR` or :data:`OTHER` for one state leaf."""
    if is_tensor(value):
        if not len(value.shape):
            return SCALAR
        return PARAM if shape is not None and _shape(value) == shape else OTHER
    return OTHER if _holds_tensor(value) else SCALAR


def same_scalar(a: Any, b: Any) -> bool:
    """Whether two scalar state values are equal.

    Tensors by dtype, shape and value (meta ones have no values to compare), anything
    else by value.
    """
    if a is b:
        return True
    if is_tensor(a) or is_tensor(b):
        if not (is_tensor(a) and is_tensor(b)) or str(a.dtype) != str(b.dtype):
            return False
        if _shape(a) != _shape(b):
            return False
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            return True  # metadata only: nothing more to compare
        if a.device.type == "meta" or b.device.type == "meta":
            return True
        try:
            x, y = a.detach().cpu(), b.detach().cpu()
            return bool(
                torch.equal(x, y) or (torch.equal(x.isnan(), y.isnan()) and x.isnan().all())
            )
        except (RuntimeError, TypeError):
            return False
    if type(a) is type(b) and type(a) in (set, frozenset, bytearray):
        return bool(a == b)  # (freeze compares unhashable values by identity)
    return bool(freeze(a) == freeze(b))


def copy_scalar(value: Any) -> Any:
    """A scalar for one more parameter: tensors cloned, mutable containers copied."""
    if isinstance(value, torch.Tensor):
        with torch.no_grad():
            return value.clone()
    if isinstance(value, (list, dict, set, bytearray)):
        return copy.copy(value)
    return value


def _classified(
    fields: Fields, shape: tuple[int, ...] | None
) -> tuple[dict[Hashable, Any], dict[Hashable, Any], list[tuple[Hashable, Any]]]:
    params: dict[Hashable, Any] = {}
    scalars: dict[Hashable, Any] = {}
    others: list[tuple[Hashable, Any]] = []
    for path, value in fields:
        kind = kind_of(value, shape)
        if kind is PARAM:
            params[path] = value
        elif kind is SCALAR:
            scalars[path] = value
        else:
            others.append((path, value))
    return params, scalars, others


def _refuse_others(
    others: list[tuple[Hashable, Any]],
    key: str,
    shape: tuple[int, ...] | None,
    inferred: bool,
    ctx: Context,
    keys: Sequence[str],
) -> Any:
    """Raise for state that cannot be converted, or return :data:`RESET` (``"reset"``)."""
    path, value = others[0]
    what = f"of shape {list(value.shape)}" if is_tensor(value) else "holding tensors"
    if shape is None:
        why = (
            "the parameter's shape is unknown (no model state dict beside the optimizer's "
            "says it, and its state tensors have several shapes)"
        )
    else:
        why = f"not shaped like the parameter {list(shape)}" + (
            " (the shape its other state has)" if inferred else ""
        )
    names = ", ".join(repr(ctx.spell(p)) for p, _ in others)
    reason = f"{key}'s state {names}: {what}, {why}"
    if ctx.nonelementwise == "reset":
        ctx.reset_reason = reason
        return RESET
    raise ctx.error(
        f"the optimizer state of {key} holds {ctx.spell(path)!r} {what}, {why}, so it cannot "
        "be converted elementwise (factored or per-tensor statistics: Adafactor, Shampoo, "
        "PSGD, ...). Pass nonelementwise='reset' to give the converted parameters fresh "
        "optimizer state, or pass the whole checkpoint with its model state dict if the "
        "shape is what is unknown.",
        keys,
    )


class _FieldKeys(Sequence[str]):
    """``"<key> state '<field>'"`` for each source key, spelled only when a message needs it."""

    def __init__(self, keys: Sequence[str], field: str) -> None:
        self.keys = keys
        self.field = field

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [f"{k} state {self.field!r}" for k in self.keys[i]]
        return f"{self.keys[i]} state {self.field!r}"


_first = itemgetter(0)
_second = itemgetter(1)
_shape_of = attrgetter("shape")
_is_meta = attrgetter("is_meta")


def _all_equal(column: Sequence[Any]) -> bool:
    """A quick proof that every value of a scalar column equals the first (``False``: not sure).

    One object throughout; or meta tensors of one dtype (no values to differ); or CPU
    tensors of one dtype and shape compared in one ``torch.eq`` (NaN fails it, and goes
    to the comparison one by one).
    """
    first = column[0]
    if all(v is first for v in column):
        return True
    if set(map(type, column)) != {torch.Tensor}:
        return False
    if len({(str(v.dtype), tuple(v.shape), v.device) for v in column}) != 1:
        return False
    if all(map(_is_meta, column)):
        return True
    if first.device.type != "cpu":
        return False
    with torch.no_grad():
        return bool(torch.stack(list(column)).eq(first).all())


def _combine_columns(
    kind: str,
    dim: int,
    entries: Sequence[Fields],
    shapes: Sequence[tuple[int, ...] | None],
    ctx: Context,
    keys: Sequence[str],
) -> Fields | None:
    """:func:`combine_state` for the usual case, a column (field) at a time; ``None``: unusual.

    Usual: every source has the same fields in the same order, each field is all tensors
    with dimensions or all scalars, and the tensors of each source share one shape (the
    parameter's, where it is known). Anything else goes to the general path, which finds
    the problem and names it.
    """
    paths = tuple(map(_first, entries[0]))
    if any(tuple(map(_first, e)) != paths for e in entries[1:]):
        return None
    columns = list(zip(*(map(_second, e) for e in entries), strict=True))
    kinds: list[str] = []
    param_shapes: list[tuple[int, ...]] | None = None
    for column in columns:
        types = set(map(type, column))
        if types <= _TENSOR_TYPES:
            column_shapes = list(map(tuple, map(_shape_of, column)))
            ranks = set(map(len, column_shapes))
            if ranks == {0}:
                kinds.append(SCALAR)
                continue
            if 0 in ranks:
                return None
            if param_shapes is None:
                param_shapes = column_shapes
            elif column_shapes != param_shapes:
                return None
            kinds.append(PARAM)
        elif types & {list, tuple, dict, torch.Tensor, torch.nn.Parameter, TensorMeta}:
            return None
        else:
            kinds.append(SCALAR)
    if param_shapes is None:
        return None  # only scalars: maybe a 0-d parameter, for the general path to tell
    if any(s is not None and s != p for s, p in zip(shapes, param_shapes, strict=True)):
        return None
    out: Fields = []
    for path, column, what in zip(paths, columns, kinds, strict=True):
        if what is PARAM:
            out.append((path, combine(kind, dim, column, ctx, _FieldKeys(keys, ctx.spell(path)))))
            continue
        first = column[0]
        if _all_equal(column):
            out.append((path, first))
            continue
        for value, key in zip(column[1:], keys[1:], strict=True):
            if value is not first and not same_scalar(first, value):
                raise ctx.error(
                    f"the optimizer state field {ctx.spell(path)!r} differs between the parts "
                    f"({keys[0]}: {_describe(first)}, {key}: {_describe(value)}); a fused "
                    "parameter has one value per scalar field, so training the parts with "
                    "different step counts cannot continue as one",
                    [keys[0], key],
                )
        out.append((path, first))
    return out


def combine_state(
    kind: str,
    dim: int,
    entries: Sequence[Fields | None],
    shapes: Sequence[tuple[int, ...] | None],
    ctx: Context,
    keys: Sequence[str],
) -> Fields | None:
    """The target's state for a fuse or stack of ``entries`` (one per source, ``None``: none).

    Returns :data:`RESET` under ``nonelementwise="reset"`` for state it cannot convert.
    """
    have = [e is not None for e in entries]
    if not any(have):
        return None
    if not all(have):
        with_state = [k for k, h in zip(keys, have, strict=True) if h]
        without = [k for k, h in zip(keys, have, strict=True) if not h]
        raise ctx.error(
            f"{', '.join(with_state)} {'has' if len(with_state) == 1 else 'have'} optimizer "
            f"state but {', '.join(without)} {'has' if len(without) == 1 else 'have'} none "
            "(never stepped, or frozen); a fused parameter needs state for every part or for "
            "none. Drop the state of these parameters first, or convert the model alone.",
            [*with_state, *without],
        )
    fast = _combine_columns(kind, dim, entries, shapes, ctx, keys)  # type: ignore[arg-type]
    if fast is not None:
        return fast
    parts = []
    for entry, shape, key in zip(entries, shapes, keys, strict=True):
        assert entry is not None
        inferred = shape is None
        if inferred:
            shape = infer_shape(entry)
        dims = {len(v.shape) for _, v in entry if is_tensor(v)}
        if 0 in dims and (shape == () or (shape is None and dims == {0})):
            # a 0-d parameter's moments are 0-d too: they cannot be told from its step
            raise ctx.error(
                f"{key} is a 0-d parameter (or one whose shape nothing says) whose optimizer "
                "state holds 0-d tensors, which cannot be told from scalar fields such as "
                "'step'; stack such parameters without their optimizer state (drop it first)",
                keys,
            )
        params, scalars, others = _classified(entry, shape)
        if others:
            return _refuse_others(others, key, shape, inferred, ctx, keys)  # type: ignore[no-any-return]
        parts.append((params, scalars, entry))
    first_params = parts[0][0]
    for (params, _, _), key in zip(parts[1:], keys[1:], strict=True):
        if params.keys() != first_params.keys():
            a = sorted(map(ctx.spell, first_params.keys() - params.keys()))
            b = sorted(map(ctx.spell, params.keys() - first_params.keys()))
            detail = (f"{keys[0]} has {a}" if a else "") + (
                (" and " if a else "") + f"{key} has {b}" if b else ""
            )
            raise ctx.error(
                f"the parts' optimizer state differs: {detail} shaped like the parameter, the "
                "other part does not",
                [keys[0], key],
            )
    scalar_values: dict[Hashable, tuple[Any, str]] = {}
    for (params, scalars, _), key in zip(parts, keys, strict=True):
        for path, value in scalars.items():
            if path in first_params:
                raise ctx.error(
                    f"{ctx.spell(path)!r} is shaped like the parameter in {keys[0]}'s state "
                    f"but is a scalar in {key}'s",
                    [keys[0], key],
                )
            seen = scalar_values.get(path)
            if seen is None:
                scalar_values[path] = (value, key)
            elif not same_scalar(seen[0], value):
                raise ctx.error(
                    f"the optimizer state field {ctx.spell(path)!r} differs between the parts "
                    f"({seen[1]}: {_describe(seen[0])}, {key}: {_describe(value)}); a fused "
                    "parameter has one value per scalar field, so training the parts with "
                    "different step counts cannot continue as one",
                    [seen[1], key],
                )
        for path in params:
            if path in scalar_values and scalar_values[path][1] != key:
                raise ctx.error(
                    f"{ctx.spell(path)!r} is a scalar in {scalar_values[path][1]}'s state but "
                    f"shaped like the parameter in {key}'s",
                    [scalar_values[path][1], key],
                )
    out: Fields = []
    done: set[Hashable] = set()
    for _, _, entry in parts:
        for path, _ in entry:
            if path in done:
                continue
            done.add(path)
            if path in first_params:
                values = [p[0][path] for p in parts]
                field_keys = [f"{k} state {ctx.spell(path)!r}" for k in keys]
                out.append((path, combine(kind, dim, values, ctx, field_keys)))
            else:
                out.append((path, scalar_values[path][0]))
    return out


def divide_state(
    kind: str,
    dim: int,
    entry: Fields | None,
    shape: tuple[int, ...] | None,
    parts: list[int] | None,
    ctx: Context,
    key: str,
    n: int,
) -> list[Fields | None] | Any:
    """The targets' states for a split (``parts``: the sizes) or unbind into ``n``.

    Returns :data:`RESET` under ``nonelementwise="reset"`` for state it cannot convert.
    """
    if entry is None:
        return [None] * n
    inferred = shape is None
    if inferred:
        shape = infer_shape(entry)
    params, _, others = _classified(entry, shape)
    if others:
        return _refuse_others(others, key, shape, inferred, ctx, [key])
    pieces: dict[Hashable, list[Any]] = {}
    for path, value in params.items():
        field = f"{key} state {ctx.spell(path)!r}"
        if kind == "split":
            assert parts is not None
            got = divide(kind, dim, value, parts, ctx, field)
        else:
            got = divide(kind, dim, value, [], ctx, field)
        if len(got) != n:
            raise ctx.error(f"{field} unbinds into {len(got)} parts, the parameter into {n}", [key])
        pieces[path] = got
    out: list[Fields | None] = []
    for i in range(n):
        target: Fields = []
        for path, value in entry:
            if path in pieces:
                target.append((path, pieces[path][i]))
            else:
                target.append((path, copy_scalar(value)))
        out.append(target)
    return out


def transpose_state(
    dims: tuple[int, int],
    entry: Fields | None,
    shape: tuple[int, ...] | None,
    ctx: Context,
    key: str,
) -> Any:
    """The state of a transposed parameter; scalars stay the same objects."""
    if entry is None:
        return None
    inferred = shape is None
    if inferred:
        shape = infer_shape(entry)
    params, _, others = _classified(entry, shape)
    if others:
        return _refuse_others(others, key, shape, inferred, ctx, [key])
    return [
        (path, transpose(dims, value, ctx, f"{key} state {ctx.spell(path)!r}"))
        if path in params
        else (path, value)
        for path, value in entry
    ]
