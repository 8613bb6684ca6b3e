"""Nested state dicts compared (and merged) parameter by parameter.

What it computes (the plain definition is :mod:`dsdmerge._spec`): the same
missing, unexpected and mismatched flat keys as the flat pass over the two
state dicts flattened, and a merged state dict with the *reference's* structure:

* a mapping key both sides have is merged recursively; one only the reference has
  is backfilled (a copy of its containers, its leaves shared); one only the
  checkpoint has is kept (unless dropped) and reported unexpected;
* a leaf both sides have is the checkpoint's (a tensor pair is checked for shape
  and dtype; :mod:`dsdmerge._tensors`);
* an optimizer state dict merges its per-parameter ``state`` like a mapping of
  mappings (a parameter the checkpoint has no state for gets the reference's), its
  ``param_groups`` by the group rules of :func:`dsdmerge._groups.merge_groups`
  (membership from the reference, hyperparameters from each group's home
  checkpoint group), optimizer-level ``state`` entries and keys beside ``state`` and
  ``param_groups`` like leaves and mappings;
* a pair of flat sub-dicts (a model, a flattened optimizer) goes through the flat
  pass (:mod:`dsdmerge._flat_pass`), re-keyed under its path.

Unexpected keys are found by a second, checkpoint-driven walk, only where the
first walk saw the checkpoint holding more than the reference.

How: explicit stacks (no recursion limit); per-parameter state in C-level passes
over all parameters in the common case (plain dict entries with the same state
names in the same order): copies with ``map(dict.copy, ...)``, all value pairs
checked together and reported in walk order; other parameters one by one.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping
from functools import partial
from itertools import accumulate, chain, compress, count, islice, repeat
from operator import and_, is_, itemgetter, not_
from typing import Any

from dsdmerge._flat_pass import run_flat
from dsdmerge._groups import merge_groups
from dsdmerge._records import Mismatch, Outcome, Slot
from dsdmerge._tensors import differs, meta, mismatched
from dsdmerge._trees import copy_tree, flat_keys
from dsdmerge._values import MISSING, is_tensor_like, key_str
from dsdmerge.errors import LayoutError
from dsdmerge.layout import (
    PARAM_GROUPS,
    PARAMS,
    PG_PREFIX,
    STATE,
    STATE_PREFIX,
    Layout,
    check_not_mixed,
    is_optimizer_state_dict,
    layout_of,
    lists_param,
    value_types,
)

__all__ = ["NestedMerge", "optimizer_vs_tree"]


class NestedMerge:
    """Compare (and merge) two nested state dicts: the reference drives the walk.

    One instance per call (it collects the :class:`~dsdmerge._records.Outcome`).
    See the module docstring for what it computes.
    """

    def __init__(self, *, merge: bool, keep_unexpected: bool, conflicts: bool) -> None:
        self.merge = merge
        self.keep = keep_unexpected
        self.want_conflicts = conflicts
        self.outcome = Outcome({}, [], [], [])
        self.any_unexpected = False
        self.types: dict[type, bool] = {}
        # id of a checkpoint sub-dict merged by the flat pass -> its unexpected keys
        self.flat_unexpected: dict[int, list[str]] = {}
        # the optimizer state dicts whose state is being merged (for optimizer-level entries)
        self.c_osd: Mapping[Any, Any] = {}
        self.r_osd: Mapping[Any, Any] = {}

    def run(self, c: Mapping[Any, Any], r: Mapping[Any, Any]) -> Outcome:
        if is_optimizer_state_dict(c) != is_optimizer_state_dict(r):
            raise optimizer_vs_tree("")
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
            known = self.types[tp] = is_tensor_like(tp)
        return known

    def _leaf(self, dest: dict[Any, Any], k: Any, cv: Any, rv: Any, key: str) -> None:
        dest[k] = cv
        if cv is rv or not self._is_tensor(type(cv)) or not self._is_tensor(type(rv)):
            return
        if differs(cv, rv):
            self.outcome.mismatches.append(Mismatch(key, meta(cv, key), meta(rv, key)))
            self.outcome.take_reference[key] = Slot(partial(dest.__setitem__, k), cv, rv)

    def _backfill(
        self, dest: dict[Any, Any], k: Any, rv: Any, key: str, *, in_optimizer: bool = False
    ) -> None:
        self.outcome.missing.extend(flat_keys(rv, key, in_optimizer=in_optimizer))  # first:
        dest[k] = copy_tree(rv, in_optimizer=in_optimizer)  # _flat_keys refuses cycles

    # -- generic mappings ------------------------------------------------------------

    def _tree(
        self, c: Mapping[Any, Any], r: Mapping[Any, Any], prefix: str, *, in_state: bool = False
    ) -> dict[Any, Any]:
        """Merge two mappings, the reference's keys first.

        ``in_state``: inside an optimizer (a parameter's state, the optimizer's own keys),
        where, as :func:`flatten` sees it, there is no optimizer state dict and no flat
        sub-dict to look for.
        """
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
                    self._backfill(dest, k, rv, key, in_optimizer=in_state)
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
                        raise optimizer_vs_tree(key)
                    dest[k] = self._optimizer(cv, rv, key + ".")
                    continue
                if not in_state and _flat_pair(cv, rv):
                    dest[k] = self._flat(cv, rv, key)
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

    def _flat(self, c: Mapping[str, Any], r: Mapping[str, Any], key: str) -> dict[str, Any]:
        """A pair of flat sub-dicts (a model, a flattened optimizer): the flat pass, re-keyed.

        So a flattened optimizer inside a whole checkpoint gets group-consistent
        hyperparameter backfill, exactly as it would on its own.
        """
        prefix = key + "."
        sub = run_flat(
            c,
            r,
            merge=True,
            keep_unexpected=self.keep,
            conflicts=self.want_conflicts,
            key_prefix=prefix,
        )
        outcome = self.outcome
        outcome.missing.extend(prefix + k for k in sub.missing)
        for m in sub.mismatches:
            outcome.mismatches.append(Mismatch(prefix + m.key, m.checkpoint, m.reference))
            outcome.take_reference[prefix + m.key] = sub.take_reference[m.key]
        outcome.conflicts.extend(f"{key!r}: {line}" for line in sub.conflicts)
        outcome.problems.extend(f"{key!r}: {line}" for line in sub.problems)
        outcome.ties.extend((prefix + k, prefix + s, put) for k, s, put in sub.ties)
        self.flat_unexpected[id(c)] = [prefix + k for k in sub.unexpected]
        if sub.unexpected:
            self.any_unexpected = True
        assert sub.merged is not None
        return sub.merged

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
                    self.outcome.unexpected.extend(flat_keys(cv, key, in_optimizer=in_state))
                    if self.keep:
                        dest[k] = copy_tree(cv, in_optimizer=in_state)
                    continue
                if not isinstance(cv, Mapping):
                    continue
                if not in_state and is_optimizer_state_dict(cv):
                    self._optimizer_unexpected(cv, rv, dest[k], key + ".")
                    continue
                flat_unexpected = None if in_state else self.flat_unexpected.get(id(cv))
                if flat_unexpected is not None:  # merged by the flat pass, which found these
                    self.outcome.unexpected.extend(flat_unexpected)
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
        self.c_osd, self.r_osd = c, r
        state: dict[Any, Any] = {}
        if not _id_types_ok(r_state) or not self._fast_state(c_state, r_state, state, prefix):
            self._state(c_state, r_state, state, prefix)
        if not c_state.keys() <= r_state.keys():
            self.any_unexpected = True
        groups, regrouped = merge_groups(
            c, r, prefix, self.outcome, keep=self.keep, conflicts=self.want_conflicts
        )
        if regrouped:
            self.any_unexpected = True
        c_extra, r_extra = _extras(c), _extras(r)
        if not c_extra and not r_extra:
            return {STATE: state, PARAM_GROUPS: groups}
        # keys an optimizer keeps beside state and param_groups: merged like any mapping (like
        # a parameter's state: flatten sees no optimizer state dict inside an optimizer's)
        extra = self._tree(c_extra, r_extra, prefix, in_state=True)
        return {STATE: state, PARAM_GROUPS: groups, **extra}

    def _state(
        self,
        c_state: Mapping[Any, Any],
        r_state: Mapping[Any, Any],
        state: dict[Any, Any],
        prefix: str,
    ) -> None:
        """Merge the per-parameter state, one parameter at a time."""
        state_prefix = prefix + STATE_PREFIX
        for pid, r_entry in r_state.items():
            key = state_prefix + key_str(pid, prefix + STATE)
            c_entry = c_state.get(pid, MISSING)
            if not isinstance(r_entry, Mapping) or not (
                c_entry is MISSING or isinstance(c_entry, Mapping)
            ):
                if isinstance(r_entry, Mapping) or isinstance(c_entry, Mapping):
                    raise LayoutError(
                        f"{key!r} is a parameter's state (a mapping) on one side and an "
                        "optimizer-level entry (a leaf) on the other"
                    )
                _require_optimizer_level(pid, key, self.c_osd, self.r_osd)
                if c_entry is MISSING:
                    self._backfill(state, pid, r_entry, key, in_optimizer=True)
                else:  # an optimizer-level entry (MADGRAD's state['k']): a leaf
                    self._leaf(state, pid, c_entry, r_entry, key)
                continue
            if c_entry is MISSING:
                self._backfill(state, pid, r_entry, key, in_optimizer=True)
            elif type(c_entry) is dict and c_entry.keys() == r_entry.keys():
                state[pid] = self._entry(c_entry, r_entry, key)
            else:
                state[pid] = self._tree(c_entry, r_entry, key + ".", in_state=True)

    def _fast_state(
        self,
        c_state: Mapping[Any, Any],
        r_state: Mapping[Any, Any],
        state: dict[Any, Any],
        prefix: str,
    ) -> bool:
        """:meth:`_state` in C-level passes over all parameters, in the common case.

        A parameter whose two entries are plain dicts with the same state names in
        the same order gets a copy of the checkpoint's entry; the value pairs of all
        such parameters are type-checked and compared together, and reported in the
        order :meth:`_state` would report them. The other parameters (backfills,
        other entry types) go through :meth:`_state` one by one, in order. Returns
        ``False``, having done nothing, when the state names differ somewhere or a
        state value is itself a mapping (nested state): :meth:`_state` then does it all.
        """
        c_entries = list(map(c_state.get, r_state, repeat(MISSING)))
        fast = bytes(
            map(
                and_,
                map(is_, map(type, c_entries), repeat(dict)),
                map(is_, map(type, r_state.values()), repeat(dict)),
            )
        )
        fast_c = list(compress(c_entries, fast))
        fast_r = list(compress(r_state.values(), fast))
        del c_entries
        # the same names in the same order, parameter by parameter (lengths, then all names)
        if list(map(len, fast_c)) != list(map(len, fast_r)) or list(
            chain.from_iterable(fast_c)
        ) != list(chain.from_iterable(fast_r)):
            return False
        c_vals = list(chain.from_iterable(map(dict.values, fast_c)))
        r_vals = list(chain.from_iterable(map(dict.values, fast_r)))
        c_seen, r_seen = set(map(type, c_vals)), set(map(type, r_vals))
        if any(issubclass(tp, Mapping) for tp in c_seen | r_seen):
            return False
        # the merged state in reference order: copies of the checkpoint's entries, and the
        # other parameters one by one (few: backfilled ones, unusual entry types)
        mismatches = self.outcome.mismatches
        mark = len(mismatches)
        spans: list[tuple[int, int, int]] = []  # (r position, first, end) of their mismatches
        copies = iter(list(map(dict.copy, fast_c)))
        pids = iter(r_state)
        done = 0
        for slow in compress(count(), map(not_, fast)):
            state.update(zip(islice(pids, slow - done), copies))  # noqa: B905
            pid = next(pids)
            first = len(mismatches)
            self._state(c_state, {pid: r_state[pid]}, state, prefix)
            if len(mismatches) > first:
                spans.append((slow, first, len(mismatches)))
            done = slow + 1
        state.update(zip(pids, copies))  # noqa: B905
        bad = mismatched(c_vals, r_vals, c_seen, r_seen)
        if not bad:
            return True
        # name the batch's mismatches, and put all of them in walk order
        positions = list(compress(count(), fast))
        ends = list(accumulate(map(len, fast_c)))
        found: list[tuple[int, int, Mismatch]] = []
        for i in bad:
            n = bisect_right(ends, i)
            pid = next(islice(r_state, positions[n], None))
            fields = state[pid]
            name = list(fields)[i - (ends[n - 1] if n else 0)]
            key = f"{_state_key(prefix, pid)}.{name}"
            found.append(
                (positions[n], i, Mismatch(key, meta(c_vals[i], key), meta(r_vals[i], key)))
            )
            self.outcome.take_reference[key] = Slot(
                partial(fields.__setitem__, name), c_vals[i], r_vals[i]
            )
        for at, first, end in spans:
            found.extend((at, k, mismatches[k]) for k in range(first, end))
        found.sort(key=itemgetter(0, 1))
        mismatches[mark:] = [m for _, _, m in found]
        return True

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

    def _optimizer_unexpected(
        self, c: Mapping[Any, Any], r: Mapping[Any, Any], out: dict[Any, Any], prefix: str
    ) -> None:
        c_state, r_state = c[STATE], r[STATE]
        state = out[STATE]
        state_prefix = prefix + STATE_PREFIX
        for pid, c_entry in c_state.items():
            key = state_prefix + key_str(pid, prefix + STATE)
            r_entry = r_state.get(pid, MISSING)
            if not isinstance(c_entry, Mapping):  # an optimizer-level entry: a leaf
                _require_optimizer_level(pid, key, c, r)
                if r_entry is MISSING:
                    self.outcome.unexpected.append(key)
                    if self.keep:
                        state[pid] = c_entry
                elif isinstance(r_entry, Mapping):
                    raise LayoutError(
                        f"{key!r} is a parameter's state (a mapping) on one side and an "
                        "optimizer-level entry (a leaf) on the other"
                    )
                continue
            if r_entry is MISSING:
                self.outcome.unexpected.extend(flat_keys(c_entry, key, in_optimizer=True))
                if self.keep:
                    state[pid] = copy_tree(c_entry, in_optimizer=True)
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
        c_extra = _extras(c)
        if c_extra:  # after param_groups, as flatten spells them
            self._tree_unexpected(c_extra, _extras(r), out, prefix, in_state=True)


def _require_optimizer_level(pid: Any, key: str, *osds: Mapping[Any, Any]) -> None:
    """Raise unless ``pid``, whose state entry is a leaf, is no parameter of ``osds``' groups.

    A leaf in ``state`` is an optimizer-level entry (MADGRAD keeps ``state['k']``);
    a parameter's state must be a mapping.
    """
    for osd in osds:
        if lists_param(osd, pid):
            raise LayoutError(
                f"{key!r}: the optimizer state of a parameter must be a mapping of state "
                "names to values"
            )


def _extras(osd: Mapping[Any, Any]) -> dict[Any, Any]:
    """The keys of an optimizer state dict beside ``state`` and ``param_groups``."""
    if len(osd) == 2:
        return {}
    return {k: v for k, v in osd.items() if k != STATE and k != PARAM_GROUPS}


def _state_key(prefix: str, pid: Any) -> str:
    return prefix + STATE_PREFIX + key_str(pid, prefix + STATE)


def _id_types_ok(state: Mapping[Any, Any]) -> bool:
    """Whether every param id is a str or an int (else the walk raises, in order)."""
    return set(map(type, state)) <= {int, str}


def _id_kind(osd: Mapping[Any, Any]) -> type | None:
    """``int`` or ``str`` when every param id of an optimizer state dict has that type."""
    kinds = set(map(type, osd[STATE]))
    for group in osd[PARAM_GROUPS]:
        if isinstance(group, Mapping) and isinstance(group.get(PARAMS), (list, tuple)):
            kinds.update(map(type, group[PARAMS][:1]))
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


def _flat_pair(c: Mapping[Any, Any], r: Mapping[Any, Any]) -> bool:
    """Whether two sub-dicts are both flat with str keys (the flat pass handles them)."""
    return (
        set(map(type, c)) <= {str}
        and set(map(type, r)) <= {str}
        and layout_of(c, value_types(c)) is Layout.FLAT
        and layout_of(r, value_types(r)) is Layout.FLAT
    )


def optimizer_vs_tree(key: str) -> LayoutError:
    where = f"at {key!r}" if key else "at the top level"
    return LayoutError(
        f"{where} one side is a nested optimizer state dict ('state' + 'param_groups') and the "
        "other is not. If one is flattened (flatten_optimizer_state_dict=True), convert the other "
        "with dsdmerge.flatten() so both have the same layout."
    )
