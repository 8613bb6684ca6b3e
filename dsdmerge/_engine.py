"""The one pass behind :func:`~dsdmerge.diff` and :func:`~dsdmerge.merge`.

:func:`run` compares a checkpoint with a reference and, when asked, builds the
merged state dict in the checkpoint's layout, in one walk:

* flat pairs: C-level key-set operations, a type scan, and shape/dtype checks on
  the tensor pairs only; ``{**reference, **checkpoint}`` for the result, then
  group-consistent values for backfilled ``param_groups.*`` keys;
* nested pairs: per parameter and per state field (never per flat key), with
  new containers and shared leaves.

Policy decisions are made by :mod:`dsdmerge.merge` on what this returns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from itertools import compress
from typing import Any

import torch

from dsdmerge._values import MISSING, freeze, key_str, same_value, short_repr, tensor_types
from dsdmerge.diff import Mismatch, TensorMeta
from dsdmerge.errors import LayoutError, StateDictTypeError
from dsdmerge.flatten import _flatten_into, _group_items, flatten, require_flat
from dsdmerge.layout import (
    PARAM_GROUPS,
    PARAMS,
    PG_PREFIX,
    STATE,
    STATE_PREFIX,
    Layout,
    check_not_mixed,
    classify,
    is_optimizer_state_dict,
    require_mapping,
)

__all__: list[str] = []


@dataclasses.dataclass
class Outcome:
    """What one pass found (and built)."""

    merged: dict[Any, Any] | None
    missing: list[str]
    unexpected: list[str]
    mismatches: list[Mismatch]
    conflicts: list[str] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)
    # mismatch key -> how to put the reference's value in its place in ``merged``
    take_reference: dict[str, Callable[[], None]] = dataclasses.field(default_factory=dict)


def run(
    checkpoint: Mapping[Any, Any],
    reference: Mapping[Any, Any],
    *,
    merge: bool,
    keep_unexpected: bool = True,
    conflicts: bool = False,
) -> Outcome:
    """Compare (and merge) ``checkpoint`` over ``reference``; see the module docstring."""
    require_mapping(checkpoint, "checkpoint")
    require_mapping(reference, "reference")
    c_layout = classify(checkpoint)
    r_layout = classify(reference)
    if c_layout is Layout.NESTED and r_layout is Layout.NESTED:
        return _Nested(merge=merge, keep_unexpected=keep_unexpected, conflicts=conflicts).run(
            checkpoint, reference
        )
    if c_layout is Layout.NESTED:
        if merge:
            raise LayoutError(
                "the checkpoint is nested but the reference is flat, so the merged result "
                "(in the checkpoint's layout) has no structure for the reference's keys. Pass "
                "the reference nested, or merge dsdmerge.flatten(checkpoint) instead."
            )
        checkpoint = flatten(checkpoint)
    groups = None
    if r_layout is Layout.NESTED:
        if is_optimizer_state_dict(reference):
            groups = [
                [key_str(pid, f"{PARAM_GROUPS}[{i}]") for pid in g[PARAMS]]
                for i, g in enumerate(reference[PARAM_GROUPS])
                if isinstance(g, Mapping) and isinstance(g.get(PARAMS), (list, tuple))
            ]
        reference = flatten(reference)
    require_flat(checkpoint, "checkpoint")
    require_flat(reference, "reference")
    return _flat(
        checkpoint,
        reference,
        merge=merge,
        keep_unexpected=keep_unexpected,
        conflicts=conflicts,
        groups=groups,
    )


# --------------------------------------------------------------------------------------
# leaves


def _meta(value: Any, key: str) -> TensorMeta:
    try:
        return TensorMeta.of(value)
    except StateDictTypeError as err:  # a value that only looks tensor-like: name its key
        raise StateDictTypeError(f"{key!r}: {err}") from None


def _differs(c: Any, r: Any) -> bool:
    """Whether two tensor-like values differ in shape or dtype."""
    try:
        return bool(c.shape != r.shape or c.dtype != r.dtype)
    except Exception:  # e.g. a NumPy dtype compared with a torch dtype  # noqa: BLE001
        return True


def _torch_types(types: frozenset[type]) -> bool:
    return all(issubclass(tp, torch.Tensor) for tp in types)


# --------------------------------------------------------------------------------------
# flat


def _flat(
    c: Mapping[str, Any],
    r: Mapping[str, Any],
    *,
    merge: bool,
    keep_unexpected: bool,
    conflicts: bool,
    groups: list[list[str]] | None,
) -> Outcome:
    if len(c) == len(r) and c.keys() == r.keys():
        missing: list[str] = []
        unexpected: list[str] = []
    else:
        gone = r.keys() - c.keys()
        missing = list(filter(gone.__contains__, r)) if gone else []
        extra = c.keys() - r.keys()
        unexpected = list(filter(extra.__contains__, c)) if extra else []
    mismatches = _flat_mismatches(c, r)
    merged: dict[str, Any] | None = None
    if merge:
        merged = {**r, **c}
        if unexpected and not keep_unexpected:
            for key in unexpected:
                del merged[key]
    outcome = Outcome(merged, missing, unexpected, mismatches)
    if merged is not None:
        target = merged

        def taker(key: str) -> Callable[[], None]:
            return lambda: target.__setitem__(key, r[key])

        outcome.take_reference = {m.key: taker(m.key) for m in mismatches}
    backfilled = [k for k in missing if k.startswith(PG_PREFIX)] if merge else []
    if backfilled or (conflicts and any(k.startswith(PG_PREFIX) for k in c)):
        _group_hyperparameters(c, r, groups, backfilled, outcome, conflicts=conflicts)
    return outcome


def _flat_mismatches(c: Mapping[str, Any], r: Mapping[str, Any]) -> list[Mismatch]:
    r_types = tensor_types(r.values())
    if not r_types:
        return []
    c_types = tensor_types(c.values())
    if not c_types:
        return []
    fast = _torch_types(r_types) and _torch_types(c_types)
    out: list[Mismatch] = []
    get = c.get
    for key, rv in compress(r.items(), map(r_types.__contains__, map(type, r.values()))):
        cv = get(key, MISSING)
        if cv is rv or type(cv) not in c_types:
            continue
        if (cv.shape != rv.shape or cv.dtype != rv.dtype) if fast else _differs(cv, rv):
            out.append(Mismatch(key, _meta(cv, key), _meta(rv, key)))
    return out


def _parse_groups(flat: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``param_groups.<fqn>.<hp>`` keys -> ``{fqn: {hp: value}}`` in key order."""
    hyper: dict[str, dict[str, Any]] = {}
    n = len(PG_PREFIX)
    for key, value in flat.items():
        if key.startswith(PG_PREFIX):
            fqn, dot, name = key[n:].rpartition(".")
            if dot and fqn:
                hyper.setdefault(fqn, {})[name] = value
    return hyper


def _group_hyperparameters(
    c: Mapping[str, Any],
    r: Mapping[str, Any],
    groups: list[list[str]] | None,
    backfilled: list[str],
    outcome: Outcome,
    *,
    conflicts: bool,
) -> None:
    """Give backfilled ``param_groups.*`` keys their group's checkpoint value; find conflicts.

    A group is the reference's (when it was nested) or else the parameters whose
    reference hyperparameters are all equal. A backfilled key takes the value of
    the first member of its group (in reference order) that the checkpoint has,
    and the reference's value only when no member has one.
    """
    r_hyper = _parse_groups(r)
    inferred = " (inferred)" if groups is None else ""
    if groups is None:
        by_signature: dict[Any, list[str]] = {}
        for fqn, values in r_hyper.items():
            signature = tuple((name, freeze(v)) for name, v in values.items())
            by_signature.setdefault(signature, []).append(fqn)
        groups = list(by_signature.values())
    group_of = {fqn: index for index, members in enumerate(groups) for fqn in members}
    merged = outcome.merged
    n = len(PG_PREFIX)
    found: dict[tuple[int, str], Any] = {}  # (group, hyperparameter) -> checkpoint value
    for key in backfilled:
        fqn, _, name = key[n:].rpartition(".")
        index = group_of.get(fqn)
        if index is None or merged is None:
            continue
        value = found.get((index, name), found)
        if value is found:  # first backfilled key of this group and name: scan the group once
            for member in groups[index]:
                value = c.get(f"{PG_PREFIX}{member}.{name}", MISSING)
                if value is not MISSING:
                    break
            found[index, name] = value
        if value is not MISSING:
            merged[key] = value
    if not conflicts:
        return
    for index, members in enumerate(groups):
        seen: dict[str, tuple[str, Any]] = {}
        reported: set[str] = set()
        for member in members:
            for name in r_hyper.get(member, {}):
                value = c.get(f"{PG_PREFIX}{member}.{name}", MISSING)
                if value is MISSING or name in reported:
                    continue
                first = seen.get(name)
                if first is None:
                    seen[name] = (member, value)
                elif not same_value(first[1], value):
                    reported.add(name)
                    outcome.conflicts.append(
                        f"param group {index}{inferred}: checkpoint members disagree on "
                        f"{name!r}: {first[0]} has {short_repr(first[1])}, {member} has "
                        f"{short_repr(value)}; "
                        "torch keeps the first member's value for the whole group"
                    )


# --------------------------------------------------------------------------------------
# nested


def _flat_keys(value: Any, key: str) -> list[str]:
    """The flat keys a nested value at ``key`` spells (one key for a leaf)."""
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        _flatten_into(out, value, key + ".")
        return list(out)
    return [key]


def copy_tree(value: Any) -> Any:
    """New containers (mappings, optimizers' param_groups and params lists), shared leaves.

    A ``param_groups`` list is a container only in an optimizer state dict; elsewhere
    it is a leaf like any list, and shared.
    """
    if not isinstance(value, Mapping):
        return value
    root: dict[Any, Any] = {}
    stack: list[tuple[Any, dict[Any, Any], bool]] = [
        (iter(value.items()), root, is_optimizer_state_dict(value))
    ]
    while stack:
        items, dest, optimizer = stack[-1]
        for k, v in items:
            if isinstance(v, Mapping):
                child: dict[Any, Any] = {}
                dest[k] = child
                stack.append((iter(v.items()), child, is_optimizer_state_dict(v)))
                break
            if optimizer and k == PARAM_GROUPS:
                dest[k] = [_copy_group(g) for g in v]
            else:
                dest[k] = v
        else:
            stack.pop()
    return root


def _copy_group(group: Any) -> Any:
    if not isinstance(group, Mapping):
        return group
    out = dict(group)
    if isinstance(out.get(PARAMS), (list, tuple)):
        out[PARAMS] = list(out[PARAMS])
    return out


class _Nested:
    """Merge two nested state dicts: the reference drives the walk, the checkpoint wins."""

    def __init__(self, *, merge: bool, keep_unexpected: bool, conflicts: bool) -> None:
        self.merge = merge
        self.keep = keep_unexpected
        self.want_conflicts = conflicts
        self.outcome = Outcome({}, [], [], [])
        self.any_unexpected = False
        self.types: dict[type, bool] = {}

    def run(self, c: Mapping[Any, Any], r: Mapping[Any, Any]) -> Outcome:
        if is_optimizer_state_dict(c) != is_optimizer_state_dict(r):
            raise _optimizer_vs_tree("")
        optimizer = is_optimizer_state_dict(c)
        merged = self._optimizer(c, r, "") if optimizer else self._tree(c, r, "")
        if self.any_unexpected:
            if optimizer:
                self._optimizer_unexpected(c, r, merged, "")
            else:
                self._tree_unexpected(c, r, merged, "")
        self.outcome.merged = merged if self.merge else None
        return self.outcome

    # -- leaves --------------------------------------------------------------------

    def _is_tensor(self, tp: type) -> bool:
        known = self.types.get(tp)
        if known is None:
            known = self.types[tp] = hasattr(tp, "shape") and hasattr(tp, "dtype")
        return known

    def _leaf(self, dest: dict[Any, Any], k: Any, cv: Any, rv: Any, key: str) -> None:
        dest[k] = cv
        if cv is rv or not self._is_tensor(type(cv)) or not self._is_tensor(type(rv)):
            return
        if _differs(cv, rv):
            self.outcome.mismatches.append(Mismatch(key, _meta(cv, key), _meta(rv, key)))
            self.outcome.take_reference[key] = lambda: dest.__setitem__(k, rv)

    def _backfill(self, dest: dict[Any, Any], k: Any, rv: Any, key: str) -> None:
        self.outcome.missing.extend(_flat_keys(rv, key))  # first: it refuses cycles
        dest[k] = copy_tree(rv)

    # -- generic mappings ------------------------------------------------------------

    def _tree(
        self, c: Mapping[Any, Any], r: Mapping[Any, Any], prefix: str, *, in_state: bool = False
    ) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        on_path = {id(c), id(r)}
        stack: list[tuple[Mapping[Any, Any], Mapping[Any, Any], dict[Any, Any], str, Any]] = [
            (c, r, out, prefix, iter(r.items()))
        ]
        while stack:
            cn, rn, dest, pfx, items = stack[-1]
            for k, rv in items:
                key = pfx + (k if type(k) is str else key_str(k, pfx[:-1]))
                cv = cn.get(k, MISSING)
                if cv is MISSING:
                    self._backfill(dest, k, rv, key)
                    continue
                c_map, r_map = isinstance(cv, Mapping), isinstance(rv, Mapping)
                if not c_map and not r_map:
                    self._leaf(dest, k, cv, rv, key)
                    continue
                if c_map != r_map:
                    raise LayoutError(
                        f"{key!r} is a {'mapping' if c_map else 'leaf'} in the checkpoint but a "
                        f"{'mapping' if r_map else 'leaf'} in the reference; the two state dicts "
                        "have different structures there."
                    )
                if id(cv) in on_path or id(rv) in on_path:
                    raise LayoutError(f"cycle: the mapping at {key!r} contains itself")
                if not in_state and (is_optimizer_state_dict(cv) or is_optimizer_state_dict(rv)):
                    if not (is_optimizer_state_dict(cv) and is_optimizer_state_dict(rv)):
                        raise _optimizer_vs_tree(key)
                    dest[k] = self._optimizer(cv, rv, key + ".")
                    continue
                child: dict[Any, Any] = {}
                dest[k] = child
                on_path.update((id(cv), id(rv)))
                stack.append((cv, rv, child, key + ".", iter(rv.items())))
                break
            else:
                stack.pop()
                on_path.discard(id(cn))
                on_path.discard(id(rn))
                if len(cn) > len(rn) or any(k not in rn for k in cn):
                    self.any_unexpected = True
        return out

    def _tree_unexpected(
        self,
        c: Mapping[Any, Any],
        r: Mapping[Any, Any],
        out: dict[Any, Any],
        prefix: str,
        *,
        in_state: bool = False,
    ) -> None:
        """Second, checkpoint-driven walk: unexpected keys in checkpoint order."""
        stack: list[tuple[Mapping[Any, Any], dict[Any, Any], str, Any]] = [
            (r, out, prefix, iter(c.items()))
        ]
        while stack:
            rn, dest, pfx, items = stack[-1]
            for k, cv in items:
                key = pfx + (k if type(k) is str else key_str(k, pfx[:-1]))
                rv = rn.get(k, MISSING)
                if rv is MISSING:
                    self.outcome.unexpected.extend(_flat_keys(cv, key))
                    if self.keep:
                        dest[k] = copy_tree(cv)
                    continue
                if not isinstance(cv, Mapping):
                    continue
                if not in_state and is_optimizer_state_dict(cv):
                    self._optimizer_unexpected(cv, rv, dest[k], key + ".")
                    continue
                stack.append((rv, dest[k], key + ".", iter(cv.items())))
                break
            else:
                stack.pop()

    # -- optimizers ------------------------------------------------------------------

    def _optimizer(self, c: Mapping[Any, Any], r: Mapping[Any, Any], prefix: str) -> dict[Any, Any]:
        check_not_mixed(c, prefix[:-1])
        check_not_mixed(r, prefix[:-1])
        c_state, r_state = c[STATE], r[STATE]
        _check_id_kinds(c, r, prefix)
        state: dict[Any, Any] = {}
        state_prefix = prefix + STATE_PREFIX
        for pid, r_entry in r_state.items():
            key = state_prefix + key_str(pid, prefix + STATE)
            c_entry = c_state.get(pid, MISSING)
            if not isinstance(r_entry, Mapping) or not (
                c_entry is MISSING or isinstance(c_entry, Mapping)
            ):
                raise LayoutError(f"{key!r}: optimizer state of a parameter must be a mapping")
            if c_entry is MISSING:
                self._backfill(state, pid, r_entry, key)
            elif type(c_entry) is dict and c_entry.keys() == r_entry.keys():
                state[pid] = self._entry(c_entry, r_entry, key)
            else:
                state[pid] = self._tree(c_entry, r_entry, key + ".", in_state=True)
        if len(c_state) > len(r_state) or any(pid not in r_state for pid in c_state):
            self.any_unexpected = True
        groups = self._groups(c, r, prefix)
        return {STATE: state, PARAM_GROUPS: groups}

    def _entry(
        self, c_entry: dict[Any, Any], r_entry: Mapping[Any, Any], key: str
    ) -> dict[Any, Any]:
        """One parameter's state when both sides have the same state names (the common case)."""
        fields: dict[Any, Any] = {}
        mark = len(self.outcome.mismatches)
        for name, cv in c_entry.items():
            rv = r_entry[name]
            if isinstance(cv, Mapping) or isinstance(rv, Mapping):  # nested state: the general walk
                for m in self.outcome.mismatches[mark:]:
                    del self.outcome.take_reference[m.key]
                del self.outcome.mismatches[mark:]
                return self._tree(c_entry, r_entry, key + ".", in_state=True)
            self._leaf(fields, name, cv, rv, f"{key}.{name}")
        return fields

    def _groups(
        self, c: Mapping[Any, Any], r: Mapping[Any, Any], prefix: str
    ) -> list[dict[str, Any]]:
        """Merge param groups: hyperparameters from the checkpoint, membership from the reference.

        A reference group takes the checkpoint group holding its first member that
        the checkpoint has; new members join it (so they get the checkpoint's
        scheduled hyperparameters), hyperparameters the checkpoint group lacks
        come from the reference group, and a reference group with no member in
        the checkpoint is taken whole from the reference.
        """
        where = prefix + PARAM_GROUPS
        c_groups = [
            (g, _group_items(g, f"{where}[{i}] (checkpoint)"))
            for i, g in enumerate(c[PARAM_GROUPS])
        ]
        r_groups = [
            (g, _group_items(g, f"{where}[{i}] (reference)")) for i, g in enumerate(r[PARAM_GROUPS])
        ]
        self._check_positional(c_groups, r_groups, c, r, where)
        try:
            c_index = {pid: i for i, (g, _) in enumerate(c_groups) for pid in g[PARAMS]}
            r_index = {pid: i for i, (g, _) in enumerate(r_groups) for pid in g[PARAMS]}
        except TypeError:  # an unhashable param id: name it
            for side, sides_groups in (("checkpoint", c_groups), ("reference", r_groups)):
                for i, (g, _) in enumerate(sides_groups):
                    for pid in g[PARAMS]:
                        key_str(pid, f"{where}[{i}] ({side})")
            raise StateDictTypeError(f"{where}: a param id is unhashable") from None
        c_names = [{name for name, _ in items} for _, items in c_groups]
        r_names = [{name for name, _ in items} for _, items in r_groups]
        group_prefix = prefix + PG_PREFIX
        missing = self.outcome.missing
        out: list[dict[str, Any]] = []
        matched: set[int] = set()
        empty_c_groups = iter([i for i, (g, _) in enumerate(c_groups) if not g[PARAMS]])
        for ri, (rg, r_items) in enumerate(r_groups):
            params = rg[PARAMS]
            spelled = [key_str(pid, f"{where}[{ri}]") for pid in params]
            ci = next((c_index[pid] for pid in params if pid in c_index), None)
            if ci is None and not params:  # an empty group: the checkpoint's next empty one
                ci = next(empty_c_groups, None)
            if ci is None:
                for s in spelled:
                    missing.extend(f"{group_prefix}{s}.{name}" for name, _ in r_items)
                out.append(_copy_group(rg))
                continue
            matched.add(ci)
            cg, c_items = c_groups[ci]
            group = dict(c_items)
            for name, value in r_items:
                group.setdefault(name, value)
            members = list(params)
            if self.keep:
                members.extend(pid for pid in cg[PARAMS] if pid not in r_index)
            group[PARAMS] = members
            out.append(group)
            lacking = [name for name, _ in r_items if name not in c_names[ci]]
            for pid, s in zip(params, spelled, strict=True):
                own = c_index.get(pid)
                if own == ci:
                    names = lacking
                else:
                    have = c_names[own] if own is not None else ()
                    names = [name for name, _ in r_items if name not in have]
                    if own is not None and self.want_conflicts:
                        self.outcome.conflicts.append(
                            f"{where}: {s} is in checkpoint group {own} but the reference puts it "
                            f"with members of checkpoint group {ci}, whose hyperparameters it takes"
                        )
                missing.extend(f"{group_prefix}{s}.{name}" for name in names)
        if len(matched) < len(c_groups):
            self.any_unexpected = True
            if self.keep:
                out.extend(_copy_group(g) for i, (g, _) in enumerate(c_groups) if i not in matched)
        for ci, (cg, _) in enumerate(c_groups):
            for ri in {r_index.get(pid, -1) for pid in cg[PARAMS]}:
                if ri < 0 or not c_names[ci] <= r_names[ri]:
                    self.any_unexpected = True
        return out

    def _check_positional(
        self,
        c_groups: list[tuple[Any, Any]],
        r_groups: list[tuple[Any, Any]],
        c: Mapping[Any, Any],
        r: Mapping[Any, Any],
        where: str,
    ) -> None:
        """Int-keyed optimizers map params by position: group sizes must agree, as torch demands."""
        ids = [pid for g, _ in c_groups + r_groups for pid in g[PARAMS]]
        ids.extend(c[STATE])
        ids.extend(r[STATE])
        if not ids or not all(type(pid) is int for pid in ids):
            return
        if len(c_groups) != len(r_groups):
            self.outcome.problems.append(
                f"{where}: the checkpoint has {len(c_groups)} param group(s) but the reference has "
                f"{len(r_groups)}; Optimizer.load_state_dict maps int-keyed state by position and "
                "rejects this. Save fqn-keyed state (get_optimizer_state_dict) to merge across "
                "model changes."
            )
            return
        for i, ((cg, _), (rg, _)) in enumerate(zip(c_groups, r_groups, strict=True)):
            if len(cg[PARAMS]) != len(rg[PARAMS]):
                self.outcome.problems.append(
                    f"{where}[{i}]: {len(cg[PARAMS])} params in the checkpoint but "
                    f"{len(rg[PARAMS])} in the reference; Optimizer.load_state_dict maps int-keyed "
                    "state by position and rejects a group whose size changed. Save fqn-keyed "
                    "state (get_optimizer_state_dict) to merge across model changes."
                )

    def _optimizer_unexpected(
        self, c: Mapping[Any, Any], r: Mapping[Any, Any], out: dict[Any, Any], prefix: str
    ) -> None:
        c_state, r_state = c[STATE], r[STATE]
        state = out[STATE]
        state_prefix = prefix + STATE_PREFIX
        for pid, c_entry in c_state.items():
            key = state_prefix + key_str(pid, prefix + STATE)
            r_entry = r_state.get(pid, MISSING)
            if not isinstance(c_entry, Mapping):
                raise LayoutError(f"{key!r}: optimizer state of a parameter must be a mapping")
            if r_entry is MISSING:
                self.outcome.unexpected.extend(_flat_keys(c_entry, key))
                if self.keep:
                    state[pid] = copy_tree(c_entry)
            elif not (
                type(c_entry) is dict
                and c_entry.keys() == r_entry.keys()
                and not any(isinstance(v, Mapping) for v in c_entry.values())
            ):  # only flat entries with the same names have nothing unexpected (see _entry)
                self._tree_unexpected(c_entry, r_entry, state[pid], key + ".", in_state=True)
        where = prefix + PARAM_GROUPS
        r_names: dict[Any, set[str]] = {}
        for g in r[PARAM_GROUPS]:
            r_group_names = {name for name in g if name != PARAMS}
            for pid in g[PARAMS]:
                r_names[pid] = r_group_names
        group_prefix = prefix + PG_PREFIX
        unexpected = self.outcome.unexpected
        for i, g in enumerate(c[PARAM_GROUPS]):
            names = [name for name in g if name != PARAMS]
            for pid in g[PARAMS]:
                have = r_names.get(pid)
                if have is not None and have.issuperset(names):
                    continue
                s = key_str(pid, f"{where}[{i}]")
                unexpected.extend(
                    f"{group_prefix}{s}.{name}"
                    for name in names
                    if have is None or name not in have
                )


def _id_kind(osd: Mapping[Any, Any]) -> type | None:
    """``int`` or ``str`` when every param id of an optimizer state dict has that type."""
    ids = list(osd[STATE])
    for group in osd[PARAM_GROUPS]:
        if isinstance(group, Mapping) and isinstance(group.get(PARAMS), (list, tuple)):
            ids.extend(group[PARAMS][:1])
    kinds = {type(pid) for pid in ids}
    return kinds.pop() if len(kinds) == 1 else None


def _check_id_kinds(c: Mapping[Any, Any], r: Mapping[Any, Any], prefix: str) -> None:
    c_kind, r_kind = _id_kind(c), _id_kind(r)
    if {c_kind, r_kind} == {int, str}:
        where = f" at {prefix[:-1]!r}" if prefix else ""
        raise LayoutError(
            f"the checkpoint optimizer{where} is keyed by {c_kind.__name__ if c_kind else ''} "
            f"param ids and the reference by {r_kind.__name__ if r_kind else ''} ids: one came "
            "from optimizer.state_dict() (int ids), the other from get_optimizer_state_dict "
            "(fqns). Produce both the same way."
        )


def _optimizer_vs_tree(key: str) -> LayoutError:
    where = f"at {key!r}" if key else "at the top level"
    return LayoutError(
        f"{where} one side is a nested optimizer state dict ('state' + 'param_groups') and the "
        "other is not. If one is flattened (flatten_optimizer_state_dict=True), convert the other "
        "with dsdmerge.flatten() so both have the same layout."
    )
