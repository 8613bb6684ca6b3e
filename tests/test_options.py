"""MergeOptions: every entry point's options, validated once, when they are made."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dsdmerge as dm
from dsdmerge._options import MergeOptions
from dsdmerge.integrations import install_load_hook, install_model_load_hook


def test_options_fold_the_allow_lists_into_the_policy_and_compile_the_rules():
    options = MergeOptions.of("strict", allow_missing="idx.*", rename="ddp")
    assert options.policy.allow_missing == ("idx.*",)
    assert options.policy.missing == "raise"
    assert options.rename is not None
    assert all(rule.preset == "ddp" for rule in options.rename)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"fresh": "sometimes"}, "fresh must be 'reference' or 'as_fresh', got 'sometimes'"),
        ({"on_shape_mismatch": "grow"}, "on_shape_mismatch must be one of"),
        ({"max_resize_bytes": -1}, "max_resize_bytes must be a number of bytes"),
        ({"max_resize_bytes": 1.5}, "max_resize_bytes must be a number of bytes"),
        ({"policy": "strict"}, "MergeOptions.policy must be a dsdmerge.Policy"),
    ],
)
def test_a_bad_option_is_refused_when_the_options_are_made(change, message):
    with pytest.raises(dm.InvalidPolicyError, match=message):
        MergeOptions(**change)
    with pytest.raises(dm.InvalidPolicyError, match=message):
        dataclasses.replace(MergeOptions(), **change)


def test_options_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        MergeOptions().fresh = "as_fresh"  # type: ignore[misc]


def test_every_entry_point_refuses_the_same_bad_option_with_the_same_message():
    ckpt, ref = {"a": 1}, {"a": 0}
    message = "on_shape_mismatch must be one of 'raise', 'take_reference', 'resize', got 'grow'"
    for call in (dm.merge, dm.merge_with_diff, dm.check):
        with pytest.raises(dm.InvalidPolicyError, match=message):
            call(ckpt, ref, on_shape_mismatch="grow")
    model = torch.nn.Linear(2, 2)
    with pytest.raises(dm.InvalidPolicyError, match=message):
        dm.integrations.resume_model(model, model.state_dict(), on_shape_mismatch="grow")


def test_the_hooks_check_their_options_when_installed_not_at_the_first_load():
    model = torch.nn.Linear(2, 2)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(dm.InvalidPolicyError, match="on_shape_mismatch must be one of"):
        install_model_load_hook(model, on_shape_mismatch="grow")
    with pytest.raises(dm.RenameError, match="unknown rename preset"):
        install_model_load_hook(model, rename="no-such-preset")
    with pytest.raises(dm.InvalidPolicyError, match="fresh must be"):
        install_load_hook(optim, model, fresh="sometimes")
    # nothing was registered: loads are torch's own
    model.load_state_dict(model.state_dict())
    optim.load_state_dict(optim.state_dict())
