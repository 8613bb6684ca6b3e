"""Lightning: ``Trainer.fit(ckpt_path=...)`` on a changed model with
``dsdmerge.integrations.lightning.ResumeCallback`` (docs/trainers/lightning.md), and the
command line on ``.ckpt`` files.

A ``.ckpt`` holds ``state_dict`` (the module's, loaded with ``strict_loading``) and
``optimizer_states`` (one ``optimizer.state_dict()`` per optimizer, int ids). Each
scenario of tests/frameworks.py: an old run saves at step 2, the changed module resumes
it with the callback to step 4 and saves, that ``.ckpt`` is resumed again to step 6; both
compared bit for bit with a pure-torch oracle. The framework alone is run too.
"""

from __future__ import annotations

import json

import pytest

pl = pytest.importorskip("lightning.pytorch")

import torch  # noqa: E402
from frameworks import (  # noqa: E402
    NAMES,
    SCENARIOS,
    Net,
    adamw,
    assert_same_model,
    assert_same_optimizer,
    batch,
    equal,
    oracle,
)

from dsdmerge import cli  # noqa: E402
from dsdmerge.integrations.lightning import ResumeCallback  # noqa: E402

PREFIX = "net."


class Module(pl.LightningModule):
    def __init__(self, **options) -> None:
        super().__init__()
        self.net = Net(**options)

    def training_step(self, batch, batch_idx):
        return self.net(batch)

    def configure_optimizers(self):
        return adamw(self.net)


def loader():
    # an epoch is the two batches of tests/frameworks.py, in order
    return torch.utils.data.DataLoader([batch(0), batch(1)], batch_size=None)


def fit(module, steps, *, ckpt=None, callbacks=()):
    """Train to global step ``steps``, a whole number of epochs (Lightning resumes the
    middle of an epoch by restarting the data loader: not the data an uninterrupted run
    sees, whatever the checkpoint holds)."""
    assert steps % 2 == 0
    trainer = pl.Trainer(
        max_epochs=steps // 2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    )
    trainer.fit(module, loader(), ckpt_path=None if ckpt is None else str(ckpt))
    return trainer


def named(trainer):
    """The ``.ckpt``'s view: the module's state and the optimizer's, with names."""
    module = trainer.lightning_module
    model = {k: v.detach().clone() for k, v in module.state_dict().items()}
    osd = trainer.optimizers[0].state_dict()
    fqn = {id(p): n for n, p in module.named_parameters()}
    osd = {
        **osd,
        "param_groups": [
            {**g, NAMES: [fqn[id(p)] for p in live["params"]]}
            for g, live in zip(osd["param_groups"], trainer.optimizers[0].param_groups, strict=True)
        ],
    }
    return model, osd


@pytest.fixture(scope="module")
def olds(tmp_path_factory):
    root = tmp_path_factory.mktemp("lightning")
    out = {}
    for name, (old_opts, _, _) in SCENARIOS.items():
        callback = ResumeCallback()  # saves names; nothing to resume here
        trainer = fit(Module(**old_opts), 2, callbacks=[callback])
        path = root / f"{name}.ckpt"
        trainer.save_checkpoint(path)
        out[name] = (path, named(trainer))
    return out


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_fit_resumes_through_the_callback(scenario, olds, tmp_path):
    _, new_opts, recipe = SCENARIOS[scenario]
    recipe = {**recipe}
    if "rename" in recipe:  # Lightning's keys carry the module attribute: net.b. -> net.mid.
        recipe["rename"] = {r"^net\.b\.": "net.mid."}
    path, old = olds[scenario]
    want = oracle(scenario, old, prefix=PREFIX)
    again = {k: v for k, v in recipe.items() if k != "rename"}
    source = path
    for step, (want_model, want_optim), options in zip((4, 6), want, (recipe, again), strict=True):
        callback = ResumeCallback(**options)
        trainer = fit(Module(**new_opts), step, ckpt=source, callbacks=[callback])
        assert trainer.global_step == step
        assert callback.model_diff is not None
        assert len(callback.optimizer_diffs) == 1
        got_model, got_optim = named(trainer)
        assert_same_model(got_model, want_model)
        assert_same_optimizer(got_optim, want_optim)
        source = tmp_path / f"step{step}.ckpt"
        trainer.save_checkpoint(source)
        saved = torch.load(source, weights_only=True)
        assert saved["optimizer_states"][0]["param_groups"][0][NAMES]  # names, from now on


ALONE = {
    "new_head": "crash",  # strict model load: missing keys
    "unfreeze": "crash",  # group size
    "swap_frozen": "silent",
    "grow_vocab": "crash",  # size mismatch
    "rename": "crash",  # strict model load: missing and unexpected keys
    "reorder": "silent",
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_fit_alone(scenario, olds):
    _, new_opts, _ = SCENARIOS[scenario]
    path, (_, old_optim) = olds[scenario]
    if ALONE[scenario] == "crash":
        with pytest.raises((RuntimeError, ValueError, KeyError)):
            fit(Module(**new_opts), 4, ckpt=path)
        return

    class AtStart(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            self.state = {k: v["exp_avg"].clone() for k, v in named(trainer)[1]["state"].items()}
            self.names = named(trainer)[1]["param_groups"][0][NAMES]

    probe = AtStart()
    fit(Module(**new_opts), 4, ckpt=path, callbacks=[probe])
    old_names = old_optim["param_groups"][0][NAMES]
    old_b = old_optim["state"][old_names.index("net.b.weight")]["exp_avg"]
    assert equal(probe.state[probe.names.index("net.a.weight")], old_b)  # b's moments on a


def dsdmerge_cli(capsys, *args):
    """The command line, in this process (its parser imports nothing heavy)."""
    capsys.readouterr()
    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_command_line_reads_ckpt_parts(olds, tmp_path, capsys):
    """``--key state_dict`` and ``--key optimizer_states.0`` pick a ``.ckpt``'s parts."""
    old, _ = olds["new_head"]
    trainer = fit(Module(head=True), 2, callbacks=[ResumeCallback()])
    new = tmp_path / "new.ckpt"
    trainer.save_checkpoint(new)

    code, out, err = dsdmerge_cli(capsys, "diff", old, new, "--key", "state_dict")
    assert code == 1, err
    assert "net.value.{bias,weight}" in out

    code, out, err = dsdmerge_cli(capsys, "diff", old, new, "--key", "optimizer_states.0", "--json")
    assert code == 1, err
    report = json.loads(out)
    assert report["unexpected"] == []
    assert report["missing"]
    assert all(
        k.startswith("state.5.") or k.startswith("param_groups.") for k in report["missing"]
    ), report

    code, out, err = dsdmerge_cli(
        capsys, "check", old, new, "--key", "state_dict", "--policy", "strict",
        "--allow-missing", "net.value.*",
    )  # fmt: skip
    assert code == 0, out + err
    code, out, err = dsdmerge_cli(capsys, "inspect", old, "--key", "optimizer_states.0")
    assert code == 0, err
    assert "state" in out
