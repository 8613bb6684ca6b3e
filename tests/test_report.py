"""Compressed key reports: exactness (property), bounded output, direction words, JSON form."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dsdmerge as dm
from dsdmerge.report import (
    Pattern,
    PatternError,
    compress,
    expand,
    format_keys,
    parse_pattern,
    render,
    summary,
)

# Segments chosen to provoke every trap: ranges, leading zeros, non-ASCII digits,
# empty segments, the escape characters, and text that looks like pattern syntax.
SEGMENTS = st.one_of(
    st.integers(0, 12).map(str),
    st.sampled_from(
        ["", "0", "00", "01", "007", "-1", "+1", "1e3", "٣", "wq", "wk", "w1", "experts"]
    ),
    st.sampled_from(["{", "}", ",", "\\", "{0..3}", "a,b", "{}", "..", "\\{", " ", "\n"]),
    st.text(max_size=3),
)
STRUCTURED = st.lists(SEGMENTS, min_size=1, max_size=5).map(".".join)
KEYS = st.one_of(
    st.sets(STRUCTURED, max_size=60),
    st.sets(st.one_of(STRUCTURED, st.text(max_size=8)), max_size=30),
)


def _grid(draw_sizes: list[int], names: list[str]) -> set[str]:
    keys = {""}
    for size, name in zip(draw_sizes, names, strict=True):
        keys = {f"{k}.{name}.{i}" if k else f"{name}.{i}" for k in keys for i in range(size)}
    return keys


@st.composite
def grids_with_holes(draw: st.DrawFn) -> set[str]:
    """Structured key sets like real models (layers x experts x projections) with holes."""
    sizes = draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))
    keys = _grid(sizes, ["layers", "experts", "proj"][: len(sizes)])
    holes = draw(st.sets(st.sampled_from(sorted(keys)), max_size=len(keys)))
    return keys - holes


@given(st.one_of(KEYS, grids_with_holes()))
def test_compression_is_exact_disjoint_and_complete(keys):
    patterns = compress(keys)
    expanded = [expand(p) for p in patterns]
    assert set().union(*expanded) == set(keys)  # nothing lost, nothing invented
    assert sum(len(e) for e in expanded) == len(keys)  # disjoint
    assert [p.count for p in patterns] == [len(e) for e in expanded]
    assert all(e <= set(keys) for e in expanded)  # no pattern claims a key that does not exist


@given(st.one_of(KEYS, grids_with_holes()), st.integers(1, 3))
def test_split_patterns_stay_exact_and_short(keys, max_parts):
    patterns = compress(keys, max_parts=max_parts)
    expanded = [expand(str(p)) for p in patterns]
    assert set().union(*expanded) == set(keys)
    assert sum(len(e) for e in expanded) == len(keys)
    for p in patterns:
        text = str(p)
        assert all(group.count(",") < max_parts for group in text.replace("\\,", "").split("{"))


def test_long_alternative_lists_are_split_in_reports():
    keys = [f"n{i}.w" for i in range(40)]
    lines = str(dm.KeyDiff(missing=tuple(keys))).splitlines()
    assert len(lines) == 4  # header and three patterns of at most 16 names
    assert max(len(line) for line in lines) < 120


@given(st.one_of(KEYS, grids_with_holes()))
def test_pattern_text_parses_back_to_the_same_keys(keys):
    for p in compress(keys):
        text = str(p)
        assert expand(text) == expand(p), text
        assert parse_pattern(text) == p


@given(st.one_of(KEYS, grids_with_holes()), st.randoms(use_true_random=False))
def test_compression_depends_only_on_the_set_of_keys(keys, rnd):
    shuffled = list(keys) * 2
    rnd.shuffle(shuffled)
    expected = compress(keys)
    assert compress(shuffled) == expected
    # a mapping's keys and a set are taken as they are (no copy): same patterns
    assert compress(dict.fromkeys(shuffled)) == expected
    assert compress(frozenset(shuffled)) == expected
    assert compress(dict.fromkeys(shuffled).keys(), max_parts=2) == compress(keys, max_parts=2)


def test_compress_leaves_the_collector_as_it_was():
    import gc

    assert gc.isenabled()
    compress([f"layers.{i}.w" for i in range(100)])
    assert gc.isenabled()
    gc.disable()
    try:
        compress([f"layers.{i}.w" for i in range(100)])
        assert not gc.isenabled()
    finally:
        gc.enable()


@given(
    st.lists(
        st.sets(st.sampled_from(["0", "1", "2", "3", "5", "01", "x", ""]), min_size=1, max_size=4),
        max_size=4,
    )
)
def test_a_full_product_compresses_into_one_pattern(sets):
    keys = {""}
    for alternatives in sets:
        keys = {f"{k}.{a}" for k in keys for a in alternatives}
    keys = {k[1:] for k in keys}
    if sets:
        assert len(compress(keys)) == 1


def test_gaps_are_shown_exactly():
    keys = [f"layers.{i}.w" for i in range(61) if i != 4]
    assert [str(p) for p in compress(keys)] == ["layers.{0..3,5..60}.w"]


def test_two_keys_are_not_claimed_as_four():
    # HF-style compression shows layers.{0,1}.experts.{0,1} here: two keys as if four.
    patterns = compress(["layers.0.experts.1", "layers.1.experts.0"])
    assert sorted(str(p) for p in patterns) == ["layers.0.experts.1", "layers.1.experts.0"]


def test_leading_zeros_are_not_ranges():
    patterns = compress(["a.01", "a.02", "a.03", "a.1"])
    assert [str(p) for p in patterns] == ["a.{1,01,02,03}"]
    assert expand(patterns[0]) == {"a.01", "a.02", "a.03", "a.1"}


def test_special_characters_are_escaped():
    keys = {"a{b}.x", "c,d.x", "e\\f.x", "{0}.x"}
    [p] = compress(keys)
    assert str(p) == "{a\\{b\\},c\\,d,e\\\\f,\\{0\\}}.x"
    assert expand(str(p)) == keys


def test_empty_segments_and_empty_key():
    keys = {"", "a..b", "a.x.b", ".", "a."}
    assert set().union(*map(expand, compress(keys))) == keys


@pytest.mark.parametrize(
    "text", ["a.{0..", "a.{b", "a}b", "a.{1..0}", "a.{01..3}", "a.{x}y", "a\\", "{a.b}"]
)
def test_bad_pattern_texts_raise(text):
    with pytest.raises(PatternError):
        parse_pattern(text)


def test_compress_rejects_non_str_keys():
    with pytest.raises(dm.StateDictTypeError):
        compress([1, "a"])


def test_pattern_is_a_value():
    p = Pattern((("a",), ("0", "1")))
    assert p.count == len(p) == 2
    assert p.to_dict() == {"pattern": "a.{0,1}", "count": 2}
    assert json.loads(json.dumps(p.to_dict())) == p.to_dict()


# -- reports ------------------------------------------------------------------------------


def _moe_keys(layers, experts, skip=()):
    return [
        f"state.layers.{layer}.mlp.experts.{e}.{w}.weight.{s}"
        for layer in range(layers)
        for e in range(experts)
        if (layer, e) not in skip
        for w in ("w1", "w2", "w3")
        for s in ("exp_avg", "exp_avg_sq")
    ]


def test_report_words_and_counts():
    missing = _moe_keys(4, 8)
    d = dm.KeyDiff(missing=tuple(missing), unexpected=("ema.w",))
    text = str(d)
    assert text.splitlines() == [
        "192 keys missing from the checkpoint (will be taken from the reference):",
        "  state.layers.{0..3}.mlp.experts.{0..7}.{w1,w2,w3}.weight.{exp_avg,exp_avg_sq}"
        "  (192 keys)",
        "1 key unexpected in the checkpoint (not in the reference):",
        "  ema.w",
    ]


def test_report_is_bounded_and_counts_the_rest():
    keys = [f"block{i}.w.{j}" for i in range(30) for j in range(i + 1)]
    text = render(dm.KeyDiff(missing=tuple(keys)), limit=3)
    lines = text.splitlines()
    assert len(lines) == 5
    assert lines[1] == "  block29.w.{0..29}  (30 keys)"
    shown = 30 + 29 + 28
    assert lines[-1] == f"  ... and {len(keys) - shown} more keys in 27 patterns"


def test_report_is_deterministic():
    keys = _moe_keys(3, 5, skip={(1, 2), (2, 0)})
    shuffled = keys[:]
    random.Random(0).shuffle(shuffled)
    assert str(dm.KeyDiff(missing=tuple(keys))) == str(dm.KeyDiff(missing=tuple(shuffled)))


def test_report_never_claims_a_missing_key_that_is_present():
    keys = _moe_keys(3, 4, skip={(0, 1), (2, 3)})
    d = dm.KeyDiff(missing=tuple(keys))
    claimed = set()
    for line in render(d, limit=100).splitlines()[1:]:
        text = line.strip().split("  (")[0]
        claimed |= expand(text)
    assert claimed == set(keys)


def test_mismatches_show_both_sides_grouped_by_shapes():
    ckpt = {f"layers.{i}.w": torch.zeros(2, 3) for i in range(5)}
    ckpt["head"] = torch.zeros(4, dtype=torch.bfloat16)
    ref = {f"layers.{i}.w": torch.zeros(3, 3) for i in range(5)}
    ref["head"] = torch.zeros(4)
    text = str(dm.diff(ckpt, ref))
    assert text.splitlines() == [
        "6 tensors in both with a different shape or dtype:",
        "  layers.{0..4}.w: checkpoint float32[2, 3], reference float32[3, 3]  (5 keys)",
        "  head: checkpoint bfloat16[4], reference float32[4]",
    ]


def test_table_and_colour_forms():
    d = dm.KeyDiff(missing=("a.0", "a.1", "a.2", "b"))
    assert render(d, table=True).splitlines()[1:] == ["  3  a.{0..2}", "  1  b"]
    coloured = render(d, color=True)
    assert "\x1b[" in coloured
    assert "\x1b[" not in render(d)


def test_no_differences():
    assert str(dm.KeyDiff()) == "no differences"


def test_format_keys_is_bounded_one_line():
    keys = [f"m{i}" + ".x" * (i + 1) for i in range(20)] + [f"layers.{i}.w" for i in range(100)]
    text = format_keys(keys, limit=2)
    assert "\n" not in text
    assert text.startswith("'layers.{0..99}.w' (100 keys), ")
    assert text.endswith(" and 19 more keys in 19 patterns")


def test_merge_error_messages_use_patterns_and_stay_bounded():
    ref = {f"layers.{i}.experts.{e}.w": 0 for i in range(61) for e in range(256)}
    ckpt = {k: v for k, v in ref.items() if not k.startswith(("layers.3.", "layers.7."))}
    ckpt.update({f"old{i}" + ".x" * i: 0 for i in range(50)})
    with pytest.raises(dm.MergeError) as info:
        dm.merge(ckpt, ref, policy="strict")
    message = str(info.value)
    assert "'layers.{3,7}.experts.{0..255}.w' (512 keys)" in message
    assert "more keys in" in message
    assert len(message) < 1500


def test_summary_is_json_ready_and_exact():
    d = dm.diff(
        {"a.0": torch.zeros(1), "old": torch.zeros(1)},
        {"a.0": torch.zeros(2), "a.1": torch.zeros(1), "a.2": torch.zeros(1)},
    )
    s = json.loads(json.dumps(summary(d)))
    assert s["missing"] == {
        "count": 2,
        "patterns": [{"pattern": "a.{1,2}", "count": 2}],
        "patterns_not_shown": 0,
    }
    assert s["unexpected"]["patterns"] == [{"pattern": "old", "count": 1}]
    assert s["mismatched"]["patterns"] == [
        {"pattern": "a.0", "count": 1, "checkpoint": "float32[1]", "reference": "float32[2]"}
    ]
    assert summary(d, limit=0)["missing"]["patterns_not_shown"] == 1
