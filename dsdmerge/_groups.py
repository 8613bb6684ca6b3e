"""Param groups: membership, consistent hyperparameters, backfill, moved parameters.

Every rule about param groups is decided here, in one place. torch's loaders give
a whole group the hyperparameters of one member (``set_optimizer_state_dict`` of a
flat dict reads each live group's first member; its checks read no other), so a
merge must leave every group's members agreeing.

* **Sections.** Only flattened optimizers have param groups: a prefix ``P`` whose
  ``P param_groups.<fqn>.<name>`` values hold a hyperparameter, not only tensors
  (:func:`~dsdmerge.layout.is_optimizer_section`). A model whose modules are named
  ``param_groups`` is a model.
* **Membership.** A flat state dict does not store groups. They are the
  reference's own when it was nested (*given* groups), else *inferred*: the
  parameters whose reference hyperparameters are all equal (:func:`inferred_rows`,
  :func:`equal_hyperparameters`), in order of first appearance.
* **Flat: one value per group and hyperparameter** (:func:`settle_groups`). For each
  group and hyperparameter, the checkpoint values of its members, in the
  reference's order. When they agree (:func:`group_value`), members the checkpoint
  lacks the key for (backfilled keys) take that value; when no member has one, the
  reference's value stays. When they *disagree* (:func:`settle`):

  - a member *moved in* from another group when every hyperparameter it holds is
    the value most of that group's members hold (:func:`moved_in`);
  - the group takes the value most of its members hold, leaving out values only
    moved members hold (unless every value is such), the first member's in the
    reference's order on a tie;
  - backfilled keys take it; so does every member holding another value when the
    groups are given, and with inferred groups only moved members (the others may
    be a second group the inference could not tell from this one: two groups built
    alike and scheduled apart; they keep their values, and torch gives each real
    group its first member's);
  - the group is reported (:func:`disagreement`: every value held, by whom, what
    changed): the policy's ``conflict`` action decides (default and warn warn,
    strict raises). The merged result does not depend on that action.

  A consistent checkpoint is usually proven so without finding the groups
  (:func:`proven_consistent`); only then is the exact check skipped.
* **Nested** (:func:`merge_groups`, where both sides' groups are known): a reference
  group takes all its hyperparameters from its *home* checkpoint group
  (:func:`home_group`: the one at the same position when some member comes from it,
  as ``Optimizer.load_state_dict`` pairs groups, else the one most members come
  from), and the reference's values for names that group lacks. A member in
  another checkpoint group has *moved*: it takes its new group's hyperparameters,
  reported (naming each one that changes, old -> new) as a conflict.
* **Int-keyed optimizers** map parameters by position: their group counts and
  sizes must agree (:func:`merge_groups` reports it as a problem, a refusal).

How: the flat rules run on columns of a :class:`~dsdmerge._table.PgTable` when the
reference's keys have torch's shape (identity bit masks against a few template
rows), else key by key (:func:`_resolve_by_keys`); both give the same results.
Flattened optimizers under a prefix (``optim.param_groups.*`` in a flattened whole
checkpoint) get the same treatment (:func:`prefixed`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import partial
from itertools import chain, compress, count, filterfalse, islice, pairwise, repeat
from operator import contains, is_, is_not, itemgetter, ne
from typing import Any, NamedTuple

from dsdmerge._records import Outcome
from dsdmerge._table import PgTable, parse_groups
from dsdmerge._trees import copy_group
from dsdmerge._values import (
    MISSING,
    freeze,
    is_tensor_like,
    key_str,
    same_value,
    short_repr,
)
from dsdmerge.errors import LayoutError, StateDictTypeError
from dsdmerge.layout import (
    PARAM_GROUPS,
    PARAMS,
    PG_PREFIX,
    STATE,
    group_items,
    optimizer_sections,
    section_prefixes,
)
from dsdmerge.report import compress as compress_keys

__all__ = [
    "DISAGREE",
    "NESTED_PG",
    "Settled",
    "Values",
    "backfill",
    "disagreement",
    "equal_hyperparameters",
    "group_value",
    "home_group",
    "inferred_rows",
    "majority",
    "merge_groups",
    "most_common",
    "moved_in",
    "prefixed",
    "proven_consistent",
    "proven_lazily",
    "resolve",
    "settle",
    "settle_all",
    "settle_groups",
    "value_classes",
    "twice",
]


# --------------------------------------------------------------------------------------
# the rules


DISAGREE: Any = object()


def group_value(values: list[Any]) -> Any:
    """The one value the present ``values`` share, ``MISSING`` if none, else ``DISAGREE``."""
    present = list(filterfalse(partial(is_, MISSING), values))
    if not present:
        return MISSING
    first = present[0]
    n = len(present)
    if list(map(type, present)).count(type(first)) == n:
        if type(first) in _EXACT and first == first:  # (NaN is never == itself)
            # values of one plain type are same_value exactly when == (in C, identity first)
            return first if present.count(first) == n else DISAGREE
        if all(map(is_, present, repeat(first))):
            return first
    if all(same_value(first, v) for v in present):
        return first
    return DISAGREE


def most_common(owners: list[int | None]) -> int | None:
    """The checkpoint group most members come from (the first on a tie), ``None`` if none."""
    counts: dict[int, int] = {}
    for own in owners:
        if own is not None:
            counts[own] = counts.get(own, 0) + 1
    if not counts:
        return None
    best = max(counts.values())
    return next(own for own, n in counts.items() if n == best)


def home_group(position: int, owners: list[int | None]) -> int | None:
    """The checkpoint group a reference group takes its hyperparameters from.

    ``position`` is the reference group's index; ``owners`` the checkpoint group of
    each of its members (``None`` for a member the checkpoint has in no group). The
    checkpoint group at the same position, as ``Optimizer.load_state_dict`` pairs
    groups, when some member comes from it; else the one most members come from (the
    first on a tie: groups were reordered); ``None`` when no member comes from any.
    """
    return position if position in owners else most_common(owners)


class Settled(NamedTuple):
    """How one param group's members that disagree on a hyperparameter are settled.

    ``classes``: the positions (in the group's member order) of the members holding
    each distinct value, in order of first holder; ``values``: one value per class
    (its first holder's object); ``moved``: per class, whether every holder moved in
    from another group; ``chosen``: the class whose value the group takes;
    ``movers``: the members of the other classes that moved in; ``changed``, once
    the whole merge is settled (:func:`settle_all`): the members whose value changed.
    """

    classes: list[list[int]]
    values: list[Any]
    moved: list[bool]
    chosen: int
    movers: frozenset[int]
    changed: frozenset[int] | None = None

    @property
    def value(self) -> Any:
        return self.values[self.chosen]

    def others(self) -> list[int]:
        """The members holding another value than the group's, in member order."""
        return sorted(at for i, ats in enumerate(self.classes) if i != self.chosen for at in ats)

    def rewritten(self, *, inferred: bool) -> list[int]:
        """The members that take the group's value instead of their own, in member order.

        Every member holding another value when the groups are given; with inferred
        groups only those that moved in (evident: their values are another group's),
        since the others may be a second group the inference could not tell apart.
        """
        if self.changed is not None:
            return sorted(self.changed)
        return [at for at in self.others() if not inferred or at in self.movers]


def value_classes(values: list[Any]) -> tuple[list[list[int]], list[Any]]:
    """The positions holding each distinct present value, and each one's first holder's value.

    Distinct as :func:`~dsdmerge._values.same_value` says, in order of first holder.
    """
    classes: list[list[int]] = []
    reps: list[Any] = []
    keys: dict[Any, int] = {}
    for at, v in enumerate(values):
        if v is MISSING:
            continue
        key = _class_key(v)
        i = keys.get(key)
        if i is None:
            keys[key] = i = len(reps)
            reps.append(v)
            classes.append([])
        classes[i].append(at)
    return classes, reps


def settle(
    values: list[Any],
    moved: Callable[[int], bool],
    classes: tuple[list[list[int]], list[Any]] | None = None,
) -> Settled:
    """Settle a param group's checkpoint values for one hyperparameter, when they disagree.

    ``values``: each member's checkpoint value, in the reference's member order
    (``MISSING`` where the checkpoint has none); ``moved(at)``: whether member ``at``
    moved in from another group (:func:`moved_in`); ``classes``: the
    :func:`value_classes` of ``values``, if known. The group takes the value most of
    its members hold, leaving out values only moved members hold (unless every value
    is such); the first member's on a tie.
    """
    by_value, reps = value_classes(values) if classes is None else classes
    known: dict[int, bool] = {}

    def is_moved(at: int) -> bool:
        if at not in known:
            known[at] = moved(at)
        return known[at]

    all_moved = [all(map(is_moved, ats)) for ats in by_value]  # (stops at one that stayed)
    pool = [i for i in range(len(reps)) if not all_moved[i]] or list(range(len(reps)))
    chosen = max(pool, key=lambda i: len(by_value[i]))  # max keeps the first of equal counts
    movers = frozenset(
        at for i, ats in enumerate(by_value) if i != chosen for at in ats if is_moved(at)
    )
    return Settled(by_value, reps, all_moved, chosen, movers)


def settle_all(
    held: Mapping[tuple[int, str], list[Any]],
    agreed: Mapping[tuple[int, str], Any],
    names: list[list[str]],
    fillable: Mapping[tuple[int, str], list[int]],
    *,
    inferred: bool,
) -> dict[tuple[int, str], tuple[Settled, list[Any]]]:
    """Every group and hyperparameter whose members disagree, settled: the report and values.

    ``held``: each (group, name)'s member values; ``agreed``: its :func:`group_value`;
    ``names``: each group's hyperparameters; ``fillable``: the members whose key the
    checkpoint lacks (and the reference has). Rounds of :func:`settle` until nothing
    changes, each on what the rounds before wrote (so that merging the result again
    changes nothing): whether a member moved in is told against each other group's
    usual values (the value its members agree on, else the one most of them hold);
    the members lacking a value take the group's, and so do those
    :meth:`Settled.rewritten` gives. Returns, per (group, name) that disagreed, the
    report (the checkpoint's classes, the value taken, who moved in, who changed)
    and every member's value after the merge.
    """
    torn = [place for place, value in agreed.items() if value is DISAGREE]
    if not torn:
        return {}
    work = {place: list(held[place]) for place in torn}
    groups = {index for index, _ in torn}
    for place, value in agreed.items():  # their groups' other values, backfilled as the merge does
        if place[0] in groups and value is not DISAGREE:
            work[place] = list(held[place])
            if value is not MISSING:
                for at in fillable.get(place, []):
                    work[place][at] = value
    moved_in_any: dict[tuple[int, str], set[int]] = {place: set() for place in torn}
    chosen: dict[tuple[int, str], Any] = {}
    for _ in range(2 * len(names) + 2):  # (a guard: rounds stop when nothing changes)
        usual: list[dict[str, Any]] = [{} for _ in names]
        for (index, name), value in agreed.items():
            if value is DISAGREE:
                now = group_value(work[index, name])
                usual[index][name] = majority(work[index, name]) if now is DISAGREE else now
            elif value is not MISSING:
                usual[index][name] = value
        writes: list[tuple[tuple[int, str], list[int], Any]] = []
        for index, name in torn:
            values = work[index, name]
            now = group_value(values)
            if now is not DISAGREE:  # settled by an earlier round
                chosen[index, name] = now
                writes.append(((index, name), fillable.get((index, name), []), now))
                continue
            others = usual[:index] + usual[index + 1 :]
            rows = {n: work[index, n] for n in names[index]}
            settled = settle(values, partial(_moved_member, rows, others))
            moved_in_any[index, name] |= settled.movers
            chosen[index, name] = settled.value
            ats = fillable.get((index, name), []) + settled.rewritten(inferred=inferred)
            writes.append(((index, name), ats, settled.value))
        changed = False
        for place, ats, value in writes:
            values = work[place]
            for at in ats:
                if values[at] is not value:
                    values[at] = value
                    changed = True
        if not changed:
            break
    out: dict[tuple[int, str], tuple[Settled, list[Any]]] = {}
    for place in torn:
        original, final = held[place], work[place]
        classes, reps = value_classes(original)
        key = _class_key(chosen[place])
        pick = next((i for i, v in enumerate(reps) if _class_key(v) == key), 0)
        movers = moved_in_any[place]
        changed_at = frozenset(
            at
            for at, (was, now) in enumerate(zip(original, final, strict=True))
            if was is not MISSING and now is not was and not same_value(was, now)
        )
        report = Settled(
            classes,
            reps,
            [all(at in movers for at in ats) for ats in classes],
            pick,
            frozenset(movers),
            changed_at,
        )
        out[place] = (report, final)
    return out


def _moved_member(rows: Mapping[str, list[Any]], others: list[dict[str, Any]], at: int) -> bool:
    """:func:`moved_in` for member ``at`` of a group (``rows``: its values, per name)."""
    pairs = ((name, values[at]) for name, values in rows.items())
    return moved_in([(n, v) for n, v in pairs if v is not MISSING], others)


def majority(values: list[Any]) -> Any:
    """The value most present ``values`` hold (the first of them on a tie), or ``MISSING``."""
    counts: dict[Any, list[Any]] = {}  # class key -> [first value, count]
    for v in values:
        if v is not MISSING:
            entry = counts.setdefault(_class_key(v), [v, 0])
            entry[1] += 1
    if not counts:
        return MISSING
    best = max(n for _, n in counts.values())
    return next(v for v, n in counts.values() if n == best)


def moved_in(row: Iterable[tuple[str, Any]], usual: Iterable[Mapping[str, Any]]) -> bool:
    """Whether a member's checkpoint hyperparameters (``row``: name, value) are another group's.

    ``usual``: for each other param group, the value most of its members hold, per
    name (:func:`majority`; names none of them holds absent). A member that moved in
    from such a group holds, for every hyperparameter it has, that group's value.
    """
    items = list(row)
    return bool(items) and any(
        all(name in values and same_value(v, values[name]) for name, v in items) for values in usual
    )


def _class_key(value: Any) -> Any:
    """A hashable key equal for values :func:`~dsdmerge._values.same_value` calls equal."""
    key = freeze(value)
    try:
        hash(key)
        key == key  # noqa: B015  (an exotic __eq__ may raise)
    except Exception:  # noqa: BLE001
        return ("id", id(value))
    return key


def _params(fqns: list[str]) -> str:
    """Parameters as compressed patterns (at most three shown), e.g. ``layers.{0..3}.bias``."""
    try:
        patterns = compress_keys(fqns, max_parts=16)
    except Exception:  # noqa: BLE001  (an fqn the patterns cannot spell: plain names)
        return ", ".join(map(repr, fqns[:3])) + (
            f" and {len(fqns) - 3} more" if len(fqns) > 3 else ""
        )
    shown = ", ".join(repr(str(p)) for p in patterns[:3])
    rest = sum(p.count for p in patterns[3:])
    count = f" ({len(fqns)} parameters)" if len(fqns) > 1 else ""
    return shown + (f" and {rest} more" if rest else "") + count


def disagreement(
    group: str,
    name: str,
    members: list[str],
    settled: Settled,
    *,
    inferred: bool,
    backfilled: list[str],
) -> str:
    """The report of a param group whose checkpoint members disagree on ``name``.

    ``members``: the group's member fqns (positions as in ``settled``); ``backfilled``:
    the members whose ``name`` the checkpoint lacks (they take the group's value).
    """
    value = short_repr(settled.value)
    held = "; ".join(
        f"{short_repr(v)} held by {_params([members[at] for at in ats])}"
        + (" (moved in: another param group's values)" if moved else "")
        for v, ats, moved in zip(settled.values, settled.classes, settled.moved, strict=True)
    )
    text = f"param group {group}: its checkpoint members disagree on {name!r}: {held}"
    rewritten = set(settled.rewritten(inferred=inferred))
    changes = [
        f"{_params([members[at] for at in ats if at in rewritten])} {short_repr(v)} -> {value}"
        for v, ats in zip(settled.values, settled.classes, strict=True)
        if any(at in rewritten for at in ats)
    ]
    text += f"; the group takes {value}" + (f": {', '.join(changes)}" if changes else "")
    if backfilled:
        text += f"; backfilled {_params(backfilled)} take it"
    left = [at for at in settled.others() if at not in rewritten]
    if left:
        text += (
            f"; {_params([members[at] for at in left])} keep their own value, as the group "
            "is inferred from equal reference values and may be two param groups scheduled "
            "apart (torch gives a whole group its first member's value): pass the reference "
            "nested (get_optimizer_state_dict without flatten_optimizer_state_dict) so that "
            "the true groups are known"
        )
    return text


Values = Callable[[], Iterator[Any]]
"""A sequence of values given as a maker of fresh iterators over it (each call, a new one)."""


def proven_consistent(
    r_values: list[Any],
    c_values: list[Any],
    period: int,
    *,
    holes: list[int] | None = None,
) -> bool:
    """Whether no param group can have checkpoint members that disagree: a quick proof.

    ``r_values`` and ``c_values`` are the two sides' values at the same positions,
    which cover every hyperparameter key (where the checkpoint lacks a key, any value
    may stand in: it only makes the proof harder). The sufficient condition proven
    is name-free and structure-free: *any two positions whose reference values are
    equal (:func:`~dsdmerge._values.same_value`) hold equal checkpoint values*.
    Members of one group have equal reference values for each hyperparameter
    (inferred groups by definition; given groups share their group's value
    objects), so then none of them disagree. ``False`` means "not proven": the
    exact, group-by-group check decides. ``holes``: the positions the checkpoint
    lacks, in order (left out). :func:`proven_lazily` says how.
    """
    n = len(r_values)
    if len(c_values) != n:
        return False
    return proven_lazily(
        partial(iter, r_values),
        partial(iter, c_values),
        n,
        period,
        holes=holes,
    )


def proven_lazily(
    r_values: Values,
    c_values: Values,
    n: int,
    period: int,
    *,
    holes: list[int] | None = None,
) -> bool:
    """:func:`proven_consistent` of ``n`` values a side, read through iterators.

    The values are read a chunk at a time (the memory is a few lists of a few
    thousand items, whatever ``n``): first by blocks of rows, when they have torch's
    shape (:func:`_proven_by_blocks`); if not, by runs (:func:`_proven_by_runs`,
    which takes both sides whole). ``holes``: positions the checkpoint lacks, in
    order (there ``c_values`` may hold anything, ``MISSING`` for one). Each chunk's
    types are made from its values, a C-level pass each.
    """
    by_blocks = _proven_by_blocks(r_values(), c_values(), n, period, holes or [])
    if by_blocks is not None:
        return by_blocks
    return _proven_by_runs(list(r_values()), list(c_values()), period)


def _proven_by_runs(r_values: list[Any], c_values: list[Any], period: int) -> bool:
    """:func:`proven_consistent` by runs of one reference object, column by column.

    The positions are sliced by ``period`` (in torch's layout, one slice per
    hyperparameter), each slice cut into runs of one reference object; a run whose
    checkpoint values are all equal (one object, or ``==`` between values of one
    plain scalar type) is summarised by one (reference, checkpoint) pair, and the
    pairs of equal reference values must have equal checkpoint values.
    """
    if len(c_values) != len(r_values):
        return False
    r_reps: list[Any] = []
    c_reps: list[Any] = []
    try:
        for j in range(period):
            r_col, c_col = r_values[j::period], c_values[j::period]
            if not r_col:
                continue
            if all(map(is_, r_col, repeat(r_col[0]))):
                cuts = [0, len(r_col)]
            else:  # where the reference object changes
                cuts = [0, *compress(count(1), map(is_not, islice(r_col, 1, None), r_col))]
                cuts.append(len(r_col))
            if len(r_reps) + len(cuts) > _PROOF_RUNS:
                return False
            for start, end in pairwise(cuts):
                run = c_col[start:end]
                first = run[0]
                if not (
                    all(map(is_, run, repeat(first)))
                    or (
                        type(first) in _EXACT
                        and run.count(first) == len(run)
                        and list(map(type, run)).count(type(first)) == len(run)
                    )
                ):
                    return False
                r_reps.append(r_col[start])
                c_reps.append(first)
        return _pairs_agree(r_reps, c_reps)
    except Exception:  # an exotic value (its == or hash raises): not proven  # noqa: BLE001
        return False


# Values of these types that are == and of one type are same_value (NaN is never == itself).
_EXACT = frozenset({float, int, bool, str, type(None)})
_PLAIN = _EXACT | {tuple}
_PROOF_RUNS = 4096  # runs summarised at most: beyond, the exact check is cheaper
_BLOCKS = 256  # blocks of equal reference rows the block proof takes at most
_CHUNK = 1 << 13  # values of a side the block proof reads at a time (at least one row)
_IDS = 64  # distinct tuple objects the block proof compares in one column of a block


def _all_plain(values: list[Any]) -> bool:
    """Whether every value is plain: a scalar of :data:`_EXACT`, or a flat tuple of them.

    (At most 16 items a tuple.) In C-level passes, no call per value.
    """
    kinds = list(map(type, values))
    present = set(kinds)
    if present <= _EXACT:
        return True
    if not present <= _PLAIN:
        return False
    tuples = list(compress(values, map(is_, kinds, repeat(tuple))))
    return max(map(len, tuples)) <= 16 and set(map(type, chain.from_iterable(tuples))) <= _EXACT


def _plain_keys(values: list[Any]) -> list[Any] | None:
    """Hashable keys, equal exactly where the values are :func:`same_value`, if all are plain.

    ``None`` when some value is not plain (:func:`_all_plain`) or is or holds a NaN.
    A scalar's key is ``(type, value, None)``; a tuple's ``(tuple, value, item types)``.
    Made in C-level passes (no call per value): where every value is plain and no NaN,
    ``==`` of one type (and, in tuples, of the items' types) is ``same_value``.
    """
    if not _all_plain(values):
        return None
    kinds = list(map(type, values))
    if any(map(ne, values, values)):  # a NaN
        return None
    extra: Iterable[Any] = repeat(None)
    if tuple in kinds:
        is_tuple = list(map(is_, kinds, repeat(tuple)))
        tuples = list(compress(values, is_tuple))
        items = list(chain.from_iterable(tuples))
        if any(map(ne, items, items)):  # a NaN inside a tuple (a tuple is == itself by identity)
            return None
        item_types = iter(list(map(tuple, map(partial(map, type), tuples))))
        extra = [next(item_types) if t else None for t in is_tuple]
    return list(zip(kinds, values, extra, strict=False))  # (extra: endless when no tuple)


def _pairs_agree(r_values: list[Any], c_values: list[Any]) -> bool:
    """Whether positions whose reference values are same_value hold same_value checkpoint values.

    For plain values in C-level passes (:func:`_plain_keys`: each reference key must
    pair with one checkpoint key); else value by value (:func:`_class_key`).
    """
    r_keys = _plain_keys(r_values)
    c_keys = None if r_keys is None else _plain_keys(c_values)
    if r_keys is not None and c_keys is not None:
        return len(set(zip(r_keys, c_keys, strict=True))) == len(set(r_keys))
    held: dict[Any, Any] = {}
    for rv, cv in zip(r_values, c_values, strict=True):
        first = held.setdefault(_class_key(rv), cv)
        if first is not cv and not same_value(first, cv):
            return False
    return True


class _Block:
    """A block of equal reference rows, as the block proof reads it, chunk after chunk.

    ``r_row``, ``r_types``: the block's first reference row and its types; ``c_row``,
    ``c_types``: the checkpoint row every row of the block must equal, each column's
    value the first row's that has the key (``MISSING`` and ``object`` while none
    has); ``r_ids``, ``c_ids``: per tuple column, the distinct tuple objects seen
    (``==`` says nothing of the items' types: each object is compared once, at the end).
    """

    __slots__ = ("c_ids", "c_row", "c_types", "r_ids", "r_row", "r_types", "unknown")

    def __init__(self, r_row: list[Any], r_types: list[type]) -> None:
        self.r_row = r_row
        self.r_types = r_types
        self.c_row: list[Any] = []
        self.c_types: list[type] = []
        self.r_ids: dict[int, dict[int, Any]] = {}
        self.c_ids: dict[int, dict[int, Any]] = {}
        self.unknown: list[int] = []  # the columns of c_row no row has given yet

    def take(
        self,
        r_types: list[type],
        r: list[Any],
        c: list[Any],
        c_types: list[type],
        k: int,
        gaps: list[int],
    ) -> bool | None:
        """Rows of the block (``r`` equal to its first row; ``gaps``: the holes among ``c``).

        ``True`` when they pass; else the proof's verdict (see :func:`_proven_by_blocks`):
        ``None`` (not this shape) or ``False`` (the checkpoint's rows differ).
        """
        rows = len(r) // k
        if r_types != self.r_types * rows or not _note_tuples(self.r_ids, r, self.r_types, k):
            return None  # equal values of other types in a block: the run-by-run proof
        gone = set(gaps)
        if not self.c_row:  # the block starts here
            self.c_row, self.c_types = c[:k], c_types[:k]
            self.unknown = [p for p in gaps if p < k] if gaps else []
            for p in self.unknown:
                self.c_row[p], self.c_types[p] = MISSING, object
            known = filterfalse(partial(is_, MISSING), self.c_row) if self.unknown else None
            if not _all_plain(self.c_row if known is None else list(known)):
                return None
        if self.unknown and not self._learn(c, c_types, k, gone):
            return None
        if gaps:  # the holes get the block's values
            c, c_types = list(c), list(c_types)
            for p in gaps:
                c[p], c_types[p] = self.c_row[p % k], self.c_types[p % k]
        if c != self.c_row * rows or c_types != self.c_types * rows:
            return False
        return _note_tuples(self.c_ids, c, self.c_types, k)

    def _learn(self, c: list[Any], c_types: list[type], k: int, gone: set[int]) -> bool:
        """The columns no row of the block had the key for so far: their first value here."""
        left = []
        for j in self.unknown:
            at = next((q for q in range(j, len(c), k) if q not in gone), None)
            if at is None:
                left.append(j)
            elif not _all_plain([c[at]]):
                return False
            else:
                self.c_row[j], self.c_types[j] = c[at], c_types[at]
        self.unknown = left
        return True

    def tuples_agree(self) -> tuple[bool, bool]:
        """Whether every tuple seen is same_value its column's first: (reference, checkpoint)."""
        return _agree(self.r_ids, self.r_row), _agree(self.c_ids, self.c_row)


def _note_tuples(
    seen: dict[int, dict[int, Any]], rows: list[Any], types: list[type], k: int
) -> bool:
    """Note the distinct tuple objects of each tuple column of ``rows``; ``False`` past _IDS."""
    for j in compress(count(), map(is_, types, repeat(tuple))):
        column = rows[j::k]
        known = seen.setdefault(j, {})
        first = column[0]
        if all(map(is_, column, repeat(first))):  # one object (the usual case)
            known.setdefault(id(first), first)
        else:
            known.update(zip(map(id, column), column, strict=True))
        if len(known) > _IDS:
            return False
    return True


def _agree(seen: dict[int, dict[int, Any]], row: list[Any]) -> bool:
    """Whether each tuple column's distinct objects are same_value its value in ``row``."""
    for j, known in seen.items():
        first = row[j]
        if (len(known) > 1 or id(first) not in known) and not all(
            same_value(first, v) for v in known.values()
        ):
            return False
    return True


def _proven_by_blocks(
    r_values: Iterator[Any],
    c_values: Iterator[Any],
    n: int,
    k: int,
    holes: list[int],
) -> bool | None:
    """:func:`proven_consistent` by blocks of rows, in C-level list comparisons.

    The positions are rows of ``k`` (torch's layout: one row per parameter), and the
    reference's rows come in blocks of equal rows (a param group's members share
    their value objects, and torch writes a group's members one after another). The
    rows are read a chunk at a time (:data:`_CHUNK` values a side). Each block's
    reference rows are found by comparisons of slices with its first row repeated
    (``==``, identity first; galloping where a block ends), and must have its first
    row's types; its checkpoint rows must equal the checkpoint's first row of the
    block (``==``, then the types); tuples' items, on both sides, by their distinct
    objects. Plain values only (scalars and short flat tuples of them, where ``==``
    of one type is same_value, NaN aside, which ``==`` never joins). Then the first
    rows' positions whose reference values are same_value (in any column: the
    condition is name-free) must hold same_value checkpoint values. At a hole (a
    position the checkpoint lacks, where no member holds a value) the block's value
    for that column stands in, from its first row that has one. ``True``: proven;
    ``False``: not proven (the exact check decides); ``None``: not this shape (the
    run-by-run proof tries).
    """
    if not n or k < 1 or n % k:
        return None
    rows = n // k
    per = max(1, _CHUNK // k)  # rows a chunk
    blocks: list[_Block] = []
    h = 0  # the next hole
    try:
        for top in range(0, rows, per):
            m = min(per, rows - top)
            size = m * k
            r = list(islice(r_values, size))
            c = list(islice(c_values, size))
            r_types, c_types = list(map(type, r)), list(map(type, c))
            if not len(r) == len(c) == len(r_types) == len(c_types) == size:
                return None  # fewer values than said
            lo, base = h, top * k
            while h < len(holes) and holes[h] < base + size:
                h += 1
            gaps = [p - base for p in holes[lo:h]] if h > lo else []
            pos = 0
            while pos < m:
                if blocks and (r if not pos else r[pos * k :]) == blocks[-1].r_row * (m - pos):
                    end = m  # the rest of the chunk is in the block (the usual case)
                elif blocks:
                    end = _rows_like(r, blocks[-1].r_row, k, pos, m)
                else:
                    end = pos
                if end == pos:  # a new block of reference rows starts here
                    if len(blocks) == _BLOCKS:
                        return None
                    row = r[pos * k : (pos + 1) * k]
                    if not _all_plain(row):
                        return None
                    blocks.append(_Block(row, r_types[pos * k : (pos + 1) * k]))
                    end = _rows_like(r, row, k, pos + 1, m)
                a, b = pos * k, end * k
                whole = a == 0 and b == size  # (no slices to make)
                verdict = blocks[-1].take(
                    r_types if whole else r_types[a:b],
                    r if whole else r[a:b],
                    c if whole else c[a:b],
                    c_types if whole else c_types[a:b],
                    k,
                    [p - a for p in gaps if a <= p < b] if gaps else gaps,
                )
                if verdict is not True:
                    return verdict
                pos = end
        if next(r_values, MISSING) is not MISSING or next(c_values, MISSING) is not MISSING:
            return None  # more values than said
        r_reps: list[Any] = []
        c_reps: list[Any] = []
        for j in range(k):  # (name-free, as proven_consistent: any columns)
            for block in blocks:
                if block.c_row[j] is not MISSING:  # (else no row of the block has the key)
                    r_reps.append(block.r_row[j])
                    c_reps.append(block.c_row[j])
        agree = [block.tuples_agree() for block in blocks]
        if not all(r_ok for r_ok, _ in agree):
            return None
        if not all(c_ok for _, c_ok in agree):
            return False
        return _pairs_agree(r_reps, c_reps)
    except Exception:  # an exotic value (its == or hash raises): not this shape  # noqa: BLE001
        return None


def _rows_like(values: list[Any], row: list[Any], k: int, start: int, rows: int) -> int:
    """The end of the run of rows from ``start`` that equal ``row`` (galloping, then bisecting)."""
    end, step = start, 1
    while end < rows:
        step = min(step, rows - end)
        if values[end * k : (end + step) * k] == row * step:
            end += step
            step *= 2
            continue
        while step > 1:  # the first row unlike ``row`` is among the next ``step``
            half = step // 2
            if values[end * k : (end + half) * k] == row * half:
                end += half
                step -= half
            else:
                step = half
        break
    return end


# --------------------------------------------------------------------------------------
# membership


def equal_hyperparameters(rows: Iterable[tuple[Any, Iterable[tuple[str, Any]]]]) -> list[Any]:
    """Group row ids by equal ``(hyperparameter, value)`` rows, in order of first appearance.

    Parameters of one group share their value objects, so each object is frozen once.
    """
    frozen: dict[int, Any] = {}
    by_signature: dict[Any, list[Any]] = {}
    for row, pairs in rows:
        signature = []
        for name, v in pairs:
            f = frozen.get(id(v), MISSING)
            if f is MISSING:
                f = frozen[id(v)] = freeze(v)
            signature.append((name, f))
        by_signature.setdefault(tuple(signature), []).append(row)
    return list(by_signature.values())


def inferred_rows(table: PgTable) -> list[list[int]]:
    """Rows whose reference hyperparameters are all equal, in order of first appearance.

    Equal as :func:`equal_hyperparameters` compares them: the same names in the same
    order (rows of blocks that order them differently are different groups, as torch
    writes each group in its own dict's order) and equal values. Members of a group
    share their value objects, so rows are matched by identity to a few template rows
    (a bit mask per template, ANDed over the columns and the rows of its order), and
    only the templates are frozen and compared by value.
    """
    k, n_rows = len(table.names), len(table.fqns)
    col = dict(zip(table.names, count()))
    blocks = table.blocks or [(0, n_rows, table.names)]

    def items(i: int) -> list[tuple[str, Any]]:  # row i's hyperparameters, in its own order
        names = next(names for first, end, names in blocks if first <= i < end)
        return [(name, table.values[i * k + col[name]]) for name in names]

    columns = [table.values[j::k] for j in range(k)]
    left = (1 << (8 * n_rows)) - 1  # a bit per row at 8-bit spacing: the rows not matched
    left &= int.from_bytes(b"\x01" * n_rows, "little")
    in_order: dict[tuple[str, ...], int] = {}  # an order of the names -> its rows
    for first, end, names in blocks:
        rows = b"\x00" * first + b"\x01" * (end - first) + b"\x00" * (n_rows - end)
        in_order[tuple(names)] = in_order.get(tuple(names), 0) | int.from_bytes(rows, "little")
    templates: list[tuple[int, int]] = []  # (first row, mask of the rows like it)
    while left:
        if len(templates) == 64:  # too many distinct rows for masks: freeze every row
            return equal_hyperparameters((i, items(i)) for i in range(n_rows))
        t = ((left & -left).bit_length() - 1) // 8
        mask = left & in_order[tuple(name for name, _ in items(t))]
        for column in columns:
            mask &= int.from_bytes(bytes(map(is_, column, repeat(column[t]))), "little")
        templates.append((t, mask))
        left &= ~mask
    masks: dict[Any, int] = {}  # signature -> rows, in order of first appearance
    for t, mask in templates:
        signature = tuple((name, freeze(v)) for name, v in items(t))
        masks[signature] = masks.get(signature, 0) | mask
    return [list(compress(count(), mask.to_bytes(n_rows, "little"))) for mask in masks.values()]


# --------------------------------------------------------------------------------------
# flat state dicts: backfill, moved members and conflicts


def resolve(
    c: Mapping[str, Any],
    r: Mapping[str, Any],
    groups: list[list[str]] | None,
    backfilled: list[str],
    outcome: Outcome,
    *,
    detect: bool,
    conflicts: bool,
    c_at_r: Callable[[], Iterable[Any]] | None = None,
) -> None:
    """Group-consistent ``param_groups.*`` values: backfills, moved members, conflicts.

    Only when ``r``'s ``param_groups.*`` keys are a flattened optimizer's (some value
    is a hyperparameter, not a tensor: see :mod:`dsdmerge.layout`). ``detect``: look
    at every group for members that disagree (else only the groups of ``backfilled``
    keys, whose members are known to agree); ``conflicts``: report those groups.
    By columns when the reference's ``param_groups.*`` keys form a table (every
    parameter with the same hyperparameter names, in the same order: what torch
    writes), else key by key; both give the same results.
    """
    table = PgTable.of(r)
    if table is None:
        _resolve_by_keys(c, r, groups, backfilled, outcome, detect=detect, conflicts=conflicts)
    elif not all(map(is_tensor_like, map(type, table.values))):  # (stops at a hyperparameter)
        _resolve_table(
            table,
            c,
            groups,
            backfilled,
            outcome,
            detect=detect,
            conflicts=conflicts,
            c_at_r=c_at_r,
        )


def _label(index: int, inferred: bool) -> str:
    return f"{index} (inferred)" if inferred else str(index)


def _resolve_table(
    table: PgTable,
    c: Mapping[str, Any],
    groups: list[list[str]] | None,
    backfilled: list[str],
    outcome: Outcome,
    *,
    detect: bool,
    conflicts: bool,
    c_at_r: Callable[[], Iterable[Any]] | None,
) -> None:
    """:func:`_resolve_by_keys`, by the columns of ``table``."""
    if groups is None:
        rows = inferred_rows(table)
    else:
        row_of = dict(zip(table.fqns, count()))
        rows = [[i for i in map(row_of.get, g) if i is not None] for g in groups]
    if not backfilled and not detect:
        return
    # the checkpoint's value at each cell of the table (MISSING where it has none), read by
    # columns below: no key is spelled or hashed
    if c_at_r is None:
        c_vals = list(map(c.get, table.keys, repeat(MISSING)))
    else:
        c_vals = list(compress(c_at_r(), table.picked))
        if table.order is not None:  # into the table's order (see PgTable.order)
            c_vals = list(map(c_vals.__getitem__, table.order))
    k = len(table.names)
    col_of = dict(zip(table.names, count()))
    fqns = table.fqns
    columns = [c_vals[j::k] for j in range(k)]

    def values_of(index: int, name: str) -> list[Any]:
        return list(map(columns[col_of[name]].__getitem__, rows[index]))

    members = [[fqns[i] for i in group] for group in rows]
    if not detect:
        backfill(c, outcome.merged, backfilled, members, values_of=values_of)
        return
    blocks = table.blocks or [(0, len(fqns), table.names)]

    def names_of(index: int) -> list[str]:  # in the order its keys name them (its first row's)
        group = rows[index]
        return next((b for first, end, b in blocks if group and first <= group[0] < end), [])

    keys = table.keys

    def key_of(index: int, at: int, name: str) -> str:
        return keys[rows[index][at] * k + col_of[name]]

    settle_groups(
        members,
        names_of,
        values_of,
        key_of,
        outcome,
        inferred=groups is None,
        conflicts=conflicts,
    )


def settle_groups(
    members: list[list[str]],
    names_of: Callable[[int], list[str]],
    values_of: Callable[[int, str], list[Any]],
    key_of: Callable[[int, int, str], str | None],
    outcome: Outcome,
    *,
    inferred: bool,
    conflicts: bool,
) -> None:
    """Every group's value for every hyperparameter, written where it is missing or moved.

    ``members``: the groups' member fqns; ``names_of(g)``: group ``g``'s hyperparameters
    in order; ``values_of(g, name)``: the checkpoint's value for each member
    (``MISSING`` where it has none); ``key_of(g, at, name)``: the flat key of member
    ``at``'s value (``None`` when the reference has none: that member has no such
    hyperparameter). Groups whose members agree give their value to the members that
    lack one; the others are settled (:func:`settle`) and reported in
    ``outcome.conflicts`` (when ``conflicts``), group by group, name by name.
    """
    merged = outcome.merged
    agreed: dict[tuple[int, str], Any] = {}
    held: dict[tuple[int, str], list[Any]] = {}
    names = [names_of(index) for index in range(len(members))]
    for index, group_names in enumerate(names):
        for name in group_names:
            values = held[index, name] = values_of(index, name)
            agreed[index, name] = group_value(values)
    torn_groups = {index for (index, _), value in agreed.items() if value is DISAGREE}
    fillable = {  # (only the groups that disagree somewhere need them)
        (index, name): [
            at
            for at in compress(count(), map(is_, values, repeat(MISSING)))
            if key_of(index, at, name) is not None
        ]
        for (index, name), values in held.items()
        if index in torn_groups
    }
    settled_all = settle_all(held, agreed, names, fillable, inferred=inferred)
    for (index, name), value in agreed.items():
        if value is MISSING:
            continue  # no member has one: a backfill keeps the reference's value
        values = held[index, name]
        lacking = [
            (at, key)
            for at in compress(count(), map(is_, values, repeat(MISSING)))
            if (key := key_of(index, at, name)) is not None
        ]
        if value is not DISAGREE:
            if merged is not None:
                merged.update(zip(map(itemgetter(1), lacking), repeat(value)))
            continue
        settled, final = settled_all[index, name]
        if merged is not None:
            for at in [at for at, _ in lacking] + settled.rewritten(inferred=inferred):
                merged[str(key_of(index, at, name))] = final[at]
        if conflicts:
            group = members[index]
            outcome.conflicts.append(
                disagreement(
                    _label(index, inferred),
                    name,
                    group,
                    settled,
                    inferred=inferred,
                    backfilled=[group[at] for at, _ in lacking],
                )
            )


def backfill(
    c: Mapping[str, Any],
    merged: dict[str, Any] | None,
    backfilled: list[str],
    groups: list[list[str]],
    *,
    values_of: Callable[[int, str], list[Any]] | None = None,
) -> None:
    """Give each backfilled ``param_groups.*`` key the value its group's members share.

    For groups known to agree (:func:`~dsdmerge._groups.proven_consistent`): ``groups``
    are lists of fqns; a key whose group has no member with a value keeps the
    reference's. Writes into ``merged`` unless it is ``None`` (a check). Each group
    and hyperparameter is scanned once: ``values_of(group, name)``, if given, is the
    checkpoint's value for each member in order (``MISSING`` where it has none), as
    the keys ``param_groups.<member>.<name>`` looked up in ``c`` would give.
    """
    if merged is None:
        return
    group_of = {fqn: index for index, members in enumerate(groups) for fqn in members}
    n = len(PG_PREFIX)
    found: dict[tuple[int, str], Any] = {}  # (group, hyperparameter) -> checkpoint value
    for key in backfilled:
        fqn, _, name = key[n:].rpartition(".")
        index = group_of.get(fqn)
        if index is None:
            continue
        value = found.get((index, name), found)
        if value is found:  # first backfilled key of this group and name: scan the group once
            if values_of is None:
                keys = [f"{PG_PREFIX}{member}.{name}" for member in groups[index]]
                values = list(map(c.get, keys, repeat(MISSING)))
            else:
                values = values_of(index, name)
            value = found[index, name] = next(filterfalse(partial(is_, MISSING), values), MISSING)
        if value is not MISSING:
            merged[key] = value


def _resolve_by_keys(
    c: Mapping[str, Any],
    r: Mapping[str, Any],
    groups: list[list[str]] | None,
    backfilled: list[str],
    outcome: Outcome,
    *,
    detect: bool,
    conflicts: bool,
) -> None:
    """:func:`resolve` key by key, for ``param_groups.*`` keys that form no table.

    Nothing happens when every such value of ``r`` is a tensor (a model with a module
    named ``param_groups``, not an optimizer). ``groups`` are the reference's own (given
    when it was nested), else inferred: the parameters whose reference
    hyperparameters are all equal (:func:`equal_hyperparameters`). Without
    ``detect``, only the backfilled keys get their group's checkpoint value
    (:func:`backfill`: those groups' members are known to agree); with it, every
    group is settled (:func:`settle_groups`; with inferred groups only moved
    members are rewritten, and the conflicts name the groups "inferred").
    """
    r_hyper, r_keys = parse_groups(r)
    values = (v for row in r_hyper.values() for v in row.values())
    if all(map(is_tensor_like, map(type, values))):
        return  # a model's tensors under a "param_groups" segment: no optimizer
    inferred = groups is None  # True: no nested reference gave the groups
    if groups is None:
        groups = equal_hyperparameters((fqn, values.items()) for fqn, values in r_hyper.items())
    if not detect:
        backfill(c, outcome.merged, backfilled, groups)
        return
    rows = [[m for m in members if m in r_keys] for members in groups]

    def names_of(index: int) -> list[str]:
        names: dict[str, None] = {}
        for member in rows[index]:
            names.update(dict.fromkeys(r_keys[member]))
        return list(names)

    def values_of(index: int, name: str) -> list[Any]:
        keys = [r_keys[m].get(name) for m in rows[index]]
        return [MISSING if key is None else c.get(key, MISSING) for key in keys]

    def key_of(index: int, at: int, name: str) -> str | None:
        key: str | None = r_keys[rows[index][at]].get(name)
        return key

    settle_groups(
        rows, names_of, values_of, key_of, outcome, inferred=inferred, conflicts=conflicts
    )


NESTED_PG = "." + PG_PREFIX


def prefixed(
    c: Mapping[str, Any],
    r: Mapping[str, Any],
    outcome: Outcome,
    *,
    detect: bool,
    conflicts: bool,
) -> None:
    """Group-consistent hyperparameters for flattened optimizers under a prefix.

    A flattened whole checkpoint spells its optimizer's keys
    ``optim.param_groups.<fqn>.<hp>``: each such prefix that is an optimizer's section
    (:func:`~dsdmerge.layout.is_optimizer_section` of the reference) gets the same
    treatment as top-level ``param_groups.*`` keys, on the keys under it: the
    prefixes of missing keys, and with ``detect`` those of every checkpoint key.
    """
    merged = outcome.merged
    backfilled = [k for k in outcome.missing if NESTED_PG in k]
    found: dict[str, None] = {}
    for key in backfilled:
        found.update(dict.fromkeys(section_prefixes(key)))
    if detect:
        # only keys with ".param_groups." in them (a C-level pass) have a prefix
        for key in compress(c, map(contains, c, repeat(NESTED_PG))):
            found.update(dict.fromkeys(section_prefixes(key)))
    found.pop("", None)
    if not found:
        return
    sections = optimizer_sections(r, found)
    for prefix in sections:
        head, n = prefix + PG_PREFIX, len(prefix)
        sub_c = {k[n:]: v for k, v in c.items() if k.startswith(head)}
        sub_r = {k[n:]: v for k, v in r.items() if k.startswith(head)}
        mine = [k[n:] for k in backfilled if k.startswith(head)]
        sub = Outcome({} if merged is not None else None, [], [], [])
        resolve(sub_c, sub_r, None, mine, sub, detect=detect, conflicts=conflicts)
        if merged is not None and sub.merged:
            merged.update((prefix + k, v) for k, v in sub.merged.items())
        outcome.conflicts.extend(f"{prefix[:-1]!r}: {line}" for line in sub.conflicts)
        outcome.problems.extend(f"{prefix[:-1]!r}: {line}" for line in sub.problems)


# --------------------------------------------------------------------------------------
# nested optimizers: groups paired, members moved


def merge_groups(
    c: Mapping[Any, Any],
    r: Mapping[Any, Any],
    prefix: str,
    outcome: Outcome,
    *,
    keep: bool,
    conflicts: bool,
) -> tuple[list[dict[str, Any]], bool]:
    """Merge param groups: hyperparameters from the checkpoint, membership from the reference.

    A reference group takes the hyperparameters of its checkpoint group: the
    one at the same position (as ``Optimizer.load_state_dict`` pairs groups)
    when some of its members come from it, else the one most of its members
    come from (the first on a tie; groups were reordered). New members and
    members moved from another group take them too (biases moved to the
    no-decay group get its decay, however many they are), hyperparameters the checkpoint
    group lacks come from the reference group, and a reference group with no
    member in the checkpoint is taken whole from the reference. The ``params``
    lists are the reference's (``Optimizer.load_state_dict`` maps by position),
    so a checkpoint parameter that no longer exists is in no group.

    Returns the merged groups, and whether the checkpoint has group keys the
    reference lacks (a checkpoint group no reference group took, or names a
    reference group lacks): then the caller looks for unexpected keys.
    """
    where = prefix + PARAM_GROUPS
    c_groups = [
        (g, group_items(g, f"{where}[{i}] (checkpoint)")) for i, g in enumerate(c[PARAM_GROUPS])
    ]
    r_groups = [
        (g, group_items(g, f"{where}[{i}] (reference)")) for i, g in enumerate(r[PARAM_GROUPS])
    ]
    _check_positional(c_groups, r_groups, c, r, where, outcome.problems)
    try:
        c_index: dict[Any, int] = {}
        for i, (g, _) in enumerate(c_groups):
            c_index.update(zip(g[PARAMS], repeat(i)))
        r_index: dict[Any, int] = {}
        for i, (g, _) in enumerate(r_groups):
            r_index.update(zip(g[PARAMS], repeat(i)))
        for side, index, sides_groups in (
            ("checkpoint", c_index, c_groups),
            ("reference", r_index, r_groups),
        ):
            if len(index) != sum(len(g[PARAMS]) for g, _ in sides_groups):
                twice(sides_groups, side, where)
    except TypeError:  # an unhashable param id: name it
        for side, sides_groups in (("checkpoint", c_groups), ("reference", r_groups)):
            for i, (g, _) in enumerate(sides_groups):
                for pid in g[PARAMS]:
                    key_str(pid, f"{where}[{i}] ({side})")
        raise StateDictTypeError(f"{where}: a param id is unhashable") from None
    c_names = [{name for name, _ in items} for _, items in c_groups]
    r_names = [{name for name, _ in items} for _, items in r_groups]
    group_prefix = prefix + PG_PREFIX
    missing = outcome.missing
    any_unexpected = False
    out: list[dict[str, Any]] = []
    matched: set[int] = set()
    empty_c_groups = iter([i for i, (g, _) in enumerate(c_groups) if not g[PARAMS]])
    for ri, (rg, r_items) in enumerate(r_groups):
        params = rg[PARAMS]
        if not set(map(type, params)) <= {int, str}:  # key_str raises, naming the first
            [key_str(pid, f"{where}[{ri}]") for pid in params]
        owners = list(map(c_index.get, params))  # each member's checkpoint group
        ci = home_group(ri, owners)
        if ci is None and not params:  # an empty group: the checkpoint's next empty one
            ci = next(empty_c_groups, None)
        if ci is None:
            for pid in params:
                s = key_str(pid, "")
                missing.extend(f"{group_prefix}{s}.{name}" for name, _ in r_items)
            out.append(copy_group(rg))
            continue
        matched.add(ci)
        cg, c_items = c_groups[ci]
        # (not keeping: what the reference group lacks is left out, as a flat merge drops it)
        group = dict(c_items) if keep else {n: v for n, v in c_items if n in r_names[ri]}
        for name, value in r_items:
            group.setdefault(name, value)
        group[PARAMS] = list(params)
        out.append(group)
        lacking = [name for name, _ in r_items if name not in c_names[ci]]
        if not lacking and owners.count(ci) == len(owners):
            continue  # every member has the group's hyperparameters in the checkpoint
        for pid, own in zip(params, owners, strict=True):
            s = key_str(pid, "")
            if own == ci:
                names = lacking
            else:
                have = c_names[own] if own is not None else ()
                names = [name for name, _ in r_items if name not in have]
                if own is not None and conflicts:
                    was = dict(c_groups[own][1])
                    changes = [
                        f"{name!r} {short_repr(was[name])} -> {short_repr(group[name])}"
                        for name, _ in r_items
                        if name in was and not same_value(was[name], group[name])
                    ]
                    if changes:  # (a move between groups that agree changes nothing)
                        outcome.conflicts.append(
                            f"{where}: {s} moved: it is in checkpoint group {own} but the "
                            f"reference puts it with members of checkpoint group {ci}, whose "
                            f"hyperparameters it takes: {', '.join(changes)}"
                        )
            missing.extend(f"{group_prefix}{s}.{name}" for name in names)
    if len(matched) < len(c_groups):
        any_unexpected = True
        if keep:  # a checkpoint group no reference group took: kept for its dead members
            for i, (g, _) in enumerate(c_groups):
                # (not for members that live on in a reference group: torch rejects a
                # parameter listed twice, and more groups than the optimizer has)
                dead = [pid for pid in g[PARAMS] if pid not in r_index]
                if i not in matched and (dead or not g[PARAMS]):
                    out.append({**copy_group(g), PARAMS: dead})
    for ci, (cg, _) in enumerate(c_groups):
        for ri in set(map(r_index.get, cg[PARAMS], repeat(-1))):
            if ri < 0 or not c_names[ci] <= r_names[ri]:
                any_unexpected = True
    return out, any_unexpected


def _check_positional(
    c_groups: list[tuple[Any, Any]],
    r_groups: list[tuple[Any, Any]],
    c: Mapping[Any, Any],
    r: Mapping[Any, Any],
    where: str,
    problems: list[str],
) -> None:
    """Int-keyed optimizers map params by position: group sizes must agree, as torch demands."""
    kinds = set(map(type, c[STATE]))
    kinds.update(map(type, r[STATE]))
    for g, _ in c_groups + r_groups:
        kinds.update(map(type, g[PARAMS]))
    if kinds != {int}:
        return
    if len(c_groups) != len(r_groups):
        problems.append(
            f"{where}: the checkpoint has {len(c_groups)} param group(s) but the reference has "
            f"{len(r_groups)}; Optimizer.load_state_dict maps int-keyed state by position and "
            "rejects this. Save fqn-keyed state (get_optimizer_state_dict) to merge across "
            "model changes."
        )
        return
    for i, ((cg, _), (rg, _)) in enumerate(zip(c_groups, r_groups, strict=True)):
        if len(cg[PARAMS]) != len(rg[PARAMS]):
            problems.append(
                f"{where}[{i}]: {len(cg[PARAMS])} params in the checkpoint but "
                f"{len(rg[PARAMS])} in the reference; Optimizer.load_state_dict maps int-keyed "
                "state by position and rejects a group whose size changed. Save fqn-keyed "
                "state (get_optimizer_state_dict) to merge across model changes."
            )


def twice(groups: list[tuple[Any, Any]], side: str, where: str) -> None:
    """Raise :class:`LayoutError` naming a param id listed twice among ``groups``."""
    seen: dict[Any, int] = {}
    for i, (g, _) in enumerate(groups):
        for pid in g[PARAMS]:
            if pid in seen:
                raise LayoutError(
                    f"{where} ({side}): parameter {short_repr(pid)} is listed twice (in groups "
                    f"{seen[pid]} and {i}); torch.optim rejects a parameter in two groups"
                )
            seen[pid] = i
