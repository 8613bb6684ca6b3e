"""Hugging Face ``Trainer`` (transformers + peft): ``train(resume_from_checkpoint=...)`` on a
changed model, through the recipe of docs/trainers/hf-trainer.md.

``Trainer`` reloads ``model.safetensors`` itself (``load_state_dict(strict=False)``) and
``optimizer.pt`` by int ids (positions in its decay / no-decay groups). The recipe: the
Trainer's own optimizer, ``record_param_names`` on it (every ``optimizer.pt`` carries
names), ``install_load_hook`` on it and ``install_model_load_hook`` on the model.

Each scenario: an old run saves ``checkpoint-2``; the changed model resumes it through
the recipe to step 4 and saves; that save is resumed again to step 6. Both saves are
compared bit for bit (model, and every optimizer state key and hyperparameter by name)
with an uninterrupted run where one exists (a head that never gets a gradient, a
renamed module), else with ``Trainer`` alone resuming a checkpoint rewritten by name in
pure torch in the test (the by-name transfer). The framework alone is run too.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are built from configs: no downloads
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import safetensors.torch  # noqa: E402
import torch  # noqa: E402
from frameworks import (  # noqa: E402
    assert_same_model,
    assert_same_optimizer,
    by_name,
    equal,
)
from torch import nn  # noqa: E402

import dsdmerge as dm  # noqa: E402
from dsdmerge.integrations import (  # noqa: E402
    install_load_hook,
    install_model_load_hook,
    record_param_names,
)

VOCAB, HIDDEN = 64, 16
STEPS = 6  # every run is scheduled for 6 steps (constant lr): a resume changes nothing


def config(vocab: int = VOCAB) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
        tie_word_embeddings=False,
    )


def data(n: int = 24) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (8,), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def llama(*, frozen: str = "k_proj", vocab: int = VOCAB, head: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config(vocab))
    if frozen:
        getattr(model.model.layers[0].self_attn, frozen).requires_grad_(False)
    if head:  # a value head nothing reads: it never gets a gradient
        torch.manual_seed(1)
        model.value_head = nn.Linear(HIDDEN, 1)
    return model


class Wrapped(nn.Module):
    """A user's model around a Llama, whose attribute was renamed (``lm`` -> ``backbone``)."""

    _keys_to_ignore_on_save = None  # Trainer reads it after a load with missing keys

    def __init__(self, attr: str) -> None:
        super().__init__()
        self.attr = attr
        self.add_module(attr, llama(frozen=""))

    def forward(self, input_ids, labels=None):
        return getattr(self, self.attr)(input_ids=input_ids, labels=labels)


def lora(targets: list[str]) -> nn.Module:
    base = llama(frozen="")
    torch.manual_seed(2)
    cfg = peft.LoraConfig(r=2, lora_alpha=4, target_modules=targets, lora_dropout=0.0)
    return peft.get_peft_model(base, cfg)


def args(out: Path, max_steps: int = STEPS) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(
        str(out),
        max_steps=max_steps,
        save_steps=2,
        per_device_train_batch_size=2,
        use_cpu=True,
        report_to=[],
        logging_steps=1000,
        learning_rate=1e-2,
        weight_decay=0.1,
        lr_scheduler_type="constant",
        disable_tqdm=True,
        seed=0,
        save_only_model=False,
    )


class AtStart(transformers.TrainerCallback):
    """What the optimizer holds once the resume loaded it, before the first step."""

    def __init__(self) -> None:
        self.state: dict = {}
        self.model: dict = {}

    def on_train_begin(self, args, state, control, optimizer=None, model=None, **kwargs):
        self.model = {k: v.clone() for k, v in model.state_dict().items()}
        fqn = {id(p): n for n, p in model.named_parameters()}
        self.state = {
            fqn[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()
        }


def run(out, model, *, max_steps=STEPS, resume=None, recipe=None, alone=False, probe=None):
    """One ``Trainer.train`` call; ``recipe``: the hooks' options (the docs' recipe)."""
    trainer = transformers.Trainer(
        model=model,
        args=args(out, max_steps),
        train_dataset=data(),
        callbacks=[probe] if probe is not None else None,
    )
    hooks = None
    if not alone:
        optimizer = trainer.create_optimizer()  # Trainer's own decay / no-decay groups
        record_param_names(optimizer, model)
        if recipe is not None:
            model_opts = {k: v for k, v in recipe.items() if k != "fresh"}
            hooks = (
                install_load_hook(optimizer, model, **recipe),
                install_model_load_hook(model, **model_opts),
            )
    trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
    return trainer, hooks


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    name = "adapter_model.safetensors" if (ckpt / "adapter_model.safetensors").exists() else None
    return safetensors.torch.load_file(str(ckpt / (name or "model.safetensors")))


def optim(ckpt: Path) -> dict:
    return torch.load(ckpt / "optimizer.pt", weights_only=True)


def assert_same_checkpoint(got: Path, want: Path) -> None:
    assert_same_model(weights(got), weights(want))
    assert_same_optimizer(optim(got), optim(want))


def transferred(old_ckpt: Path, new_model: nn.Module, dest: Path, rename=lambda k: k) -> Path:
    """The by-name oracle, pure torch: ``old_ckpt`` rewritten for ``new_model`` by name.

    Model: every old tensor under its (renamed) name, the trained rows of a grown one;
    new keys keep the new model's values. Optimizer: every old parameter's state under
    its name (a grown moment keeps its trained rows, zeros elsewhere, as Adam starts),
    each group's hyperparameters from the old group at its position (decay / no-decay);
    parameters the old run did not train get no state.
    """
    shutil.copytree(old_ckpt, dest)
    adapter = (old_ckpt / "adapter_model.safetensors").exists()
    old_w = weights(old_ckpt)
    if adapter:  # PEFT saves the adapter only, without the adapter name
        new_w = {
            k.replace(".default.", "."): v.detach().clone()
            for k, v in new_model.state_dict().items()
            if "lora_" in k
        }
    else:
        new_w = {k: v.detach().clone() for k, v in new_model.state_dict().items()}
    for key, value in old_w.items():
        new_w[rename(key)] = grown(value, new_w[rename(key)])
    name = "adapter_model.safetensors" if adapter else "model.safetensors"
    safetensors.torch.save_file(new_w, str(dest / name), metadata={"format": "pt"})

    old = optim(old_ckpt)
    old_state, _ = by_name(old)
    trainer = transformers.Trainer(model=new_model, args=args(dest.parent / "tmp"))
    live = trainer.create_optimizer().state_dict()
    fqn = dict(
        zip(
            (id(p) for p in new_model.parameters()),
            (n for n, _ in new_model.named_parameters()),
            strict=True,
        )
    )
    state, groups = {}, []
    at = 0
    for old_group, group in zip(old["param_groups"], trainer.optimizer.param_groups, strict=True):
        ids = list(range(at, at + len(group["params"])))
        at += len(ids)
        names = [fqn[id(p)] for p in group["params"]]
        for pid, name, p in zip(ids, names, group["params"], strict=True):
            old_name = next((o for o in old_state if rename(o) == name), None)
            if old_name is not None:
                state[pid] = {k: grown(v, p, moment=True) for k, v in old_state[old_name].items()}
        hyper = {k: v for k, v in old_group.items() if k not in ("params", "param_names")}
        groups.append({**hyper, "params": ids, "param_names": names})
    assert len(groups) == len(live["param_groups"])
    torch.save({"state": state, "param_groups": groups}, dest / "optimizer.pt")
    return dest


def grown(old: torch.Tensor, like: torch.Tensor, *, moment: bool = False) -> torch.Tensor:
    """``old`` in ``like``'s shape: its leading rows; elsewhere ``like``'s values (a weight)
    or zeros (an optimizer moment, as Adam starts)."""
    if old.dim() == 0 or old.shape == like.shape:
        return old
    out = torch.zeros_like(like) if moment else like.detach().clone()
    out[tuple(slice(0, n) for n in old.shape)] = old
    return out


# --------------------------------------------------------------------------------------
# the old runs (shared by the scenarios)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    run(root / "old", llama(), max_steps=2)  # layer 0's k_proj frozen
    run(root / "old_lora", lora(["q_proj"]), max_steps=2)
    return root


def resume_twice(root, name, make, old_ckpt, recipe, again=None):
    """The recipe's resume to step 4, then its own save resumed again to step 6
    (with ``again``'s options if given: a rename is done once)."""
    _, (opt_hook, model_hook) = run(
        root / name, make(), max_steps=4, resume=old_ckpt, recipe=recipe
    )
    diffs = (opt_hook.diff, model_hook.diff)
    again, (opt_hook2, _) = run(
        root / f"{name}_again",
        make(),
        resume=root / name / "checkpoint-4",
        recipe=recipe if again is None else again,
    )
    # its own save carries names and every parameter: only state never created is missing
    again_diff = opt_hook2.diff
    assert again_diff is not None
    assert not again_diff.unexpected
    assert not again_diff.mismatched
    assert all(k.startswith("state.") for k in again_diff.missing)
    return diffs, root / name / "checkpoint-4", root / f"{name}_again" / f"checkpoint-{STEPS}"


def by_transfer(root, name, make, old_ckpt, rename=lambda k: k):
    """Trainer alone, resuming the by-name transfer: the oracle's saves at 4 and 6."""
    dest = transferred(old_ckpt, make(), root / f"{name}_oracle_in", rename)
    run(root / f"{name}_oracle", make(), resume=dest, alone=True)
    return root / f"{name}_oracle" / "checkpoint-4", root / f"{name}_oracle" / f"checkpoint-{STEPS}"


# --------------------------------------------------------------------------------------
# scenarios


def test_new_head_that_never_gets_a_gradient(runs):
    make = lambda: llama(head=True)  # noqa: E731
    run(runs / "head_uninterrupted", make())
    recipe = {"policy": "strict", "allow_missing": "*value_head.*"}
    (o_diff, m_diff), at4, at6 = resume_twice(runs, "head", make, runs / "old/checkpoint-2", recipe)
    assert m_diff.missing == ("value_head.weight", "value_head.bias")
    assert {k.split(".")[0] for k in o_diff.missing} == {"state", "param_groups"}
    assert all("value_head" in k for k in o_diff.missing)
    assert_same_checkpoint(at4, runs / "head_uninterrupted/checkpoint-4")
    assert_same_checkpoint(at6, runs / f"head_uninterrupted/checkpoint-{STEPS}")
    # alone: the head is appended to both groups, whose sizes no longer match
    with pytest.raises(ValueError, match="doesn't match the size"):
        run(runs / "head_alone", make(), max_steps=4, resume=runs / "old/checkpoint-2", alone=True)


def test_unfreeze_a_layer(runs):
    make = lambda: llama(frozen="")  # noqa: E731
    recipe = {"policy": "strict", "allow_missing": "*layers.0.self_attn.k_proj.*"}
    (o_diff, m_diff), at4, at6 = resume_twice(
        runs, "unfreeze", make, runs / "old/checkpoint-2", recipe
    )
    assert m_diff.missing == ()
    assert m_diff.unexpected == ()
    assert {k for k in o_diff.missing if k.startswith("state.")} == {
        f"state.model.layers.0.self_attn.k_proj.weight.{s}"
        for s in ("step", "exp_avg", "exp_avg_sq")
    }
    want4, want6 = by_transfer(runs, "unfreeze", make, runs / "old/checkpoint-2")
    assert_same_checkpoint(at4, want4)
    assert_same_checkpoint(at6, want6)
    with pytest.raises(ValueError, match="doesn't match the size"):
        run(
            runs / "unfreeze_alone",
            make(),
            max_steps=4,
            resume=runs / "old/checkpoint-2",
            alone=True,
        )


def test_change_which_layer_is_frozen_maps_by_name_where_trainer_misassigns(runs):
    make = lambda: llama(frozen="q_proj")  # noqa: E731
    old_ckpt = runs / "old/checkpoint-2"
    recipe = {
        "policy": "strict",
        "allow_missing": "*layers.0.self_attn.k_proj.*",
        "allow_unexpected": "*layers.0.self_attn.q_proj.*",
    }
    (o_diff, _), at4, at6 = resume_twice(runs, "swap", make, old_ckpt, recipe)
    assert all("k_proj" in k for k in o_diff.missing)
    assert o_diff.unexpected
    assert all("q_proj" in k for k in o_diff.unexpected)
    want4, want6 = by_transfer(runs, "swap", make, old_ckpt)
    assert_same_checkpoint(at4, want4)
    assert_same_checkpoint(at6, want6)

    # alone: the same group sizes, so torch maps by position: k_proj gets q_proj's moments
    probe = AtStart()
    run(runs / "swap_alone", make(), max_steps=3, resume=old_ckpt, alone=True, probe=probe)
    old_state, _ = by_name(optim(old_ckpt))
    q = old_state["model.layers.0.self_attn.q_proj.weight"]
    assert equal(probe.state["model.layers.0.self_attn.k_proj.weight"], q)  # silently misassigned

    # and through dsdmerge without names: refused, never guessed
    nameless = runs / "swap_nameless"
    shutil.copytree(old_ckpt, nameless)
    osd = optim(old_ckpt)
    for g in osd["param_groups"]:
        del g["param_names"]
    torch.save(osd, nameless / "optimizer.pt")
    with pytest.raises(dm.LayoutError, match="record_param_names"):
        run(runs / "swap_refused", make(), max_steps=4, resume=nameless, recipe=recipe)


def test_grow_the_vocabulary(runs):
    make = lambda: llama(vocab=VOCAB + 8)  # noqa: E731
    recipe = {"on_shape_mismatch": "resize"}  # the default policy: resized without a warning
    (o_diff, m_diff), at4, at6 = resume_twice(
        runs, "vocab", make, runs / "old/checkpoint-2", recipe
    )
    assert {r.key for r in m_diff.resized} == {"model.embed_tokens.weight", "lm_head.weight"}
    assert {r.key.split(".")[-1] for r in o_diff.resized} == {"exp_avg", "exp_avg_sq"}
    want4, want6 = by_transfer(runs, "vocab", make, runs / "old/checkpoint-2")
    assert_same_checkpoint(at4, want4)
    assert_same_checkpoint(at6, want6)
    with pytest.raises(RuntimeError, match="size mismatch"):
        run(runs / "vocab_alone", make(), max_steps=4, resume=runs / "old/checkpoint-2", alone=True)


def test_rename_a_module(runs):
    run(runs / "rename_old", Wrapped("lm"))  # uninterrupted, 6 steps, saves at 2, 4, 6
    old_ckpt = runs / "rename_old/checkpoint-2"
    make = lambda: Wrapped("backbone")  # noqa: E731
    recipe = {"policy": "strict", "rename": {r"^lm\.": "backbone."}}
    (o_diff, m_diff), at4, at6 = resume_twice(
        runs, "rename", make, old_ckpt, recipe, again={"policy": "strict"}
    )
    assert not m_diff
    assert not o_diff

    def renamed(ckpt):
        w = {k.replace("lm.", "backbone.", 1): v for k, v in weights(ckpt).items()}
        o = optim(ckpt)
        for g in o["param_groups"]:
            g["param_names"] = [n.replace("lm.", "backbone.", 1) for n in g["param_names"]]
        return w, o

    for got, step in ((at4, 4), (at6, STEPS)):
        want_w, want_o = renamed(runs / f"rename_old/checkpoint-{step}")
        assert_same_model(weights(got), want_w)
        assert_same_optimizer(optim(got), want_o)

    # alone: the non-strict model load skips every key (the model restarts from its
    # initialisation), while the optimizer loads by position: silent
    probe = AtStart()
    untrained = make().state_dict()
    run(runs / "rename_alone", make(), max_steps=3, resume=old_ckpt, alone=True, probe=probe)
    assert len(probe.state) == len(optim(old_ckpt)["state"])  # the trained moments, by position,
    assert_same_model(probe.model, untrained)  # on a model that restarted from its initialisation


def test_add_a_lora_target(runs):
    make = lambda: lora(["q_proj", "v_proj"])  # noqa: E731
    old_ckpt = runs / "old_lora/checkpoint-2"
    # PEFT loads the adapter alone (the base weights are not in it): the default policy
    recipe = {"allow_missing": "*v_proj.lora_*"}
    (o_diff, m_diff), at4, at6 = resume_twice(runs, "lora", make, old_ckpt, recipe)
    assert all("v_proj.lora_" in k for k in o_diff.missing)
    assert {k for k in m_diff.missing if "lora_" in k} == {
        f"base_model.model.model.layers.{i}.self_attn.v_proj.lora_{ab}.default.weight"
        for i in range(2)
        for ab in "AB"
    }
    want4, want6 = by_transfer(runs, "lora", make, old_ckpt)
    assert_same_checkpoint(at4, want4)
    assert_same_checkpoint(at6, want6)
    with pytest.raises(ValueError, match="doesn't match the size"):
        run(runs / "lora_alone", make(), max_steps=4, resume=old_ckpt, alone=True)
    config_json = json.loads((at6 / "adapter_config.json").read_text())
    assert sorted(config_json["target_modules"]) == ["q_proj", "v_proj"]
