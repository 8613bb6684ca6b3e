"""Work and memory stay bounded by the input: rename suggestions over many keys, resizes
from a reference whose tensors hold few bytes, allow-list ranges. The attacker's files are
built here; time and address space are bounded in a child process."""

from __future__ import annotations

import sys
from pathlib import Path

import hostile_files as hf
import pytest
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
        "diff", str(tmp_path / "ddp.safetensors"), str(tmp_path / "ref.safetensors"), seconds=60
    )
    assert proc.returncode == 1, proc.stderr
    assert "to apply: --rename '^module\\.='" in proc.stdout
    assert f"{n:,} params, {n:,} keys" in proc.stdout
    # about 10 s here with reading both headers (a quadratic check took minutes)
    assert seconds < 60, seconds


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


# -- resizes --------------------------------------------------------------------------------


def expanded_reference(tmp_path, rows: int, cols: int) -> str:
    """A reference .pt of a few bytes whose tensor claims [rows, cols]: stride 0, one float."""
    path = tmp_path / f"ref-{rows}x{cols}.pt"
    torch.save({"w": torch.zeros(1, 1).expand(rows, cols), "b": torch.zeros(2)}, path)
    return str(path)


def test_a_stride_0_reference_cannot_make_a_resize_allocate_beyond_the_files(tmp_path):
    torch.save({"w": torch.ones(2, 2), "b": torch.ones(2)}, tmp_path / "ckpt.pt")
    ref = expanded_reference(tmp_path, 4096, 4096)
    assert Path(ref).stat().st_size < 2_000  # 1.5 KB on disk, 64 MiB as a tensor
    out = tmp_path / "out.pt"
    args = ["merge", str(tmp_path / "ckpt.pt"), ref, "-o", str(out), "--on-shape-mismatch"]
    # 32 MiB of address space more than the imports: the 64 MiB clone cannot even be tried
    proc, _ = hf.run_cli_bounded(*args, "resize", seconds=60, extra=32 << 20)
    assert proc.returncode == 1, proc.stderr
    assert "67,108,864 bytes, more than the bytes the checkpoint's and the reference's" in (
        proc.stderr
    )
    assert "--max-bytes BYTES" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()
    # asked for: allowed, and made
    proc, _ = hf.run_cli_bounded(*args, "resize", "--max-bytes", "64MiB", seconds=60)
    assert proc.returncode == 0, proc.stderr
    assert torch.load(out, weights_only=True)["w"].shape == (4096, 4096)


def test_a_resize_whose_allocation_fails_is_a_merge_error(tmp_path):
    """A [10^6, 10^6] claim (4 TB) with the bound lifted: torch's allocator fails, and the
    error is a MergeError naming the key, never a bare RuntimeError out of dm.merge."""
    ckpt = {"w": torch.ones(2, 2)}
    ref = {"w": torch.zeros(1, 1).expand(10**6, 10**6)}
    with pytest.raises(dm.MergeError, match="more than the bytes"):
        dm.merge(ckpt, ref, on_shape_mismatch="resize")
    with pytest.raises(dm.MergeError, match=r"'w': cannot resize: .* could not be made"):
        dm.merge(ckpt, ref, on_shape_mismatch="resize", max_resize_bytes=10**15)
    torch.save(ckpt, tmp_path / "ckpt.pt")
    args = ["merge", str(tmp_path / "ckpt.pt"), expanded_reference(tmp_path, 10**6, 10**6)]
    out = str(tmp_path / "out.pt")
    proc, _ = hf.run_cli_bounded(
        *args, "-o", out, "--on-shape-mismatch", "resize", "--max-bytes", "1e15", seconds=60
    )
    assert proc.returncode == 1, proc.stderr
    assert "could not be made" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not Path(out).exists()


def test_the_resize_bound_counts_storages_not_shapes():
    from dsdmerge.resize import held_nbytes

    base = torch.zeros(8, 8)
    trees = ({"a": base, "b": base[2:], "c": [base.t(), (base[0],)]}, {"m": torch.zeros(3)})
    assert held_nbytes(*trees) == 8 * 8 * 4 + 3 * 4
    assert held_nbytes({"x": torch.zeros(10, device="meta")}) == 0
    grown = {"w": torch.zeros(6, 4)}  # a real reference: its own bytes always cover its resize
    merged = dm.merge({"w": torch.ones(4, 4)}, grown, on_shape_mismatch="resize")
    assert merged["w"].shape == (6, 4)
    with pytest.raises(dm.InvalidPolicyError, match="max_resize_bytes"):
        dm.merge({"w": torch.ones(1)}, {"w": torch.ones(1)}, max_resize_bytes=-1)
    with pytest.raises(dm.MergeError, match="max_resize_bytes"):
        dm.merge({"w": torch.ones(4, 4)}, grown, on_shape_mismatch="resize", max_resize_bytes=95)
    assert dm.merge(
        {"w": torch.ones(4, 4)}, grown, on_shape_mismatch="resize", max_resize_bytes=96
    )["w"].shape == (6, 4)
