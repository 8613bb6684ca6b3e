"""The resume story against real optimizers: a tiny model, the optimizer specs, run and compare.

The story: train ``N_STEPS`` steps with a never-gradient
``indexer`` first in both param groups and a ``LambdaLR`` with one lambda per group, save
the optimizer in three layouts (DSD flat, DSD nested fqn-keyed, ``optimizer.state_dict()``
with int ids) through ``torch.save`` and ``torch.load(weights_only=True)``, resume a fresh
model/optimizer/scheduler built the same way, take one more step and compare bit for bit
with an uninterrupted run of ``N_STEPS + 1`` steps.

Every spec says how its optimizer is built and driven (closure, ``create_graph``,
``.train()``/``.eval()``, sparse gradients, 2-D params only). ``SPECS`` lists them all;
third-party ones name the package they need and are skipped when it is absent.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import random
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

N_STEPS = 3
LAYOUTS = ("flat", "nested", "int")
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
VOCAB, DIM, CLASSES = 8, 4, 3
LAMBDAS = (lambda s: 0.5**s, lambda s: 0.8**s)  # one per group: equal base lrs drift apart

# --------------------------------------------------------------------------------------
# the model


class StoryModel(nn.Module):
    """An ``indexer`` registered first (never a gradient), an embedding, a projection, a head.

    ``bias=False`` gives 2-D parameters only (Muon). ``sparse=True`` makes every
    module an ``nn.Embedding(sparse=True)`` (SparseAdam takes sparse gradients
    only). ``adapter=True`` registers a new ``adapter`` before everything (its
    parameters lead their groups); ``old=True`` keeps an ``old`` module that a
    grown model no longer has.
    """

    def __init__(
        self, *, bias: bool = True, sparse: bool = False, adapter: bool = False, old: bool = False
    ) -> None:
        super().__init__()
        self.sparse = sparse
        if adapter:
            self.adapter = self._linear(DIM, DIM, bias)
        if sparse:
            self.indexer = nn.Embedding(VOCAB, DIM, sparse=True)
            self.embed = nn.Embedding(VOCAB, DIM, sparse=True)
            self.head = nn.Embedding(VOCAB, CLASSES, sparse=True)
        else:
            self.indexer = self._linear(DIM, DIM, bias)
            self.embed = nn.Embedding(VOCAB, DIM)
            self.proj = self._linear(DIM, DIM, bias)
            self.head = self._linear(2, CLASSES, bias)
        if old:
            self.old = self._linear(DIM, DIM, bias)

    @staticmethod
    def _linear(i: int, o: int, bias: bool) -> nn.Linear:
        return nn.Linear(i, o, bias=bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.sparse:
            picked = self.indexer(tokens).topk(2, dim=-1).indices  # no gradient reaches it
            x = self.embed(tokens).gather(-1, picked).sum(-1, keepdim=True)
            return self.head(tokens) * x
        x = self.embed(tokens)
        if hasattr(self, "adapter"):
            x = x + self.adapter(x)
        if hasattr(self, "old"):
            x = x + self.old(x)
        picked = self.indexer(x).topk(2, dim=-1).indices  # no gradient reaches the indexer
        return self.head(torch.tanh(self.proj(x)).gather(-1, picked))

    def wake(self, tokens: torch.Tensor) -> torch.Tensor:
        """A loss term through which the indexer does get a gradient (its first real step)."""
        x = tokens if self.sparse else self.embed(tokens)
        return self.indexer(x).square().mean()


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of step ``i``: the same in every run."""
    gen = torch.Generator().manual_seed(1000 + i)
    return torch.randint(0, VOCAB, (4, 5), generator=gen), torch.randint(
        0, CLASSES, (4, 5), generator=gen
    )


def loss_of(model: StoryModel, i: int, *, wake: bool = False) -> torch.Tensor:
    """The loss of step ``i``; ``wake``: plus a term that gives the indexer a gradient."""
    tokens, target = batch(i)
    logits = model(tokens)
    loss = nn.functional.cross_entropy(logits.reshape(-1, CLASSES), target.reshape(-1))
    return loss + model.wake(tokens) if wake else loss


# --------------------------------------------------------------------------------------
# optimizer specs


@dataclasses.dataclass(frozen=True)
class Spec:
    """How to build and drive one optimizer in the story.

    Attributes:
        id: The test id, ``<package>.<Class>[-variant]``.
        make: ``make(groups)`` builds the optimizer from param-group dicts (each
            with ``params`` and, when ``per_group`` says so, ``lr``/``weight_decay``).
        package: The import name it needs (skipped when absent), ``None`` for torch.
        cls: The optimizer class's name (for torch, what the coverage check counts).
        model: ``StoryModel`` keyword arguments (``bias=False``: 2-D only; ``sparse=True``).
        one_group: The optimizer accepts one param group only (LBFGS).
        closure: ``step`` needs a closure that recomputes loss and gradients.
        create_graph: Backward with ``create_graph=True`` (Hessian estimates).
        train_eval: schedulefree's ``.train()``/``.eval()`` protocol: ``.train()``
            after building and after resuming, ``.eval()`` before saving.
        weight_decay: Give group 0 this weight decay, group 1 zero (``None``: the
            optimizer has no ``weight_decay``).
        lr: Base learning rate of group 0 (group 1 gets half).
        before: ``before(monkeypatch)`` before the optimizer is built (e.g. no compiling).
        note: Why the spec is special, for the reader.
    """

    id: str
    make: Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
    package: str | None = None
    cls: str = ""
    model: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    one_group: bool = False
    closure: bool = False
    create_graph: bool = False
    train_eval: bool = False
    weight_decay: float | None = 0.01
    lr: float = 1e-2
    before: Callable[[Any], None] | None = None
    note: str = ""

    def __str__(self) -> str:
        return self.id


def _torch(
    name: str,
    variant: str = "",
    *,
    kwargs: Mapping[str, Any] | None = None,
    **spec: Any,
) -> Spec:
    cls = getattr(torch.optim, name)
    extra = dict(kwargs or {})
    return Spec(
        id=f"torch.{name}" + (f"-{variant}" if variant else ""),
        make=lambda groups: cls(groups, **extra),
        cls=name,
        **spec,
    )


def _third(package: str, name: str, variant: str = "", **spec: Any) -> Spec:
    kwargs = dict(spec.pop("kwargs", {}))

    def make(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        module = __import__(package)
        return getattr(module, name)(groups, **kwargs)

    return Spec(
        id=f"{package}.{name}" + (f"-{variant}" if variant else ""),
        make=make,
        package=package,
        cls=name,
        **spec,
    )


def _heavyball_eager(monkeypatch: Any) -> None:
    # heavyball compiles its step with torch.compile (inductor): slow on CPU and not what the
    # story is about. Eager for the test only: heavyball's own switch, and TORCHDYNAMO_DISABLE=1
    # (torch.compile reads it on every call and then returns the function uncompiled).
    import heavyball.utils

    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    monkeypatch.setattr(heavyball.utils, "compile_mode", None)
    monkeypatch.setattr(heavyball.utils, "compile_mode_recommended_to_none", None)


TORCH_SPECS: tuple[Spec, ...] = (
    _torch("ASGD"),
    _torch("Adadelta", lr=1.0),
    _torch("Adafactor"),
    _torch("Adagrad"),
    _torch("Adam"),
    _torch("Adam", "amsgrad", kwargs={"amsgrad": True}),
    _torch("AdamW"),
    _torch("Adamax"),
    _torch(
        "LBFGS",
        lr=0.5,
        one_group=True,
        closure=True,
        weight_decay=None,
        kwargs={"max_iter": 3, "history_size": 4},
        note="one param group only; step(closure); keeps its whole state on its first "
        "param (here the indexer, which therefore does have state)",
    ),
    _torch(
        "Muon",
        model={"bias": False},
        lr=2e-2,
        note="2-D params only: the model has no biases (two groups of matrices)",
    ),
    _torch("NAdam"),
    _torch("RAdam"),
    _torch("RMSprop"),
    _torch("RMSprop", "centered-momentum", kwargs={"centered": True, "momentum": 0.9}),
    _torch("Rprop", weight_decay=None),
    _torch("SGD"),
    _torch("SGD", "momentum", kwargs={"momentum": 0.9}),
    _torch("SGD", "nesterov", kwargs={"momentum": 0.9, "nesterov": True}),
    _torch(
        "SparseAdam",
        model={"sparse": True},
        weight_decay=None,
        note="sparse gradients only: every module is an nn.Embedding(sparse=True)",
    ),
)

THIRD_PARTY_SPECS: tuple[Spec, ...] = (
    # pytorch-optimizer: a spread of state shapes
    _third("pytorch_optimizer", "AdamP"),
    _third("pytorch_optimizer", "Lion", lr=1e-3),
    _third("pytorch_optimizer", "Lamb"),
    _third("pytorch_optimizer", "Adan"),
    _third("pytorch_optimizer", "AdaBelief"),
    _third(
        "pytorch_optimizer",
        "MADGRAD",
        note="keeps a global state['k'] entry that is not a parameter",
    ),
    _third(
        "pytorch_optimizer",
        "SophiaH",
        create_graph=True,
        note="Hutchinson Hessian estimates: backward(create_graph=True); step count in "
        "the param groups; DSD's zero-gradient init step fails inside it",
    ),
    _third("pytorch_optimizer", "Prodigy", lr=1.0, note="a global D estimate per group"),
    _third("pytorch_optimizer", "DAdaptAdam", lr=1.0),
    _third("pytorch_optimizer", "SOAP", note="eigenbasis preconditioners (matrices) per param"),
    _third("pytorch_optimizer", "Shampoo", note="preconditioner matrices per param"),
    _third("pytorch_optimizer", "Kron", note="PSGD Kronecker factors: lists of tensors"),
    _third("pytorch_optimizer", "ScheduleFreeAdamW", train_eval=True),
    _third("pytorch_optimizer", "ScheduleFreeSGD", train_eval=True),
    _third("pytorch_optimizer", "ScheduleFreeRAdam", train_eval=True),
    # schedulefree
    _third(
        "schedulefree",
        "AdamWScheduleFree",
        train_eval=True,
        note=".train() creates empty state entries, so DSD's init step never runs",
    ),
    _third("schedulefree", "SGDScheduleFree", train_eval=True),
    _third("schedulefree", "RAdamScheduleFree", train_eval=True),
    # heavyball (needs Python >= 3.11 via numpy >= 2.3)
    _third(
        "heavyball",
        "AdamW",
        before=_heavyball_eager,
        note="its own top-level 'heavyball' key in state_dict(), read back by a load "
        "pre-hook; per-param state nested under int view indices",
    ),
    _third("heavyball", "SOAP", before=_heavyball_eager),
    _third("heavyball", "SFAdamW", before=_heavyball_eager, train_eval=True),
)

SPECS: tuple[Spec, ...] = TORCH_SPECS + THIRD_PARTY_SPECS
BY_ID = {s.id: s for s in SPECS}
assert len(BY_ID) == len(SPECS), "spec ids must be unique"


def torch_optimizer_classes() -> set[str]:
    """Every public optimizer class torch.optim exports (Optimizer itself excluded)."""
    return {
        name
        for name in dir(torch.optim)
        if not name.startswith("_")
        and inspect.isclass(getattr(torch.optim, name))
        and issubclass(getattr(torch.optim, name), torch.optim.Optimizer)
        and getattr(torch.optim, name) is not torch.optim.Optimizer
    }


def require(spec: Spec, monkeypatch: Any) -> None:
    """Skip (cleanly, naming the package and the extra) when the spec's package is absent."""
    import pytest

    if spec.package is not None:
        pytest.importorskip(
            spec.package,
            reason=f"{spec.package} is not installed (pip install -e '.[test]')",
        )
    if spec.before is not None:
        spec.before(monkeypatch)


# --------------------------------------------------------------------------------------
# building and driving


@dataclasses.dataclass
class Run:
    """A model, its optimizer and scheduler, built the same way every time."""

    spec: Spec
    model: StoryModel
    optim: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR


def groups_for(spec: Spec, model: nn.Module) -> list[dict[str, Any]]:
    """Decay / no-decay groups (matrices / the rest), the indexer first in each.

    ``bias=False`` models: group 0 the indexer and projection, group 1 the rest.
    LBFGS: one group, every param, the indexer first.
    """
    named = list(model.named_parameters())
    if spec.one_group:
        return [{"params": [p for _, p in named], "lr": spec.lr}]
    if spec.model.get("bias", True) and not spec.model.get("sparse", False):
        first = [p for n, p in named if n.endswith("weight")]
        second = [p for n, p in named if not n.endswith("weight")]
    else:
        split = ("embed.", "head.")
        first = [p for n, p in named if not n.startswith(split)]
        second = [p for n, p in named if n.startswith(split)]
    groups: list[dict[str, Any]] = [
        {"params": first, "lr": spec.lr},
        {"params": second, "lr": spec.lr / 2},
    ]
    if spec.weight_decay is not None:
        groups[0]["weight_decay"] = spec.weight_decay
        groups[1]["weight_decay"] = 0.0
    return groups


def build(spec: Spec, **model_kwargs: Any) -> Run:
    """Seeded model, optimizer, LambdaLR (one lambda per group); ``.train()`` when needed."""
    torch.manual_seed(0)
    model = StoryModel(**{**spec.model, **model_kwargs})
    optim = spec.make(groups_for(spec, model))
    sched = torch.optim.lr_scheduler.LambdaLR(optim, list(LAMBDAS[: len(optim.param_groups)]))
    if spec.train_eval:
        optim.train()  # type: ignore[attr-defined]
    return Run(spec, model, optim, sched)


def backward(run: Run, i: int, *, wake: bool = False) -> torch.Tensor:
    """Forward and backward of step ``i`` (grads are left on the params)."""
    run.optim.zero_grad(set_to_none=True)
    loss = loss_of(run.model, i, wake=wake)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # create_graph's reference-cycle warning
        loss.backward(create_graph=run.spec.create_graph)
    return loss


def step(run: Run, i: int, *, have_grads: bool = False, wake: bool = False) -> None:
    """One training step ``i``: backward (unless the grads are there already), step, schedule.

    ``wake``: the indexer gets a gradient in this step (its first real step).

    The global RNGs (torch, numpy, random) are seeded per step, so optimizers that draw
    random numbers (Hutchinson estimates, PSGD's balancing) draw the same ones in every run.
    """
    torch.manual_seed(2000 + i)
    np.random.seed(2000 + i)
    random.seed(2000 + i)
    if run.spec.closure:
        run.optim.step(lambda: backward(run, i, wake=wake))
    else:
        if not have_grads:
            backward(run, i, wake=wake)
        run.optim.step()
    run.optim.zero_grad(set_to_none=True)
    run.sched.step()


def before_save(run: Run) -> None:
    if run.spec.train_eval:
        run.optim.eval()  # type: ignore[attr-defined]


def after_save(run: Run) -> None:
    if run.spec.train_eval:
        run.optim.train()  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------
# the checkpoint and the uninterrupted run


@dataclasses.dataclass
class Story:
    """What the story of one spec needs, computed once.

    Attributes:
        files: Layout name to the saved ``.pt`` file (``{"model", "optim", "sched"}``).
        save_errors: Layout name to why torch itself could not save it in that layout.
        saved: ``optim.state_dict()`` at save time (a deep copy).
        saved_by_fqn: The saved per-param state by parameter name (deep copies).
        final: The uninterrupted run after ``N_STEPS + 1`` steps (``snapshot_run``).
        final_wake: The same, but the indexer gets a gradient in the last step.
        indexer_ids: The int ids of the indexer's params.
    """

    files: dict[str, Path]
    save_errors: dict[str, str]
    saved: dict[str, Any]
    saved_by_fqn: dict[str, Any]
    final: dict[str, Any]
    final_wake: dict[str, Any]
    indexer_ids: tuple[int, ...]


def snapshot_run(run: Run) -> dict[str, Any]:
    """Deep copies of a run's params, optimizer state dict and scheduler state dict."""
    return {
        "params": {n: p.detach().clone() for n, p in run.model.named_parameters()},
        "optim": copy.deepcopy(run.optim.state_dict()),
        "sched": copy.deepcopy(run.sched.state_dict()),
    }


def state_by_fqn(run: Run) -> dict[str, Any]:
    """The optimizer's per-param state keyed by parameter name (live values)."""
    return {n: run.optim.state[p] for n, p in run.model.named_parameters() if p in run.optim.state}


def save(run: Run, where: Path) -> tuple[dict[str, Path], dict[str, str]]:
    """Save model, optimizer (each layout) and scheduler; a layout torch cannot save is noted."""
    where.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    errors: dict[str, str] = {}
    for layout in LAYOUTS:
        try:
            if layout == "flat":
                optim_sd = get_optimizer_state_dict(run.model, run.optim, options=FLAT)
            elif layout == "nested":
                optim_sd = get_optimizer_state_dict(run.model, run.optim)
            else:
                optim_sd = run.optim.state_dict()
            path = where / f"{layout}.pt"
            torch.save(
                {
                    "model": run.model.state_dict(),
                    "optim": optim_sd,
                    "sched": run.sched.state_dict(),
                },
                path,
            )
            files[layout] = path
        except Exception as err:  # noqa: BLE001 - torch's own save fails: reported, not hidden
            errors[layout] = f"{type(err).__name__}: {err}"
    return files, errors


def uninterrupted(spec: Spec, *, wake: bool = False, **model_kwargs: Any) -> dict[str, Any]:
    """``N_STEPS + 1`` steps without a checkpoint (but with the save point's eval/train)."""
    run = build(spec, **model_kwargs)
    for i in range(N_STEPS):
        step(run, i)
    before_save(run)  # the save point: schedulefree's eval()/train() round trip
    after_save(run)
    step(run, N_STEPS, wake=wake)
    return snapshot_run(run)


def make_story(spec: Spec, where: Path, **model_kwargs: Any) -> Story:
    """Train and save (three layouts), and run the uninterrupted ``N_STEPS + 1`` steps."""
    run = build(spec, **model_kwargs)
    for i in range(N_STEPS):
        step(run, i)
    before_save(run)
    files, errors = save(run, where)
    params = [p for g in run.optim.param_groups for p in g["params"]]
    indexer = {id(p) for p in run.model.indexer.parameters()}
    return Story(
        files=files,
        save_errors=errors,
        saved=copy.deepcopy(run.optim.state_dict()),
        saved_by_fqn=copy.deepcopy(state_by_fqn(run)),
        final=uninterrupted(spec, **model_kwargs),
        final_wake=uninterrupted(spec, wake=True, **model_kwargs),
        indexer_ids=tuple(i for i, p in enumerate(params) if id(p) in indexer),
    )


def nested_to_ids(nested: Mapping[str, Any], run: Run) -> dict[str, Any]:
    """DSD's fqn-keyed optimizer state dict with int ids, as ``optimizer.state_dict()`` numbers
    them (position over the groups' params); no other change."""
    names = {id(p): n for n, p in run.model.named_parameters()}
    params = [p for g in run.optim.param_groups for p in g["params"]]
    ids = {names[id(p)]: i for i, p in enumerate(params)}
    return {
        "state": {ids.get(k, k): v for k, v in nested["state"].items()},
        "param_groups": [
            {**g, "params": [ids.get(f, f) for f in g["params"]]} for g in nested["param_groups"]
        ],
    }


def load(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=True)


# --------------------------------------------------------------------------------------
# comparing


def tree_differences(expected: Any, actual: Any, path: str = "") -> list[str]:
    """Every place two state trees differ, bit for bit (tensors: dtype, shape, values)."""
    out: list[str] = []
    if isinstance(expected, torch.Tensor) or isinstance(actual, torch.Tensor):
        if not (isinstance(expected, torch.Tensor) and isinstance(actual, torch.Tensor)):
            return [f"{path}: {_short(expected)} != {_short(actual)}"]
        if expected.dtype != actual.dtype or expected.shape != actual.shape:
            return [
                f"{path}: {expected.dtype}{list(expected.shape)} != "
                f"{actual.dtype}{list(actual.shape)}"
            ]
        e, a = expected.detach(), actual.detach()
        if e.layout != torch.strided:
            e, a = e.to_dense(), a.to_dense()
        if not (torch.equal(e, a) or (torch.equal(e.isnan(), a.isnan()) and _equal_nan(e, a))):
            return [f"{path}: tensor values differ (max abs diff {_max_diff(e, a)})"]
        return []
    if isinstance(expected, Mapping) and isinstance(actual, Mapping):
        for key in expected:  # in the expected tree's order: reports read the same every run
            if key not in actual:
                out.append(f"{path}[{key!r}]: missing (expected {_short(expected[key])})")
            else:
                out.extend(tree_differences(expected[key], actual[key], f"{path}[{key!r}]"))
        for key in actual:
            if key not in expected:
                out.append(f"{path}[{key!r}]: unexpected ({_short(actual[key])})")
        return out
    if isinstance(expected, (list, tuple)) and isinstance(actual, (list, tuple)):
        if type(expected) is not type(actual) or len(expected) != len(actual):
            return [f"{path}: {_short(expected)} != {_short(actual)}"]
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            out.extend(tree_differences(e, a, f"{path}[{i}]"))
        return out
    if type(expected) is not type(actual) or not _same_scalar(expected, actual):
        return [f"{path}: {_short(expected)} != {_short(actual)}"]
    return []


def _same_scalar(a: Any, b: Any) -> bool:
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - any object in a third-party state dict
        return a is b


def _equal_nan(e: torch.Tensor, a: torch.Tensor) -> bool:
    mask = ~e.isnan()
    return torch.equal(e[mask], a[mask])


def _max_diff(e: torch.Tensor, a: torch.Tensor) -> float:
    try:
        return float((e.double() - a.double()).abs().max())
    except Exception:  # noqa: BLE001 - only for the message (e.g. bool tensors)
        return math.nan


def _short(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor {x.dtype}{list(x.shape)}"
    text = repr(x)
    return text if len(text) < 80 else text[:77] + "..."


def without_empty_entries(optim_sd: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` without the empty per-param entries some optimizers create on access."""
    return {
        **optim_sd,
        "state": {k: v for k, v in optim_sd["state"].items() if v != {}},
    }


def run_differences(expected: Mapping[str, Any], run: Run) -> list[str]:
    """Differences between a snapshot (``snapshot_run``) and a live run, bit for bit."""
    actual = snapshot_run(run)
    out = [f"param {d}" for d in tree_differences(expected["params"], actual["params"])]
    out += [f"optimizer {d}" for d in tree_differences(expected["optim"], actual["optim"])]
    out += [f"scheduler {d}" for d in tree_differences(expected["sched"], actual["sched"])]
    return out


# --------------------------------------------------------------------------------------
# the stories, computed once per session


class Stories:
    """Stories and plain-torch controls, computed once per session and spec."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cache: dict[tuple[str, str], Story] = {}
        self.controls: dict[str, str | None] = {}
        self.count = 0

    def serial(self) -> int:
        self.count += 1
        return self.count

    def get(self, spec: Spec, **model_kwargs: Any) -> Story:
        key = (spec.id, repr(sorted(model_kwargs.items())))
        if key not in self.cache:
            where = self.root / f"{spec.id}-{len(self.cache)}"
            self.cache[key] = make_story(spec, where, **model_kwargs)
        return self.cache[key]

    def control(self, spec: Spec, layout: str = "int") -> str | None:
        """Why plain torch does not round-trip ``spec`` (``None``: it does, bit for bit).

        ``int``: ``Optimizer.load_state_dict`` of the int-id file. ``flat``/``nested``:
        DSD's ``get_optimizer_state_dict`` keeps only ``state`` and ``param_groups``, so
        the same load without the optimizer's other top-level keys (heavyball's own key):
        what DSD does not save, no loader can give back.
        """
        key = f"{spec.id}/{'int' if layout == 'int' else 'dsd'}"
        if key not in self.controls:
            self.controls[key] = plain_torch_resume(spec, self.get(spec), dsd=layout != "int")
        return self.controls[key]


def plain_torch_resume(spec: Spec, st: Story, *, dsd: bool = False) -> str | None:
    """The story with torch's own loader: ``Optimizer.load_state_dict`` of the int-id file.

    ``dsd``: first check that DSD's nested file holds what ``optimizer.state_dict()`` holds
    (``state`` and ``param_groups``, fqns mapped back to ids); then, if the optimizer has other
    top-level keys (DSD drops them), the same load without them.
    """
    if "int" not in st.files:
        return f"{spec.id}: torch cannot save its optimizer.state_dict(): {st.save_errors['int']}"
    try:
        loaded = load(st.files["int"])
    except Exception as err:  # noqa: BLE001 - the control reports whatever torch raises
        return f"{spec.id}: torch.load(weights_only=True) refuses its state dict: {err}"
    optim_sd = loaded["optim"]
    dropped = sorted(k for k in optim_sd if k not in ("state", "param_groups"))
    run = build(spec)
    if dsd:
        if "nested" not in st.files:
            return f"{spec.id}: DSD's get_optimizer_state_dict cannot save it: {st.save_errors}"
        # what DSD saved (fqn-keyed) is what optimizer.state_dict() saved, id for id
        lost = tree_differences(
            {"state": optim_sd["state"], "param_groups": optim_sd["param_groups"]},
            nested_to_ids(load(st.files["nested"])["optim"], run),
        )
        if lost:
            return f"{spec.id}: DSD's nested save differs from optimizer.state_dict(): {lost[:3]}"
        if not dropped:
            return None  # then the int-id control's load is exactly this one
        optim_sd = {"state": optim_sd["state"], "param_groups": optim_sd["param_groups"]}
    try:
        run.model.load_state_dict(loaded["model"])
        run.optim.load_state_dict(optim_sd)
        run.sched.load_state_dict(loaded["sched"])
        after_save(run)
        step(run, N_STEPS)
    except Exception as err:  # noqa: BLE001 - the control reports whatever torch raises
        return f"{spec.id}: plain torch fails to resume it: {type(err).__name__}: {err}"
    diffs = run_differences(st.final, run)
    if diffs and dsd:
        return (
            f"{spec.id}: DSD's get_optimizer_state_dict does not save its top-level "
            f"key(s) {dropped}, and without them it does not resume bit for bit: {diffs[:3]}"
        )
    if diffs:
        return f"{spec.id}: plain torch does not round-trip it bit for bit: {diffs[:3]}"
    return None
