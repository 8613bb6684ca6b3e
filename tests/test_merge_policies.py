"""One test per row of the policy table, for each built-in policy."""

from __future__ import annotations

import warnings

import pytest
import torch

import dsdmerge as dm


def t(*shape, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype)


@pytest.fixture
def quiet():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def dsd_warnings(caught):
    return [w for w in caught if issubclass(w.category, dm.DSDMergeWarning)]


# -- missing keys --------------------------------------------------------------------


def test_default_backfills_missing_from_reference(quiet):
    ckpt = {"w": t(2)}
    ref = {"w": t(2), "indexer.w": t(3)}
    out = dm.merge(ckpt, ref)
    assert out["w"] is ckpt["w"]
    assert out["indexer.w"] is ref["indexer.w"]
    assert dsd_warnings(quiet) == []


def test_warn_backfills_missing_and_warns_once(quiet):
    ref = {"w": t(2), **{f"indexer.{i}": t(1) for i in range(50)}}
    out = dm.merge({"w": t(2)}, ref, policy="warn")
    assert set(out) == set(ref)
    [w] = dsd_warnings(quiet)
    assert "50 key(s) missing from the checkpoint" in str(w.message)
    assert "'indexer.{0..49}' (50 keys)" in str(w.message)  # compressed, exact
    assert w.filename == __file__  # points at the caller


def test_strict_raises_on_missing_naming_keys_sorted():
    ref = {"w": t(2), "b.x": t(1), "a.x": t(1)}
    with pytest.raises(dm.MergeError, match=r"'\{a,b\}\.x' \(2 keys\)") as info:
        dm.merge({"w": t(2)}, ref, policy="strict")
    assert info.value.diff.missing == ("b.x", "a.x")
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("policy", ["default", "warn", "strict"])
def test_allowed_missing_is_backfilled_silently_under_every_policy(policy, quiet):
    ref = {"w": t(2), "layers.0.indexer.w": t(3)}
    out = dm.merge({"w": t(2)}, ref, policy=policy, allow_missing=["*.indexer.*"])
    assert out["layers.0.indexer.w"] is ref["layers.0.indexer.w"]
    assert dsd_warnings(quiet) == []


def test_strict_with_allow_list_still_fails_on_real_data_loss():
    ref = {"w": t(2), "layers.0.indexer.w": t(3), "layers.0.attn.w": t(3)}
    with pytest.raises(dm.MergeError, match=r"layers\.0\.attn\.w") as info:
        dm.merge({"w": t(2)}, ref, policy="strict", allow_missing=["*.indexer.*"])
    assert "indexer" not in info.value.problems[0]


# -- unexpected keys ------------------------------------------------------------------


def test_default_keeps_unexpected(quiet):
    ckpt = {"w": t(2), "old": t(1)}
    out = dm.merge(ckpt, {"w": t(2)})
    assert out["old"] is ckpt["old"]
    assert dsd_warnings(quiet) == []


def test_warn_keeps_unexpected_and_warns(quiet):
    ckpt = {"w": t(2), "old": t(1)}
    out = dm.merge(ckpt, {"w": t(2)}, policy="warn")
    assert out["old"] is ckpt["old"]
    [w] = dsd_warnings(quiet)
    assert "unexpected in the checkpoint" in str(w.message)


def test_strict_raises_on_unexpected():
    with pytest.raises(dm.MergeError, match=r"unexpected in the checkpoint.*'old'"):
        dm.merge({"w": t(2), "old": t(1)}, {"w": t(2)}, policy="strict")


@pytest.mark.parametrize("policy", ["default", "warn", "strict"])
def test_allowed_unexpected_is_kept_silently(policy, quiet):
    ckpt = {"w": t(2), "ema.w": t(2)}
    out = dm.merge(ckpt, {"w": t(2)}, policy=policy, allow_unexpected="ema.*")
    assert out["ema.w"] is ckpt["ema.w"]
    assert dsd_warnings(quiet) == []


# -- shape and dtype mismatches -------------------------------------------------------


@pytest.mark.parametrize("policy", ["default", "warn", "strict"])
def test_shape_mismatch_raises_under_every_builtin_policy(policy):
    with pytest.raises(
        dm.MergeError, match=r"'w' \(checkpoint float32\[2\], reference float32\[3\]\)"
    ):
        dm.merge({"w": t(2)}, {"w": t(3)}, policy=policy, allow_missing="*", allow_unexpected="*")


def test_the_deprecated_policy_shape_still_takes_the_reference(quiet):
    ref = {"head": t(5)}
    with pytest.warns(DeprecationWarning, match="on_shape_mismatch='take_reference'"):
        policy = dm.DEFAULT.replace(shape="warn")
    out = dm.merge({"head": t(4)}, ref, policy=policy)
    assert out["head"] is ref["head"]
    [w] = dsd_warnings(quiet)
    assert "shape differs" in str(w.message)


def test_default_keeps_dtype_mismatch(quiet):
    ckpt = {"w": t(2, dtype=torch.bfloat16)}
    out, diff, _ = dm.merge_with_diff(ckpt, {"w": t(2)})
    assert out["w"] is ckpt["w"]
    assert diff.mismatched[0].dtype_differs
    assert not diff.mismatched[0].shape_differs
    assert dsd_warnings(quiet) == []


def test_warn_keeps_dtype_mismatch_and_warns(quiet):
    ckpt = {"w": t(2, dtype=torch.bfloat16)}
    out = dm.merge(ckpt, {"w": t(2)}, policy="warn")
    assert out["w"] is ckpt["w"]
    [w] = dsd_warnings(quiet)
    assert "bfloat16" in str(w.message)
    assert "float32" in str(w.message)


def test_strict_raises_on_dtype_mismatch():
    with pytest.raises(dm.MergeError, match="dtype"):
        dm.merge({"w": t(2, dtype=torch.bfloat16)}, {"w": t(2)}, policy="strict")


def test_scalars_are_never_mismatched():
    d = dm.diff({"step": 3, "lr": 0.1, "t": torch.tensor(1.0)}, {"step": 1.0, "lr": (1,), "t": 5})
    assert d.mismatched == ()


def test_meta_tensors_are_compared_by_shape_and_dtype():
    meta = torch.empty(4096, 4096, device="meta")
    d = dm.diff({"w": meta}, {"w": torch.empty(4096, 4095, device="meta")})
    assert d.mismatched_keys == ("w",)


# -- warnings are summarised ----------------------------------------------------------


def test_warn_emits_a_few_warnings_not_one_per_key(quiet):
    ckpt = {f"old.{i}": t(1) for i in range(100)} | {
        f"w.{i}": t(1, dtype=torch.half) for i in range(100)
    }
    ref = {f"new.{i}": t(1) for i in range(100)} | {f"w.{i}": t(1) for i in range(100)}
    dm.merge(ckpt, ref, policy="warn")
    assert len(dsd_warnings(quiet)) == 3


def test_strict_collects_every_problem_in_one_error():
    with pytest.raises(dm.MergeError) as info:
        dm.merge({"a": t(1), "x": t(2, dtype=torch.half)}, {"b": t(1), "x": t(2)}, policy="strict")
    assert len(info.value.problems) == 3
    assert info.value.diff == dm.diff(
        {"a": t(1), "x": t(2, dtype=torch.half)}, {"b": t(1), "x": t(2)}
    )


# -- policies as values ---------------------------------------------------------------


def test_policies_are_frozen_values():
    with pytest.raises(AttributeError):
        dm.STRICT.missing = "ignore"  # type: ignore[misc]
    assert dm.resolve_policy("strict") is dm.STRICT
    assert dm.Policy(missing="raise").name == "custom"


@pytest.mark.parametrize(
    "kwargs",
    [{"policy": "lenient"}, {"policy": 3}, {"allow_missing": [1]}, {"allow_unexpected": 5}],
)
def test_bad_policy_arguments_raise_invalid_policy_error(kwargs):
    with pytest.raises(dm.InvalidPolicyError) as info:
        dm.merge({}, {}, **kwargs)
    assert isinstance(info.value, dm.DSDMergeError)


def test_bad_action_raises_invalid_policy_error():
    with pytest.raises(dm.InvalidPolicyError, match=r"Policy\.missing"):
        dm.Policy(missing="explode")  # type: ignore[arg-type]


def test_a_bare_string_allow_list_is_one_glob_not_characters():
    with pytest.raises(dm.MergeError):
        dm.merge({}, {"a.b": 1, "zzz": 2}, policy="strict", allow_missing="a.*")


def test_drop_unexpected_leaves_them_out_and_says_so(quiet):
    pol = dm.Policy(unexpected="warn", drop_unexpected=True)
    out = dm.merge({"w": 1, "old": 2}, {"w": 0}, policy=pol)
    assert out == {"w": 1}
    assert "dropped" in str(dsd_warnings(quiet)[0].message)


def test_check_applies_the_policy_without_merging():
    ref = {"w": dm.TensorMeta((2,), torch.float32), "idx.w": dm.TensorMeta((3,), torch.float32)}
    ckpt = {"w": dm.TensorMeta((2,), torch.float32)}
    assert dm.check(ckpt, ref, policy="strict", allow_missing="idx.*").missing == ("idx.w",)
    with pytest.raises(dm.MergeError):
        dm.check(ckpt, ref, policy="strict")


@pytest.mark.parametrize("verb", [dm.merge, dm.merge_with_diff, dm.check])
@pytest.mark.parametrize(
    ("ckpt", "ref", "options"),
    [
        ({"w": t(2)}, {"w": t(2), "b": t(1)}, {"policy": "warn"}),  # a missing key
        ({"w": t(2)}, {"w": t(2)}, {"rename": {"^nothing\\.": "x."}}),  # a rule matching nothing
        ({"w": t(2)}, {"w": t(3)}, {"on_shape_mismatch": "take_reference"}),
        ({"w": t(2)}, {"w": t(3)}, {"on_shape_mismatch": "resize", "policy": "warn"}),
    ],
    ids=["missing", "unmatched-rename", "take-reference", "resize"],
)
def test_every_warning_of_every_verb_points_at_the_caller(verb, ckpt, ref, options):
    with pytest.warns(dm.DSDMergeWarning) as record:
        verb(ckpt, ref, **options)
    assert {w.filename for w in record} == {__file__}
