"""What diff and merge compute, the specification every fast path must equal (used by tests).

:func:`outcome` gives, for valid inputs, exactly the
:class:`~dsdmerge._records.Outcome` that :func:`dsdmerge._engine.run` gives (the
property tests in ``tests/test_semantics.py`` check that on the strategies of
:mod:`dsdmerge.strategies`), written key by key and parameter by parameter, with
no batching, no C-level passes, no shortcuts. It is slow on purpose. Refusals of
malformed input (cycles, bad key types, mixed layouts) are the engine's; this
module assumes well-formed state dicts.

Flat state dicts (``checkpoint`` and ``reference`` both flat, or a flat checkpoint
over a nested reference, which is flattened first):

1. *missing* keys are the reference's keys the checkpoint lacks, in the
   reference's order; *unexpected* keys the checkpoint's keys the reference lacks,
   in the checkpoint's order.
2. A key both sides have whose two values are tensor-like, distinct objects and
   differ in shape or dtype is *mismatched* (in the reference's order).
3. The merged dict is the checkpoint's items in its order (unexpected ones only
   when kept), then each missing key with the reference's value; but a missing key
   whose reference tensor is the very tensor of a key the checkpoint has (tied
   weights: :func:`dsdmerge._tensors.same_view`, neither key a flattened
   optimizer's) takes that key's checkpoint value, and is *tied* to it.
4. Then the param-group rules of :mod:`dsdmerge._groups`, per flattened
   optimizer: the top level and each prefix ``P`` of a key ``P + "param_groups." +
   ...`` that is missing or (when merging or looking for conflicts) that the
   checkpoint has, each only when it is an optimizer's section of the reference
   (:func:`dsdmerge.layout.is_optimizer_section`: some hyperparameter, not only
   tensors, and inside no other section). Per group (given when the reference was
   nested, at the top level; else inferred) and hyperparameter, in the group's key
   order: when its members' checkpoint values agree, a missing
   ``param_groups.<fqn>.<hp>`` key takes that value; when they disagree (looked at
   only when merging or looking for conflicts), :func:`dsdmerge._groups.settle_all`
   picks the group's value, the missing keys and the members
   :meth:`~dsdmerge._groups.Settled.rewritten` take it, and one conflict line
   (:func:`dsdmerge._groups.disagreement`) reports the group.

Nested state dicts (both nested): the reference drives a recursive walk
(:func:`_tree`): a key only the reference has is backfilled (its flat keys
missing), a leaf both have is the checkpoint's (tensors checked), a pair of flat
sub-dicts is merged as above under its path, an optimizer state dict merges its
per-parameter state entry by entry and its param groups by
:func:`dsdmerge._groups.merge_groups`; a second walk, driven by the checkpoint,
finds the unexpected keys and keeps them.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache, partial
from typing import Any

from dsdmerge._groups import (
    DISAGREE,
    NESTED_PG,
    disagreement,
    group_value,
    merge_groups,
    settle_all,
)
from dsdmerge._records import Mismatch, Outcome, Slot, TensorMeta
from dsdmerge._tensors import differs, same_view
from dsdmerge._trees import copy_tree, flat_keys, flatten
from dsdmerge._values import MISSING, freeze, is_tensor_like, key_str
from dsdmerge.errors import LayoutError
from dsdmerge.layout import (
    PARAM_GROUPS,
    PARAMS,
    PG_PREFIX,
    STATE,
    STATE_PREFIX,
    Layout,
    classify,
    holds_hyperparameters,
    in_section,
    is_optimizer_section,
    is_optimizer_state_dict,
    section_prefixes,
)

__all__ = ["outcome"]


def outcome(
    checkpoint: Mapping[Any, Any],
    reference: Mapping[Any, Any],
    *,
    merge: bool,
    keep_unexpected: bool = True,
    conflicts: bool = False,
) -> Outcome:
    """The :class:`~dsdmerge._records.Outcome` :func:`dsdmerge._engine.run` must give.

    Does not modify its inputs.
    """
    c_nested = classify(checkpoint) is Layout.NESTED
    r_nested = classify(reference) is Layout.NESTED
    if c_nested and r_nested:
        walk = _Walk(keep_unexpected, conflicts)
        merged = walk.merge(checkpoint, reference)
        return Outcome(
            merged if merge else None,
            walk.missing,
            walk.unexpected,
            walk.mismatches,
            walk.conflicts,
            walk.problems,
            walk.slots,
            walk.ties,
        )
    if c_nested and merge:
        raise LayoutError("the checkpoint is nested but the reference is flat")
    groups = None
    if r_nested and is_optimizer_state_dict(reference):
        groups = [[key_str(pid, "") for pid in g[PARAMS]] for g in reference[PARAM_GROUPS]]
    return flat(
        flatten(checkpoint),
        flatten(reference),
        merge=merge,
        keep_unexpected=keep_unexpected,
        conflicts=conflicts,
        groups=groups,
    )


def _tensor_pair(cv: Any, rv: Any) -> bool:
    return is_tensor_like(type(cv)) and is_tensor_like(type(rv))


def _mismatch(key: str, cv: Any, rv: Any) -> Mismatch:
    return Mismatch(key, TensorMeta.of(cv), TensorMeta.of(rv))


# --------------------------------------------------------------------------------------
# flat


def flat(
    c: Mapping[str, Any],
    r: Mapping[str, Any],
    *,
    merge: bool,
    keep_unexpected: bool = True,
    conflicts: bool = False,
    groups: list[list[str]] | None = None,
    key_prefix: str = "",
) -> Outcome:
    """Two flat state dicts, key by key (rules 1 to 4 of the module docstring)."""
    missing = [k for k in r if k not in c]
    unexpected = [k for k in c if k not in r]
    mismatches = []
    for k, rv in r.items():
        if k in c and c[k] is not rv and _tensor_pair(c[k], rv) and differs(c[k], rv):
            mismatches.append(_mismatch(k, c[k], rv))
    merged = None
    if merge:
        merged = {k: v for k, v in c.items() if keep_unexpected or k in r}
        for k in missing:
            merged[k] = r[k]
    out = Outcome(merged, missing, unexpected, mismatches)
    if merged is not None:
        for m in mismatches:
            out.take_reference[m.key] = Slot(partial(merged.__setitem__, m.key), c[m.key], r[m.key])
    # rule 3b: a missing key whose reference tensor is the very tensor (same_view) of a key the
    # checkpoint has, the first in reference order, takes that key's value (neither of them a
    # flattened optimizer's key). Whether a prefix holds hyperparameters is asked once per
    # prefix (a scan of r each time made this cubic in the keys).
    holds = cache(partial(holds_hyperparameters, r))
    for k in missing:
        if in_section(r, k, holds):
            continue
        for k2, v2 in r.items():
            if k2 in c and not in_section(r, k2, holds) and same_view(r[k], v2):
                put = _nowhere if merged is None else partial(merged.__setitem__, k)
                if merged is not None:
                    merged[k] = merged[k2]
                out.ties.append((k, k2, put))
                break
    # rule 4: the top level's param groups (given when the reference was nested), then each
    # flattened optimizer under a prefix (inferred), in order of first appearance
    look = merge or conflicts
    candidates: dict[str, None] = {}
    for k in missing:
        if NESTED_PG in k:
            candidates.update(dict.fromkeys(section_prefixes(k)))
    if look:
        for k in c:
            if NESTED_PG in k:
                candidates.update(dict.fromkeys(section_prefixes(k)))
    candidates.pop("", None)
    sections: list[tuple[str, list[list[str]] | None]] = []
    if is_optimizer_section(r, ""):
        sections.append(("", groups))
    sections += [(p, None) for p in candidates if is_optimizer_section(r, p)]
    for prefix, given in sections:
        n = len(prefix)
        head = prefix + PG_PREFIX
        sub_c = {k[n:]: v for k, v in c.items() if k.startswith(head)}
        sub_r = {k[n:]: v for k, v in r.items() if k.startswith(head)}
        values, conflict_lines = _param_groups(sub_c, sub_r, given, look=look)
        if merged is not None:
            merged.update((prefix + k, v) for k, v in values.items())
        where = f"{prefix[:-1]!r}: " if prefix else ""
        if conflicts:
            out.conflicts += [where + line for line in conflict_lines]
    if key_prefix:  # a flat sub-dict of a nested walk names its keys by its path
        out.missing = [key_prefix + k for k in out.missing]
        out.unexpected = [key_prefix + k for k in out.unexpected]
        out.mismatches = [
            Mismatch(key_prefix + m.key, m.checkpoint, m.reference) for m in out.mismatches
        ]
        out.take_reference = {key_prefix + k: s for k, s in out.take_reference.items()}
        out.ties = [(key_prefix + k, key_prefix + k2, put) for k, k2, put in out.ties]
    return out


def _param_groups(
    c: Mapping[str, Any],
    r: Mapping[str, Any],
    given: list[list[str]] | None,
    *,
    look: bool,
) -> tuple[dict[str, Any], list[str]]:
    """``(values to write, conflict lines)`` for one optimizer's ``param_groups.*`` keys.

    The groups are ``given`` or else the parameters whose reference hyperparameters
    are all equal. For each group and hyperparameter (in the order the group's keys
    name them), the members' checkpoint values: a member the checkpoint lacks a value
    for takes the value they all hold (none: the reference's stays); when they
    disagree (only looked at with ``look``: a merge or a search for conflicts), the
    group is settled by :func:`dsdmerge._groups.settle` and each member lacking a
    value, or moved in (:meth:`~dsdmerge._groups.Settled.rewritten`), takes its value.
    """
    rows: dict[str, dict[str, str]] = {}  # fqn -> {hyperparameter: key}, in key order
    for key in r:
        fqn, dot, name = key[len(PG_PREFIX) :].rpartition(".")
        if dot and fqn:
            rows.setdefault(fqn, {})[name] = key
    if given is None:
        by_signature: dict[Any, list[str]] = {}
        for fqn, keys in rows.items():
            signature = tuple((name, freeze(r[key])) for name, key in keys.items())
            by_signature.setdefault(signature, []).append(fqn)
        groups = list(by_signature.values())
    else:
        groups = [[m for m in members if m in rows] for members in given]
    inferred = given is None
    # each group's members' values per hyperparameter, in member order (MISSING: none)
    held: dict[tuple[int, str], list[Any]] = {}
    for index, members in enumerate(groups):
        for member in members:
            for name in rows[member]:
                held.setdefault((index, name), [])
        for name in [n for (i, n) in held if i == index]:
            held[index, name] = [
                c.get(rows[m][name], MISSING) if name in rows[m] else MISSING for m in members
            ]
    agreed = {place: group_value(values) for place, values in held.items()}
    names = [[n for (i, n) in held if i == index] for index in range(len(groups))]
    fillable = {
        (index, name): [
            at
            for at, m in enumerate(groups[index])
            if held[index, name][at] is MISSING and name in rows[m]
        ]
        for (index, name) in held
    }
    settled_all = settle_all(held, agreed, names, fillable, inferred=inferred) if look else {}
    values: dict[str, Any] = {}
    lines: list[str] = []
    for (index, name), value in agreed.items():
        members = groups[index]
        vals = held[index, name]
        lacking = [at for at, v in enumerate(vals) if v is MISSING and name in rows[members[at]]]
        if value is MISSING:
            continue
        if value is not DISAGREE:
            for at in lacking:
                values[rows[members[at]][name]] = value
            continue
        if not look:  # (a comparison that looks for nothing)
            continue
        settled, final = settled_all[index, name]
        for at in lacking + settled.rewritten(inferred=inferred):
            values[rows[members[at]][name]] = final[at]
        lines.append(
            disagreement(
                f"{index} (inferred)" if inferred else str(index),
                name,
                members,
                settled,
                inferred=inferred,
                backfilled=[members[at] for at in lacking],
            )
        )
    return values, lines


def _nowhere(value: Any) -> None:
    """Where a tied value of a comparison that builds nothing goes."""


# --------------------------------------------------------------------------------------
# nested


def _flat_pair(c: Mapping[Any, Any], r: Mapping[Any, Any]) -> bool:
    """Both sides flat, with str keys: a model or a flattened optimizer inside a nested dict."""
    return all(
        all(type(k) is str and not isinstance(v, Mapping) for k, v in side.items())
        for side in (c, r)
    )


class _Walk:
    """The nested walk, plainly: recursion, one key at a time."""

    def __init__(self, keep: bool, conflicts: bool) -> None:
        self.keep = keep
        self.want_conflicts = conflicts
        self.missing: list[str] = []
        self.unexpected: list[str] = []
        self.mismatches: list[Mismatch] = []
        self.conflicts: list[str] = []
        self.problems: list[str] = []
        self.slots: dict[str, Slot] = {}
        self.ties: list[tuple[str, str, Any]] = []
        self.flat_unexpected: dict[int, list[str]] = {}  # id of a flat sub-dict -> its keys

    def merge(self, c: Mapping[Any, Any], r: Mapping[Any, Any]) -> dict[Any, Any]:
        if is_optimizer_state_dict(r):
            out = self._optimizer(c, r, "")
            self._optimizer_unexpected(c, r, out, "")
        else:
            out = self._tree(c, r, "", in_state=False)
            self._tree_unexpected(c, r, out, "", in_state=False)
        return out

    def _leaf(self, dest: dict[Any, Any], k: Any, cv: Any, rv: Any, key: str) -> None:
        dest[k] = cv
        if cv is not rv and _tensor_pair(cv, rv) and differs(cv, rv):
            self.mismatches.append(_mismatch(key, cv, rv))
            self.slots[key] = Slot(partial(dest.__setitem__, k), cv, rv)

    def _tree(
        self, c: Mapping[Any, Any], r: Mapping[Any, Any], prefix: str, *, in_state: bool
    ) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        for k, rv in r.items():
            key = prefix + key_str(k, prefix[:-1])
            if k not in c:
                self.missing += flat_keys(rv, key, in_optimizer=in_state)
                out[k] = copy_tree(rv, in_optimizer=in_state)
            elif not isinstance(rv, Mapping):
                self._leaf(out, k, c[k], rv, key)
            elif not in_state and is_optimizer_state_dict(rv):
                out[k] = self._optimizer(c[k], rv, key + ".")
            elif not in_state and _flat_pair(c[k], rv):
                out[k] = self._flat(c[k], rv, key)
            else:
                out[k] = self._tree(c[k], rv, key + ".", in_state=in_state)
        return out

    def _flat(self, c: Mapping[str, Any], r: Mapping[str, Any], key: str) -> dict[str, Any]:
        sub = flat(
            c,
            r,
            merge=True,
            keep_unexpected=self.keep,
            conflicts=self.want_conflicts,
            key_prefix=key + ".",
        )
        self.missing += sub.missing
        self.mismatches += sub.mismatches
        self.slots.update(sub.take_reference)
        self.ties += sub.ties
        self.conflicts += [f"{key!r}: {line}" for line in sub.conflicts]
        self.problems += [f"{key!r}: {line}" for line in sub.problems]
        self.flat_unexpected[id(c)] = sub.unexpected
        assert sub.merged is not None
        return sub.merged

    def _tree_unexpected(
        self,
        c: Mapping[Any, Any],
        r: Mapping[Any, Any],
        out: dict[Any, Any],
        prefix: str,
        *,
        in_state: bool,
    ) -> None:
        for k, cv in c.items():
            key = prefix + key_str(k, prefix[:-1])
            if k not in r:
                self.unexpected += flat_keys(cv, key, in_optimizer=in_state)
                if self.keep:
                    out[k] = copy_tree(cv, in_optimizer=in_state)
            elif not isinstance(cv, Mapping):
                continue
            elif not in_state and is_optimizer_state_dict(cv):
                self._optimizer_unexpected(cv, r[k], out[k], key + ".")
            elif not in_state and id(cv) in self.flat_unexpected:
                self.unexpected += self.flat_unexpected[id(cv)]
            else:
                self._tree_unexpected(cv, r[k], out[k], key + ".", in_state=in_state)

    def _optimizer(self, c: Mapping[Any, Any], r: Mapping[Any, Any], prefix: str) -> dict[Any, Any]:
        c_state, r_state = c[STATE], r[STATE]
        state: dict[Any, Any] = {}
        for pid, r_entry in r_state.items():
            key = prefix + STATE_PREFIX + key_str(pid, prefix + STATE)
            c_entry = c_state.get(pid, MISSING)
            if c_entry is MISSING:  # no state in the checkpoint: the reference's
                self.missing += flat_keys(r_entry, key, in_optimizer=True)
                state[pid] = copy_tree(r_entry, in_optimizer=True)
            elif not isinstance(r_entry, Mapping):  # an optimizer-level entry: a leaf
                self._leaf(state, pid, c_entry, r_entry, key)
            elif type(c_entry) is dict and c_entry.keys() == r_entry.keys():
                state[pid] = self._entry(c_entry, r_entry, key)
            else:
                state[pid] = self._tree(c_entry, r_entry, key + ".", in_state=True)
        groups, _ = merge_groups(
            c, r, prefix, self._groups_outcome(), keep=self.keep, conflicts=self.want_conflicts
        )
        extra_c = {k: v for k, v in c.items() if k not in (STATE, PARAM_GROUPS)}
        extra_r = {k: v for k, v in r.items() if k not in (STATE, PARAM_GROUPS)}
        return {
            STATE: state,
            PARAM_GROUPS: groups,
            **self._tree(extra_c, extra_r, prefix, in_state=True),
        }

    def _groups_outcome(self) -> Outcome:
        """The outcome :func:`merge_groups` writes its findings into: this walk's lists."""
        out = Outcome(None, self.missing, self.unexpected, self.mismatches)
        out.conflicts, out.problems = self.conflicts, self.problems
        return out

    def _entry(
        self, c_entry: dict[Any, Any], r_entry: Mapping[Any, Any], key: str
    ) -> dict[Any, Any]:
        """One parameter's state with the same names on both sides: in the checkpoint's order."""
        if any(isinstance(v, Mapping) for v in (*c_entry.values(), *r_entry.values())):
            return self._tree(c_entry, r_entry, key + ".", in_state=True)  # nested state
        fields: dict[Any, Any] = {}
        for name, cv in c_entry.items():
            self._leaf(fields, name, cv, r_entry[name], f"{key}.{name}")
        return fields

    def _optimizer_unexpected(
        self, c: Mapping[Any, Any], r: Mapping[Any, Any], out: dict[Any, Any], prefix: str
    ) -> None:
        c_state, r_state, state = c[STATE], r[STATE], out[STATE]
        for pid, c_entry in c_state.items():
            key = prefix + STATE_PREFIX + key_str(pid, prefix + STATE)
            if pid not in r_state:
                self.unexpected += flat_keys(c_entry, key, in_optimizer=True)
                if self.keep:
                    state[pid] = copy_tree(c_entry, in_optimizer=True)
            elif isinstance(c_entry, Mapping):
                self._tree_unexpected(c_entry, r_state[pid], state[pid], key + ".", in_state=True)
        r_names = {  # each reference member's hyperparameter names
            pid: {name for name in g if name != PARAMS}
            for g in r[PARAM_GROUPS]
            for pid in g[PARAMS]
        }
        for i, g in enumerate(c[PARAM_GROUPS]):
            for pid in g[PARAMS]:
                s = key_str(pid, f"{prefix}{PARAM_GROUPS}[{i}]")
                self.unexpected += [
                    f"{prefix}{PG_PREFIX}{s}.{name}"
                    for name in g
                    if name != PARAMS and name not in r_names.get(pid, ())
                ]
        extra_c = {k: v for k, v in c.items() if k not in (STATE, PARAM_GROUPS)}
        extra_r = {k: v for k, v in r.items() if k not in (STATE, PARAM_GROUPS)}
        self._tree_unexpected(extra_c, extra_r, out, prefix, in_state=True)
