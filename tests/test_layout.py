from __future__ import annotations

import pytest
import torch
from torch import nn

import dsdmerge as dm


def test_layout_is_a_str_enum():
    assert dm.Layout.NESTED == "nested"
    assert dm.Layout.FLAT == "flat"
    assert str(dm.Layout.FLAT) == "flat"
    assert f"{dm.Layout.NESTED}" == "nested"


def test_empty_mapping_is_flat():
    assert dm.classify({}) is dm.Layout.FLAT


def test_model_state_dict_is_flat():
    assert dm.classify(nn.Linear(2, 2).state_dict()) is dm.Layout.FLAT


def test_safetensors_like_dict_is_flat():
    assert dm.classify({"a.weight": torch.zeros(1), "b.bias": torch.zeros(2)}) is dm.Layout.FLAT


def test_flat_optimizer_dict_with_scalars_and_tuples_is_flat():
    flat = {"state.w.step": torch.tensor(1.0), "param_groups.w.betas": (0.9, 0.99)}
    assert dm.classify(flat) is dm.Layout.FLAT


def test_torch_optimizer_state_dict_is_nested():
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([p])
    p.grad = torch.ones(2)
    opt.step()
    assert dm.classify(opt.state_dict()) is dm.Layout.NESTED


def test_untrained_optimizer_state_dict_is_nested():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    assert dm.classify(opt.state_dict()) is dm.Layout.NESTED


def test_fqn_keyed_and_whole_checkpoint_dicts_are_nested():
    fqn = {"state": {"a.w": {"step": 1}}, "param_groups": [{"lr": 1.0, "params": ["a.w"]}]}
    assert dm.classify(fqn) is dm.Layout.NESTED
    assert (
        dm.classify({"model": {"w": torch.zeros(1)}, "optim": fqn, "step": 3}) is dm.Layout.NESTED
    )


def test_mixed_optimizer_layouts_raise_layout_error_naming_a_key():
    mixed = {"state": {"w": {"step": 1}}, "param_groups": [], "state.x.step": 2}
    with pytest.raises(dm.LayoutError, match=r"state\.x\.step"):
        dm.classify(mixed)


def test_layout_error_is_a_value_error_and_dsdmerge_error():
    assert issubclass(dm.LayoutError, ValueError)
    assert issubclass(dm.LayoutError, dm.DSDMergeError)


@pytest.mark.parametrize("bad", [None, [1, 2], "state", 3, torch.zeros(2)])
def test_non_mapping_raises_dsdmerge_error(bad):
    with pytest.raises(dm.DSDMergeError):
        dm.classify(bad)
    with pytest.raises(TypeError):
        dm.classify(bad)


def test_is_optimizer_state_dict():
    assert dm.is_optimizer_state_dict({"state": {}, "param_groups": []})
    assert not dm.is_optimizer_state_dict({"state": {}})
    assert not dm.is_optimizer_state_dict([])


# -- a segment name does not make a model an optimizer ---------------------------------------


class Blocks(nn.Module):
    """A model whose module lists are named like an optimizer's sections."""

    def __init__(self, layers: int, *, names: tuple[str, ...] = ("param_groups",)) -> None:
        super().__init__()
        for name in names:
            setattr(self, name, nn.ModuleList([nn.LayerNorm(4) for _ in range(layers)]))


def _trained(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(1.5 + i)
    return model


@pytest.mark.parametrize(
    "names", [("param_groups",), ("state",), ("state", "param_groups")], ids="+".join
)
@pytest.mark.parametrize("fresh", ["reference", "as_fresh"])
def test_a_model_with_modules_named_like_optimizer_sections_merges_as_a_model(names, fresh):
    # was: a new layer's weight and bias took another layer's trained tensors (equal fresh
    # LayerNorm tensors looked like one param group), and fresh="as_fresh" dropped them
    old, new = _trained(Blocks(2, names=names)), Blocks(3, names=names)
    ckpt, ref = old.state_dict(), new.state_dict()
    out, diff, conflicts = dm.merge_with_diff(
        ckpt, ref, policy="strict", allow_missing="*.2.*", fresh=fresh
    )
    added = [k for k in ref if k not in ckpt]
    assert list(diff.missing) == added
    assert conflicts == ()
    assert out.keys() == ref.keys()
    assert all(out[k] is ckpt[k] for k in ckpt)
    assert all(out[k] is ref[k] for k in added)
    new.load_state_dict(out)
    for k, v in new.state_dict().items():
        assert torch.equal(v, ckpt[k] if k in ckpt else ref[k]), k
    assert dm.classify(ckpt) is dm.Layout.FLAT
    assert dm.flatten(dm.unflatten(ckpt)) == ckpt  # split on dots: no optimizer


def test_a_model_key_named_state_gets_the_models_shape_message():
    old, new = (
        Blocks(2, names=("state", "param_groups")),
        Blocks(2, names=("state", "param_groups")),
    )
    ckpt = {**old.state_dict(), "state.0.weight": torch.zeros(5)}
    with pytest.raises(dm.MergeError, match="torch would reject them on load") as err:
        dm.merge(ckpt, new.state_dict())
    assert "optimizers load state" not in str(err.value)


def test_a_flat_optimizer_of_such_a_model_keeps_its_groups():
    """The optimizer of that model, flattened: fqns holding a ``param_groups`` segment under
    ``state.`` and ``param_groups.`` are parameters, not sections of their own."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    old, new = _trained(Blocks(2)), Blocks(3)
    optim = torch.optim.AdamW(old.parameters(), lr=5e-5)
    for p in old.parameters():
        p.grad = torch.ones_like(p)
    optim.step()
    ckpt = get_optimizer_state_dict(old, optim, options=flat)
    ref = get_optimizer_state_dict(new, torch.optim.AdamW(new.parameters(), lr=1e-3), options=flat)
    out = dm.merge(ckpt, ref, policy="strict", allow_missing="*.param_groups.2.*")
    assert out["param_groups.param_groups.2.weight.lr"] == 5e-5  # the group's scheduled lr
    assert out["state.param_groups.2.weight.exp_avg"] is ref["state.param_groups.2.weight.exp_avg"]
    assert all(out[k] is v for k, v in ckpt.items())
