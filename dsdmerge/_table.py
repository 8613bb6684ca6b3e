"""Torch's flattened optimizer format, read as a table.

DSD's flattened optimizer state dict (``flatten_optimizer_state_dict=True``)
spells one ``param_groups.<fqn>.<hyperparameter>`` key per parameter and
hyperparameter; group membership is not stored. Two readings of those keys:

* :func:`parse_groups`: key by key, any order: ``{fqn: {hyperparameter: value}}``;
  a key whose rest has no dot, or an empty fqn, is no hyperparameter key.
* :class:`PgTable`: the same, when the keys have the shape torch writes (every
  parameter with the same hyperparameter names in the same order, one row after
  another): verified in C-level passes over all keys, then read by columns.

Both give the same rows for the same keys (:class:`PgTable` is only built when the
shape check proves it: every key is ``param_groups.<row fqn>.<column name>``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from itertools import compress, count, islice, repeat
from operator import add, itemgetter, methodcaller
from typing import Any

from dsdmerge.layout import PG_PREFIX

__all__ = ["Block", "PgTable", "joined", "parse_groups", "read_rows", "spelled_rows"]


Block = tuple[int, int, list[str]]  # rows (first, end) and their names, in their order there


@dataclasses.dataclass
class PgTable:
    """The ``param_groups.*`` keys of a flat state dict as a table: one row per parameter.

    Torch's flattened format writes, for every parameter, the same hyperparameters,
    in its group's order, one parameter after another. When a state dict's keys have
    that shape, group inference,
    backfills and conflict checks work on columns of the table in C-level passes
    (:mod:`dsdmerge._groups`); row ``i``, column ``j`` is the key
    ``param_groups.<fqns[i]>.<names[j]>``, whose value is ``values[i * len(names) + j]``.
    """

    picked: bytes  # 1 per reference key that is a param_groups.* key
    keys: list[str]  # those keys, row after row, each row in the order of ``names``
    fqns: list[str]  # one per row
    names: list[str]  # the hyperparameters, one per column
    values: list[Any]  # the reference's values, as ``keys``
    # rows (first, end) whose keys stand in another order of the names (torch writes each
    # group's hyperparameters in its own dict's order: a no-decay group made as
    # {"params": ..., "weight_decay": 0.0} has weight_decay first), with that order; and
    # where each cell's key stands among the picked keys, when some block is not in the
    # order of ``names`` (else None: cell i is picked key i)
    blocks: list[Block] = dataclasses.field(default_factory=list)
    order: list[int] | None = None

    @classmethod
    def of(cls, r: Mapping[str, Any]) -> PgTable | None:
        """The table of ``r``, or ``None`` when its keys do not have that shape.

        torch writes every ``state.*`` key before the first ``param_groups.*`` key,
        so the keys from the first ``param_groups.*`` key on are tried as the table
        first (finding it scans only the keys before it); when they do not all
        fit, every key is tested.
        """
        first = next(compress(count(), map(str.startswith, r, repeat(PG_PREFIX))), None)
        if first is None:
            return None
        tail = bytes(first) + b"\x01" * (len(r) - first)
        table = cls._shaped(
            tail, list(islice(r, first, None)), lambda: list(islice(r.values(), first, None))
        )
        if table is None:  # other keys among them, or no table at all
            picked = bytes(map(str.startswith, r, repeat(PG_PREFIX)))
            if picked != tail:
                table = cls._shaped(
                    picked, list(compress(r, picked)), lambda: list(compress(r.values(), picked))
                )
        return table

    @classmethod
    def _shaped(
        cls, picked: bytes, keys: list[str], values: Callable[[], list[Any]]
    ) -> PgTable | None:
        """The table of ``keys`` (at the positions ``picked``), if they have its shape.

        Read by :func:`read_rows`: every key is ``param_groups.<row fqn>.<name>``,
        which is what :func:`parse_groups` would make of it.
        """
        found = read_rows(keys, PG_PREFIX)
        if found is None:
            return None
        fqns, blocks = found
        names = blocks[0][2]
        k = len(names)
        if all(block_names == names for _, _, block_names in blocks):
            return cls(picked, keys, fqns, names, values(), blocks)
        order: list[int] = []
        for first, end, block_names in blocks:
            if block_names == names:
                order += range(first * k, end * k)
            else:
                perm = list(map(block_names.index, names))
                order += (base + p for base in range(first * k, end * k, k) for p in perm)
        in_r = values()
        table_keys = list(map(keys.__getitem__, order))
        return cls(
            picked, table_keys, fqns, names, list(map(in_r.__getitem__, order)), blocks, order
        )


def read_rows(keys: list[str], prefix: str) -> tuple[list[str], list[Block]] | None:
    """``keys`` read as rows ``<prefix><fqn>.<name>``, one row per fqn, if they are that.

    The shape is checked without splitting every key: the first row gives the names,
    the first key of each row its fqn, and then every key must be
    ``<prefix><row fqn>.<name>`` (one comparison of NUL-joined texts), which is what
    splitting each key at its last dot would make of it. Rows come in blocks (param
    groups) that may each order the names their own way. Returns the fqns (unique,
    none empty) and the blocks ``(first row, end row, names in their order there)``.
    """
    n = len(prefix)
    names = _row_names(keys, 0, None, prefix)
    if names is None:
        return None
    k = len(names)
    rows, rest = divmod(len(keys), k)
    if rest:
        return None
    # every key is <prefix><its row's fqn>.<a name>: the keys joined by NUL equal the expected
    # keys joined by NUL (one join per row builds them), and no key holds a NUL itself (then
    # the joined texts split only one way)
    got = joined(keys)
    if got is None:
        return None
    fqns: list[str] = []
    blocks: list[Block] = []
    texts = []
    row = 0
    while row < rows:
        block_names = names if row == 0 else _row_names(keys, row * k, names, prefix)
        if block_names is None:
            return None
        suffix = "." + block_names[0]
        heads = keys[row * k :: k]
        size = bytes(map(str.endswith, heads, repeat(suffix))).find(0)
        size = len(heads) if size < 0 else size
        if size == 0:
            return None
        block = list(map(itemgetter(slice(n, -len(suffix))), heads[:size]))
        prefixes = list(map(add, repeat(prefix), map(add, block, repeat("."))))
        texts.append(spelled_rows(prefixes, block_names))
        fqns += block
        blocks.append((row, row + size, block_names))
        row += size
    if not all(fqns) or len(set(fqns)) != rows or got != "\0".join(texts):
        return None
    return fqns, blocks


def joined(keys: list[str]) -> str | None:
    """``keys`` joined by NUL, or ``None`` when a key holds a NUL itself.

    Two lists of keys without NULs are equal exactly when their joined texts are:
    one string comparison in C instead of a comparison per key. (With a NUL inside
    a key, other keys could spell the same text.)
    """
    text = "\0".join(keys)
    return text if text.count("\0") == max(len(keys) - 1, 0) else None


def spelled_rows(prefixes: list[str], names: list[str]) -> str:
    """The keys ``prefix + name``, prefix after prefix, joined by NUL (:func:`joined`).

    Built by one ``join`` per prefix, so no key string is made on its own.
    """
    separators = map(add, repeat("\0"), prefixes)
    return "\0".join(map(add, prefixes, map(str.join, separators, repeat(names))))


def _row_names(
    keys: list[str], start: int, names: list[str] | None, prefix: str
) -> list[str] | None:
    """The names of the row whose first key is ``keys[start]``, in their order there.

    Without ``names``: every key after it with the same fqn; with ``names``: the next
    ``len(names)`` keys, which must spell a permutation of ``names`` after one prefix.
    ``None`` if they cannot be a row (no fqn, a name that is empty, repeated or dotted).
    """
    if start >= len(keys):
        return None
    n = len(prefix)
    fqn, dot, _ = keys[start][n:].rpartition(".")
    if not dot or not fqn or not keys[start].startswith(prefix):
        return None
    prefix = f"{prefix}{fqn}."
    if names is None:
        found = []
        for key in islice(keys, start, None):
            head, _, name = key[n:].rpartition(".")
            if head != fqn:
                break
            found.append(name)
    else:
        row = keys[start : start + len(names)]
        if not all(map(str.startswith, row, repeat(prefix))):
            return None
        found = [key[len(prefix) :] for key in row]
        if sorted(found) != sorted(names):
            return None
    if not all(found) or len(set(found)) != len(found) or "." in "".join(found):
        return None
    return found


def parse_groups(flat: Mapping[str, Any]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """``param_groups.<fqn>.<hp>`` keys -> ``{fqn: {hp: value}}`` in key order, and the keys.

    The second mapping is ``{fqn: {hp: flat key}}``, so that the same key can be
    looked up elsewhere without spelling it again.
    """
    hyper: dict[str, dict[str, Any]] = {}
    keys: dict[str, Any] = {}
    n = len(PG_PREFIX)
    for key, value in compress(flat.items(), map(methodcaller("startswith", PG_PREFIX), flat)):
        fqn, dot, name = key[n:].rpartition(".")
        if dot and fqn:
            values = hyper.get(fqn)
            if values is None:
                values = hyper[fqn] = {}
                keys[fqn] = {}
            values[name] = value
            keys[fqn][name] = key
    return hyper, keys
