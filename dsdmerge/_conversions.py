"""The conversion records: what a layout change does to parameters, as data.

The rule: each record names parameters by fqn templates (:mod:`dsdmerge._templates`:
``{NAME}`` is one dot-free segment, ``{NAME*}`` one or more) and says how their
tensors become the new ones:

* :class:`Fuse`: several parameters, concatenated along ``dim`` (``torch.cat``);
* :class:`Split`: one parameter, cut along ``dim`` into several (``torch.split``);
* :class:`Stack`: the parameters a placeholder numbers ``0..n-1``, stacked along a new
  ``dim`` (``torch.stack``);
* :class:`Unstack`: one parameter, unbound along ``dim`` into ``n`` numbered ones;
* :class:`Transpose`: one parameter, two of its dimensions swapped.

Every placeholder of a source appears in every target and the other way round
(except a :class:`Stack`'s or :class:`Unstack`'s ``over``, which numbers the parts).
The records are frozen and validate their arguments when built, so a bad rule fails
where it is written; :func:`~dsdmerge.convert` applies them. :data:`CONVERSION_PRESETS`
holds the rules for the layouts people meet.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from dsdmerge._templates import Template, template
from dsdmerge._text import short_repr
from dsdmerge.errors import ConversionError

__all__ = [
    "CONVERSION_PRESETS",
    "Conversion",
    "Fuse",
    "Split",
    "Stack",
    "Transpose",
    "Unstack",
    "expand",
]


def _dim(value: object, what: str = "dim") -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConversionError(f"{what} must be an int, got {short_repr(value)}")
    return int(value)


def _templates(value: object, what: str) -> tuple[Template, ...]:
    """Two or more distinct templates from a list or tuple of str."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ConversionError(
            f"{what} must be a list of at least two fqn templates, got {short_repr(value)}"
        )
    out = tuple(template(text, f"{what}[{i}]") for i, text in enumerate(value))
    if len(out) < 2:
        raise ConversionError(f"{what} must list at least two templates, got {len(out)}")
    texts = [t.text for t in out]
    twice = sorted({t for t in texts if texts.count(t) > 1})
    if twice:
        raise ConversionError(f"{what} lists {twice[0]!r} twice")
    return out


def _same_placeholders(first: Template, others: Iterable[Template], *, extra: str = "") -> None:
    """``others`` have ``first``'s placeholders (``extra``: one more, or one fewer)."""
    for other in others:
        want = set(first.names) ^ ({extra} if extra else set())
        if set(other.names) != want or (first.many != other.many and extra != first.many):
            raise ConversionError(
                f"templates {first.text!r} and {other.text!r} must have the same placeholders"
                + (f" (but for {{{extra}}})" if extra else "")
                + f"; they have {_names(first)} and {_names(other)}. Each placeholder says "
                "which parameter a part comes from, so every target needs them all."
            )


def _names(t: Template) -> str:
    return "{" + ", ".join(n + ("*" if n == t.many else "") for n in t.names) + "}"


def _over(over: object, has: Template, lacks: Template) -> str:
    if not isinstance(over, str):
        raise ConversionError(f"over must be a placeholder name (a str), got {short_repr(over)}")
    if over not in has.names:
        raise ConversionError(
            f"over={over!r} must be a placeholder of {has.text!r} (it numbers the parts), "
            f"whose placeholders are {_names(has)}"
        )
    if over == has.many:
        raise ConversionError(f"over={over!r} must be a one-segment placeholder, not {{{over}*}}")
    if over in lacks.names:
        raise ConversionError(f"over={over!r} must not appear in {lacks.text!r}")
    return over


def _set(record: object, **fields: Any) -> None:
    for name, value in fields.items():
        object.__setattr__(record, name, value)


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class Fuse:
    """Concatenate parameters into one along ``dim`` (``torch.cat``), in the order listed.

    The optimizer state shaped like each source is concatenated the same way; its
    scalars (``step``) must be equal across the sources; the sources must share
    their hyperparameters, and the target takes the first source's place.

    Args:
        sources: Two or more fqn templates, e.g. ``"layers.{L}.attn.q_proj.weight"``.
        target: The fused parameter's fqn template, with the same placeholders.
        dim: The dimension to concatenate along.

    Raises:
        ConversionError: A template that does not parse, fewer than two sources, a
            source listed twice, placeholders that differ, or a ``dim`` that is not an int.

    Examples:
        >>> import torch, dsdmerge as dm
        >>> rule = dm.Fuse(["{L}.q", "{L}.k"], "{L}.qk")
        >>> out = dm.convert({"0.q": torch.zeros(2, 3), "0.k": torch.ones(1, 3)}, [rule])
        >>> {k: tuple(v.shape) for k, v in out.items()}
        {'0.qk': (3, 3)}
    """

    sources: tuple[str, ...]
    target: str
    dim: int
    _sources: tuple[Template, ...] = dataclasses.field(compare=False)
    _target: Template = dataclasses.field(compare=False)

    def __init__(self, sources: Sequence[str], target: str, *, dim: int = 0) -> None:
        compiled = _templates(sources, "sources")
        tgt = template(target, "target")
        _same_placeholders(tgt, compiled)
        _set(
            self,
            sources=tuple(t.text for t in compiled),
            target=tgt.text,
            dim=_dim(dim),
            _sources=compiled,
            _target=tgt,
        )

    def __repr__(self) -> str:
        dim = f", dim={self.dim}" if self.dim else ""
        return f"Fuse({list(self.sources)!r}, {self.target!r}{dim})"


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class Split:
    """Cut one parameter into several along ``dim`` (``torch.split``).

    Equal parts when ``sizes`` is ``None``; else ``sizes[i]`` is the size of
    ``targets[i]`` along ``dim``. The optimizer state shaped like the source is cut
    the same way, its scalars are copied to every target, and the targets take the
    source's hyperparameters and place, in order.

    Args:
        source: The fqn template of the parameter to cut.
        targets: Two or more fqn templates, with the source's placeholders.
        dim: The dimension to cut along.
        sizes: One positive size per target, or ``None`` for equal parts.

    Raises:
        ConversionError: A bad template, fewer than two targets, placeholders that
            differ, or ``sizes`` that are not one positive int per target.

    Examples:
        >>> import torch, dsdmerge as dm
        >>> rule = dm.Split("qk", ["q", "k"], sizes=[2, 1])
        >>> {k: tuple(v.shape) for k, v in dm.convert({"qk": torch.zeros(3, 4)}, [rule]).items()}
        {'q': (2, 4), 'k': (1, 4)}
    """

    source: str
    targets: tuple[str, ...]
    dim: int
    sizes: tuple[int, ...] | None
    _source: Template = dataclasses.field(compare=False)
    _targets: tuple[Template, ...] = dataclasses.field(compare=False)

    def __init__(
        self,
        source: str,
        targets: Sequence[str],
        *,
        dim: int = 0,
        sizes: Sequence[int] | None = None,
    ) -> None:
        src = template(source, "source")
        compiled = _templates(targets, "targets")
        _same_placeholders(src, compiled)
        if sizes is not None:
            if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
                raise ConversionError(f"sizes must be a list of ints, got {short_repr(sizes)}")
            checked = tuple(_dim(s, "each of sizes") for s in sizes)
            if len(checked) != len(compiled) or min(checked) < 1:
                raise ConversionError(
                    f"sizes {list(checked)} must be one positive size per target "
                    f"({len(compiled)} targets)"
                )
            sizes = checked
        _set(
            self,
            source=src.text,
            targets=tuple(t.text for t in compiled),
            dim=_dim(dim),
            sizes=sizes,
            _source=src,
            _targets=compiled,
        )

    def __repr__(self) -> str:
        dim = f", dim={self.dim}" if self.dim else ""
        sizes = f", sizes={list(self.sizes)}" if self.sizes is not None else ""
        return f"Split({self.source!r}, {list(self.targets)!r}{dim}{sizes})"


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class Stack:
    """Stack the parameters numbered by a placeholder into one, along a new ``dim``.

    ``over`` names the placeholder of ``source`` that numbers the parts (an expert
    index); its values must be ``0..n-1``, every one of them, and the parts are
    stacked in index order (``torch.stack``). ``target`` has every other placeholder
    of ``source``. Optimizer state and hyperparameters carry over as for :class:`Fuse`.

    Args:
        source: The template of the parts, e.g. ``"layers.{L}.mlp.experts.{E}.w1.weight"``.
        target: The stacked parameter's template, e.g. ``"layers.{L}.mlp.experts.w1"``.
        over: The placeholder that numbers the parts (``"E"``).
        dim: Where the new dimension goes.

    Raises:
        ConversionError: A bad template, ``over`` not a one-segment placeholder of the
            source or also one of the target, or other placeholders that differ.

    Examples:
        >>> import torch, dsdmerge as dm
        >>> sd = {f"experts.{e}.w": torch.zeros(2, 3) for e in range(4)}
        >>> out = dm.convert(sd, [dm.Stack("experts.{E}.w", "experts.w", over="E")])
        >>> {k: tuple(v.shape) for k, v in out.items()}
        {'experts.w': (4, 2, 3)}
    """

    source: str
    target: str
    over: str
    dim: int
    _source: Template = dataclasses.field(compare=False)
    _target: Template = dataclasses.field(compare=False)

    def __init__(self, source: str, target: str, *, over: str, dim: int = 0) -> None:
        src = template(source, "source")
        tgt = template(target, "target")
        name = _over(over, src, tgt)
        _same_placeholders(src, [tgt], extra=name)
        _set(
            self,
            source=src.text,
            target=tgt.text,
            over=name,
            dim=_dim(dim),
            _source=src,
            _target=tgt,
        )

    def __repr__(self) -> str:
        dim = f", dim={self.dim}" if self.dim else ""
        return f"Stack({self.source!r}, {self.target!r}, over={self.over!r}{dim})"


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class Unstack:
    """Unbind one parameter along ``dim`` into parts numbered ``0..n-1`` (``torch.unbind``).

    ``over`` names the placeholder of ``target`` that takes the part's index; ``n``
    is the source's size along ``dim``. Optimizer state and hyperparameters carry
    over as for :class:`Split`.

    Args:
        source: The stacked parameter's template.
        target: The parts' template, with ``over`` and every placeholder of ``source``.
        over: The placeholder that numbers the parts.
        dim: The dimension to unbind.

    Raises:
        ConversionError: As for :class:`Stack`, with the two templates' roles swapped.

    Examples:
        >>> import torch, dsdmerge as dm
        >>> rule = dm.Unstack("experts.w", "experts.{E}.w", over="E")
        >>> sorted(dm.convert({"experts.w": torch.zeros(2, 3)}, [rule]))
        ['experts.0.w', 'experts.1.w']
    """

    source: str
    target: str
    over: str
    dim: int
    _source: Template = dataclasses.field(compare=False)
    _target: Template = dataclasses.field(compare=False)

    def __init__(self, source: str, target: str, *, over: str, dim: int = 0) -> None:
        src = template(source, "source")
        tgt = template(target, "target")
        name = _over(over, tgt, src)
        _same_placeholders(tgt, [src], extra=name)
        _set(
            self,
            source=src.text,
            target=tgt.text,
            over=name,
            dim=_dim(dim),
            _source=src,
            _target=tgt,
        )

    def __repr__(self) -> str:
        dim = f", dim={self.dim}" if self.dim else ""
        return f"Unstack({self.source!r}, {self.target!r}, over={self.over!r}{dim})"


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class Transpose:
    """Swap two dimensions of a parameter (``torch.transpose``); its fqn stays.

    The optimizer state shaped like the parameter is transposed the same way; its
    scalars and hyperparameters stay as they are. Transposing twice is the identity.

    Args:
        key: The parameter's fqn template.
        dims: The two dimensions to swap, e.g. ``(1, 2)``.

    Raises:
        ConversionError: A bad template, or ``dims`` that are not two distinct ints.

    Examples:
        >>> import torch, dsdmerge as dm
        >>> out = dm.convert({"w": torch.zeros(2, 3)}, [dm.Transpose("w", dims=(0, 1))])
        >>> tuple(out["w"].shape)
        (3, 2)
    """

    key: str
    dims: tuple[int, int]
    _key: Template = dataclasses.field(compare=False)

    def __init__(self, key: str, *, dims: Sequence[int]) -> None:
        compiled = template(key, "key")
        if isinstance(dims, (str, bytes)) or not isinstance(dims, Sequence) or len(dims) != 2:
            raise ConversionError(f"dims must be two ints, got {short_repr(dims)}")
        a, b = (_dim(d, "each of dims") for d in dims)
        if a == b:
            raise ConversionError(f"dims must be two different dimensions, got ({a}, {b})")
        _set(self, key=compiled.text, dims=(a, b), _key=compiled)

    def __repr__(self) -> str:
        return f"Transpose({self.key!r}, dims={self.dims!r})"


Conversion = Fuse | Split | Stack | Unstack | Transpose
"""One conversion record."""

_RECORDS = (Fuse, Split, Stack, Unstack, Transpose)


def _stack_experts(gate: str, up: str, down: str) -> tuple[Conversion, ...]:
    base = "{P*}.experts"
    return (
        Stack(f"{base}.{{E}}.{gate}.weight", f"{base}.gate_proj", over="E"),
        Stack(f"{base}.{{E}}.{up}.weight", f"{base}.up_proj", over="E"),
        Fuse([f"{base}.gate_proj", f"{base}.up_proj"], f"{base}.gate_up_proj", dim=1),
        Stack(f"{base}.{{E}}.{down}.weight", f"{base}.down_proj", over="E"),
    )


CONVERSION_PRESETS: Mapping[str, tuple[Conversion, ...]] = MappingProxyType(
    {
        "qkv": (
            Fuse(["{P*}.q_proj.{T}", "{P*}.k_proj.{T}", "{P*}.v_proj.{T}"], "{P*}.qkv_proj.{T}"),
        ),
        "gate_up": (Fuse(["{P*}.gate_proj.{T}", "{P*}.up_proj.{T}"], "{P*}.gate_up_proj.{T}"),),
        "stack_experts": _stack_experts("gate_proj", "up_proj", "down_proj"),
        "stack_experts_w123": _stack_experts("w1", "w3", "w2"),
        "transpose_experts": (
            Transpose("{P*}.experts.gate_up_proj", dims=(1, 2)),
            Transpose("{P*}.experts.down_proj", dims=(1, 2)),
        ),
    }
)
"""Conversion rules for common layout changes, by name (for ``convert=`` and ``--convert``).

* ``"qkv"``: ``<prefix>.q_proj``, ``k_proj`` and ``v_proj`` (weights and biases, any
  prefix) fused along dim 0 into ``<prefix>.qkv_proj``.
* ``"gate_up"``: ``<prefix>.gate_proj`` and ``up_proj`` fused along dim 0 into
  ``<prefix>.gate_up_proj``.
* ``"stack_experts"``: per-expert MoE weights
  ``<prefix>.experts.<e>.{gate_proj,up_proj,down_proj}.weight`` stacked into the 3-D
  parameters of transformers v5: ``<prefix>.experts.gate_up_proj``
  (``experts x 2*intermediate x hidden``: gate and up stacked, then concatenated along
  dim 1) and ``<prefix>.experts.down_proj`` (``experts x hidden x intermediate``).
  Checked against transformers' Qwen2-MoE, Qwen3-MoE, Qwen3-Next, DeepSeek-V2/V3,
  OLMoE, GLM-4-MoE, dots1, HunYuan-MoE and Jamba.
* ``"stack_experts_w123"``: the same for Mixtral-style names ``w1`` (gate), ``w3`` (up)
  and ``w2`` (down): Mixtral, MiniMax and PhiMoE (whose ``block_sparse_moe`` module is
  ``mlp`` in transformers v5: ``rename={r"\\.block_sparse_moe\\.": ".mlp."}``).
* ``"transpose_experts"``: ``<prefix>.experts.gate_up_proj`` and ``down_proj`` with
  their last two dimensions swapped: stacked experts saved ``experts x hidden x
  2*intermediate`` (Qwen3-VL-MoE's checkpoints) into transformers v5's
  ``experts x 2*intermediate x hidden``.
"""


def expand(conversions: object) -> list[tuple[Conversion, str | None]]:
    """The rules of ``conversions`` in order, each with the preset it comes from.

    ``conversions`` is a list (or tuple) of records and preset names, or one of those.

    Raises:
        ConversionError: An unknown preset name, or something that is not a rule.
    """
    items: Iterable[object]
    if isinstance(conversions, (str, *_RECORDS)):
        items = (conversions,)
    elif isinstance(conversions, (list, tuple)):
        items = conversions
    else:
        raise ConversionError(
            "conversions must be a list of conversion records (dsdmerge.Fuse, Split, Stack, "
            f"Unstack, Transpose) and preset names, got {short_repr(conversions)}"
        )
    out: list[tuple[Conversion, str | None]] = []
    for item in items:
        if isinstance(item, str):
            preset = CONVERSION_PRESETS.get(item)
            if preset is None:
                raise ConversionError(
                    f"unknown conversion preset {item!r}; the presets are "
                    f"{', '.join(map(repr, CONVERSION_PRESETS))}"
                )
            out.extend((rule, item) for rule in preset)
        elif isinstance(item, _RECORDS):
            out.append((item, None))
        else:
            raise ConversionError(
                f"{short_repr(item)} is not a conversion: pass dsdmerge.Fuse, Split, Stack, "
                "Unstack or Transpose records, or preset names"
            )
    return out
