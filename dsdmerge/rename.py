r"""Renaming parameters: one rule set for a model and everything that names its parameters.

A model refactor (``attn.wq`` -> ``attn.q_proj``), a wrapper that was there when
the checkpoint was saved and is not now (DDP's ``module.``, ``torch.compile``'s
``_orig_mod.``) or the other way round changes every fqn of the affected
parameters. :func:`rename` maps fqns by rules, regular expressions applied with
:func:`re.sub` semantics and chained in order, and applies the same mapping
everywhere an fqn appears, so the optimizer state follows the weights:

* model state dicts (``{fqn: tensor}``);
* optimizer state dicts, nested (``state`` keys and ``params`` lists keyed by
  fqn, as ``get_optimizer_state_dict`` returns them) or flattened
  (``state.<fqn>.<name>`` and ``param_groups.<fqn>.<hyperparameter>``), and the
  ``param_names`` torch >= 2.5 stores in param groups;
* whole checkpoints (``{"model": ..., "optim": ..., "step": ...}``), nested or
  flattened with dots, and metadata-only views of them
  (:func:`dsdmerge.integrations.read_metadata`), without reading a tensor.

Param ids are never renamed: int ids (``optimizer.state_dict()``) and their
decimal spellings (``state.0.step``) stay as they are (see :func:`dsdmerge.rekey`).

Where the fqn sits in a flat key: under an optimizer section (a prefix ``P``
that is empty or ends in a dot, with ``P + "param_groups.<fqn>.<name>"`` keys),
it is the part after ``P + "state."`` or ``P + "param_groups."``; every other key
is an fqn after as many leading segments as ``P`` has (``model.layers.0.w`` next
to ``optim.state...`` is the fqn ``layers.0.w``; a model dict alone is all fqns).
A flat dict without optimizer keys cannot say where its fqns start: its keys are
taken as fqns, so rename ``{"model": {...}}`` nested rather than flattened.

:data:`RENAME_PRESETS` holds the rules for the wrappers everybody meets.
"""

from __future__ import annotations

import difflib
import re
import warnings
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from itertools import compress, repeat
from operator import add, attrgetter, getitem, is_not, itemgetter, methodcaller, or_
from types import MappingProxyType
from typing import Any, Literal, NamedTuple

from dsdmerge._records import SuggestedRename
from dsdmerge._trees import copy_tree as copy_acyclic
from dsdmerge._values import is_tensor_like, leaf_codes, shape_dtype, short_repr
from dsdmerge.errors import DSDMergeWarning, LayoutError, MergeError, RenameError
from dsdmerge.flatten import split_param_key
from dsdmerge.layout import (
    PARAM_GROUPS,
    PARAM_NAMES,
    PARAMS,
    PG_PREFIX,
    STATE,
    STATE_PREFIX,
    check_not_mixed,
    is_optimizer_state_dict,
    require_mapping,
)

__all__ = ["RENAME_PRESETS", "Rules", "SuggestedRename", "rename", "strip_prefix"]

Rules = str | Mapping[Any, str] | Sequence[str | Mapping[Any, str]]
"""Rename rules: ``{pattern: replacement}`` (regular expressions, applied in order with
:func:`re.sub` semantics), a preset name from :data:`RENAME_PRESETS`, or a sequence of
those (applied in order)."""


# (?<![^.]) : at the start of the fqn or right after a dot (the start of a segment)
# PEFT's adapter segments: lora_A.default.weight in a model, lora_A.weight in its saved adapter
_LORA = r"(?<![^.])(lora_(?:A|B|embedding_A|embedding_B|magnitude_vector))(?![^.])"
RENAME_PRESETS: Mapping[str, Mapping[str, str]] = MappingProxyType(
    {
        "ddp": MappingProxyType({r"^module\.": ""}),
        "compile": MappingProxyType({r"(?<![^.])_orig_mod\.": ""}),
        "checkpoint_wrapper": MappingProxyType({r"(?<![^.])_checkpoint_wrapped_module\.": ""}),
        "fsdp1": MappingProxyType({r"(?<![^.])_fsdp_wrapped_module\.": ""}),
        "peft": MappingProxyType({r"^base_model\.model\.": ""}),
        "lora": MappingProxyType({r"(?<![^.])base_layer\.": ""}),
        # the other direction, and PEFT's adapter name (which its saved adapter files drop)
        "to_peft": MappingProxyType({r"^(?!base_model\.model\.)": "base_model.model."}),
        "lora_adapter_name": MappingProxyType({_LORA + r"\.default(?![^.])": r"\1"}),
        "to_lora_adapter_name": MappingProxyType({_LORA + r"(?!\.default(?![^.]))": r"\1.default"}),
    }
)
"""Rules for the fqn segments wrappers add, by name, for ``rename=``.

* ``"ddp"``: ``DistributedDataParallel``'s (and ``DataParallel``'s) leading ``module.``;
* ``"compile"``: ``torch.compile``'s ``_orig_mod.`` (leading, or inside for a compiled
  submodule);
* ``"checkpoint_wrapper"``: activation checkpointing's ``_checkpoint_wrapped_module.``;
* ``"fsdp1"``: FSDP1's ``_fsdp_wrapped_module.``;
* ``"peft"``: PEFT's leading ``base_model.model.``;
* ``"lora"``: PEFT LoRA's ``base_layer.`` (``q_proj.base_layer.weight`` -> ``q_proj.weight``);
* ``"to_peft"``: adds PEFT's leading ``base_model.model.`` (a plain checkpoint resumed into
  a PEFT model). Where LoRA wraps a module its weights move under ``base_layer.`` too, a
  rule that names the wrapped modules; :func:`dsdmerge.diff` suggests it for the modules
  it sees wrapped (``v_proj.weight`` -> ``v_proj.base_layer.weight``);
* ``"lora_adapter_name"``: drops the adapter name PEFT puts after ``lora_A``, ``lora_B``,
  ``lora_embedding_A/B`` and ``lora_magnitude_vector`` (``lora_A.default.weight`` ->
  ``lora_A.weight``, as ``save_pretrained`` writes adapters);
* ``"to_lora_adapter_name"``: puts it back (``lora_A.weight`` -> ``lora_A.default.weight``:
  a saved adapter into the model).

To add a prefix instead (a bare checkpoint resumed into a wrapped model), use a rule
such as ``{r"^": "module."}``.
"""

Unmatched = Literal["ignore", "warn", "raise"]


# --------------------------------------------------------------------------------------
# rules


class Rule(NamedTuple):
    """One compiled rule: ``pattern.sub(replacement, fqn)``."""

    pattern: re.Pattern[str]
    replacement: str
    preset: str | None = None

    def __str__(self) -> str:
        text = f"{self.pattern.pattern!r} -> {self.replacement!r}"
        return f"{text} (preset {self.preset!r})" if self.preset else text


def compile_rules(rules: Rules | Sequence[Rule] | None) -> tuple[Rule, ...]:
    """The rules, compiled and in order; ``()`` for ``None``; compiled rules pass through.

    Raises:
        RenameError: A pattern that does not compile, a replacement that is not a
            str, an unknown preset name, or something that is not rules at all.
    """
    if rules is None:
        return ()
    out: list[Rule] = []
    items: Iterable[object] = (
        (rules,) if isinstance(rules, (str, Mapping)) or _is_pair(rules) else rules
    )
    if not isinstance(items, Iterable) or isinstance(items, (bytes, bytearray)):
        raise RenameError(_RULES_HELP.format(got=type(rules).__name__))
    for item in items:
        if isinstance(item, str):
            preset = RENAME_PRESETS.get(item)
            if preset is None:
                raise RenameError(
                    f"unknown rename preset {item!r}; the presets are "
                    f"{', '.join(map(repr, RENAME_PRESETS))}. For a rule, pass a mapping "
                    "{pattern: replacement}."
                )
            out.extend(_rule(p, r, item) for p, r in preset.items())
        elif isinstance(item, Rule):  # compiled already
            out.append(item)
        elif isinstance(item, Mapping):
            out.extend(_rule(p, r, None) for p, r in item.items())
        elif _is_pair(item):
            pair: tuple[object, object] = item  # type: ignore[assignment]
            out.append(_rule(pair[0], pair[1], None))
        else:
            raise RenameError(_RULES_HELP.format(got=type(item).__name__))
    return tuple(out)


_RULES_HELP = (
    "rename rules must be a mapping {{pattern: replacement}}, a preset name or a sequence of "
    "those, got {got}"
)


def _is_pair(obj: object) -> bool:
    return (
        isinstance(obj, tuple)
        and len(obj) == 2
        and isinstance(obj[0], (str, re.Pattern))
        and isinstance(obj[1], str)
    )


def _rule(pattern: object, replacement: object, preset: str | None) -> Rule:
    if not isinstance(replacement, str):
        raise RenameError(
            f"rename rule {short_repr(pattern)}: the replacement must be a str, got "
            f"{type(replacement).__name__}"
        )
    if isinstance(pattern, re.Pattern):
        if not isinstance(pattern.pattern, str):
            raise RenameError(f"rename rule {short_repr(pattern)}: a bytes pattern; use a str")
        compiled = pattern
    elif isinstance(pattern, str):
        try:
            compiled = re.compile(pattern)
        except re.error as err:
            raise RenameError(
                f"rename rule {pattern!r} is not a regular expression: {err}"
            ) from None
    else:
        raise RenameError(
            f"rename rule {short_repr(pattern)}: the pattern must be a str (a regular "
            f"expression), got {type(pattern).__name__}"
        )
    try:  # a bad group reference in the replacement fails here, not half-way through
        compiled.sub(replacement, "")
    except (re.error, IndexError) as err:
        raise RenameError(
            f"rename rule {compiled.pattern!r}: bad replacement {replacement!r}: {err}"
        ) from None
    return Rule(compiled, replacement, preset)


def strip_prefix(prefix: str, /) -> dict[str, str]:
    r"""The rule that removes a leading prefix of whole segments from every fqn.

    A missing trailing dot is added: ``"module"`` strips ``module.`` (never
    ``modules.``). Does not modify its input.

    Args:
        prefix: The prefix, e.g. ``"module."`` or ``"model.backbone"``.

    Returns:
        ``{pattern: ""}``, for :func:`rename` or ``rename=``.

    Raises:
        RenameError: ``prefix`` is empty or not a str.

    Examples:
        >>> import dsdmerge as dm
        >>> dm.strip_prefix("module")
        {'^module\\.': ''}
        >>> dm.rename({"module.w": 1, "head": 2}, dm.strip_prefix("module."))
        {'w': 1, 'head': 2}
    """
    if not isinstance(prefix, str) or not prefix.strip("."):
        raise RenameError(f"strip_prefix needs a non-empty str prefix, got {short_repr(prefix)}")
    if not prefix.endswith("."):
        prefix += "."
    return {"^" + re.escape(prefix): ""}


# --------------------------------------------------------------------------------------
# the renamer


def _is_id(name: str) -> bool:
    """A param id's decimal spelling (``"0"``), which renames never touch."""
    return name.isdigit() and name.isascii()


class Renamer:
    """Applies compiled rules to fqns and remembers which rules matched something."""

    def __init__(self, rules: tuple[Rule, ...], *, fast: bool = True) -> None:
        self.rules = rules
        self.hit = [False] * len(rules)
        self.example: str | None = None
        self.fast = fast  # the fast paths for flat keys (see required_literal)

    def names(self, names: list[str]) -> list[str]:
        """``names`` renamed, element by element (unchanged ones are the same objects)."""
        if names and self.example is None:
            self.example = names[0]
        current = names
        for i, rule in enumerate(self.rules):
            try:
                new = list(map(rule.pattern.sub, repeat(rule.replacement), current))
            except (re.error, IndexError, TypeError) as err:
                raise RenameError(f"rename rule {rule}: {err}") from None
            if not self.hit[i] and (
                any(map(is_not, new, current)) or any(map(rule.pattern.search, current))
            ):
                self.hit[i] = True
            current = new
        return current

    def unmatched(self) -> list[Rule]:
        """The rules that matched no name given to :meth:`names`."""
        return [rule for rule, hit in zip(self.rules, self.hit, strict=True) if not hit]


def unmatched_text(rules: Sequence[Rule], example: str | None) -> str:
    """One line naming the rules that matched nothing."""
    shown = ", ".join(str(rule) for rule in rules)
    seen = f"; fqns look like {example!r}" if example is not None else "; it holds no fqns"
    return (
        f"{len(rules)} rename rule(s) matched no key: {shown}. Check them for a typo (a rule "
        f"is a regular expression over fqns, applied with re.sub){seen}."
    )


def renamed(
    state_dict: Mapping[Any, Any], rules: tuple[Rule, ...], /, *, fast: bool = True
) -> tuple[dict[Any, Any], list[Rule], str | None]:
    """``(renamed state dict, unmatched rules, an example fqn)``; see :func:`rename`.

    ``fast=False``: the general path only, never the fast paths for flat keys (they
    give the same result; tests compare the two).
    """
    require_mapping(state_dict, "the state dict")
    renamer = Renamer(rules, fast=fast)
    if not rules:
        return _copy(state_dict), [], None
    out = _rename(state_dict, renamer)
    return out, renamer.unmatched(), renamer.example


def rename_checkpoint(
    checkpoint: Mapping[Any, Any], rules: Rules, /
) -> tuple[dict[Any, Any], str | None]:
    """``(renamed checkpoint, a line naming the rules that matched nothing, or None)``.

    What ``rename=`` does to the checkpoint side of :func:`~dsdmerge.merge`,
    :func:`~dsdmerge.diff` and :func:`~dsdmerge.check` (which then warn or raise
    about the unmatched rules as their policy says). Does not modify its input.

    Raises:
        RenameError: A rule is not valid, or two keys would get the same name.
    """
    out, missed, example = renamed(checkpoint, compile_rules(rules))
    return out, (unmatched_text(missed, example) if missed else None)


def rename(
    state_dict: Mapping[Any, Any], rules: Rules, /, *, unmatched: Unmatched = "warn"
) -> dict[Any, Any]:
    r"""Rename parameters by rules, everywhere their fqns appear.

    Each rule is a regular expression and its replacement, applied to every fqn
    with :func:`re.sub` semantics; rules are chained (each applies to the
    output of the previous one, in order). Keys that are not fqns (``"step"``
    next to ``"model"``, int param ids) are left alone. The result has the
    input's layout; a metadata-only view comes back as a plain dict of its
    (renamed) metadata, and no tensor is read. Does not modify its input; the
    result is made of new containers and shares every leaf by identity (a
    ``param_names`` list is a new list of the new names).

    Args:
        state_dict: A model or optimizer state dict (flat, nested, fqn- or
            id-keyed), a whole checkpoint, or a metadata-only view.
        rules: ``{pattern: replacement}``, a preset name (:data:`RENAME_PRESETS`)
            or a sequence of those.
        unmatched: What to do about a rule that matches no fqn: ``"warn"`` (a
            :class:`~dsdmerge.DSDMergeWarning` naming it), ``"raise"`` (a
            :class:`~dsdmerge.MergeError`) or ``"ignore"``.

    Returns:
        A new state dict with every fqn renamed.

    Raises:
        RenameError: A rule is not valid, or two keys would get the same name
            (``err.keys`` names both, ``err.target`` the name).
        MergeError: A rule matched nothing and ``unmatched="raise"``.
        LayoutError: The state dict is malformed (see :func:`~dsdmerge.flatten`).
        StateDictTypeError: It is not a mapping.

    Examples:
        >>> import dsdmerge as dm
        >>> osd = {"state": {"module.w": {"step": 3}},
        ...        "param_groups": [{"lr": 0.1, "params": ["module.w"]}]}
        >>> dm.rename(osd, "ddp")
        {'state': {'w': {'step': 3}}, 'param_groups': [{'lr': 0.1, 'params': ['w']}]}
        >>> dm.rename({"state.l.0.wq.step": 1, "param_groups.l.0.wq.lr": 0.1},
        ...           {r"\.wq$": ".q_proj"})
        {'state.l.0.q_proj.step': 1, 'param_groups.l.0.q_proj.lr': 0.1}
    """
    if unmatched not in ("ignore", "warn", "raise"):
        raise RenameError(
            f"unmatched must be 'ignore', 'warn' or 'raise', got {short_repr(unmatched)}"
        )
    out, missed, example = renamed(state_dict, compile_rules(rules))
    if missed and unmatched != "ignore":
        text = unmatched_text(missed, example)
        if unmatched == "raise":
            raise MergeError(f"rename refused: {text}", problems=(text,))
        warnings.warn(DSDMergeWarning(f"dsdmerge: {text}"), stacklevel=2)
    return out


# --------------------------------------------------------------------------------------
# walking state dicts


def _copy(sd: Mapping[Any, Any]) -> dict[Any, Any]:
    out: dict[Any, Any] = copy_tree(sd, "")
    return out


def copy_tree(value: Any, where: str) -> Any:
    """New mappings (and optimizers' group lists), shared leaves; a cycle is a LayoutError."""
    if not isinstance(value, Mapping):
        return value
    on_path = {id(value)}
    stack: list[tuple[Mapping[Any, Any], Any]] = [(value, iter(value.values()))]
    while stack:
        node, children = stack[-1]
        for child in children:
            if isinstance(child, Mapping):
                if id(child) in on_path:
                    raise LayoutError(
                        f"cycle: a mapping under {where or 'the top'!r} contains itself"
                    )
                on_path.add(id(child))
                stack.append((child, iter(child.values())))
                break
        else:
            stack.pop()
            on_path.discard(id(node))
    return copy_acyclic(value)


def _rename(root: Mapping[Any, Any], renamer: Renamer) -> dict[Any, Any]:
    """Dispatch on the kind of mapping; walk containers with an explicit stack."""
    single = _rename_node(root, renamer, "")
    if single is not None:
        return single
    out: dict[Any, Any] = {}
    on_path = {id(root)}
    stack: list[tuple[Any, dict[Any, Any], str, Mapping[Any, Any]]] = [
        (iter(root.items()), out, "", root)
    ]
    while stack:
        items, dest, prefix, node = stack[-1]
        for k, v in items:
            if not isinstance(v, Mapping):
                dest[k] = v
                continue
            path = f"{prefix}{k}"
            if id(v) in on_path:
                raise LayoutError(f"cycle: the mapping at {path!r} contains itself")
            done = _rename_node(v, renamer, path)
            if done is not None:
                dest[k] = done
                continue
            child: dict[Any, Any] = {}
            dest[k] = child
            on_path.add(id(v))
            stack.append((iter(v.items()), child, path + ".", v))
            break
        else:
            stack.pop()
            on_path.discard(id(node))
    return out


def _rename_node(node: Mapping[Any, Any], renamer: Renamer, path: str) -> dict[Any, Any] | None:
    """An optimizer or a flat mapping, renamed; ``None`` for a container to walk into."""
    if is_optimizer_state_dict(node):
        return _rename_optimizer(node, renamer, path)
    types = set(map(type, node.values()))
    if any(issubclass(tp, Mapping) for tp in types):
        return None
    if not set(map(type, node)) <= {str}:  # leaves under non-str keys: not named by fqns
        return dict(node)
    return _rename_flat(node, renamer, path, has_lists=list in types)


def _rename_optimizer(osd: Mapping[Any, Any], renamer: Renamer, path: str) -> dict[Any, Any]:
    check_not_mixed(osd, path)
    where = f"{path}." if path else ""
    state, groups = osd[STATE], osd[PARAM_GROUPS]
    for i, group in enumerate(groups):
        if not isinstance(group, Mapping) or not isinstance(group.get(PARAMS), (list, tuple)):
            raise LayoutError(f"{where}{PARAM_GROUPS}[{i}] must be a mapping with a 'params' list")
    fqns: dict[str, None] = {}
    fqns.update((k, None) for k in state if type(k) is str and not _is_id(k))
    for group in groups:
        fqns.update((p, None) for p in group[PARAMS] if type(p) is str and not _is_id(p))
    old = list(fqns)
    new = renamer.names(old)
    mapping = {o: n for o, n in zip(old, new, strict=True) if o is not n}
    if len(set(new)) != len(new):
        _collision(old, new, where)
    new_state = {
        mapping.get(k, k) if type(k) is str else k: copy_tree(v, f"{where}{STATE}")
        for k, v in state.items()
    }
    new_groups = []
    for group in groups:
        g = dict(group)
        g[PARAMS] = [mapping.get(p, p) if type(p) is str else p for p in group[PARAMS]]
        names = g.get(PARAM_NAMES)
        if type(names) is list and _names_list(names):
            g[PARAM_NAMES] = renamer.names(list(names))
        new_groups.append(g)
    return {STATE: new_state, PARAM_GROUPS: new_groups}


def _names_list(value: object) -> bool:
    return type(value) is list and all(type(n) is str for n in value)


def _collision(old: Sequence[str], new: Sequence[str], where: str) -> None:
    seen: dict[str, str] = {}
    for o, n in zip(old, new, strict=True):
        first = seen.setdefault(n, o)
        if first is not o and first != o:
            a, b = sorted((first, o))
            raise RenameError(
                f"renaming would give {where}{a!r} and {where}{b!r} the same name "
                f"{where}{n!r}; a state dict holds one value per key. Make the rules more "
                "specific, or drop one of the two first.",
                keys=(where + a, where + b),
                target=where + n,
            )


# --------------------------------------------------------------------------------------
# flat state dicts


_OPT_PREFIXES = (STATE_PREFIX, PG_PREFIX)


def optimizer_prefixes(keys: list[str]) -> list[str]:
    """The prefixes of the optimizer sections of a flat dict, longest first.

    A section prefix ``P`` is empty or ends in a dot, and some key starts with
    ``P + "param_groups."``. Prefixes that lie inside another section's ``state.``
    keys (an fqn holding a ``param_groups`` segment) are not sections.

    Raises:
        LayoutError: Two sections at different depths (then where the fqns of the
            other keys start cannot be told).
    """
    found = list(map(methodcaller("find", PG_PREFIX), keys))
    prefixes: set[str] = set()
    for pos in set(found):
        if pos == 0:
            prefixes.add("")
        elif pos > 0:
            at = compress(keys, map(pos.__eq__, found))
            prefixes.update(
                p for p in dict.fromkeys(map(itemgetter(slice(0, pos)), at)) if p[-1] == "."
            )
    out = [
        p for p in prefixes if not any(p != q and p.startswith(q + STATE_PREFIX) for q in prefixes)
    ]
    depths = {p.count(".") for p in out}
    if len(depths) > 1:
        shown = ", ".join(repr(p) for p in sorted(out)[:4])
        raise LayoutError(
            f"this flat state dict has optimizer sections at different depths ({shown}), so "
            "where the fqns of its other keys start cannot be told; rename the nested state "
            "dict (or each part) instead."
        )
    return sorted(out, key=len, reverse=True)


class FlatKeys:
    """Where the fqn sits in each key of a flat state dict (see the module docstring).

    Optimizer keys are looked at through their *heads* (the key up to its last dot:
    ``param_groups.<fqn>``, ``state.<fqn>``), of which there are about two per
    parameter: every per-head step is a C-level pass over the distinct heads, and the
    per-key work is one split per key. Model keys are fqns after :attr:`depth`
    leading segments.
    """

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys
        self.opt_mask: bytes | None = None  # 1 per optimizer key; None: every key is one
        heads = list(map(itemgetter(0), map(methodcaller("rpartition", "."), keys)))
        distinct = list(dict.fromkeys(heads))
        sections = bytes(map(methodcaller("startswith", _OPT_PREFIXES), distinct))
        if (
            distinct
            and 0 not in sections
            and any(map(methodcaller("startswith", PG_PREFIX), distinct))
        ):
            self.prefixes = [""]  # an optimizer alone (the common case: no per-key test)
            self.opt_keys, self.heads = keys, heads
        else:
            self.prefixes = optimizer_prefixes(keys) if keys else []
            if self.prefixes:
                opt = tuple(p + s for p in self.prefixes for s in _OPT_PREFIXES)
                self.opt_mask = bytes(map(methodcaller("startswith", opt), keys))
                self.opt_keys = list(compress(keys, self.opt_mask))
                self.heads = list(compress(heads, self.opt_mask))
                distinct = list(dict.fromkeys(self.heads))
            else:
                self.opt_mask, self.opt_keys, self.heads, distinct = b"", [], [], []
        self.depth = self.prefixes[0].count(".") if self.prefixes else 0
        self._opt_starts = tuple(p + s for p in self.prefixes for s in _OPT_PREFIXES)
        # head -> what precedes its fqn (P + "state." or P + "param_groups."), its fqn, and
        # what follows the fqn inside the head (nested state names only)
        self.before: dict[str, str] = {}
        self.fqn: dict[str, str] = {}
        self.after: dict[str, str] = {}
        if distinct:
            self._classify_heads(distinct)

    def _classify_heads(self, remaining: list[str]) -> None:
        for p in self.prefixes:
            pg, st = p + PG_PREFIX, p + STATE_PREFIX
            is_pg = bytes(map(methodcaller("startswith", pg), remaining))
            pg_heads = list(compress(remaining, is_pg))  # (an fqn may be "", as in flatten)
            known = dict.fromkeys(map(itemgetter(slice(len(pg), None)), pg_heads))
            self.fqn.update(zip(pg_heads, known, strict=True))  # distinct heads, distinct fqns
            self.before.update(zip(pg_heads, repeat(pg)))
            is_st = bytes(map(methodcaller("startswith", st), remaining))
            st_heads = list(compress(remaining, is_st))
            rests = list(map(itemgetter(slice(len(st), None)), st_heads))
            found = bytes(map(known.__contains__, rests))
            self.fqn.update(zip(compress(st_heads, found), compress(rests, found)))  # noqa: B905
            self.before.update(zip(st_heads, repeat(st)))
            if 0 in found:  # nested state (Shampoo-like): split at the longest known fqn
                longest = max(map(len, known), default=0)
                for head, rest, ok in zip(st_heads, rests, found, strict=True):
                    if ok:
                        continue
                    parts = split_param_key(rest, known, longest)
                    if parts is None:
                        raise LayoutError(
                            f"{self._key_of(head)!r} names no parameter of the "
                            f"{p}param_groups.* keys, so where its fqn ends cannot be told; "
                            "rename the nested state dict instead."
                        )
                    self.fqn[head] = parts[0]
                    self.after[head] = "." + parts[1]
        if len(self.fqn) != len(remaining):
            head = next(h for h in remaining if h not in self.fqn)
            raise LayoutError(
                f"{self._key_of(head)!r} is not of the form '<prefix>state.<fqn>.<name>' or "
                "'<prefix>param_groups.<fqn>.<hyperparameter>'"
            )

    def _key_of(self, head: str) -> str:
        return self.opt_keys[self.heads.index(head)]

    def model_keys(self) -> list[str]:
        """The keys outside optimizer sections, in order."""
        if self.opt_mask is None:
            return []
        if not self.opt_mask:
            return self.keys
        return list(compress(self.keys, map((1).__xor__, self.opt_mask)))

    def split_model_key(self, key: str) -> tuple[str, str] | None:
        """``(container, fqn)`` for a key outside the optimizer sections; ``None``: no fqn."""
        if not self.depth:
            return "", key
        cut = -1
        for _ in range(self.depth):
            cut = key.find(".", cut + 1)
            if cut < 0:
                return None
        return (key[: cut + 1], key[cut + 1 :]) if cut + 1 < len(key) else None

    def split(self, key: str) -> tuple[str, str, str] | None:
        """``(before, fqn, after)`` with ``before + fqn + after == key``; ``None``: no fqn."""
        if self._opt_starts and key.startswith(self._opt_starts):
            head = key.rpartition(".")[0]
            fqn = self.fqn.get(head)
            if fqn is not None:
                return self.before[head], fqn, self.after.get(head, "") + key[len(head) :]
        found = self.split_model_key(key)
        if found is None:
            return None
        return found[0], found[1], ""

    def split_many(self, keys: list[str]) -> tuple[list[str], list[str], list[str], list[str]]:
        """:meth:`split` of many keys in C-level passes: ``(befores, fqns, afters, keys)``.

        Keys without an fqn are left out (of all four lists alike).
        """
        heads = list(map(itemgetter(0), map(methodcaller("rpartition", "."), keys)))
        fqns: list[str | None] = list(map(self.fqn.get, heads))
        befores: list[str | None] = list(map(self.before.get, heads))
        tails = map(getitem, keys, map(slice, map(len, heads), repeat(None)))
        afters: list[str | None] = list(map(add, map(self.after.get, heads, repeat("")), tails))
        if None in fqns:  # model keys, or keys of no known head: one by one
            for i in [i for i, f in enumerate(fqns) if f is None]:
                found = self.split_model_key(keys[i])
                if found is None:
                    continue
                befores[i], fqns[i], afters[i] = found[0], found[1], ""
            keep = bytes(f is not None for f in fqns)
            return (
                list(compress(befores, keep)),  # type: ignore[arg-type]
                list(compress(fqns, keep)),  # type: ignore[arg-type]
                list(compress(afters, keep)),  # type: ignore[arg-type]
                list(compress(keys, keep)),
            )
        return befores, fqns, afters, keys  # type: ignore[return-value]

    def fqns(self) -> list[str]:
        """Every distinct fqn, in order of first appearance (optimizer fqns first)."""
        out: dict[str, None] = dict.fromkeys(self.fqn.values())
        for key in self.model_keys():
            found = self.split_model_key(key)
            if found is not None:
                out[found[1]] = None
        return list(out)


def _rename_flat(
    flat: Mapping[str, Any], renamer: Renamer, path: str, *, has_lists: bool
) -> dict[str, Any]:
    keys = list(flat)
    fast = _fast_renamed_keys(keys, renamer) if renamer.fast else None
    if fast is not None:
        new_keys, prefixes = fast
    else:
        index = FlatKeys(keys)
        new_keys, prefixes = _renamed_keys(index, renamer), index.prefixes
    values: Iterable[Any] = flat.values()
    if prefixes and has_lists:  # param_names lists to rename
        values = _rename_param_names(keys, list(values), prefixes, renamer)
    out = dict(zip(new_keys, values, strict=True))
    if len(out) != len(keys):
        _collision(keys, new_keys, f"{path}." if path else "")
    return out


def _renamed_keys(index: FlatKeys, renamer: Renamer) -> list[str]:
    """The keys with their fqns renamed (the very list when nothing changes)."""
    keys = index.keys
    new_opt = _renamed_opt_keys(index, renamer)
    if index.opt_mask is None:
        return new_opt
    model = index.model_keys()
    new_model = _renamed_model_keys(index, model, renamer) if model else model
    if not index.opt_mask:
        return new_model
    if new_opt is index.opt_keys and new_model is model:
        return keys
    parts = (iter(new_model), iter(new_opt))
    return [next(parts[m]) for m in index.opt_mask]


def _renamed_opt_keys(index: FlatKeys, renamer: Renamer) -> list[str]:
    keys, heads = index.opt_keys, index.heads
    if not keys:
        return keys
    # every fqn once; an id-like fqn (the spelling of an int id) is left alone
    fqns = list(dict.fromkeys(index.fqn.values()))
    fqns = list(compress(fqns, map(not_id, fqns)))
    new = renamer.names(fqns)
    changed = bytes(map(is_not, new, fqns))
    if 1 not in changed:
        return keys
    mapping = dict(zip(compress(fqns, changed), compress(new, changed)))  # noqa: B905
    fqn_of = index.fqn
    hit = bytes(map(mapping.__contains__, fqn_of.values()))
    heads_hit = list(compress(fqn_of, hit))
    new_heads = map(
        add,
        map(index.before.__getitem__, heads_hit),
        map(mapping.__getitem__, compress(fqn_of.values(), hit)),
    )
    head_map = dict(zip(heads_hit, new_heads))  # noqa: B905
    for head, rest in index.after.items():  # nested state names inside the head
        if head in head_map:
            head_map[head] += rest
    if len(head_map) == len(fqn_of):  # every key changes
        return list(map(add, map(head_map.__getitem__, heads), map(str.removeprefix, keys, heads)))
    mask = bytes(map(head_map.__contains__, heads))
    changed_heads = list(compress(heads, mask))
    built = map(
        add,
        map(head_map.__getitem__, changed_heads),
        map(str.removeprefix, compress(keys, mask), changed_heads),
    )
    out = list(keys)  # the other keys stay the very objects (their hashes are known)
    for i, key in zip(compress(range(len(keys)), mask), built):  # noqa: B905
        out[i] = key
    return out


def not_id(name: str) -> bool:
    """Not the decimal spelling of a param id."""
    return not _is_id(name)


def _renamed_model_keys(index: FlatKeys, keys: list[str], renamer: Renamer) -> list[str]:
    if not index.depth:
        new = renamer.names(keys)
        return new if any(map(is_not, new, keys)) else keys
    splits = [index.split_model_key(k) for k in keys]
    at = [i for i, s in enumerate(splits) if s is not None]
    fqns = [splits[i][1] for i in at]  # type: ignore[index]
    new_fqns = renamer.names(fqns)
    out = list(keys)
    changed = False
    for i, fqn, name in zip(at, fqns, new_fqns, strict=True):
        if name is not fqn:
            out[i] = splits[i][0] + name  # type: ignore[index]
            changed = True
    return out if changed else keys


def _rename_param_names(
    keys: list[str], values: list[Any], prefixes: list[str], renamer: Renamer
) -> list[Any]:
    """New lists for ``param_groups.<fqn>.param_names`` values (one per original list)."""
    suffix = "." + PARAM_NAMES
    pg = tuple(p + PG_PREFIX for p in prefixes)
    done: dict[int, list[str]] = {}
    out = values
    for i, (key, value) in enumerate(zip(keys, values, strict=True)):
        if type(value) is list and key.endswith(suffix) and key.startswith(pg):
            if not _names_list(value):
                continue
            new = done.get(id(value))
            if new is None:
                new = done[id(value)] = renamer.names(list(value))
            if out is values:
                out = list(values)
            out[i] = new
    return out


# Fast paths for the two shapes almost every flat state dict has (an optimizer alone, DSD's
# flattened form, or a model alone) and the rules almost everybody writes (each a literal,
# perhaps anchored). They give exactly what the general path gives (tests compare them), in
# fewer passes over the keys: a rule that needs a literal only touches keys holding it, and
# a prefix every fqn has is replaced by one str.replace per key. Renamer(fast=False) takes
# the general path only.

_LEFT_ANCHORS = ("^", "(?<![^.])")
_RIGHT_ANCHORS = ("$", "(?![^.])")
_ESCAPED = re.compile(r"(?:\\[^0-9A-Za-z]|[^\\.^$*+?{}\[\]|()])*")


def required_literal(rule: Rule) -> tuple[str, str, str] | None:
    """``(left anchor, literal, right anchor)`` if the pattern is a literal between anchors.

    Every string the pattern matches then holds the literal; ``None`` for any other pattern.
    """
    text = rule.pattern.pattern
    if rule.pattern.flags & ~re.UNICODE:
        return None
    left = next((a for a in _LEFT_ANCHORS if text.startswith(a)), "")
    text = text[len(left) :]
    right = next((a for a in _RIGHT_ANCHORS if text.endswith(a) and text != a), "")
    if right == "$" and text.endswith("\\$"):
        right = ""
    text = text[: len(text) - len(right)]
    if _ESCAPED.fullmatch(text) is None:
        return None
    literal = re.sub(r"\\(.)", r"\1", text)
    return (left, literal, right) if literal else None


def _fast_renamed_keys(keys: list[str], renamer: Renamer) -> tuple[list[str], list[str]] | None:
    """``(new keys, optimizer prefixes)`` by a fast path, or ``None`` where none applies."""
    literals = [required_literal(rule) for rule in renamer.rules]
    if not keys or any(lit is None for lit in literals):
        return None
    first = literals[0] if len(literals) == 1 else None
    replacement = renamer.rules[0].replacement
    if first is not None and first[0] == "^" and not first[2] and "\\" not in replacement:
        done = _leading_literal(keys, first[1], replacement, renamer)
        if done is not None:
            return done
    starts = bytes(map(methodcaller("startswith", _OPT_PREFIXES), keys))
    if 0 not in starts and any(map(methodcaller("startswith", PG_PREFIX), keys)):
        kind = "optimizer"
    elif not any(map(methodcaller("__contains__", PG_PREFIX), keys)):
        kind = "model"  # no optimizer section anywhere: every key is an fqn
    else:
        return None
    _example(keys, kind, renamer)
    new_keys = _by_literals(keys, [lit[1] for lit in literals if lit], kind, renamer)
    return None if new_keys is None else (new_keys, [""] if kind == "optimizer" else [])


def _example(keys: list[str], kind: str, renamer: Renamer) -> None:
    """The fqn the general path would show in messages: the first key's, or the first group's."""
    if renamer.example is None:
        if kind == "model":
            renamer.example = keys[0]
        else:
            fqns = (k[len(PG_PREFIX) :].rpartition(".")[0] for k in keys if k.startswith(PG_PREFIX))
            renamer.example = next(filter(not_id, fqns), None)


def _leading_literal(
    keys: list[str], literal: str, replacement: str, renamer: Renamer
) -> tuple[list[str], list[str]] | None:
    """The DDP case: every fqn starts with one literal, replaced by a literal, key by key.

    A lone optimizer all of whose keys are ``<section><literal>...``: each key's first
    occurrence of the literal is right after its section, so one ``str.replace`` per key
    does it. ``None`` for anything else (or an fqn that is a dot-prefix of the literal,
    which the literal would reach past).
    """
    if literal[0].isdigit():  # it could match an int id's spelling, which is never renamed
        return None
    sections = tuple(s + literal for s in _OPT_PREFIXES)
    if any(s.find(literal) != len(s) - len(literal) for s in sections):
        return None  # the literal also occurs inside a section name
    if 0 in bytes(map(methodcaller("startswith", sections), keys)):
        return None
    if not any(map(methodcaller("startswith", PG_PREFIX), keys)):
        return None
    _example(keys, "optimizer", renamer)
    dots = [i for i, ch in enumerate(literal) if ch == "."]
    if dots:
        counts = list(map(methodcaller("count", "."), keys))
        for end in dots:
            fqn_key = PG_PREFIX + literal[: end + 1]  # "param_groups.<fqn>." then a name
            n = fqn_key.count(".")
            if any(
                keys[i].startswith(fqn_key)
                for i in compress(range(len(keys)), map(n.__eq__, counts))
            ):
                return None
    renamer.hit[0] = True
    return list(map(methodcaller("replace", literal, replacement, 1), keys)), [""]


def _by_literals(
    keys: list[str], literals: list[str], kind: str, renamer: Renamer
) -> list[str] | None:
    """Only the keys holding a rule's literal can change: parse and rename just those."""
    mask = bytes(map(methodcaller("__contains__", literals[0]), keys))
    for literal in literals[1:]:
        mask = bytes(map(or_, mask, map(methodcaller("__contains__", literal), keys)))
    if 1 not in mask:
        renamer.names([])
        return keys
    at = list(compress(range(len(keys)), mask))
    hit = [keys[i] for i in at]
    if kind == "model":
        new = renamer.names(hit)
    else:
        new_opt = _candidates_renamed(hit, renamer)
        if new_opt is None:
            return None
        new = new_opt
    out = list(keys)
    for i, key in zip(at, new, strict=True):
        out[i] = key
    return out


def _candidates_renamed(keys: list[str], renamer: Renamer) -> list[str] | None:
    """Optimizer keys that hold a literal, renamed; ``None`` to leave it to the general path.

    An fqn holding a literal has all its keys holding it, its param_groups key among them: so
    the fqns of these param_groups keys are every fqn a rule can match.
    """
    heads = [k.rpartition(".")[0] for k in keys]
    known = {h[len(PG_PREFIX) :]: None for h in heads if h.startswith(PG_PREFIX)}
    longest = max(map(len, known), default=0)
    parts: list[tuple[str, str, str]] = []
    for key, head in zip(keys, heads, strict=True):
        section = PG_PREFIX if head.startswith(PG_PREFIX) else STATE_PREFIX
        rest = key[len(section) :]
        if section == PG_PREFIX:
            fqn = head[len(PG_PREFIX) :]
        elif head[len(STATE_PREFIX) :] in known:
            fqn = head[len(STATE_PREFIX) :]
        else:
            found = split_param_key(rest, known, longest)
            if found is None:
                return None  # an fqn without the literal, or a malformed key: be exact
            fqn = found[0]
        parts.append((section, fqn, rest[len(fqn) :]))
    fqns = [f for f in dict.fromkeys(fqn for _, fqn, _ in parts) if not _is_id(f)]
    mapping = dict(zip(fqns, renamer.names(fqns), strict=True))
    return [section + mapping.get(fqn, fqn) + tail for section, fqn, tail in parts]


# --------------------------------------------------------------------------------------
# suggestions


_SAMPLE = 2048  # unexpected fqns that vote for candidate rules
_INDEXED = 50_000  # missing fqns indexed for one-segment changes
_TRIED = 12  # candidate rules validated, most votes first
_SEGMENTS = 32  # fqns with more segments take no part in suggestions (bounded work per fqn)
_WRAPPERS = {  # one dropped segment -> the preset that drops it
    "_orig_mod": "compile",
    "_checkpoint_wrapped_module": "checkpoint_wrapper",
    "_fsdp_wrapped_module": "fsdp1",
    "base_layer": "lora",
    "default": "lora_adapter_name",
}
_LEADING = {"module": "ddp", "base_model.model": "peft"}
_ADDED = {"base_model.model": "to_peft"}  # a leading run of segments added -> its preset
_INSERTED = {"default": "to_lora_adapter_name"}  # one segment inserted -> its preset


class _Side:
    """One side's differing keys split at their fqn, in bulk, and which fqns differ wholly.

    ``keys[i] == befores[i] + fqns[i] + afters[i]`` for every differing key that has an
    fqn; ``of_key`` gives each such key's ``(before, fqn, after)``; ``counts`` the
    differing keys per fqn, and ``whole`` the fqns all of whose keys differ (the only
    ones a rename can explain).
    """

    def __init__(self, flat: Mapping[str, Any], differing: Sequence[str]) -> None:
        self.flat = flat
        self.index = FlatKeys(list(flat))
        befores, fqns, afters, keys = self.index.split_many(list(differing))
        self.keys, self.befores, self.fqns, self.afters = keys, befores, fqns, afters
        self.counts: Counter[str] = Counter(fqns)
        self._of_key: dict[str, tuple[str, str, str]] | None = None
        totals: dict[str, int] = dict.fromkeys(self.counts, 0)
        if totals:
            fqn_of = self.index.fqn
            for head, n in Counter(self.index.heads).items():
                fqn = fqn_of.get(head)
                if fqn in totals:
                    totals[fqn] += n
            for key in self.index.model_keys():
                split = self.index.split_model_key(key)
                if split is not None and split[1] in totals:
                    totals[split[1]] += 1
        self.whole = [f for f, n in self.counts.items() if n == totals[f]]

    @property
    def of_key(self) -> dict[str, tuple[str, str, str]]:
        """``key -> (before, fqn, after)`` of each differing key (made on first use)."""
        if self._of_key is None:
            parts = zip(self.befores, self.fqns, self.afters, strict=True)
            self._of_key = dict(zip(self.keys, parts, strict=True))
        return self._of_key


def suggest_renames(
    checkpoint: Mapping[str, Any],
    reference: Mapping[str, Any],
    missing: Sequence[str],
    unexpected: Sequence[str],
) -> tuple[SuggestedRename, ...]:
    """Rename rules pairing unexpected keys with missing ones; see :class:`SuggestedRename`.

    ``checkpoint`` and ``reference`` are flat; ``missing`` and ``unexpected`` are
    keys of the reference and of the checkpoint.
    """
    if not missing or not unexpected:
        return ()
    c, r = _Side(checkpoint, unexpected), _Side(reference, missing)
    if not c.whole or not r.whole:
        return ()
    targets = set(r.whole)
    sources = set(c.whole)
    votes = _votes(c.whole, r.whole, targets)
    # each candidate change on its own: the first of its spellings that explains keys
    valid: list[tuple[float, int, Rule, dict[str, str]]] = []
    for candidate, n in votes.most_common(_TRIED):
        for rule in _rules_for(candidate):
            found = _explains([rule], c, r, sources, targets)
            if found is not None:
                valid.append((_likeness(candidate), n, rule, found))
                break
    # most alike names first (wq -> q_proj before wq -> k_proj), then most votes; a candidate
    # with a rival as good for one of its parameters is ambiguous: no guess
    valid.sort(key=lambda v: (-v[0], -v[1]))
    all_fqns: list[str] | None = None
    accepted: list[tuple[Rule, SuggestedRename]] = []
    explained: set[str] = set()
    taken: set[str] = set()
    for score, n, rule, found in valid:
        if found.keys() <= explained or taken & set(found.values()):
            continue
        if any(
            (s2, n2) == (score, n) and r2 is not rule and _rivals(found, f2)
            for s2, n2, r2, f2 in valid
        ):
            continue
        rules = [*(a for a, _ in accepted), rule]
        chained = _explains(rules, c, r, sources, targets) if accepted else found
        if chained is None:
            continue
        if all_fqns is None:
            all_fqns = c.index.fqns()
        if not _leaves_others_alone(rules, all_fqns, sources):
            continue
        new = {f: m for f, m in chained.items() if f not in explained}
        suggestion = SuggestedRename(
            rule.pattern.pattern,
            rule.replacement,
            len(new),
            sum(map(c.counts.__getitem__, new)),
            next(iter(new.items())),
            rule.preset,
        )
        accepted.append((rule, suggestion))
        explained.update(new)
        taken.update(new.values())
    return tuple(s for _, s in accepted)


def _votes(
    sources: list[str], targets: list[str], target_set: set[str]
) -> Counter[tuple[str, ...]]:
    """Candidate changes, with how many sampled unexpected fqns each would explain."""
    by_hole: dict[tuple[int, int, str, str], list[str]] = {}
    by_suffix: dict[str, list[str]] = {}
    by_inserted: dict[str, list[tuple[str, str]]] = {}  # fqn without one inner segment
    for m in targets[:_INDEXED]:
        segs = m.split(".", _SEGMENTS)
        if len(segs) > _SEGMENTS:
            continue
        for i in range(len(segs)):
            by_hole.setdefault(
                (len(segs), i, ".".join(segs[:i]), ".".join(segs[i + 1 :])), []
            ).append(segs[i])
        for i in range(1, len(segs) - 1):
            by_inserted.setdefault(".".join(segs[:i] + segs[i + 1 :]), []).append(
                (segs[i], segs[i - 1])
            )
        for i in range(1, len(segs)):
            by_suffix.setdefault(".".join(segs[i:]), []).append(".".join(segs[:i]))
    step = max(1, len(sources) // _SAMPLE)
    votes: Counter[tuple[str, ...]] = Counter()
    for u in sources[::step][:_SAMPLE]:
        segs = u.split(".", _SEGMENTS)
        if len(segs) > _SEGMENTS:
            continue
        n = len(segs)
        for i in range(n):
            for new in by_hole.get((n, i, ".".join(segs[:i]), ".".join(segs[i + 1 :])), ())[:4]:
                votes["sub", segs[i], new, segs[i - 1] if i else ""] += 1
        for k in range(1, n):
            if ".".join(segs[k:]) in target_set:
                votes["strip", ".".join(segs[:k])] += 1
        for a in range(1, n - 1):
            for b in range(a + 1, n):
                if ".".join(segs[:a] + segs[b:]) in target_set:
                    votes["drop", ".".join(segs[a:b])] += 1
        for prefix in by_suffix.get(u, ())[:4]:
            votes["add", prefix] += 1
        for segment, after in by_inserted.get(u, ())[:4]:
            votes["insert", segment, after] += 1
    return votes


def _likeness(candidate: tuple[str, ...]) -> float:
    """How alike the old and new names of a one-segment change are (1.0 for other changes)."""
    if candidate[0] != "sub":
        return 1.0
    return difflib.SequenceMatcher(None, candidate[1], candidate[2]).ratio()


def _rivals(a: Mapping[str, str], b: Mapping[str, str]) -> bool:
    """Two renames that disagree: one old name to two new ones, or two old names to one."""
    if a == b:
        return False
    return any(a[k] != b[k] for k in a.keys() & b.keys()) or bool(
        {v for k, v in a.items() if k not in b} & {v for k, v in b.items() if k not in a}
    )


def _rules_for(candidate: tuple[str, ...]) -> list[Rule]:
    """Rules for a candidate change, most readable first (validation picks one)."""
    kind = candidate[0]
    if kind == "sub":
        old, left = re.escape(candidate[1]), re.escape(candidate[3])
        new, lft = _template(candidate[2]), _template(candidate[3])
        if lft:
            texts = [
                (rf"\.{left}\.{old}\.", f".{lft}.{new}."),
                (rf"(?<![^.]){left}\.{old}(?![^.])", f"{lft}.{new}"),
            ]
        else:
            texts = [(rf"^{old}\.", f"{new}."), (rf"^{old}(?![^.])", new)]
        return [Rule(re.compile(p), rep) for p, rep in texts]
    if kind == "strip":
        preset = _LEADING.get(candidate[1]) or (
            _WRAPPERS.get(candidate[1]) if candidate[1] in ("_orig_mod",) else None
        )
        if preset is not None:
            return [_preset_rule(preset)]
        return [Rule(re.compile("^" + re.escape(candidate[1] + ".")), "")]
    if kind == "drop":
        preset = _WRAPPERS.get(candidate[1])
        if preset is not None:
            return [_preset_rule(preset)]
        run = re.escape(candidate[1])
        return [Rule(re.compile(rf"\.{run}\."), "."), Rule(re.compile(rf"(?<![^.]){run}\."), "")]
    if kind == "insert":  # one segment more, after the segment ``after``
        preset = _INSERTED.get(candidate[1])
        if preset is not None:
            return [_preset_rule(preset)]
        after, new = re.escape(candidate[2]), _template(candidate[1])
        return [
            Rule(re.compile(rf"(?<![^.])({after})\.(?!{re.escape(candidate[1])}\.)"), rf"\1.{new}.")
        ]
    preset = _ADDED.get(candidate[1])  # "add"
    if preset is not None:
        return [_preset_rule(preset)]
    return [Rule(re.compile("^"), _template(candidate[1]) + ".")]


def _template(text: str) -> str:
    """``text`` as a re.sub replacement that stands for itself."""
    return text.replace("\\", "\\\\")


def _preset_rule(name: str) -> Rule:
    [(pattern, replacement)] = RENAME_PRESETS[name].items()
    return Rule(re.compile(pattern), replacement, name)


def _explains(
    rules: list[Rule], c: _Side, r: _Side, sources: set[str], targets: set[str]
) -> dict[str, str] | None:
    """The renames of unexpected fqns if every one lands exactly on missing keys; else None.

    Every key of a renamed fqn, spelled with the new fqn, must be a missing key split
    the same way (same text before and after the fqn) with the same shape and dtype.
    Linear in the differing keys: one set lookup per renamed fqn, the keys respelled
    and looked up in C-level passes, then one comparison of their metadata in bulk.
    """
    olds = list(c.counts)
    news = Renamer(tuple(rules)).names(olds)
    found: dict[str, str] = {}
    landed: set[str] = set()  # found's values, as a set: one lookup per fqn
    for old, new in zip(olds, news, strict=True):
        if new == old:
            continue
        if old not in sources or new not in targets or new in landed:
            return None
        found[old] = new
        landed.add(new)
    if not found:
        return None
    at = bytes(map(found.__contains__, c.fqns))
    befores, afters = list(compress(c.befores, at)), list(compress(c.afters, at))
    new_fqns = list(map(found.__getitem__, compress(c.fqns, at)))
    spelled = list(map(add, map(add, befores, new_fqns), afters))
    wanted = list(zip(befores, new_fqns, afters, strict=True))
    if list(map(r.of_key.get, spelled)) != wanted:
        return None
    values = list(map(c.flat.__getitem__, compress(c.keys, at)))
    return found if _same_metas(values, list(map(r.flat.__getitem__, spelled))) else None


def _leaves_others_alone(rules: list[Rule], fqns: list[str], sources: set[str]) -> bool:
    """No fqn with a matched key is renamed (a rename must not break what already loads)."""
    news = Renamer(tuple(rules)).names(fqns)
    return all(old in sources for old, new in zip(fqns, news, strict=True) if new != old)


def _same_metas(a: list[Any], b: list[Any]) -> bool:
    """Whether ``a[i]`` and ``b[i]`` agree for every ``i`` as :func:`_same_meta` says.

    Lists of plain tensors and common leaves (the usual case) are compared in C-level
    passes: the same kinds of values at the same places, then the tensors' shapes and
    dtypes as two list comparisons.
    """
    codes_a, codes_b = leaf_codes(a), leaf_codes(b)
    if codes_a is None or codes_b is None:
        return all(map(_same_meta, a, b))
    if codes_a != codes_b:
        return False
    tensors_a, tensors_b = list(compress(a, codes_a)), list(compress(b, codes_b))
    return list(map(_SHAPE, tensors_a)) == list(map(_SHAPE, tensors_b)) and list(
        map(_DTYPE, tensors_a)
    ) == list(map(_DTYPE, tensors_b))


_SHAPE, _DTYPE = attrgetter("shape"), attrgetter("dtype")


def _same_meta(a: Any, b: Any) -> bool:
    a_tensor, b_tensor = is_tensor_like(type(a)), is_tensor_like(type(b))
    if a_tensor != b_tensor:
        return False
    if not a_tensor:
        return True  # hyperparameters and other values: their values may differ
    try:
        return shape_dtype(a) == shape_dtype(b)
    except Exception:  # a tensor-looking value without a usable shape  # noqa: BLE001
        return False
