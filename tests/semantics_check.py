"""The check that the engine's Outcome equals the plain semantics' (tests/test_semantics.py)."""

from __future__ import annotations

from conftest import Snapshot, same_tree

import dsdmerge as dm
from dsdmerge import _engine, _spec


def _tree_order(tree):
    """The key order of every mapping in ``tree`` (same_tree ignores it)."""
    out, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            out.append(list(node))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return out


def _run(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs), None
    except dm.DSDMergeError as err:
        return None, type(err)


def assert_same_outcome(c, r, **options):
    snaps = Snapshot(c), Snapshot(r)
    fast, fast_error = _run(_engine.run, c, r, **options)
    plain, plain_error = _run(_spec.outcome, c, r, **options)
    assert fast_error is plain_error
    assert all(s.unchanged() for s in snaps)
    if fast is None:
        return
    assert fast.missing == plain.missing
    assert fast.unexpected == plain.unexpected
    assert fast.mismatches == plain.mismatches
    assert fast.conflicts == plain.conflicts
    assert fast.problems == plain.problems
    assert [t[:2] for t in fast.ties] == [t[:2] for t in plain.ties]
    assert (fast.merged is None) == (plain.merged is None)
    if fast.merged is None:
        return
    assert same_tree(fast.merged, plain.merged)
    assert _tree_order(fast.merged) == _tree_order(plain.merged)
    assert list(fast.take_reference) == list(plain.take_reference)
    for key, slot in fast.take_reference.items():
        other = plain.take_reference[key]
        assert slot.checkpoint is other.checkpoint
        assert slot.reference is other.reference
        slot()  # each puts the reference's value in its own result, at the same place
        other()
    assert same_tree(fast.merged, plain.merged)
