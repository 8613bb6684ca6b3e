"""on_shape_mismatch="resize": each resized tensor's trained slice kept, nothing else copied."""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
from conftest import Snapshot, leaves, same_tree
from helpers import taking_reference
from hypothesis import given
from hypothesis import strategies as st

import dsdmerge as dm
from dsdmerge.strategies import checkpoint_pairs

# pairs without shape mismatches of their own (dtype ones allowed): the tests make them
plain_pairs = st.one_of(
    checkpoint_pairs(layout="flat"),
    checkpoint_pairs(layout="nested"),
    checkpoint_pairs(layout="nested", keyed="id", max_unexpected=0),
    checkpoint_pairs(layout="flat", kind="model"),
    checkpoint_pairs(layout="nested", kind="model"),
)


def _no_shape_mismatch(pair) -> bool:
    return not any(m.shape_differs for m in dm.diff(*pair).mismatched)


@st.composite
def resized_pairs(draw):
    """``(checkpoint, reference, resized keys)``: some checkpoint tensors given another size.

    Every tensor of rank >= 1 may get one dimension grown or shrunk (as a weight and its
    moments do when a vocabulary grows or experts are removed), with new random values.
    """
    ckpt, ref = draw(plain_pairs.filter(_no_shape_mismatch))
    flat_c, flat_r = dm.flatten(ckpt), dm.flatten(ref)
    candidates = [
        k
        for k, v in flat_c.items()
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and k in flat_r and not v.is_meta
    ]
    chosen = (
        draw(st.lists(st.sampled_from(candidates), unique=True, max_size=3)) if candidates else []
    )
    changed = dict(flat_c)
    for key in chosen:
        old = flat_c[key]
        dim = draw(st.integers(0, old.dim() - 1))
        size = draw(st.integers(1, old.shape[dim] + 3).filter(lambda n, s=old.shape[dim]: n != s))
        shape = list(old.shape)
        shape[dim] = size
        seed = draw(st.integers(0, 2**16))
        gen = torch.Generator().manual_seed(seed)
        changed[key] = (torch.rand(shape, generator=gen) * 10).to(old.dtype)
    if dm.classify(ckpt) is dm.Layout.NESTED:
        changed = dm.unflatten(changed, like=ckpt)
    return changed, ref, chosen


def _value(sd, key):
    return dm.flatten(sd)[key]


@given(resized_pairs())
def test_resize_keeps_exactly_the_overlap_and_takes_the_rest_from_the_reference(case):
    ckpt, ref, chosen = case
    snaps = Snapshot(ckpt), Snapshot(ref)
    merged = dm.merge_with_diff(ckpt, ref, on_shape_mismatch="resize")
    assert snaps[0].unchanged()
    assert snaps[1].unchanged()
    out, c, r = dm.flatten(merged.state_dict), dm.flatten(ckpt), dm.flatten(ref)
    assert sorted(x.key for x in merged.diff.resized) == sorted(chosen)
    for key in chosen:
        got, old, new = out[key], c[key], r[key]
        assert got is not old
        assert got is not new
        assert got.shape == new.shape
        assert got.dtype == old.dtype  # the checkpoint's, as for any dtype mismatch
        assert got.device == new.device
        overlap = tuple(slice(0, min(a, b)) for a, b in zip(old.shape, new.shape, strict=True))
        assert torch.equal(got[overlap], old[overlap])
        mask = torch.ones(new.shape, dtype=torch.bool)
        mask[overlap] = False
        assert torch.equal(got[mask], new[mask].to(old.dtype))
        [rec] = [x for x in merged.diff.resized if x.key == key]
        assert rec.kept == math.prod(min(a, b) for a, b in zip(old.shape, new.shape, strict=True))
        assert rec.kept + rec.from_reference == new.numel()
        assert rec.dims == tuple(i for i in range(new.dim()) if old.shape[i] != new.shape[i])
    # every other leaf is the very object merge would have kept or backfilled
    take = dm.flatten(taking_reference(dm.merge, ckpt, ref, policy=quiet()))
    assert out.keys() == take.keys()
    for key, value in out.items():
        if key not in chosen:
            assert value is take[key], key


def quiet():
    return dm.DEFAULT


@given(plain_pairs.filter(_no_shape_mismatch))
def test_resize_of_unchanged_shapes_is_the_identity(pair):
    ckpt, ref = pair
    with_resize = dm.merge_with_diff(ckpt, ref, on_shape_mismatch="resize")
    assert same_tree(with_resize.state_dict, dm.merge(ckpt, ref))
    assert with_resize.diff.resized == ()
    for t in leaves(ckpt):
        if isinstance(t, torch.Tensor) and not t.is_meta:
            assert dm.resize(t, t) is t


@given(resized_pairs())
def test_check_and_diff_agree_with_a_resizing_merge(case):
    ckpt, ref, chosen = case
    d = dm.check(ckpt, ref, on_shape_mismatch="resize")  # metadata only: ranks agree
    assert sorted(m.key for m in d.mismatched if m.shape_differs) == sorted(chosen)
    merged = dm.merge_with_diff(ckpt, ref, on_shape_mismatch="resize")
    assert merged.diff.mismatched == d.mismatched
    if chosen:
        with pytest.raises(dm.MergeError, match="on_shape_mismatch='resize'"):
            dm.merge(ckpt, ref)


def test_grown_embedding_with_adam_moments_and_a_step():
    ckpt = {
        "state.embed.weight.step": torch.tensor(7.0),
        "state.embed.weight.exp_avg": torch.full((4, 2), 1.0),
        "state.embed.weight.exp_avg_sq": torch.full((4, 2), 2.0),
        "param_groups.embed.weight.lr": 5e-5,
    }
    ref = {
        "state.embed.weight.step": torch.tensor(1.0),
        "state.embed.weight.exp_avg": torch.zeros(6, 2),
        "state.embed.weight.exp_avg_sq": torch.zeros(6, 2),
        "param_groups.embed.weight.lr": 1e-3,
    }
    merged = dm.merge_with_diff(ckpt, ref, on_shape_mismatch="resize")
    sd = merged.state_dict
    assert sd["state.embed.weight.step"] is ckpt["state.embed.weight.step"]
    assert torch.equal(sd["state.embed.weight.exp_avg"][:4], ckpt["state.embed.weight.exp_avg"])
    assert torch.equal(sd["state.embed.weight.exp_avg"][4:], torch.zeros(2, 2))
    assert torch.equal(sd["state.embed.weight.exp_avg_sq"][:4], torch.full((4, 2), 2.0))
    assert sd["param_groups.embed.weight.lr"] == 5e-5
    text = str(merged.diff)
    assert "2 tensors resized" in text
    assert "dim 0 4 -> 6; 8 elements kept, 4 from the reference each" in text
    assert merged.diff.to_dict()["resized"][0]["dims"] == [0]
    assert [r.kept for r in merged.diff.resized] == [8, 8]


def test_shrinking_keeps_the_leading_rows_and_nested_optimizers_resize_per_field():
    ckpt = {
        "state": {"w": {"momentum_buffer": torch.arange(6.0).reshape(3, 2)}},
        "param_groups": [{"lr": 0.1, "momentum": 0.9, "params": ["w"]}],
    }
    ref = {
        "state": {"w": {"momentum_buffer": torch.zeros(2, 3)}},
        "param_groups": [{"lr": 0.2, "momentum": 0.9, "params": ["w"]}],
    }
    out = dm.merge(ckpt, ref, on_shape_mismatch="resize")
    assert torch.equal(out["state"]["w"]["momentum_buffer"], torch.tensor([[0.0, 1, 0], [2, 3, 0]]))
    assert out["param_groups"][0]["lr"] == 0.1


def test_resize_keeps_the_checkpoints_dtype_as_the_dtype_rule_says():
    ckpt = {"w": torch.ones(2, dtype=torch.float64)}
    ref = {"w": torch.full((3,), 0.5, dtype=torch.bfloat16)}
    merged = dm.merge_with_diff(ckpt, ref, on_shape_mismatch="resize")  # default: quiet
    out = merged.state_dict["w"]
    assert out.dtype == torch.float64  # was: bfloat16, under every policy
    assert out.tolist() == [1.0, 1.0, 0.5]
    assert "float64[2]" in str(merged.diff)
    assert "bfloat16[3]" in str(merged.diff)
    # a model loads it as it loads any tensor of another dtype: cast by copy_
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    model.load_state_dict(merged.state_dict)
    assert model.w.dtype == torch.bfloat16
    assert model.w.tolist() == [1.0, 1.0, 0.5]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dm.merge(ckpt, ref, on_shape_mismatch="resize", policy="warn")
    texts = [str(w.message) for w in caught]
    assert any("resized" in t for t in texts)
    assert any(re.search(r"dtype differs.*'w'", t) for t in texts)
    for call in (dm.merge, dm.check):  # strict refuses it before making anything
        with pytest.raises(dm.MergeError, match=r"dtype differs.*'w'"):
            call(ckpt, ref, on_shape_mismatch="resize", policy="strict")
    allowed = dm.STRICT.replace(dtype="ignore")
    with pytest.warns(dm.DSDMergeWarning, match="resized"):  # (strict says what it resized)
        out = dm.merge(ckpt, ref, on_shape_mismatch="resize", policy=allowed)
    assert out["w"].dtype == torch.float64


@pytest.mark.parametrize("resized", [False, True])
def test_a_complex_tensor_cast_to_real_is_never_silent(resized):
    ckpt = {"w": torch.tensor([1 + 2j, 3 - 1j])}
    ref = {"w": torch.zeros(3 if resized else 2)}
    with pytest.warns(dm.DSDMergeWarning, match="drops the imaginary part"):
        out = dm.merge(ckpt, ref, on_shape_mismatch="resize")  # the default policy
    assert out["w"].dtype == torch.complex64
    assert out["w"][:2].tolist() == [1 + 2j, 3 - 1j]
    with pytest.raises(dm.MergeError, match="imaginary"):
        dm.merge(ckpt, ref, on_shape_mismatch="resize", policy="strict")
    # the other way, a resize casts the reference's complex values into the real checkpoint's
    if resized:
        with pytest.warns(dm.DSDMergeWarning, match="drops the imaginary part"):
            out = dm.merge(
                {"w": torch.ones(2)}, {"w": torch.full((3,), 1j)}, on_shape_mismatch="resize"
            )
        assert out["w"].tolist() == [1.0, 1.0, 0.0]
    else:  # (a real tensor into a complex parameter loses nothing: the default says nothing)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            dm.merge({"w": torch.ones(2)}, {"w": torch.zeros(2, dtype=torch.complex64)})


@pytest.mark.parametrize(
    ("ckpt", "ref", "why"),
    [
        (torch.ones(2, 2), torch.zeros(2), "rank changed"),
        (torch.ones(2), torch.empty(3, device="meta"), "meta device"),
        (torch.empty(2, device="meta"), torch.zeros(3), "meta device"),
        (dm.TensorMeta((2,), torch.float32), torch.zeros(3), "not a torch tensor"),
    ],
)
def test_what_cannot_be_resized_is_refused_before_anything_is_made(ckpt, ref, why):
    c, r = {"w": ckpt, "b": torch.ones(1)}, {"w": ref, "b": torch.zeros(1), "new": torch.zeros(1)}
    snaps = Snapshot(c), Snapshot(r)
    with pytest.raises(dm.MergeError, match=f"cannot be resized: 'w': .*{why}") as err:
        dm.merge(c, r, on_shape_mismatch="resize")
    assert "take_reference" in str(err.value)
    assert snaps[0].unchanged()
    assert snaps[1].unchanged()
    with pytest.raises(dm.StateDictTypeError, match=why):
        dm.resize(ckpt, ref)


def test_dtensor_references_are_refused(monkeypatch):
    class FakeDTensor(torch.Tensor):
        pass

    ref = torch.zeros(3).as_subclass(FakeDTensor)
    with pytest.raises(dm.MergeError, match="FakeDTensor; resize plain tensors"):
        dm.merge({"w": torch.ones(2)}, {"w": ref}, on_shape_mismatch="resize")


def test_check_refuses_rank_changes_under_resize_from_metadata():
    view = {"w": dm.TensorMeta((2, 2), torch.float32), "v": dm.TensorMeta((2,), torch.float32)}
    ref = {"w": dm.TensorMeta((2,), torch.float32), "v": dm.TensorMeta((4,), torch.float32)}
    with pytest.raises(dm.MergeError, match=r"'w'.*rank changed"):
        dm.check(view, ref, on_shape_mismatch="resize")
    d = dm.check({"v": view["v"]}, {"v": ref["v"]}, on_shape_mismatch="resize")
    assert [m.key for m in d.mismatched] == ["v"]


def test_take_reference_and_policies():
    c, r = {"w": torch.ones(2)}, {"w": torch.zeros(3)}
    with pytest.warns(dm.DSDMergeWarning, match="reference's were taken"):
        out = dm.merge(c, r, on_shape_mismatch="take_reference")
    assert out["w"] is r["w"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dm.merge(c, r, on_shape_mismatch="resize")  # default policy: reported, not warned
    with pytest.warns(dm.DSDMergeWarning, match="1 tensor\\(s\\) resized"):
        dm.merge(c, r, on_shape_mismatch="resize", policy="strict")
    with pytest.warns(dm.DSDMergeWarning, match="resized"):
        dm.merge(c, r, on_shape_mismatch="resize", policy="warn")
    with pytest.raises(dm.InvalidPolicyError, match="on_shape_mismatch"):
        dm.merge(c, r, on_shape_mismatch="take-reference")  # type: ignore[arg-type]


def test_a_parameter_reference_gives_a_plain_tensor_without_autograd():
    p = torch.nn.Parameter(torch.zeros(3))
    out = dm.resize(torch.ones(2), p)
    assert type(out) is torch.Tensor
    assert not out.requires_grad
    assert out.tolist() == [1.0, 1.0, 0.0]
    assert p.tolist() == [0.0, 0.0, 0.0]
