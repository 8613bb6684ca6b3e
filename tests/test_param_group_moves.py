"""A parameter moved to another param group, and groups whose members disagree, with real torch.

The checkpoints are torch's own flat optimizer state dicts (``get_optimizer_state_dict`` with
``flatten_optimizer_state_dict=True``), saved and loaded as trainers do; the merged result is
loaded with ``set_optimizer_state_dict``, and every group's hyperparameters and every state
entry are compared with a pure-torch oracle written here (the checkpoint's state mapped by
fqn by hand). Then the run goes on: one step, the next save, a strict resume of it into new
objects, one more step, each bit for bit against the oracle.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

import dsdmerge as dm

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def saved(obj):
    """``obj`` after a torch.save / torch.load(weights_only=True) round trip."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1 = nn.Linear(3, 3)
        self.l2 = nn.Linear(3, 3)
        self.n = nn.LayerNorm(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.n(self.l2(self.l1(x)))


def adamw(model: nn.Module, groups: list[tuple[list[str], float]]) -> torch.optim.AdamW:
    named = dict(model.named_parameters())
    return torch.optim.AdamW(
        [{"params": [named[n] for n in names], "lr": lr} for names, lr in groups]
    )


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(4, 3, generator=gen)).square().sum().backward()
        optim.step()
        optim.zero_grad()


OLD = [(["l1.weight", "l1.bias", "l2.weight"], 5e-3), (["l2.bias", "n.weight", "n.bias"], 2.5e-3)]
NEW = [(["l1.weight", "l1.bias"], 5e-3), (["l2.weight", "l2.bias", "n.weight", "n.bias"], 2.5e-3)]


def oracle(trained: torch.optim.Optimizer, old_model: nn.Module, model: nn.Module, groups):
    """A pure-torch optimizer over ``model`` with ``groups``: the trained state by fqn, and each
    new group the hyperparameters of the trained group most of its members come from."""
    optim = adamw(model, groups)
    old_param = dict(old_model.named_parameters())
    old_groups = trained.state_dict()["param_groups"]
    old_ids = {n: i for i, (n, _) in enumerate(old_model.named_parameters())}
    home = {}
    for g, (names, _) in enumerate(groups):
        owners = [
            next(i for i, og in enumerate(old_groups) if old_ids[n] in og["params"]) for n in names
        ]
        home[g] = max(set(owners), key=owners.count)
    ids = {n: i for i, n in enumerate(n for names, _ in groups for n in names)}
    optim.load_state_dict(
        {
            "state": {
                ids[n]: {k: v.clone() for k, v in trained.state[old_param[n]].items()}
                for names, _ in groups
                for n in names
            },
            "param_groups": [
                {
                    **{k: v for k, v in old_groups[home[g]].items() if k != "params"},
                    "params": [ids[n] for n in names],
                }
                for g, (names, _) in enumerate(groups)
            ],
        }
    )
    return optim


def assert_same(model, optim, other_model, other_optim):
    """Every parameter, every state entry and every group's hyperparameters, bit for bit."""
    for (n, p), (m, q) in zip(
        model.named_parameters(), other_model.named_parameters(), strict=True
    ):
        assert n == m
        assert torch.equal(p, q), n
    for p, q in zip(model.parameters(), other_model.parameters(), strict=True):
        a, b = optim.state[p], other_optim.state[q]
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert len(optim.state) == len(other_optim.state)
    for g, h in zip(optim.param_groups, other_optim.param_groups, strict=True):
        assert {k: v for k, v in g.items() if k != "params"} == {
            k: v for k, v in h.items() if k != "params"
        }


@pytest.fixture
def trained():
    model = Net()
    optim = adamw(model, OLD)
    train(model, optim, 3, seed=1)
    return model, optim, saved(get_optimizer_state_dict(model, optim, options=FLAT))


def resumed(old_model, checkpoint, *, nested_reference: bool, policy="default"):
    model = Net()
    model.load_state_dict(old_model.state_dict())
    optim = adamw(model, NEW)
    options = StateDictOptions() if nested_reference else FLAT
    reference = get_optimizer_state_dict(model, optim, options=options)
    merged = dm.merge_with_diff(checkpoint, reference, policy=policy)
    set_optimizer_state_dict(model, optim, merged.state_dict, options=FLAT)
    return model, optim, merged


@pytest.mark.parametrize("nested_reference", [False, True], ids=["flat reference", "nested"])
def test_a_moved_parameter_takes_its_new_groups_lr_and_the_run_goes_on_exactly(
    trained, nested_reference
):
    old_model, old_optim, checkpoint = trained
    # was: l2.weight kept 5e-3, nothing said, and torch gave its whole new group 5e-3
    with pytest.warns(dm.DSDMergeWarning, match=r"'l2\.weight' 0\.005 -> 0\.0025") as caught:
        model, optim, merged = resumed(old_model, checkpoint, nested_reference=nested_reference)
    assert len(caught) == 1
    assert "disagree on 'lr'" in merged.conflicts[0]
    assert merged.state_dict["param_groups.l2.weight.lr"] == 2.5e-3
    assert [g["lr"] for g in optim.param_groups] == [5e-3, 2.5e-3]
    expected_model = Net()
    expected_model.load_state_dict(old_model.state_dict())
    expected = oracle(old_optim, old_model, expected_model, NEW)
    assert_same(model, optim, expected_model, expected)
    # the run goes on: a step, the next save, a strict resume into new objects, a step
    train(model, optim, 1, seed=2)
    train(expected_model, expected, 1, seed=2)
    assert_same(model, optim, expected_model, expected)
    again = saved(get_optimizer_state_dict(model, optim, options=FLAT))
    later = Net()
    later.load_state_dict(model.state_dict())
    later_optim = adamw(later, NEW)
    fresh = get_optimizer_state_dict(later, later_optim, options=FLAT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = dm.merge(again, fresh, policy="strict")  # consistent now: nothing to say
    set_optimizer_state_dict(later, later_optim, out, options=FLAT)
    assert_same(later, later_optim, expected_model, expected)
    train(later, later_optim, 1, seed=3)
    train(expected_model, expected, 1, seed=3)
    assert_same(later, later_optim, expected_model, expected)


def test_strict_refuses_a_moved_parameter_naming_it_the_hyperparameter_and_both_values(trained):
    _, _, checkpoint = trained
    model = Net()
    optim = adamw(model, NEW)
    reference = get_optimizer_state_dict(model, optim, options=FLAT)
    with pytest.raises(dm.MergeError, match=r"disagree on 'lr'.*'l2\.weight' 0\.005 -> 0\.0025"):
        dm.merge(checkpoint, reference, policy="strict")
    with pytest.raises(dm.MergeError, match="disagree on 'lr'"):
        dm.check(checkpoint, reference, policy="strict")
    # accepted when the policy says so, with the same result as the default
    quiet = dm.STRICT.replace(conflict="ignore")
    assert dm.merge(checkpoint, reference, policy=quiet)["param_groups.l2.weight.lr"] == 2.5e-3


def test_a_group_whose_checkpoint_members_disagree_is_never_silent(trained):
    # a checkpoint made by a naive backfill ({**fresh, **checkpoint}): n.bias got the fresh lr
    _, _, checkpoint = trained
    bad = {**checkpoint, "param_groups.n.bias.lr": 1e-3}
    model = Net()
    optim = adamw(model, OLD)
    nested = get_optimizer_state_dict(model, optim)
    flat = get_optimizer_state_dict(model, optim, options=FLAT)
    for policy in ("default", "warn"):
        # the true groups: n.bias takes its group's lr
        with pytest.warns(dm.DSDMergeWarning, match=r"'n\.bias' 0\.001 -> 0\.0025"):
            assert dm.merge(bad, nested, policy=policy)["param_groups.n.bias.lr"] == 2.5e-3
        # inferred groups: nothing says n.bias moved in, so it is named and left as it is
        with pytest.warns(dm.DSDMergeWarning, match=r"'n\.bias' keep their own value"):
            assert dm.merge(bad, flat, policy=policy)["param_groups.n.bias.lr"] == 1e-3
    for reference in (nested, flat):
        with pytest.raises(dm.MergeError, match=r"0\.001 held by 'n\.bias'"):
            dm.merge(bad, reference, policy="strict")


def test_warn_takes_the_majority_for_an_ambiguous_backfill_and_loads_as_torch_would():
    """verl's hook: flat over flat, groups inferred. Two groups built alike and scheduled apart
    (a LambdaLR per group) look like one; a new parameter joins the first. warn goes on: the
    value most members hold, every candidate named; each real group keeps its own lr."""

    class Grown(Net):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(3, 3)

        def forward(self, x):
            return self.head(super().forward(x))

    old = Net()
    old_groups = [(["l1.weight", "l1.bias", "l2.weight"], 1e-3), (["l2.bias", "n.weight"], 1e-3)]
    old_optim = adamw(old, old_groups)
    lambdas = [lambda t: 1 / (1 + t), lambda t: 1 / (1 + 2 * t)]
    scheduler = torch.optim.lr_scheduler.LambdaLR(old_optim, lambdas)
    for seed in range(3):
        train(old, old_optim, 1, seed)
        scheduler.step()
    checkpoint = saved(get_optimizer_state_dict(old, old_optim, options=FLAT))
    lrs = [g["lr"] for g in old_optim.param_groups]
    assert lrs[0] != lrs[1]
    model = Grown()
    model.load_state_dict(old.state_dict(), strict=False)
    new_groups = [(["head.weight", *old_groups[0][0]], 1e-3), old_groups[1]]
    optim = adamw(model, new_groups)
    torch.optim.lr_scheduler.LambdaLR(optim, lambdas)
    reference = get_optimizer_state_dict(model, optim, options=FLAT)
    with pytest.warns(dm.DSDMergeWarning) as caught:
        out = dm.merge(checkpoint, reference, policy="warn", allow_missing="*head*")
    text = "\n".join(str(w.message) for w in caught)
    assert all(repr(lr) in text for lr in lrs)  # every candidate value named
    assert out["param_groups.head.weight.lr"] == lrs[0]  # three members hold it, two the other
    set_optimizer_state_dict(model, optim, out, options=FLAT)
    assert [g["lr"] for g in optim.param_groups] == lrs  # each real group its own
    with pytest.raises(dm.MergeError, match="disagree on 'lr'"):
        dm.merge(checkpoint, reference, policy="strict", allow_missing="*head*")
