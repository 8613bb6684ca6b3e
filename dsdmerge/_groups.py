"""Param groups: membership, consistent hyperparameters, backfill, moved parameters.

Every rule about param groups is decided here, in one place:

* **Membership.** A flat state dict does not store groups. They are the
  reference's own when it was nested (*given* groups), else *inferred*: the
  parameters whose reference hyperparameters are all equal (:func:`inferred_rows`,
  :func:`equal_hyperparameters`), in order of first appearance.
* **A backfilled hyperparameter takes its group's checkpoint value.** Flat
  (:func:`backfill`): a ``param_groups.<fqn>.<hp>`` key the checkpoint lacks takes
  the value the checkpoint's members of ``fqn``'s group hold (:func:`group_value`);
  the reference's own value only when no member has one. When the members
  disagree: with given groups the most common value, the first on a tie
  (:func:`majority`: members moved in from another group are the minority); with
  inferred groups no value is picked and the merge is refused (:func:`ambiguous`:
  the inference may have joined two groups scheduled apart). Nested
  (:func:`merge_groups`, where both sides' groups are known): a reference group
  takes all its hyperparameters from its *home* checkpoint group
  (:func:`home_group`: the one at the same position when some member comes from it,
  as ``Optimizer.load_state_dict`` pairs groups, else the one most members come
  from), and the reference's values for names that group lacks.
* **Consistency.** Checkpoint members of one group that disagree on a
  hyperparameter are a *conflict* (torch silently keeps the first member's value
  for the whole group): :func:`conflict` names them. A consistent checkpoint is
  usually proven so without finding the groups (:func:`proven_consistent`).
  Nested, a member in another
  checkpoint group than its reference group's home group has *moved*, and takes
  its new group's hyperparameters.
* **Int-keyed optimizers** map parameters by position: their group counts and
  sizes must agree (:func:`merge_groups` reports it as a problem, a refusal).

How: the flat rules run on columns of a :class:`~dsdmerge._table.PgTable` when the
reference's keys have torch's shape (identity bit masks against a few template
rows; conflicts by column with ``is`` before value equality), else key by key
(:func:`_resolve_by_keys`); both give the same results. Flattened optimizers
under a prefix (``optim.param_groups.*`` in a flattened whole checkpoint) get the
same treatment (:func:`prefixed`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from functools import partial
from itertools import compress, count, filterfalse, islice, pairwise, repeat
from operator import contains, is_, is_not, itemgetter
from typing import Any

from dsdmerge._records import Outcome
from dsdmerge._table import PgTable, parse_groups
from dsdmerge._trees import copy_group
from dsdmerge._values import MISSING, freeze, key_str, same_value, short_repr
from dsdmerge.errors import LayoutError, StateDictTypeError
from dsdmerge.layout import PARAM_GROUPS, PARAMS, PG_PREFIX, STATE, group_items

__all__ = [
    "DISAGREE",
    "NESTED_PG",
    "ambiguous",
    "backfill",
    "conflict",
    "equal_hyperparameters",
    "group_prefix",
    "group_value",
    "home_group",
    "inferred_rows",
    "majority",
    "merge_groups",
    "most_common",
    "prefixed",
    "proven_consistent",
    "resolve",
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
    if all(map(is_, present, repeat(first))) or all(same_value(first, v) for v in present):
        return first
    return DISAGREE


def majority(values: list[Any]) -> Any:
    """The most common present value (by equality; the first of them on a tie)."""
    kinds: list[list[Any]] = []  # [representative, count]
    for v in values:
        if v is MISSING:
            continue
        for kind in kinds:
            if kind[0] is v or same_value(kind[0], v):
                kind[1] += 1
                break
        else:
            kinds.append([v, 1])
    best = max(kind[1] for kind in kinds)
    return next(kind[0] for kind in kinds if kind[1] == best)


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


def ambiguous(index: int, name: str, members: list[str], values: list[Any], key: str) -> str:
    shown: list[tuple[str, Any]] = []
    for member, v in zip(members, values, strict=True):
        if v is not MISSING and not any(same_value(v, seen) for _, seen in shown):
            shown.append((member, v))
        if len(shown) == 2:
            break
    (a, va), (b, vb) = shown
    return (
        f"param group {index} (inferred from equal reference hyperparameters): its checkpoint "
        f"members disagree on {name!r} ({a} has {short_repr(va)}, {b} has {short_repr(vb)}), "
        f"so it may be two groups scheduled apart and the value for {key!r} cannot be told. "
        "Pass the reference nested (get_optimizer_state_dict without "
        "flatten_optimizer_state_dict), so that the true groups are known."
    )


def conflict(group: str, name: str, first: tuple[str, Any], other: tuple[str, Any]) -> str:
    """The report of two checkpoint members of a param group that disagree on ``name``."""
    return (
        f"param group {group}: checkpoint members disagree on {name!r}: {first[0]} has "
        f"{short_repr(first[1])}, {other[0]} has {short_repr(other[1])}; "
        "torch keeps the first member's value for the whole group"
    )


def proven_consistent(r_values: list[Any], c_values: list[Any], period: int) -> bool:
    """Whether no param group can have checkpoint members that disagree: a quick proof.

    ``r_values`` and ``c_values`` are the two sides' values at the same positions,
    which cover every hyperparameter key (where the checkpoint lacks a key, any value
    may stand in: it only makes the proof harder). The sufficient condition proven
    is name-free and structure-free: *any two positions whose reference values are
    equal (:func:`~dsdmerge._values.same_value`) hold equal checkpoint values*.
    Members of one group have equal reference values for each hyperparameter
    (inferred groups by definition; given groups share their group's value
    objects), so then none of them disagree. ``False`` means "not proven": the
    exact, group-by-group check decides.

    How: the positions are sliced by ``period`` (in torch's layout, one slice per
    hyperparameter), each slice cut into runs of one reference object; a run whose
    checkpoint values are all equal (one object, or ``==`` between values of one
    plain scalar type) is summarised by one (reference, checkpoint) pair, and the
    pairs of equal reference values must have equal checkpoint values.
    """
    pairs: list[tuple[Any, Any]] = []
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
            if len(pairs) + len(cuts) > _PROOF_RUNS:
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
                pairs.append((r_col[start], first))
        held: dict[Any, Any] = {}
        for rv, cv in pairs:
            first = held.setdefault(freeze(rv), cv)
            if first is not cv and not same_value(first, cv):
                return False
    except Exception:  # an exotic value (its == or hash raises): not proven  # noqa: BLE001
        return False
    return True


# Values of these types that are == and of one type are same_value (NaN is never == itself).
_EXACT = frozenset({float, int, bool, str, type(None)})
_PROOF_RUNS = 4096  # runs summarised at most: beyond, the exact check is cheaper


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
# flat state dicts: backfill and conflicts


def resolve(
    c: Mapping[str, Any],
    r: Mapping[str, Any],
    groups: list[list[str]] | None,
    backfilled: list[str],
    outcome: Outcome,
    *,
    conflicts: bool,
    c_at_r: Callable[[], Iterable[Any]] | None = None,
) -> None:
    """Group-consistent values for backfilled ``param_groups.*`` keys, and conflicts.

    By columns when the reference's ``param_groups.*`` keys form a table (every
    parameter with the same hyperparameter names, in the same order: what torch
    writes), else key by key.
    """
    table = PgTable.of(r)
    if table is None:
        _resolve_by_keys(c, r, groups, backfilled, outcome, conflicts=conflicts)
    else:
        _resolve_table(table, c, groups, backfilled, outcome, conflicts=conflicts, c_at_r=c_at_r)


def _resolve_table(
    table: PgTable,
    c: Mapping[str, Any],
    groups: list[list[str]] | None,
    backfilled: list[str],
    outcome: Outcome,
    *,
    conflicts: bool,
    c_at_r: Callable[[], Iterable[Any]] | None,
) -> None:
    """:func:`_resolve_by_keys`, by the columns of ``table``."""
    inferred = " (inferred)" if groups is None else ""
    if groups is None:
        rows = inferred_rows(table)
    else:
        row_of = dict(zip(table.fqns, count()))
        rows = [[i for i in map(row_of.get, g) if i is not None] for g in groups]
    if not backfilled and not conflicts:
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
    if backfilled:
        fqns = table.fqns
        col_of = dict(zip(table.names, count()))

        def values_of(index: int, name: str) -> list[Any]:
            return list(map(c_vals[col_of[name] :: k].__getitem__, rows[index]))

        backfill(
            c,
            outcome.merged,
            backfilled,
            [[fqns[i] for i in members] for members in rows],
            inferred=groups is None,
            problems=outcome.problems,
            values_of=values_of,
        )
    if not conflicts:
        return
    blocks = table.blocks or [(0, len(table.fqns), table.names)]
    for index, members in enumerate(rows):
        found: list[tuple[int, int, str]] = []
        # reported in the order the group's keys name them (its first member's block)
        names = next((b for first, end, b in blocks if members and first <= members[0] < end), [])
        place = dict(zip(names, count()))
        for j, name in enumerate(table.names):
            column = list(map(c_vals[j::k].__getitem__, members))
            if column and all(map(is_, column, repeat(column[0]))) and column[0] is not MISSING:
                continue  # the same object for every member: no conflict
            first: tuple[int, Any] | None = None
            for at, value in enumerate(column):
                if value is MISSING:
                    continue
                if first is None:
                    first = (at, value)
                elif not same_value(first[1], value):
                    text = conflict(
                        f"{index}{inferred}",
                        name,
                        (table.fqns[members[first[0]]], first[1]),
                        (table.fqns[members[at]], value),
                    )
                    found.append((at, place.get(name, j), text))
                    break
        found.sort(key=itemgetter(0, 1))
        outcome.conflicts.extend(text for _, _, text in found)


def backfill(
    c: Mapping[str, Any],
    merged: dict[str, Any] | None,
    backfilled: list[str],
    groups: list[list[str]],
    *,
    inferred: bool,
    problems: list[str],
    values_of: Callable[[int, str], list[Any]] | None = None,
) -> None:
    """Give each backfilled ``param_groups.*`` key its group's checkpoint value.

    ``groups`` are lists of fqns. The value is the one the checkpoint's members of
    the group hold (the most common one, the first on a tie, when they disagree:
    members moved in from another group are the minority); the reference's when
    no member has one. With ``inferred`` groups (made from equal reference values)
    members that disagree may be two groups the inference could not tell apart,
    so no value is picked: a line goes to ``problems`` (the merge is refused).
    Writes into ``merged`` unless it is ``None`` (a check). Each group and
    hyperparameter is scanned once: ``values_of(group, name)``, if given, is the
    checkpoint's value for each member in order (``MISSING`` where it has none), as
    the keys ``param_groups.<member>.<name>`` looked up in ``c`` would give.
    """
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
            members = groups[index]
            if values_of is None:
                keys = [f"{PG_PREFIX}{member}.{name}" for member in members]
                values = list(map(c.get, keys, repeat(MISSING)))
            else:
                values = values_of(index, name)
            value = group_value(values)
            if value is DISAGREE:
                if inferred:
                    problems.append(ambiguous(index, name, members, values, key))
                    value = MISSING
                else:
                    value = majority(values)
            found[index, name] = value
        if value is not MISSING and merged is not None:
            merged[key] = value


def _resolve_by_keys(
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
    r_hyper, r_keys = parse_groups(r)
    inferred_from_nested = groups is not None
    inferred = " (inferred)" if groups is None else ""
    if groups is None:
        groups = equal_hyperparameters((fqn, values.items()) for fqn, values in r_hyper.items())
    if backfilled:
        backfill(
            c,
            outcome.merged,
            backfilled,
            groups,
            inferred=not inferred_from_nested,
            problems=outcome.problems,
        )
    if not conflicts:
        return
    c_get = c.get
    for index, members in enumerate(groups):
        seen: dict[str, tuple[str, Any]] = {}
        reported: set[str] = set()
        for member in members:
            keys = r_keys.get(member)
            if not keys:
                continue
            for name, key in keys.items():
                value = c_get(key, MISSING)
                if value is MISSING or name in reported:
                    continue
                first = seen.get(name)
                if first is None:
                    seen[name] = (member, value)
                elif first[1] is not value and not same_value(first[1], value):
                    reported.add(name)
                    outcome.conflicts.append(
                        conflict(f"{index}{inferred}", name, first, (member, value))
                    )


NESTED_PG = "." + PG_PREFIX


def group_prefix(key: str) -> str:
    """``"optim."`` for ``"optim.param_groups.w.lr"``; ``""`` when there is no such prefix."""
    at = key.find(NESTED_PG)
    return key[: at + 1] if at >= 0 else ""


def prefixed(
    c: Mapping[str, Any], r: Mapping[str, Any], outcome: Outcome, *, conflicts: bool
) -> None:
    """Group-consistent hyperparameters for flattened optimizers under a prefix.

    A flattened whole checkpoint spells its optimizer's keys
    ``optim.param_groups.<fqn>.<hp>``: each such prefix gets the same treatment as
    top-level ``param_groups.*`` keys, on the keys under it.
    """
    merged = outcome.merged
    backfilled = [k for k in outcome.missing if NESTED_PG in k]
    prefixes = dict.fromkeys(filter(None, map(group_prefix, backfilled)))
    if conflicts:
        # only keys with ".param_groups." in them (a C-level pass) have a prefix
        nested = compress(c, map(contains, c, repeat(NESTED_PG)))
        prefixes.update(dict.fromkeys(filter(None, map(group_prefix, nested))))
    for prefix in prefixes:
        head, n = prefix + PG_PREFIX, len(prefix)
        sub_c = {k[n:]: v for k, v in c.items() if k.startswith(head)}
        sub_r = {k[n:]: v for k, v in r.items() if k.startswith(head)}
        mine = [k[n:] for k in backfilled if k.startswith(head)]
        sub = Outcome({} if merged is not None else None, [], [], [])
        resolve(sub_c, sub_r, None, mine, sub, conflicts=conflicts)
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
                    outcome.conflicts.append(
                        f"{where}: {s} moved: it is in checkpoint group {own} but the "
                        f"reference puts it with members of checkpoint group {ci}, whose "
                        "hyperparameters it takes"
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
