"""Key templates: parameter fqns with placeholders, as the conversion rules spell them.

The rule: a template is an fqn some of whose dot-separated segments are placeholders.

* ``{NAME}`` matches exactly one segment (non-empty, without a dot):
  ``layers.{L}.attn.q_proj.weight`` matches ``layers.0.attn.q_proj.weight`` with
  ``L = "0"``, and not ``layers.0.1.attn.q_proj.weight``.
* ``{NAME*}`` matches one or more whole segments, for a prefix (or a middle) of any
  depth: ``{P*}.q_proj.weight`` matches ``model.layers.3.self_attn.q_proj.weight``
  with ``P = "model.layers.3.self_attn"``. A template holds at most one of these,
  so every other placeholder matches a fixed segment and a match is unique.

A placeholder is a whole segment (``layer{L}`` is refused, so that two placeholders
can never split one segment two ways); ``NAME`` is a Python identifier and appears
at most once per template. Everything else is literal: a template without
placeholders matches its own text only.

Then the code: a template compiles once to an anchored regular expression (each
literal escaped) and is matched with ``fullmatch``; a literal run of the template is
looked for first (a C-level substring test), so that matching many fqns costs a
regular-expression match only for the candidates.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from operator import methodcaller

from dsdmerge._text import short_repr
from dsdmerge.errors import ConversionError

__all__ = ["Template", "template"]

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(\*?)\}")
_ONE = r"[^.]+"
_MANY = r"[^.]+(?:\.[^.]+)*"


@dataclasses.dataclass(frozen=True)
class Template:
    """A compiled key template (see the module docstring).

    Attributes:
        text: The template as written.
        names: Its placeholder names, in order.
        many: The name of its ``{NAME*}`` placeholder, or ``None``.
        segments: Per segment, the placeholder name or ``None`` for a literal segment.
        pattern: The anchored regular expression, one group per placeholder.
        literal: A substring every match holds (for a quick pre-filter), maybe ``""``.
    """

    text: str
    names: tuple[str, ...]
    many: str | None
    segments: tuple[str | None, ...]
    pattern: re.Pattern[str]
    literal: str

    def __repr__(self) -> str:
        return repr(self.text)

    def match(self, fqn: str) -> tuple[str, ...] | None:
        """The placeholder values (in :attr:`names` order) if ``fqn`` matches, else ``None``."""
        found = self.pattern.fullmatch(fqn)
        return None if found is None else found.groups()

    def matches(self, fqns: Iterable[str]) -> list[tuple[str, tuple[str, ...]]]:
        """``(fqn, values)`` for each of ``fqns`` that matches, in their order."""
        candidates: Iterable[str] = fqns
        if self.literal:
            candidates = filter(methodcaller("__contains__", self.literal), fqns)
        fullmatch = self.pattern.fullmatch
        out = []
        for fqn in candidates:
            found = fullmatch(fqn)
            if found is not None:
                out.append((fqn, found.groups()))
        return out

    def fill(self, values: Mapping[str, str]) -> str:
        """The fqn this template spells with its placeholders set to ``values``."""
        parts = self.text.split(".")
        return ".".join(
            part if name is None else values[name]
            for part, name in zip(parts, self.segments, strict=True)
        )


def template(text: object, what: str) -> Template:
    """Compile a key template; ``what`` names the argument in errors (``"target"``).

    Raises:
        ConversionError: ``text`` is not a non-empty str, has an empty segment, a brace
            outside a whole-segment placeholder, a name twice, or two ``{NAME*}``.
    """
    if not isinstance(text, str) or not text:
        raise ConversionError(
            f"{what} must be a non-empty str (an fqn template such as "
            f"'layers.{{L}}.attn.q_proj.weight'), got {short_repr(text)}"
        )
    parts = text.split(".")
    if "" in parts:
        raise ConversionError(
            f"{what} {text!r} has an empty segment (two dots in a row, or a dot at an end)"
        )
    segments: list[str | None] = []
    regex: list[str] = []
    names: list[str] = []
    many: str | None = None
    for part in parts:
        found = _PLACEHOLDER.fullmatch(part)
        if found is None:
            if "{" in part or "}" in part:
                raise ConversionError(
                    f"{what} {text!r}: segment {part!r} holds a brace; a placeholder is a "
                    "whole segment, '{NAME}' (one segment) or '{NAME*}' (one or more)"
                )
            segments.append(None)
            regex.append(re.escape(part))
            continue
        name, star = found.groups()
        if name in names:
            raise ConversionError(f"{what} {text!r} names the placeholder {{{name}}} twice")
        if star:
            if many is not None:
                raise ConversionError(
                    f"{what} {text!r} has two many-segment placeholders ({{{many}*}} and "
                    f"{{{name}*}}); a template holds at most one, so that a match is unique"
                )
            many = name
        names.append(name)
        segments.append(name)
        regex.append(f"({_MANY if star else _ONE})")
    return Template(
        text=text,
        names=tuple(names),
        many=many,
        segments=tuple(segments),
        pattern=re.compile(r"\.".join(regex)),
        literal=_longest_literal(parts, segments),
    )


def _longest_literal(parts: list[str], segments: list[str | None]) -> str:
    """The longest run of literal segments, with the dots that surround it in every match."""
    best = ""
    run: list[int] = []
    for i, name in enumerate([*segments, "end"]):
        if name is None:
            run.append(i)
            continue
        if run:
            text = ".".join(parts[run[0] : run[-1] + 1])
            text = ("." if run[0] > 0 else "") + text + ("." if run[-1] < len(parts) - 1 else "")
            if len(text) > len(best):
                best = text
        run = []
    return best
