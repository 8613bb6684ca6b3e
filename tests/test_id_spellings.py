"""One spelling of a param id: a DCP round trip's ``'0'`` is the int ``0`` everywhere.

A plain ``optimizer.state_dict()`` saved with ``dcp.save`` comes back with string state
keys (``'0'``) and int ``params`` lists. ``merge``, ``diff``, ``check``, ``rekey`` and the
resume helpers read it as the int ids; both spellings of one id, or two keys that
``rekey`` would put on one name, are refused, naming the keys; nothing is dropped.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import dsdmerge as dm
from dsdmerge.integrations import load_checkpoint, resume_optimizer


def trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.randn(5, 3)).square().mean().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


@pytest.fixture
def dcp_loaded(tmp_path) -> tuple[dict, dict]:
    """(what load_checkpoint gives back for a DCP-saved optimizer.state_dict(), the original)."""
    _, optim = trained()
    original = copy.deepcopy(optim.state_dict())
    dcp.save({"optim": optim.state_dict()}, checkpoint_id=str(tmp_path / "ckpt"))
    loaded = load_checkpoint(tmp_path / "ckpt")["optim"]
    assert set(loaded["state"]) == {"0", "1", "2", "3"}  # what DCP does to the ids
    assert loaded["param_groups"][0]["params"] == [0, 1, 2, 3]
    return loaded, original


def fresh_reference() -> dict:
    """A live optimizer's state dict with int ids (it has taken a step: it holds state)."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=0.5)
    model(torch.randn(5, 3)).sum().backward()
    optim.step()
    return optim.state_dict()


def test_merge_reads_string_ids_as_the_ints(dcp_loaded):
    loaded, original = dcp_loaded
    merged = dm.merge(loaded, fresh_reference(), policy="strict")
    assert set(merged["state"]) == {0, 1, 2, 3}
    for pid in range(4):
        for name, value in original["state"][pid].items():
            assert torch.equal(merged["state"][pid][name], value), (pid, name)
    # and it is the checkpoint's tensor itself (no copy)
    assert merged["state"][0]["exp_avg"] is loaded["state"]["0"]["exp_avg"]


def test_diff_and_check_read_string_ids_as_the_ints(dcp_loaded):
    loaded, _ = dcp_loaded
    ref = fresh_reference()
    assert not dm.diff(loaded, ref).missing
    assert not dm.diff(loaded, ref).unexpected
    assert dm.check(loaded, ref, policy="strict").missing == ()


def test_torch_loads_the_merge_of_a_dcp_round_trip(dcp_loaded):
    """The merged dict, given to torch, gives exactly the trained state (no junk string keys)."""
    loaded, original = dcp_loaded
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=0.5)
    optim.load_state_dict(dm.merge(loaded, optim.state_dict()))
    assert all(isinstance(k, torch.Tensor) for k in optim.state)
    got = optim.state_dict()
    assert set(got["state"]) == set(original["state"])
    assert got["param_groups"][0]["lr"] == original["param_groups"][0]["lr"]


def test_both_spellings_of_one_id_are_refused_by_every_verb(dcp_loaded):
    loaded, _ = dcp_loaded
    both = {**loaded, "state": {**loaded["state"], 0: loaded["state"]["0"]}}
    ref = fresh_reference()
    for call in (
        lambda: dm.merge(both, ref),
        lambda: dm.diff(both, ref),
        lambda: dm.check(both, ref),
        lambda: dm.rekey(both, ["a", "b", "c", "d"]),
    ):
        with pytest.raises(dm.LayoutError, match=r"0 and '0'"):
            call()


def test_resume_optimizer_of_a_dcp_round_trip(dcp_loaded):
    loaded, original = dcp_loaded
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=0.5)
    resume_optimizer(model, optim, loaded, policy="strict")
    assert set(optim.state_dict()["state"]) == set(original["state"])


def test_rekey_refuses_two_keys_on_one_name():
    osd = {
        "state": {0: {"step": 1}, "embed.weight": {"step": 9}},
        "param_groups": [{"lr": 0.1, "params": [0]}],
    }
    with pytest.raises(dm.LayoutError, match=r"0 and 'embed\.weight'|'embed\.weight' and 0"):
        dm.rekey(osd, ["embed.weight"])
    back = {
        "state": {"embed.weight": {"step": 1}, 0: {"step": 9}},
        "param_groups": [{"lr": 0.1, "params": ["embed.weight"]}],
    }
    with pytest.raises(dm.LayoutError, match="one name"):
        dm.rekey(back)


def test_rekey_keeps_the_optimizers_own_top_level_keys():
    """timm's Kron keeps ``rng_state`` beside state and param_groups; heavyball its own key."""
    rng = torch.get_rng_state()
    osd = {
        "state": {0: {"step": 1}, "k": torch.tensor(3)},
        "param_groups": [{"lr": 0.1, "params": [0, 1]}],
        "rng_state": rng,
        "heavyball": {"inner_group": {"x": 1}},
    }
    fqn = dm.rekey(osd, ["a.weight", "b.weight"])
    assert list(fqn) == ["state", "param_groups", "rng_state", "heavyball"]
    assert fqn["rng_state"] is rng
    assert fqn["heavyball"] == {"inner_group": {"x": 1}}
    assert fqn["state"]["k"] is osd["state"]["k"]  # optimizer-level entries too
    back = dm.rekey(fqn)
    assert back["rng_state"] is rng
    assert set(back) == set(osd)
    assert back["state"] == osd["state"]


def test_rekey_reads_string_ids_as_the_ints():
    osd = {"state": {"1": {"step": 2}}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}
    assert dm.rekey(osd, ["a", "b"])["state"] == {"b": {"step": 2}}


def test_fqn_keyed_state_dicts_are_never_renumbered():
    """A ParameterList model's fqns are '0', '1': names, not spelled ids."""
    osd = {"state": {"0": {"step": 1}}, "param_groups": [{"lr": 0.1, "params": ["0", "1"]}]}
    assert dm.merge(osd, osd)["state"] == {"0": {"step": 1}}
    assert dm.diff(osd, osd).missing == ()


def test_whole_checkpoints_are_normalised_inside(dcp_loaded):
    loaded, _ = dcp_loaded
    ref = {"optim": fresh_reference(), "step": 3}
    merged = dm.merge({"optim": loaded, "step": 7}, ref, policy="strict")
    assert set(merged["optim"]["state"]) == {0, 1, 2, 3}
    assert merged["step"] == 7
