"""Shared pieces of the tests against real trainers (tests/test_frameworks_*.py).

Oracles here are pure torch: optimizer state compared by parameter name (every state
key of every parameter, every hyperparameter of its group), model state bit for bit.
The life of a resumed run (resume, step, compare, save; resume that save strictly, step,
compare) is :func:`resume_twice`, over a trainer wrapped as a :class:`Trainer`.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

NAMES = "param_names"


def by_name(osd: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """``(state by fqn, hyperparameters by fqn)`` of an int-keyed state dict with param_names."""
    state: dict[str, Any] = {}
    hyper: dict[str, dict[str, Any]] = {}
    for group in osd["param_groups"]:
        names = group[NAMES]
        assert len(names) == len(group["params"]), group
        for pid, name in zip(group["params"], names, strict=True):
            hyper[name] = {k: v for k, v in group.items() if k not in ("params", NAMES)}
            if pid in osd["state"]:
                state[name] = osd["state"][pid]
    return state, hyper


def equal(a: Any, b: Any) -> bool:
    """Bit for bit: tensors by ``torch.equal`` (and dtype), containers recursively."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def assert_same_optimizer(got: Mapping[str, Any], want: Mapping[str, Any]) -> None:
    """Every parameter's every state key, and its group's every hyperparameter, by name."""
    g_state, g_hyper = by_name(got)
    w_state, w_hyper = by_name(want)
    assert g_hyper.keys() == w_hyper.keys()
    assert g_state.keys() == w_state.keys(), sorted(g_state.keys() ^ w_state.keys())
    for name in w_state:
        assert equal(g_state[name], w_state[name]), name
    for name in w_hyper:
        assert equal(g_hyper[name], w_hyper[name]), (name, g_hyper[name], w_hyper[name])


def assert_same_model(got: Mapping[str, Any], want: Mapping[str, Any]) -> None:
    """Every key, every tensor bit for bit (dtype and shape too)."""
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())
    differ = [k for k in want if not equal(got[k], want[k])]
    assert not differ, differ


class Trainer(Protocol):
    """A real trainer's run, as :func:`resume_twice` drives it (global steps count from 0).

    ``steps(start, n)``: ``n`` training steps from global step ``start``, the trainer's way.
    ``save(step)``: the trainer's checkpoint of global step ``step``. ``load(step)``: the
    trainer's resume from that checkpoint (what it returns is handed to the test's check).
    ``named()``: ``(model state, optimizer state with param_names)``, copied.
    """

    def steps(self, start: int, n: int, /) -> None: ...
    def save(self, step: int, /) -> None: ...
    def load(self, step: int, /) -> Any: ...
    def named(self) -> tuple[dict[str, Any], dict[str, Any]]: ...


def trained(run: Trainer, steps: int = 2) -> Trainer:
    """``run`` (an old model's) trained from step 0 for ``steps`` steps, saved there."""
    run.steps(0, steps)
    run.save(steps)
    return run


def resume_twice(
    resume: Callable[[Any], Trainer],
    recipes: Sequence[Any],
    want: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]],
    *,
    at: int = 2,
    check: Callable[[int, Trainer, Any], None] = lambda i, run, loaded: None,
) -> None:
    """The life of a resumed run: each resume steps twice, is compared, and saves.

    For the ``i``-th recipe (the first resumes the old run's save at step ``at``; each
    later one the save the one before it took): ``resume(recipe)`` builds a fresh run of the
    new model, it loads the save, ``check(i, run, what load returned)`` asserts what the
    test knows of that load, the run trains two steps and is compared bit for bit with
    ``want[i]`` (the model's every key; the optimizer's every state key of every parameter
    and every group's hyperparameters, by name), then saves two steps later.
    """
    assert len(recipes) == len(want), (len(recipes), len(want))
    for i, (recipe, (want_model, want_optim)) in enumerate(zip(recipes, want, strict=True)):
        step = at + 2 * i
        run = resume(recipe)
        check(i, run, run.load(step))
        run.steps(step, 2)
        got_model, got_optim = run.named()
        assert_same_model(got_model, want_model)
        assert_same_optimizer(got_optim, want_optim)
        run.save(step + 2)


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------------------
# a small model and the scenarios every plain-torch trainer (accelerate, Lightning,
# DeepSpeed ZeRO-0) is resumed through


class Net(torch.nn.Module):
    """An embedding, two same-shape layers and an output; options make the changed models.

    ``vocab``: embedding rows. ``head``: a value head nothing reads (never a gradient).
    ``order``: the order ``a`` and ``b`` are registered in (parameter order, so int ids).
    ``mid``: the name ``b`` is registered under (a renamed module). ``frozen``: names of
    modules whose parameters do not train. Initial values depend only on the seed, not on
    the order or names, and a model with more rows holds the same leading rows.
    """

    def __init__(
        self,
        *,
        vocab: int = 16,
        head: bool = False,
        order: tuple[str, str] = ("a", "b"),
        mid: str = "b",
        frozen: tuple[str, ...] = (),
        seed: int = 0,
    ) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        embed = torch.nn.Embedding(vocab, 8)
        with torch.no_grad():
            embed.weight.copy_(torch.randn(64, 8, generator=g)[:vocab])
        layers = {n: torch.nn.Linear(8, 8) for n in ("a", "b")}
        out = torch.nn.Linear(8, 4)
        value = torch.nn.Linear(8, 1)
        with torch.no_grad():
            for m in (layers["a"], layers["b"], out, value):
                for p in m.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        self.embed = embed
        self.names = {"a": "a", "b": mid}
        for n in order:
            self.add_module(self.names[n], layers[n])
        self.out = out
        if head:
            self.value = value
        for name in frozen:
            getattr(self, self.names.get(name, name)).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).mean(1)
        h = getattr(self, self.names["a"])(h).tanh()
        h = getattr(self, self.names["b"])(h).tanh()
        return self.out(h).square().mean()


def batch(step: int) -> torch.Tensor:
    """The batch of a global step: two batches, cycled (an epoch is two steps)."""
    return torch.randint(0, 16, (4, 3), generator=torch.Generator().manual_seed(step % 2))


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=0.05, weight_decay=0.1
    )


def torch_steps(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    start: int,
    n: int,
    *,
    zero_grads: bool = False,
) -> None:
    """``n`` training steps from global step ``start``, plain torch.

    ``zero_grads``: a trainable parameter without a gradient gets a zero one (DeepSpeed's
    gradient all-reduce does that), so the optimizer steps it too.
    """
    for step in range(start, start + n):
        model(batch(step)).backward()
        if zero_grads:
            for p in model.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad()


# name: (old model options, new model options, recipe, what the framework alone does)
SCENARIOS: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = {
    "new_head": ({}, {"head": True}, {"policy": "strict", "allow_missing": "*value.*"}),
    "unfreeze": ({"frozen": ("a",)}, {}, {"policy": "strict", "allow_missing": "*a.*"}),
    "swap_frozen": (
        {"frozen": ("a",)},
        {"frozen": ("b",)},
        {"policy": "strict", "allow_missing": "*a.*", "allow_unexpected": "*b.*"},
    ),
    "grow_vocab": ({}, {"vocab": 24}, {"on_shape_mismatch": "resize"}),
    "rename": ({}, {"mid": "mid"}, {"policy": "strict", "rename": {r"(?<![^.])b\.": "mid."}}),
    "reorder": ({}, {"order": ("b", "a")}, {"policy": "strict"}),
}
# scenarios whose new model computes exactly what the old one did: an uninterrupted run of
# the new model is the reference (the rest: a by-name transfer of the checkpoint)
UNINTERRUPTED = {"new_head", "rename", "reorder"}


def renamed(fqn: str, prefix: str = "") -> str:
    """The rename scenario's rule, by hand."""
    b = f"{prefix}b."
    return f"{prefix}mid." + fqn[len(b) :] if fqn.startswith(b) else fqn


def transfer(
    old_model: Mapping[str, torch.Tensor],
    old_optim: Mapping[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rename: Any = lambda k: k,
) -> None:
    """The by-name oracle, pure torch: load an old model's and optimizer's state by name.

    Weights: every old tensor under its (renamed) name, a grown one's leading rows (the
    rest keeps the model's values). Optimizer (one param group, ``param_names`` saved):
    every old parameter's state under its name, a grown moment's leading rows (zeros
    elsewhere, as Adam starts); the group's hyperparameters from the old group.
    """
    with torch.no_grad():
        current = model.state_dict()
        for key, value in old_model.items():
            new = current[rename(key)]
            new[tuple(slice(0, n) for n in value.shape)] = value
    names = {id(p): n for n, p in model.named_parameters()}
    (old_group,) = old_optim["param_groups"]
    old_state = {
        rename(n): old_optim["state"][pid]
        for pid, n in zip(old_group["params"], old_group[NAMES], strict=True)
        if pid in old_optim["state"]
    }
    (group,) = optimizer.param_groups
    state = {}
    for i, p in enumerate(group["params"]):
        entry = old_state.get(names[id(p)])
        if entry is not None:
            state[i] = {k: _grown_moment(v, p) for k, v in entry.items()}
    hyper = {k: v for k, v in old_group.items() if k not in ("params", NAMES)}
    optimizer.load_state_dict(
        {"state": state, "param_groups": [{**hyper, "params": list(range(len(group["params"])))}]}
    )


def _grown_moment(old: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if old.dim() == 0 or old.shape == like.shape:
        return old
    out = torch.zeros_like(like)
    out[tuple(slice(0, n) for n in old.shape)] = old
    return out


def named_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state dict with param_names (by the model's names), copied."""
    import copy

    sd = copy.deepcopy(optimizer.state_dict())
    names = {id(p): n for n, p in model.named_parameters()}
    for group, live in zip(sd["param_groups"], optimizer.param_groups, strict=True):
        group[NAMES] = [names[id(p)] for p in live["params"]]
    return sd


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, named_state(
        model, optimizer
    )


def oracle(
    scenario: str, old: tuple[dict, dict], *, prefix: str = "", zero_grads: bool = False
) -> list[tuple[dict, dict]]:
    """What the new model holds 2 and 4 steps after the resume at step 2, pure torch.

    ``old``: the old run's (model state, named optimizer state) at step 2. Uninterrupted
    scenarios: the new model trained from step 0; the others: the by-name transfer of
    ``old``. ``prefix``: the trainer's prefix on model keys (Lightning's module attribute).
    ``zero_grads``: see :func:`torch_steps` (then a new head trains too: no uninterrupted
    run is the same, the by-name transfer is the reference).
    """
    _, new_opts, _ = SCENARIOS[scenario]
    model = Net(**new_opts)
    optimizer = adamw(model)
    if scenario in UNINTERRUPTED and not (zero_grads and scenario == "new_head"):
        torch_steps(model, optimizer, 0, 2)
    else:
        strip = {k[len(prefix) :]: v for k, v in old[0].items()}
        o = old[1]
        o = {
            **o,
            "param_groups": [
                {**g, NAMES: [n[len(prefix) :] for n in g[NAMES]]} for g in o["param_groups"]
            ],
        }
        transfer(strip, o, model, optimizer)
    out = []
    for start in (2, 4):
        torch_steps(model, optimizer, start, 2, zero_grads=zero_grads)
        m, o = snapshot(model, optimizer)
        m = {prefix + k: v for k, v in m.items()}
        for g in o["param_groups"]:
            g[NAMES] = [prefix + n for n in g[NAMES]]
        out.append((m, o))
    return out
