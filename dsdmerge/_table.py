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

__all__ = ["PgTable", "parse_groups"]


@dataclasses.dataclass
class PgTable:
    """The ``param_groups.*`` keys of a flat state dict as a table: one row per parameter.

    Torch's flattened format writes, for every parameter, the same hyperparameters in
    the same order. When a state dict's keys have that shape, group inference,
    backfills and conflict checks work on columns of the table in C-level passes
    (:mod:`dsdmerge._groups`); row ``i``, column ``j`` is the key
    ``param_groups.<fqns[i]>.<names[j]>``, whose value is ``values[i * len(names) + j]``.
    """

    picked: bytes  # 1 per reference key that is a param_groups.* key
    keys: list[str]  # those keys, row after row
    fqns: list[str]  # one per row
    names: list[str]  # the hyperparameters, one per column
    values: list[Any]  # the reference's values, row after row

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

        The shape is checked without splitting every key: the first row gives the
        hyperparameter names, the first key of each row its fqn, and then every key
        must be ``param_groups.<row fqn>.<column name>`` (one comparison of NUL-joined
        texts), which is what :func:`parse_groups` would make of it.
        """
        n = len(PG_PREFIX)
        if not keys:
            return None
        first_fqn, dot, _ = keys[0][n:].rpartition(".")
        names = []
        for key in keys:
            fqn, dot, name = key[n:].rpartition(".")
            if fqn != first_fqn:
                break
            names.append(name)
        k = len(names)
        rows, rest = divmod(len(keys), k)
        if rest or not dot or not first_fqn or len(set(names)) != k or "." in "".join(names):
            return None
        suffix = "." + names[0]
        heads = keys[::k]
        if not all(map(str.endswith, heads, repeat(suffix))):
            return None
        fqns = list(map(itemgetter(slice(n, -len(suffix))), heads))
        if not all(fqns) or len(set(fqns)) != rows:
            return None
        # every key is param_groups.<its row's fqn>.<its column's name>: the keys joined by
        # NUL equal the expected keys joined by NUL (one join per row builds them), and no
        # key holds a NUL itself (then the joined texts split only one way)
        got = "\0".join(keys)
        if got.count("\0") != len(keys) - 1:
            return None
        prefixes = list(map(add, repeat(PG_PREFIX), map(add, fqns, repeat("."))))
        rows_text = map(
            add, prefixes, map(str.join, map(add, repeat("\0"), prefixes), repeat(names))
        )
        if got != "\0".join(rows_text):
            return None
        return cls(picked, keys, fqns, names, values())


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
