"""accelerate: ``Accelerator.load_state`` on a changed model, through the hooks
(docs/trainers/accelerate.md).

``save_state`` writes the model (``model.safetensors``) and ``optimizer.state_dict()``
(``optimizer.bin``, int ids); ``load_state`` loads the model strictly and the optimizer
by position, and ``prepare()`` reloads the optimizer's own empty state through the same
``load_state_dict``. Each scenario of tests/frameworks.py: an old run saves at step 2,
the changed model resumes it through the recipe, trains to step 4 and saves, that save
is resumed again and trained to step 6; both are compared bit for bit (model, every
optimizer state key and hyperparameter by name) with a pure-torch oracle. The framework
alone is run too.
"""

from __future__ import annotations

import pytest

accelerate = pytest.importorskip("accelerate")

import torch  # noqa: E402
from frameworks import (  # noqa: E402
    SCENARIOS,
    Net,
    adamw,
    batch,
    equal,
    named_state,
    oracle,
    resume_twice,
    snapshot,
)

import dsdmerge as dm  # noqa: E402
from dsdmerge.integrations import (  # noqa: E402
    install_load_hook,
    install_model_load_hook,
    record_param_names,
)

MODEL = {"policy", "allow_missing", "allow_unexpected", "rename", "on_shape_mismatch"}


def prepared(model, *, recipe=None, names=True):
    """The recipe: the optimizer and model as accelerate prepares them, hooks on both."""
    accelerator = accelerate.Accelerator(cpu=True)
    optimizer = adamw(model)
    hooks = None
    if names:
        record_param_names(optimizer, model)
    if recipe is not None:
        hooks = (
            install_load_hook(optimizer, model, **recipe),
            install_model_load_hook(model, **{k: v for k, v in recipe.items() if k in MODEL}),
        )
    model, optimizer = accelerator.prepare(model, optimizer)  # reloads its own empty state
    return accelerator, model, optimizer, hooks


def steps(accelerator, model, optimizer, start, n):
    for step in range(start, start + n):
        accelerator.backward(model(batch(step)))
        optimizer.step()
        optimizer.zero_grad()


@pytest.fixture(scope="module")
def olds(tmp_path_factory):
    """The old runs' saves at step 2, one per old model."""
    root = tmp_path_factory.mktemp("accelerate")
    out = {}
    for name, (old_opts, _, _) in SCENARIOS.items():
        model = Net(**old_opts)
        accelerator, model, optimizer, _ = prepared(model)
        steps(accelerator, model, optimizer, 0, 2)
        accelerator.save_state(str(root / name))
        out[name] = (root / name, snapshot(model, optimizer.optimizer))
    return out


class Run:
    """A new model prepared with the recipe's hooks: the old save at step 2, its own later."""

    def __init__(self, new_opts, recipe, old_path, folder):
        self.accelerator, self.model, self.optimizer, hooks = prepared(
            Net(**new_opts), recipe=recipe
        )
        self.o_hook, self.m_hook = hooks
        self.prepared_diff = self.o_hook.diff  # what prepare()'s reload of the empty state did
        self.old_path, self.folder = old_path, folder

    def steps(self, start, n):
        steps(self.accelerator, self.model, self.optimizer, start, n)

    def load(self, step):
        self.accelerator.load_state(str(self.old_path if step == 2 else self.folder / f"at{step}"))

    def save(self, step):
        self.accelerator.save_state(str(self.folder / f"at{step}"))
        self.o_hook.remove()
        self.m_hook.remove()

    def named(self):
        return self.model.state_dict(), named_state(self.model, self.optimizer.optimizer)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_load_state_through_the_hooks(scenario, olds, tmp_path):
    _, new_opts, recipe = SCENARIOS[scenario]
    path, old = olds[scenario]

    def check(i, run, loaded):
        assert run.prepared_diff is None  # prepare()'s reload of the empty state passed through
        assert run.o_hook.loads == 1
        assert run.m_hook.loads == 1

    again = {k: v for k, v in recipe.items() if k != "rename"}  # a rename is done once
    resume_twice(
        lambda options: Run(new_opts, options, path, tmp_path),
        [recipe, again],
        oracle(scenario, old),
        check=check,
    )


ALONE = {
    "new_head": "crash",
    "unfreeze": "crash",
    "swap_frozen": "silent",
    "grow_vocab": "crash",
    "rename": "crash",
    "reorder": "silent",
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_load_state_alone(scenario, olds):
    """What accelerate does by itself: a crash, or the state on the wrong parameters."""
    _, new_opts, _ = SCENARIOS[scenario]
    path, (_, old_optim) = olds[scenario]
    model = Net(**new_opts)
    accelerator, model, optimizer, _ = prepared(model, names=False)
    if ALONE[scenario] == "crash":
        with pytest.raises((RuntimeError, ValueError)):
            accelerator.load_state(str(path))
        return
    accelerator.load_state(str(path))
    got = named_state(model, optimizer.optimizer)
    # a's moments now sit on b (or b's on a), since the two have the same shape
    old_a = next(
        s
        for pid, s in old_optim["state"].items()
        if old_optim["param_groups"][0]["param_names"][pid] == "b.weight"
    )
    names = got["param_groups"][0]["param_names"]
    on_a = got["state"][names.index("a.weight")]
    assert equal(on_a["exp_avg"], old_a["exp_avg"])


def test_same_shape_modules_in_another_order_without_names_are_refused(olds, tmp_path):
    """The silent swap is impossible through dsdmerge: no names, no guess."""
    path, _ = olds["reorder"]
    nameless = tmp_path / "nameless"
    import shutil

    shutil.copytree(path, nameless)
    osd = torch.load(nameless / "optimizer.bin", weights_only=True)
    for g in osd["param_groups"]:
        del g["param_names"]
    torch.save(osd, nameless / "optimizer.bin")
    model = Net(order=("b", "a"))
    accelerator, model, optimizer, _ = prepared(model, recipe={"policy": "strict"})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(dm.LayoutError, match="names="):
        accelerator.load_state(str(nameless))
    assert not optimizer.optimizer.state
    # the model was loaded first (by name, correctly); the optimizer kept nothing
    assert not equal(model.state_dict(), before)
    # with the old model's names, it resumes by name
    names = [n for n, _ in Net().named_parameters()]
    accelerator, model, optimizer, (hook, _) = prepared(
        Net(order=("b", "a")), recipe={"policy": "strict", "names": names}
    )
    accelerator.load_state(str(nameless))
    assert not hook.diff
