"""Work and memory stay bounded by the input: rename suggestions over many keys, resizes
from a reference whose tensors hold few bytes, allow-list ranges. The attacker's files are
built here; time and address space are bounded in a child process."""

from __future__ import annotations

import sys

import hostile_files as hf
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file

import dsdmerge as dm
import dsdmerge.rename

rename_module = sys.modules["dsdmerge.rename"]

# -- rename suggestions ------------------------------------------------------------------


def test_rename_suggestions_over_a_hundred_thousand_keys_take_seconds(tmp_path):
    """A DDP checkpoint (every key behind ``module.``) of 100k model keys: the suggestion
    pairs every unexpected key with a missing one, each in one lookup."""
    n = 100_000
    ref = {f"layers.{i}.w": torch.zeros(1) for i in range(n)}
    save_file(ref, str(tmp_path / "ref.safetensors"))
    save_file({"module." + k: v for k, v in ref.items()}, str(tmp_path / "ddp.safetensors"))
    proc, seconds = hf.run_cli_bounded(
        "diff", str(tmp_path / "ddp.safetensors"), str(tmp_path / "ref.safetensors"), seconds=30
    )
    assert proc.returncode == 1, proc.stderr
    assert "to apply: --rename '^module\\.='" in proc.stdout
    assert f"{n:,} params, {n:,} keys" in proc.stdout
    assert seconds < 30, seconds


def _explains_key_by_key(rules, c, r, sources, targets):
    """What a rename must do to be suggested, one key at a time (the definition)."""
    olds = list(c.counts)
    news = rename_module.Renamer(tuple(rules)).names(olds)
    found = {}
    for old, new in zip(olds, news, strict=True):
        if new == old:
            continue
        if old not in sources or new not in targets or new in found.values():
            return None
        found[old] = new
    if not found:
        return None
    for key, before, fqn, after in zip(c.keys, c.befores, c.fqns, c.afters, strict=True):
        if fqn not in found:
            continue
        spelled = before + found[fqn] + after
        if r.of_key.get(spelled) != (before, found[fqn], after):
            return None
        if not rename_module._same_meta(c.flat[key], r.flat[spelled]):
            return None
    return found


_NAMES = st.sampled_from(["a", "b", "wq", "q", "module", "0", "1", "x.y"])
_VALUES = st.sampled_from(
    [torch.zeros(2), torch.zeros(3), torch.zeros(2, dtype=torch.int8), 0.1, "s", None]
)


@given(
    st.dictionaries(st.lists(_NAMES, min_size=1, max_size=3).map(".".join), _VALUES),
    st.dictionaries(st.lists(_NAMES, min_size=1, max_size=3).map(".".join), _VALUES),
    st.sampled_from([{"^module\\.": ""}, {"wq": "q"}, {"^": "module."}, {"(?<![^.])a": "b"}]),
)
def test_a_rename_explains_keys_exactly_as_key_by_key(ckpt, ref, rule):
    """The bulk check accepts a rename exactly when every key, respelled, is a missing key
    split the same way with the same shape and dtype."""
    d = dm.diff(ckpt, ref)
    if not d.missing or not d.unexpected:
        return
    c = rename_module._Side(ckpt, list(d.unexpected))
    r = rename_module._Side(ref, list(d.missing))
    rules = list(rename_module.compile_rules(rule))
    sources, targets = set(c.whole), set(r.whole)
    assert rename_module._explains(rules, c, r, sources, targets) == _explains_key_by_key(
        rules, c, r, sources, targets
    )


@given(st.lists(st.tuples(_VALUES, _VALUES)))
def test_same_metas_is_same_meta_of_each_pair(pairs):
    a, b = [x for x, _ in pairs], [y for _, y in pairs]
    assert rename_module._same_metas(a, b) == all(map(rename_module._same_meta, a, b))


def test_split_many_is_split_of_each_key():
    keys = [
        "optim.state.l.0.w.exp_avg",
        "optim.param_groups.l.0.w.lr",
        "optim.state.l.0.w.step",
        "model.l.0.w",
        "model",
        "optim.state.l.0.w.nested.name",
    ]
    flat = dict.fromkeys(keys, 0)
    index = rename_module.FlatKeys(list(flat))
    befores, fqns, afters, kept = index.split_many(list(flat))
    want = [(k, index.split(k)) for k in flat if index.split(k) is not None]
    assert kept == [k for k, _ in want]
    assert list(zip(befores, fqns, afters, strict=True)) == [s for _, s in want]


# -- allow-list ranges -------------------------------------------------------------------


def test_a_million_key_range_in_an_allow_list_compiles_in_no_time(tmp_path):
    """``--allow-missing 'x.{0..999999}'`` (as reports print ranges) is matched as a range."""
    torch.save({"w": torch.zeros(1)}, tmp_path / "ckpt.pt")
    torch.save({"w": torch.zeros(1), "x.123456": torch.zeros(1)}, tmp_path / "ref.pt")
    args = [str(tmp_path / "ckpt.pt"), str(tmp_path / "ref.pt")]
    for option in ("--allow-missing", "--only"):
        big = "x.{0..999999,1000000..99999999999999999999}"
        proc, seconds = hf.run_cli_bounded("diff", *args, option, big, seconds=20, extra=1 << 28)
        assert proc.returncode == (0 if option == "--allow-missing" else 1), proc.stderr
        assert seconds < 5, seconds
    proc, _ = hf.run_cli_bounded(
        "check", *args, "--policy", "strict", "--allow-missing", "x.{0..123455}", seconds=20
    )
    assert proc.returncode == 1, proc.stdout  # 123456 is not in the range
    assert "x.123456" in proc.stdout


@given(
    st.lists(
        st.tuples(st.integers(0, 10**7), st.integers(0, 10**7)).map(sorted), min_size=1, max_size=4
    ),
    st.lists(st.integers(0, 2 * 10**7), max_size=20),
    st.lists(st.sampled_from(["01", "-1", "1.5", "x", "", "1e3", "00"]), max_size=3),
)
def test_ranges_match_exactly_the_numbers_they_hold(ranges, numbers, junk):
    from dsdmerge.policy import matcher

    text = "x.{" + ",".join(f"{a}..{b}" if a < b else str(a) for a, b in ranges) + "}.w"
    allowed = matcher([text])
    for n in [*numbers, *(a for a, _ in ranges), *(b for _, b in ranges)]:
        for probe in (n - 1, n, n + 1):
            inside = any(a <= probe <= b for a, b in ranges)
            assert allowed(f"x.{probe}.w") == inside, (text, probe)
    for segment in junk:  # not a plain decimal: never in a range
        assert not allowed(f"x.{segment}.w")
    small = [r for r in ranges if r[1] - r[0] < 1000]
    if small and len(small) == len(ranges):
        keys = dm.report.expand(text)
        assert all(map(allowed, keys))
        assert len(keys) == len({n for a, b in ranges for n in range(a, b + 1)})
