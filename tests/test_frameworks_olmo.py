"""OLMo-core 3.0 as it is: its ``Transformer``, ``TransformerTrainModule`` and trainer
``Checkpointer``, real, on CPU in one process, resumed on a changed model through the recipe
of docs/trainers/olmo-core.md.

The checkpointer saves ``{"model": ..., "optim": ...}`` (torch DSD, the optimizer
flattened) with OLMo-core's own DCP storage writer, whose ``.metadata`` names its storage
class (``olmo_core.distributed.checkpoint.filesystem._StorageInfo``), and loads with its own
reader, then ``set_model_state_dict`` / ``set_optimizer_state_dict``. A train module that
has ``load_state_dict_direct`` loads itself: the recipe gives it one that reads through
``load_dcp``.
"""

from __future__ import annotations

import copy
import warnings

import pytest

pytest.importorskip("olmo_core.train.checkpoint")

import torch
from frameworks import named_state, resume_twice, trained, transfer
from olmo_core.distributed.checkpoint.filesystem import RemoteFileSystemReader
from olmo_core.nn.transformer import TransformerConfig
from olmo_core.optim import AdamWConfig
from olmo_core.train.checkpoint import Checkpointer
from olmo_core.train.train_module import TransformerTrainModule

from dsdmerge.integrations import load_dcp, resume_model, resume_optimizer

TRUST = ["olmo_core.distributed.checkpoint.filesystem._StorageInfo"]
D, LR, WD = 16, 0.05, 0.1


def resume_through_dsdmerge(train_module, **options):
    """The recipe: OLMo-core's ``Checkpointer.load`` calls this instead of its DCP load."""

    def load_state_dict_direct(dir, *, process_group=None, load_optim_state=None, **_):
        optim = load_optim_state is not False and train_module.optim is not None
        loaded, train_module.dsdmerge_diff = load_dcp(
            dir,
            train_module.state_dict(optim=optim),
            storage_reader=RemoteFileSystemReader(dir),
            trusted=TRUST,
            process_group=process_group,
            **options,
        )
        checked = {k: v for k, v in options.items() if k in ("policy", "allow_missing")}
        resume_model(train_module.model, loaded["model"], **checked)
        if optim:
            resume_optimizer(train_module.model, train_module.optim, loaded["optim"], **checked)

    train_module.load_state_dict_direct = load_state_dict_direct
    return train_module


class Run:
    """A small OLMo-core transformer, its train module and checkpointer, on CPU.

    ``vocab``: embedding rows. ``head``: the name of an extra linear head; ``trained``:
    whether the loss reads it (if not, it never gets a gradient). ``frozen``: submodules
    that do not train.
    """

    def __init__(self, work, *, vocab=32, head=None, trained=False, frozen=(), recipe=None):
        config = TransformerConfig.llama_like(
            d_model=D, vocab_size=vocab, n_layers=1, n_heads=2, hidden_size_multiple_of=16
        )
        torch.manual_seed(0)
        model = config.build(init_device="cpu")
        model.init_weights(device=torch.device("cpu"))
        self.head = head if trained else None
        if head is not None:
            torch.manual_seed(1)
            model.add_module(head, torch.nn.Linear(D, 1))
        for name in frozen:
            model.get_submodule(name).requires_grad_(False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.module = TransformerTrainModule(
                model,
                AdamWConfig(lr=LR, weight_decay=WD),
                rank_microbatch_size=8,
                max_sequence_length=4,
            )
        if recipe is not None:
            resume_through_dsdmerge(self.module, **recipe)
        self.checkpointer = Checkpointer(work_dir=work / "work")
        self.work = work

    @property
    def model(self):
        return self.module.model

    def steps(self, start: int, n: int) -> None:
        for step in range(start, start + n):
            x = torch.randint(0, 32, (2, 4), generator=torch.Generator().manual_seed(step % 2))
            loss = self.model(x).square().mean()
            if self.head is not None:
                loss = loss + getattr(self.model, self.head)(self.model.embeddings(x)).mean()
            loss.backward()
            self.module.optim.step()
            self.module.optim.zero_grad()

    def save(self, step: int) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.checkpointer.save(self.work / f"step{step}", self.module, {"global_step": step})

    def load(self, step: int):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return self.checkpointer.load(self.work / f"step{step}", self.module)

    def named(self):
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}, named_state(
            self.model, self.module.optim
        )


FF, ATTN = "blocks.0.feed_forward", "blocks.0.attention"
# name: (old run, new run, recipe, rename by hand)
SCENARIOS = {
    "new_head": (
        {},
        {"head": "value_head"},
        {"policy": "strict", "allow_missing": "*value_head.*"},
    ),
    "unfreeze": ({"frozen": (FF,)}, {}, {"policy": "strict", "allow_missing": f"*{FF}.*"}),
    "swap_frozen": (
        {"frozen": (FF,)},
        {"frozen": (ATTN,)},
        {"policy": "strict", "allow_missing": f"*{FF}.*", "allow_unexpected": f"*{ATTN}.*"},
    ),
    "rename": (
        {"head": "value_head", "trained": True},
        {"head": "reward_head", "trained": True},
        {"policy": "strict", "rename": {r"^value_head\.": "reward_head."}},
    ),
    "grow_vocab": ({}, {"vocab": 48}, {"policy": "strict", "on_shape_mismatch": "resize"}),
}


def by_hand(scenario):
    if scenario == "rename":
        return lambda k: "reward_head." + k[len("value_head.") :] if k.startswith("value_") else k
    return lambda k: k


def oracle(tmp_path, scenario, old):
    """Pure torch: the old state loaded by name (``transfer``), then the steps."""
    _, new_opts, _ = SCENARIOS[scenario]
    run = Run(tmp_path / "oracle", **new_opts)
    transfer(*old, run.model, run.module.optim, by_hand(scenario))
    run.steps(2, 2)
    first = run.named()
    run.steps(4, 2)
    return first, run.named()


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_the_checkpointer_resumes_through_the_recipe(scenario, tmp_path):
    old_opts, new_opts, recipe = SCENARIOS[scenario]
    old = trained(Run(tmp_path, **old_opts))
    want = oracle(tmp_path, scenario, copy.deepcopy(old.named()))

    def check(i, run, loaded):
        diff = run.module.dsdmerge_diff
        if i == 1:  # its own save, strictly: nothing in it the model does not have
            assert not diff.unexpected
            return
        assert loaded == {"global_step": 2}  # the trainer state, as OLMo-core reads it
        if scenario == "grow_vocab":  # the embedding and the output, weights and both moments
            assert {r.key for r in diff.resized} == {
                f"{part}{fqn}{moment}"
                for fqn in ("embeddings.weight", "lm_head.w_out.weight")
                for part, moment in [
                    ("model.", ""),
                    ("optim.state.", ".exp_avg"),
                    ("optim.state.", ".exp_avg_sq"),
                ]
            }

    # its own save, strictly: a head that never got a gradient has no state in it
    never = {"allow_missing": "*value_head.*"} if scenario == "new_head" else {}
    resume_twice(
        lambda options: Run(tmp_path, recipe=options, **new_opts),
        [recipe, {"policy": "strict", **never}],
        want,
        check=check,
    )


# what OLMo-core alone does on each changed model: DCP's CheckpointException (a
# BaseException) out of Checkpointer.load, naming the first key it cannot place
ALONE = {
    "new_head": "Missing key in checkpoint state_dict: model.value_head",
    "unfreeze": "Missing key in checkpoint state_dict: optim.state.blocks.0.feed_forward",
    "swap_frozen": "Missing key in checkpoint state_dict: optim.state.blocks.0.feed_forward",
    "rename": "Missing key in checkpoint state_dict: model.reward_head",
    "grow_vocab": "Size mismatch between saved torch.Size",
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_the_checkpointer_alone(scenario, tmp_path):
    old_opts, new_opts, _ = SCENARIOS[scenario]
    trained(Run(tmp_path, **old_opts))
    new = Run(tmp_path, **new_opts)
    with pytest.raises(BaseException, match=ALONE[scenario]) as err:
        new.load(2)
    assert type(err.value).__name__ == "CheckpointException"


def test_its_metadata_names_its_storage_class(tmp_path):
    """OLMo-core's writer puts its own class into ``.metadata``: refused unless trusted."""
    import dsdmerge as dm
    from dsdmerge.integrations import read_metadata

    old = Run(tmp_path)
    old.save(1)
    where = tmp_path / "step1" / "model_and_optim"
    with pytest.raises(dm.UnsafeCheckpointError, match="_StorageInfo"):
        read_metadata(where)
    assert "model.embeddings.weight" in read_metadata(where, trusted=TRUST)
