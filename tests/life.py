"""The life of a run, without dsdmerge: a model you can change, saves, and a pure-torch oracle.

What ``test_life_of_a_run.py`` drives. Nothing here imports dsdmerge: the oracle is what a
careful engineer would write by hand, with torch only, for the resume dsdmerge is asked to do.

* :class:`Config`: a model as a list of modules (:class:`Mod`: an embedding, linears, a
  ``never`` linear that gets no gradient) with stable uids, which parameter goes to which param
  group, the groups' hyperparameters, one optimizer or two (a container, as torchtitan's),
  and whether the optimizer is built from named parameters (torch's ``param_names``).
* :func:`build`: the model and optimizer(s) of a config, seeded per module, so that two builds
  of one config are bit-identical and a module's initial values do not depend on the others.
* :func:`train_step`: one deterministic step, driven as the spec says (closure, create_graph).
* :func:`record`: what a save holds, by module uid and parameter name: the model's tensors, each
  parameter's optimizer state, its group's hyperparameters and group, optimizer-level entries
  and the optimizer's own top-level keys (deep copies).
* :func:`oracle`: a run built from a config and loaded *by hand* from a record: tensors by uid
  (grown ones keep the trained leading slice), each parameter's state by uid (resized fields
  keep the trained slice, the rest from the optimizer's own fresh state), parameters without
  checkpoint state as a new optimizer has them, each group's hyperparameters from the
  checkpoint group most of its members come from (ties: the first member's), everything else
  the new optimizer's own; then ``Optimizer.load_state_dict``.
"""

from __future__ import annotations

import copy
import dataclasses
import random
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from story import Spec
from torch import nn

D = 4
VOCAB = 6  # tokens are drawn below this; a grown vocabulary's rows get zero gradients
GROUPS = ("decay", "nodecay", "extra")

Key = tuple[int, str]  # (module uid, parameter name)


@dataclasses.dataclass(frozen=True)
class Mod:
    uid: int
    name: str
    kind: str  # "embed" | "linear" | "never"
    rows: int = VOCAB
    frozen: bool = False  # requires_grad=False, and left out of the optimizer
    groups: tuple[tuple[str, str], ...] = (("weight", "decay"), ("bias", "nodecay"))

    def group_of(self, pname: str) -> str:
        return dict(self.groups)[pname]


@dataclasses.dataclass(frozen=True)
class Config:
    mods: tuple[Mod, ...]
    hp: tuple[tuple[str, float, float], ...] = (
        ("decay", 1e-2, 0.01),
        ("nodecay", 5e-3, 0.0),
        ("extra", 2e-3, 0.0),
    )
    split: bool = False
    named: bool = False

    def mod(self, uid: int) -> Mod | None:
        return next((m for m in self.mods if m.uid == uid), None)

    def replace(self, **kw: Any) -> Config:
        return dataclasses.replace(self, **kw)

    def with_mod(self, uid: int, **kw: Any) -> Config:
        return self.replace(
            mods=tuple(dataclasses.replace(m, **kw) if m.uid == uid else m for m in self.mods)
        )


def initial_config(*, named: bool) -> Config:
    return Config(
        mods=(
            Mod(0, "embed", "embed", groups=(("weight", "nodecay"),)),
            Mod(1, "never", "never"),
            Mod(2, "l1", "linear"),
            Mod(3, "l2", "linear"),
            Mod(4, "head", "linear"),
        ),
        named=named,
    )


class Net(nn.Module):
    """The modules of a config, registered in its order; residual tanh linears over an embedding."""

    def __init__(self, config: Config, *, bias: bool) -> None:
        super().__init__()
        self.order = [m.name for m in config.mods]
        self.kinds = {m.name: m.kind for m in config.mods}
        for m in config.mods:
            torch.manual_seed(10_000 + 97 * m.uid)
            module: nn.Module = (
                nn.Embedding(m.rows, D) if m.kind == "embed" else nn.Linear(D, D, bias=bias)
            )
            if m.frozen:
                module.requires_grad_(False)
            setattr(self, m.name, module)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        embed = next(n for n in self.order if self.kinds[n] == "embed")
        x = getattr(self, embed)(tokens)
        for name in self.order:
            if self.kinds[name] == "linear":
                x = x + torch.tanh(getattr(self, name)(x))
        return x.square().mean()


class Container(torch.optim.Optimizer):
    """Two optimizers behind one, as torchtitan's ``OptimizersContainer`` holds them."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers  # no param_groups of its own: dsdmerge finds these

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        for o in self.optimizers:
            o.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


@dataclasses.dataclass
class Run:
    spec: Spec
    config: Config
    model: Net
    optims: list[torch.optim.Optimizer]

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """What a trainer holds: the optimizer, or the container of two."""
        return self.optims[0] if len(self.optims) == 1 else Container(self.optims)

    def key_of(self) -> dict[int, Key]:
        out = {}
        for m in self.config.mods:
            for pname, p in getattr(self.model, m.name).named_parameters():
                out[id(p)] = (m.uid, pname)
        return out

    def fqn(self, key: Key) -> str:
        mod = self.config.mod(key[0])
        assert mod is not None
        return f"{mod.name}.{key[1]}"


def param_groups(spec: Spec, config: Config, model: Net, part: int | None) -> list[dict[str, Any]]:
    """The param groups of one optimizer (``part``: which half of a split; ``None``: all)."""
    hp = {g: (lr, wd) for g, lr, wd in config.hp}
    groups: dict[str, list[Any]] = {g: [] for g in GROUPS}
    for i, m in enumerate(config.mods):
        if m.frozen or (part is not None and i % 2 != part):
            continue
        for pname, p in getattr(model, m.name).named_parameters():
            item = (f"{m.name}.{pname}", p) if config.named else p
            groups["decay" if spec.one_group else m.group_of(pname)].append(item)
    out = []
    for g in GROUPS:
        if not groups[g]:
            continue
        lr, wd = hp[g]
        group: dict[str, Any] = {"params": groups[g], "lr": lr}
        if spec.weight_decay is not None:
            group["weight_decay"] = wd
        out.append(group)
    return out


def build(spec: Spec, config: Config) -> Run:
    """A model and its optimizer(s), seeded: two builds of one config are bit-identical."""
    model = Net(config, bias=spec.model.get("bias", True))
    parts = [0, 1] if config.split else [None]
    optims = [spec.make(param_groups(spec, config, model, part)) for part in parts]
    if spec.train_eval:
        for o in optims:
            o.train()  # type: ignore[attr-defined]
    return Run(spec, config, model, optims)


def batch(i: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 5), generator=torch.Generator().manual_seed(7_000 + i))


def seed(n: int) -> None:
    """Seed every global RNG an optimizer may draw from."""
    torch.manual_seed(n)
    np.random.seed(n)
    random.seed(n)


def train_step(run: Run, i: int) -> None:
    """One step ``i`` (global RNGs seeded per step: optimizers that draw numbers agree)."""
    seed(2000 + i)

    def closure() -> torch.Tensor:
        for o in run.optims:
            o.zero_grad(set_to_none=True)
        loss = run.model(batch(i))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # create_graph's reference cycle
            loss.backward(create_graph=run.spec.create_graph)
        return loss

    if run.spec.closure:
        for o in run.optims:
            o.step(closure)
    else:
        closure()
        for o in run.optims:
            o.step()
    for o in run.optims:
        o.zero_grad(set_to_none=True)


def before_save(run: Run) -> None:
    if run.spec.train_eval:
        for o in run.optims:
            o.eval()  # type: ignore[attr-defined]


def after_save(run: Run) -> None:
    if run.spec.train_eval:
        for o in run.optims:
            o.train()  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------
# what a save holds, by uid


@dataclasses.dataclass
class Record:
    """What a checkpoint holds, keyed by (module uid, parameter name), deep copies."""

    config: Config
    model: dict[Key, torch.Tensor]
    state: dict[Key, Any]  # parameters with state
    hp: dict[Key, dict[str, Any]]  # every optimized parameter: its group's hyperparameters
    group: dict[Key, tuple[int, int]]  # every optimized parameter: (optimizer, group index)
    entries: list[dict[Any, Any]]  # per optimizer: state entries that are no parameter's
    extras: list[dict[Any, Any]]  # per optimizer: top-level keys besides state/param_groups


def record(run: Run) -> Record:
    key_of = run.key_of()
    model = {}
    for m in run.config.mods:
        for pname, t in getattr(run.model, m.name).state_dict().items():
            model[(m.uid, pname)] = t.detach().clone()
    state: dict[Key, Any] = {}
    hp: dict[Key, dict[str, Any]] = {}
    group: dict[Key, tuple[int, int]] = {}
    entries = []
    extras = []
    for n, o in enumerate(run.optims):
        sd = o.state_dict()
        params = {id(p) for g in o.param_groups for p in g["params"]}
        for gi, (g, saved) in enumerate(zip(o.param_groups, sd["param_groups"], strict=True)):
            values = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
            for p in g["params"]:
                key = key_of[id(p)]
                hp[key] = copy.deepcopy(values)
                group[key] = (n, gi)
                if o.state.get(p):
                    state[key] = copy.deepcopy(o.state[p])
        own = {
            k: v
            for k, v in o.state.items()
            if not (isinstance(k, torch.Tensor) and id(k) in params)
        }
        entries.append(copy.deepcopy(own))
        extras.append(
            copy.deepcopy({k: v for k, v in sd.items() if k not in ("state", "param_groups")})
        )
    return Record(run.config, model, state, hp, group, entries, extras)


# --------------------------------------------------------------------------------------
# the oracle


class Refused(Exception):
    """What the oracle cannot load by hand either (torch would fail or it would be a guess)."""


def fresh_state(spec: Spec, config: Config, model: Net) -> list[dict[int, Any]]:
    """Per optimizer, ``id(param of model) -> the state a new optimizer has or makes first``.

    A new optimizer's own state where it has some (Adagrad makes it with the optimizer), else
    that of one step with zero gradients and lr 0 on copies (what DSD's init step makes).
    """
    clones = copy.deepcopy(model)
    run = Run(spec, config, clones, [])
    parts = [0, 1] if config.split else [None]
    run.optims = [spec.make(param_groups(spec, config, clones, part)) for part in parts]
    after_save(run)  # schedule-free optimizers step in train() mode only
    out = []
    to_live = {id(q): p for p, q in zip(model.parameters(), clones.parameters(), strict=True)}
    for o in run.optims:
        if not any(o.state.values()):  # schedulefree's train() makes empty entries
            o.state.clear()
            for g in o.param_groups:
                if "lr" in g:
                    g["lr"] = 0.0
                for p in g["params"]:
                    # a Hessian estimate differentiates the gradient: one that has a graph
                    p.grad = p * 0 if spec.create_graph else torch.zeros_like(p)
            try:
                if spec.closure:
                    o.step(lambda: torch.zeros(()))
                else:
                    o.step()
            except Exception:  # noqa: BLE001 - no fresh values: nothing can be resized
                o.state.clear()
        out.append(
            {id(to_live[id(p)]): v for p, v in o.state.items() if isinstance(p, torch.Tensor)}
        )
    return out


def siblings(checkpoint: Mapping[Any, Any], fresh: Mapping[Any, Any]) -> dict[Any, Any]:
    """A field the fresh state lacks (SophiaH's later ``hessian``) is sized like the field of
    its shape and dtype in the checkpoint (``momentum``): the fresh one of that field."""
    by_shape = {}
    for k, v in checkpoint.items():
        f = fresh.get(k)
        if isinstance(v, torch.Tensor) and isinstance(f, torch.Tensor) and v.dim() > 0:
            by_shape.setdefault((tuple(v.shape), v.dtype), f)
    out = dict(fresh)
    for k, v in checkpoint.items():
        if k not in fresh and isinstance(v, torch.Tensor):
            sibling = by_shape.get((tuple(v.shape), v.dtype))
            if sibling is not None:
                out[k] = sibling
    return out


def resized(checkpoint: Any, fresh: Any, where: str) -> Any:
    """The checkpoint's state entry with every tensor whose shape differs from ``fresh`` resized:
    the fresh tensor, with the checkpoint's overlapping leading slice (same rank only)."""
    if isinstance(checkpoint, Mapping) and isinstance(fresh, Mapping):
        return {
            k: resized(v, fresh[k], f"{where}.{k}") if k in fresh else v
            for k, v in checkpoint.items()
        }
    if isinstance(checkpoint, (list, tuple)) and isinstance(fresh, (list, tuple)):
        for c, f in zip(checkpoint, fresh, strict=False):
            if isinstance(c, torch.Tensor) and isinstance(f, torch.Tensor) and c.shape != f.shape:
                raise Refused(f"{where}: a tensor in a list changes shape")
        return checkpoint
    if isinstance(checkpoint, torch.Tensor) and isinstance(fresh, torch.Tensor):
        if checkpoint.shape == fresh.shape or (checkpoint.numel() == 1 == fresh.numel()):
            return checkpoint
        if checkpoint.dim() != fresh.dim():
            raise Refused(f"{where}: rank changes")
        out = fresh.detach().clone()
        region = tuple(
            slice(0, min(a, b)) for a, b in zip(checkpoint.shape, fresh.shape, strict=True)
        )
        out[region] = checkpoint[region].to(out.dtype)
        return out
    return checkpoint


def oracle(spec: Spec, rec: Record, config: Config, *, extras: bool) -> Run:
    """The run a resume of ``rec`` into ``config`` must give, loaded by hand (see the module).

    ``extras``: the checkpoint holds the optimizer's own top-level keys (``optimizer.state_dict()``
    does; DSD's ``get_optimizer_state_dict`` does not).

    Raises:
        Refused: a state tensor in a list would change shape, or a rank would change.
    """
    run = build(spec, config)
    key_of = run.key_of()
    with torch.no_grad():
        for m in config.mods:
            for pname, p in getattr(run.model, m.name).named_parameters():
                saved = rec.model.get((m.uid, pname))
                if saved is not None:
                    p.copy_(resized(saved, p.detach(), f"{m.name}.{pname}"))
    need_fresh = any(
        key_of[id(p)] in rec.state for o in run.optims for g in o.param_groups for p in g["params"]
    )
    fresh = fresh_state(spec, config, run.model) if need_fresh else [{} for _ in run.optims]
    for n, o in enumerate(run.optims):
        sd = o.state_dict()
        state: dict[Any, Any] = {}
        groups = []
        for g, saved in zip(o.param_groups, sd["param_groups"], strict=True):
            owners = []
            for p, pid in zip(g["params"], saved["params"], strict=True):
                key = key_of[id(p)]
                owners.append(rec.group.get(key))
                if key in rec.state:
                    f = siblings(rec.state[key], fresh[n].get(id(p), {}))
                    state[pid] = resized(copy.deepcopy(rec.state[key]), f, run.fqn(key))
                elif pid in sd["state"]:
                    state[pid] = sd["state"][pid]  # a new optimizer's own (Adagrad's)
            home = _majority(owners)
            group = dict(saved)
            if home is not None:
                member = next(
                    k for k in (key_of[id(p)] for p in g["params"]) if rec.group.get(k) == home
                )
                group.update(copy.deepcopy(rec.hp[member]))
            groups.append(group)
        if len(run.optims) == len(rec.entries):
            state.update(copy.deepcopy(rec.entries[n]))
        top = copy.deepcopy(rec.extras[n]) if extras and len(run.optims) == len(rec.extras) else {}
        own = {k: v for k, v in sd.items() if k not in ("state", "param_groups")}
        o.load_state_dict({**own, **top, "state": state, "param_groups": groups})
    return run


def _majority(owners: list[Any]) -> Any:
    counts: dict[Any, int] = {}
    for own in owners:
        if own is not None:
            counts[own] = counts.get(own, 0) + 1
    if not counts:
        return None
    best = max(counts.values())
    return next(own for own in owners if own is not None and counts[own] == best)


def snapshot(run: Run) -> dict[str, Any]:
    """Deep copies of a run's parameters (by name) and each optimizer's ``state_dict()``."""
    return {
        "params": {n: p.detach().clone() for n, p in run.model.named_parameters()},
        "optims": [copy.deepcopy(o.state_dict()) for o in run.optims],
    }


def iter_keys(run: Run) -> Iterator[tuple[Key, torch.nn.Parameter]]:
    for m in run.config.mods:
        for pname, p in getattr(run.model, m.name).named_parameters():
            yield (m.uid, pname), p
