"""``load_dcp`` renames, converts and resizes while it reads.

Checkpoints are written by ``torch.distributed.checkpoint.save`` (one process, no process
group), with a model and a flat optimizer state dict as torch's
``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`` makes it. Each
scenario is a life of a run: resume through ``load_dcp`` + ``resume_optimizer``, step,
save the way the run saves, resume that strictly into new objects, step; bit for bit
against a pure-torch oracle (the old checkpoint mapped by hand).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
import warnings
from datetime import timedelta

import hostile_files as hf
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from frameworks import (
    Net,
    assert_same_model,
    assert_same_optimizer,
    equal,
    free_port,
    named_state,
    torch_steps,
    transfer,
)
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

import dsdmerge as dm
from dsdmerge.integrations import load_dcp, resume_optimizer

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
LR, WD = 0.05, 0.1


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        [(n, p) for n, p in model.named_parameters() if p.requires_grad], lr=LR, weight_decay=WD
    )


class Wrapped(torch.nn.Module):
    """A model as DDP saves it: every key behind ``module.``."""

    def __init__(self, **net) -> None:
        super().__init__()
        self.module = Net(**net)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


class Attn(torch.nn.Module):
    """Separate q/k/v projections, or one fused ``qkv_proj`` computing the same."""

    def __init__(self, *, fused: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Embedding(16, 8)
        weights = [torch.randn(8, 8, generator=g) * 0.3 for _ in range(3)]
        self.attn = torch.nn.Module()
        self.fused = fused
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(16, 8, generator=g))
            if fused:
                self.attn.qkv_proj = torch.nn.Linear(8, 24, bias=False)
                self.attn.qkv_proj.weight.copy_(torch.cat(weights))
            else:
                for name, w in zip(("q_proj", "k_proj", "v_proj"), weights, strict=True):
                    setattr(self.attn, name, torch.nn.Linear(8, 8, bias=False))
                    getattr(self.attn, name).weight.copy_(w)
        self.out = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).mean(1)
        if self.fused:
            q, k, v = self.attn.qkv_proj(h).chunk(3, -1)
        else:
            q, k, v = (getattr(self.attn, f"{n}_proj")(h) for n in "qkv")
        return self.out((q * k).tanh() + v).square().mean()


def state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """What the run saves and loads into: the model and the flat optimizer state dict."""
    return {
        "model": model.state_dict(),
        "optim": get_optimizer_state_dict(model, optimizer, options=FLAT),
    }


def save(model, optimizer, path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state(model, optimizer), checkpoint_id=str(path))


def resume(path, model, optimizer, **options):
    """The recipe: ``load_dcp`` reads (and renames, converts, resizes), then the optimizer."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded, diff = load_dcp(path, state(model, optimizer), **options)
        model.load_state_dict(loaded["model"])  # read in place already: the same tensors
        resume_optimizer(model, optimizer, loaded["optim"], policy="strict")
    return diff


def snapshot(model, optimizer):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, named_state(
        model, optimizer
    )


def by_hand_qkv(old_model, old_optim, model, optimizer) -> None:
    """The fuse, by hand: q, k, v rows stacked, in the weights and in both moments."""
    parts = [f"attn.{n}_proj.weight" for n in "qkv"]
    (group,) = old_optim["param_groups"]
    state = {
        n: old_optim["state"][pid]
        for pid, n in zip(group["params"], group["param_names"], strict=True)
    }
    with torch.no_grad():
        for k, v in old_model.items():
            if k not in parts:
                model.state_dict()[k].copy_(v)
        model.attn.qkv_proj.weight.copy_(torch.cat([old_model[k] for k in parts]))
    fused = {
        "step": state[parts[0]]["step"],
        **{m: torch.cat([state[k][m] for k in parts]) for m in ("exp_avg", "exp_avg_sq")},
    }
    names = [n for n, _ in model.named_parameters()]
    new_state = {
        i: (fused if n == "attn.qkv_proj.weight" else state[n]) for i, n in enumerate(names)
    }
    hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
    optimizer.load_state_dict(
        {
            "state": new_state,
            "param_groups": [{**hyper, "params": list(range(len(names))), "param_names": names}],
        }
    )


# name: (old model, new model, load_dcp options, the oracle's mapping)
SCENARIOS = {
    "ddp_prefix": (
        lambda: Wrapped(),
        lambda: Net(),
        {"policy": "strict", "rename": {r"^module\.": ""}},
        lambda m, o, model, opt: transfer(m, o, model, opt, lambda k: k.removeprefix("module.")),
    ),
    "qkv_fuse": (
        lambda: Attn(),
        lambda: Attn(fused=True),
        {"policy": "strict", "convert": ["qkv"]},
        by_hand_qkv,
    ),
    "grow_vocab": (
        lambda: Net(),
        lambda: Net(vocab=24),
        {"policy": "strict", "on_shape_mismatch": "resize"},
        transfer,
    ),
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_a_changed_model_resumes_bit_for_bit_twice(scenario, tmp_path):
    make_old, make_new, options, by_hand = SCENARIOS[scenario]
    old = make_old()
    old_optim = adamw(old)
    torch_steps(old, old_optim, 0, 2)
    save(old, old_optim, tmp_path / "step-2")

    # the oracle: pure torch, the old state mapped by hand, then four steps
    want_model = make_new()
    want_optim = adamw(want_model)
    by_hand(old.state_dict(), old_optim.state_dict(), want_model, want_optim)
    torch_steps(want_model, want_optim, 2, 2)
    want = [snapshot(want_model, want_optim)]
    torch_steps(want_model, want_optim, 4, 2)
    want.append(snapshot(want_model, want_optim))

    model = make_new()
    optimizer = adamw(model)
    diff = resume(tmp_path / "step-2", model, optimizer, **options)
    assert not diff.missing
    assert not diff.unexpected
    if scenario == "grow_vocab":  # the weight and both moments, read and resized
        assert {r.key for r in diff.resized} == {
            "model.embed.weight",
            "optim.state.embed.weight.exp_avg",
            "optim.state.embed.weight.exp_avg_sq",
        }
    torch_steps(model, optimizer, 2, 2)
    assert_same_model(model.state_dict(), want[0][0])
    assert_same_optimizer(named_state(model, optimizer), want[0][1])
    save(model, optimizer, tmp_path / "step-4")

    again = make_new()
    again_optim = adamw(again)
    diff = resume(tmp_path / "step-4", again, again_optim, policy="strict")
    assert not (diff.missing)
    assert not (diff.unexpected)
    assert not (diff.mismatched)
    torch_steps(again, again_optim, 4, 2)
    assert_same_model(again.state_dict(), want[1][0])
    assert_same_optimizer(named_state(again, again_optim), want[1][1])


def test_a_fuse_record_is_the_preset(tmp_path):
    old = Attn()
    old_optim = adamw(old)
    torch_steps(old, old_optim, 0, 1)
    save(old, old_optim, tmp_path / "ckpt")
    got = []
    for convert in (
        ["qkv"],
        dm.Fuse([f"{{P*}}.{n}_proj.{{T}}" for n in "qkv"], "{P*}.qkv_proj.{T}"),
    ):
        model = Attn(fused=True)
        optimizer = adamw(model)
        resume(tmp_path / "ckpt", model, optimizer, policy="strict", convert=convert)
        got.append(snapshot(model, optimizer))
    assert_same_model(got[0][0], got[1][0])
    assert_same_optimizer(got[0][1], got[1][1])


# -- refusals: nothing read, nothing changed -----------------------------------------------


class Recording(FileSystemReader):
    """DCP's own reader, recording which keys it reads."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.read: list[str] = []

    def read_data(self, plan, planner):
        self.read.extend(item.storage_index.fqn for item in plan.items)
        return super().read_data(plan, planner)


def trained_checkpoint(path, **net):
    old = Wrapped(**net)
    optimizer = adamw(old)
    torch_steps(old, optimizer, 0, 2)
    save(old, optimizer, path)


def values(tree):
    return copy.deepcopy(tree)


REFUSED = {
    "renamed_wrong": ({}, {"policy": "strict", "rename": {r"^module\.": "net."}}),
    "rule_matches_nothing": ({}, {"policy": "strict", "rename": {r"^nothing\.": ""}}),
    "grown_not_resized": ({"vocab": 24}, {"rename": {r"^module\.": ""}}),
    "resized_but_missing": (
        {"vocab": 24, "head": True},
        {"policy": "strict", "rename": {r"^module\.": ""}, "on_shape_mismatch": "resize"},
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_refused_call_reads_nothing_and_changes_nothing(tmp_path, case):
    net, options = REFUSED[case]
    trained_checkpoint(tmp_path / "ckpt")
    model = Net(**net)
    optimizer = adamw(model)
    sd = state(model, optimizer)
    before = values(sd)
    reader = Recording(tmp_path / "ckpt")
    with pytest.raises(dm.MergeError):
        load_dcp(tmp_path / "ckpt", sd, storage_reader=reader, **options)
    assert reader.read == []
    assert equal(sd, before)
    assert equal(state(model, optimizer), before)
    # the same checkpoint and target, accepted: it reads, and changes the target
    load_dcp(
        tmp_path / "ckpt",
        sd,
        storage_reader=reader,
        rename={r"^module\.": ""},
        on_shape_mismatch="resize",
        allow_missing="*value.*",
    )
    assert reader.read
    assert not equal(sd, before)


def test_unexpected_keys_are_never_read(tmp_path):
    trained_checkpoint(tmp_path / "ckpt", head=True)
    model = Net()  # no value head: its weights and moments are unexpected
    optimizer = adamw(model)
    reader = Recording(tmp_path / "ckpt")
    loaded, diff = load_dcp(
        tmp_path / "ckpt",
        state(model, optimizer),
        rename={r"^module\.": ""},
        allow_unexpected="*value.*",
        policy="strict",
        storage_reader=reader,
    )
    assert diff.unexpected
    assert all("value." in k for k in diff.unexpected)
    assert reader.read
    assert not [k for k in reader.read if "value." in k]
    assert not [k for k in dm.flatten(loaded) if "value." in k]


def test_loading_only_the_model_reads_no_optimizer_state(tmp_path):
    old = Attn()
    old_optim = adamw(old)
    torch_steps(old, old_optim, 0, 1)
    save(old, old_optim, tmp_path / "ckpt")
    model = Attn(fused=True)
    reader = Recording(tmp_path / "ckpt")
    _, diff = load_dcp(
        tmp_path / "ckpt",
        {"model": model.state_dict()},
        convert=["qkv"],
        policy="strict",
        allow_unexpected="optim.*",
        storage_reader=reader,
    )
    assert diff.unexpected
    assert reader.read
    assert all(k.startswith("model.") for k in reader.read)
    parts = [old.state_dict()[f"attn.{n}_proj.weight"] for n in "qkv"]
    assert torch.equal(model.attn.qkv_proj.weight, torch.cat(parts))


# -- the buffer bound: a crafted .metadata ---------------------------------------------------

BOUNDED = textwrap.dedent(
    """
    import sys, time
    import hostile_files as hf
    import torch
    import dsdmerge as dm
    from dsdmerge.integrations import load_dcp
    import torch.distributed.checkpoint
    target = {"w": torch.zeros(64, 64)}
    hf.limit_memory(256 << 20)
    start = time.perf_counter()
    try:
        load_dcp(sys.argv[1], target, rename={r"^module\\.": ""}, on_shape_mismatch="resize")
        print("loaded")
    except dm.DSDMergeError as err:
        print(type(err).__name__, str(err).splitlines()[0][:400])
    print("changed" if target["w"].any() else "unchanged")
    print("seconds", time.perf_counter() - start)
    """
)


def test_a_crafted_metadata_cannot_make_the_buffers_allocate_its_claim(tmp_path):
    ckpt = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"module.w": torch.ones(64, 64)}, checkpoint_id=str(ckpt))
    claim = torch.Size([1 << 20, 1 << 16])  # 256 GiB of float32, in 16 KiB of data

    def edit(md):
        md.state_dict_metadata["module.w"].size = claim
        md.state_dict_metadata["module.w"].chunks[0].sizes = claim

    hf.edit_metadata(ckpt, edit)
    env = {**os.environ, "PYTHONPATH": f"{hf.ROOT}{os.pathsep}{hf.ROOT / 'tests'}"}
    proc = subprocess.run(
        [sys.executable, "-c", BOUNDED, str(ckpt)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    *lines, took = proc.stdout.strip().splitlines()
    assert float(took.split()[1]) < 30, took
    assert lines[0].startswith("MergeError"), lines
    assert "more than the tensors they go into" in lines[0], lines
    assert lines[1] == "unchanged", lines


# -- what these loads take: plain tensors, stored under their flat name ---------------------


def test_a_nested_optimizer_state_dict_is_a_layout_error(tmp_path):
    old = Wrapped()
    optimizer = adamw(old)
    torch_steps(old, optimizer, 0, 1)
    sd = {"optim": get_optimizer_state_dict(old, optimizer)}  # nested: params in lists
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(tmp_path / "ckpt"))
    model = Net()
    new = {"optim": get_optimizer_state_dict(model, adamw(model))}
    before = values(new)
    with pytest.raises(dm.LayoutError, match="flatten_optimizer_state_dict=True"):
        load_dcp(tmp_path / "ckpt", new, rename={r"^module\.": ""})
    assert equal(new, before)


def test_a_dtensor_target_is_a_state_dict_type_error(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"module.w": torch.ones(4, 4)}, checkpoint_id=str(tmp_path / "ckpt"))
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=60),
    )
    try:
        mesh = init_device_mesh("cpu", (1,))
        target = {"w": distribute_tensor(torch.zeros(4, 4), mesh)}
        with pytest.raises(dm.StateDictTypeError, match="DTensor"):
            load_dcp(tmp_path / "ckpt", target, rename={r"^module\.": ""})
        assert not target["w"].full_tensor().any()
    finally:
        dist.destroy_process_group()


def test_a_model_alone_and_a_flat_optimizer_alone_rename_too(tmp_path):
    old = Wrapped()
    old_optim = adamw(old)
    torch_steps(old, old_optim, 0, 2)
    saved = {
        "model": old.state_dict(),
        "optim": get_optimizer_state_dict(old, old_optim, options=FLAT),
    }
    model = Net()
    targets = {
        "model": model.state_dict(),
        "optim": get_optimizer_state_dict(model, adamw(model), options=FLAT),
    }
    for part in ("model", "optim"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(saved[part], checkpoint_id=str(tmp_path / part))
        loaded, diff = load_dcp(
            tmp_path / part, targets[part], policy="strict", rename={r"^module\.": ""}
        )
        assert not diff.missing
        assert not diff.unexpected
        # the one rule, by hand: in every key, and in every param_names list
        by_hand = {
            k.replace("module.", "", 1): [n.removeprefix("module.") for n in v]
            if k.endswith(".param_names")
            else v
            for k, v in saved[part].items()
        }
        assert equal(loaded, by_hand)
        assert equal(targets[part], by_hand)  # read in place
