"""An optimizer's own fresh state, computed on a throwaway copy of it: no live object changes.

Internal to :mod:`dsdmerge.integrations`. What shape (and dtype) an optimizer gives
each state field of each parameter is known only to the optimizer: Adam's moments
have the parameter's shape, Adafactor's factors one dimension less, Shampoo's
preconditioners are square, LBFGS flattens every parameter into one vector. So the
resume helpers ask the optimizer itself, the way DSD builds its reference
(``_init_optim_state``: one ``step()`` with zero gradients and ``lr`` 0), but on a
*twin*: a copy of the optimizer whose parameters are stand-ins and whose state starts
empty. The live optimizer, its parameters and the model are never touched.

Two kinds of twin:

* ``"meta"``: the stand-ins are meta tensors (shape, dtype, no memory), one per
  shape, dtype and layout in each param group (meta kernels run in Python, about
  1 ms a tensor). Measured (``benchmarks/bench_fresh_state.py``, AdamW, one CPU
  thread): 27 ms for a 1.26B-parameter Llama-shaped model of 201 tensors, 7 ms at
  124M parameters, and no tensor memory at all. Some steps cannot run on meta
  tensors (``.item()`` on a value: torch's ASGD, Adafactor and LBFGS,
  pytorch-optimizer's AdamP, Prodigy, DAdaptAdam), and an optimizer that tells
  tensors apart by their storage address (heavyball) may mix up equal-sized
  parameters on meta tensors, whose addresses are all 0.
* ``"copy"``: the stand-ins are detached clones of the parameters, on their device.
  Exact (it is DSD's own step, on copies), but it holds one copy of the parameters
  and the fresh state while it runs: at 124M parameters 5.1 s and 1.5 GiB (3x the
  parameters' bytes with AdamW; the process's peak RSS grew 2.2 GiB), so about
  15 GB at 1.26B; as much as DSD's own reference costs.

What the resume helpers do with them (:mod:`dsdmerge.integrations._optim`): the meta
twin first, for every parameter whose checkpoint state is loaded without the live
optimizer holding state for it; the copy only when the meta step fails or finds a
field whose shape or dtype differs from the checkpoint's (to confirm it, and because
a resize or ``take_reference`` needs real values), or for ``fresh="reference"``
(DSD's zero-gradient state is the value asked for). So a resume whose shapes agree
costs nothing beyond the meta step, and memory is spent only where a copy is the
only way to know.

How a twin is built: a new instance of the optimizer's class whose ``__dict__`` is a
deep copy of the live one's (so attributes a subclass sets in ``__init__`` survive,
which ``copy.deepcopy`` of an ``Optimizer`` loses), with every parameter mapped to
its stand-in, views of a parameter kept in other attributes mapped to the same view
of the stand-in, ``state`` empty, no step hooks, and no ``step`` instance attribute:
an lr scheduler wraps ``optimizer.step`` in a function that calls the *live*
optimizer, so the twin always calls its class's ``step``. The twin takes the step
with zero gradients (sparse ones for an optimizer that only takes sparse gradients)
and ``lr`` 0, with ``closure=None`` first and a closure returning a zero loss when
the step needs one (LBFGS).
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

__all__: list[str] = []

Kind = Literal["meta", "copy"]

_STEP_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")
_SKIP = ("state", "step", *_STEP_HOOKS)
_WALK_DEPTH = 16


def twin(
    optimizer: torch.optim.Optimizer, /, *, kind: Kind, one_per_kind: bool = False
) -> tuple[torch.optim.Optimizer, dict[int, torch.Tensor]]:
    """A throwaway copy of ``optimizer`` with empty state; and ``id(live param) -> stand-in``.

    ``one_per_kind`` (for a step whose state only tells shapes): each group of the twin
    keeps one parameter per :func:`_kind`, and every live parameter maps to the stand-in
    of its kind in its group. The parameters of a kind share one stand-in to begin with,
    unless the optimizer holds its parameters elsewhere too (a list of its own, which its
    step may walk): then each gets its own, as without ``one_per_kind``.

    Raises whatever copying raises (the caller falls back).
    """
    import torch

    attrs = {k: v for k, v in vars(optimizer).items() if k not in _SKIP}
    groups = optimizer.param_groups
    # the tensors besides the groups' parameters (walked once; a parameter among them is
    # held elsewhere too)
    rest = [v for k, v in attrs.items() if k != "param_groups"]
    rest += [v for g in groups for k, v in g.items() if k != "params"]
    others = list(_tensors(rest))
    ids = {id(p) for g in groups for p in g["params"]}
    share = one_per_kind and not any(id(t) in ids for t in others)
    memo: dict[int, Any] = {}
    stand_in: dict[int, torch.Tensor] = {}
    params: list[torch.Tensor] = []
    for group in groups:
        made: dict[Any, torch.Tensor] = {}  # per kind (shared) or per parameter
        for p in group["params"]:
            if id(p) in stand_in:
                continue
            new = made.get(by := _kind(p) if share else id(p))
            if new is None:
                with torch.no_grad():
                    data = (
                        torch.empty_like(p, device="meta") if kind == "meta" else p.detach().clone()
                    )
                new = made[by] = torch.nn.Parameter(data, requires_grad=p.requires_grad)
            stand_in[id(p)] = new
            memo[id(p)] = new
            params.append(p)
    for t in others:
        if id(t) in memo:
            continue
        view = _view_of(t, params, stand_in)
        if view is not None:
            memo[id(t)] = view
        elif kind == "meta" and t.device.type != "meta" and t.dim() > 0:
            memo[id(t)] = torch.empty_like(t, device="meta")
    out = object.__new__(type(optimizer))
    memo[id(optimizer)] = out
    state = optimizer.state
    memo[id(state)] = copy.copy(state)
    memo[id(state)].clear()
    copied = copy.deepcopy(attrs, memo)
    out.__dict__.update(copied)
    out.__dict__["state"] = memo[id(state)]
    for name in _STEP_HOOKS:
        out.__dict__[name] = OrderedDict()
    if share:
        for group in out.param_groups:
            group["params"] = list({id(p): p for p in group["params"]}.values())
    elif one_per_kind:
        rep: dict[int, torch.Tensor] = {}
        for group in out.param_groups:
            seen: dict[tuple[Any, ...], torch.Tensor] = {}
            for p in group["params"]:
                rep[id(p)] = seen.setdefault(_kind(p), p)
            group["params"] = list(seen.values())
        stand_in = {live: rep.get(id(p), p) for live, p in stand_in.items()}
    return out, stand_in


def _kind(p: torch.Tensor) -> tuple[Any, ...]:
    """What a parameter's fresh state depends on besides its group: shape, dtype, layout, grad.

    A meta step runs each op through Python meta kernels (about 1 ms a tensor for AdamW),
    so a model of 47k parameters in 20 shapes would take 47 s one stand-in each; an
    optimizer that keeps per-parameter state gives equal parameters of one group equal
    fresh state. (LBFGS, whose state spans every parameter, cannot step on meta tensors
    at all.)
    """
    return (tuple(p.shape), p.dtype, p.layout, p.requires_grad)


def zero_step(
    optimizer: torch.optim.Optimizer, /, *, every_param: bool, probe: bool = False
) -> None:
    """DSD's ``_init_optim_state`` step on a twin: zero gradients, ``lr`` 0, one ``step()``.

    ``every_param``: give every parameter a gradient (for the shape of every field);
    else only those that require one, as DSD does. ``probe``: gradients of ones instead,
    for the fields an optimizer creates only once a gradient is not zero (LBFGS returns
    before it makes its direction and history): shapes only, the values mean nothing.

    Raises:
        Exception: Whatever the optimizer's step raises, for every way it was tried.
    """
    import torch

    for group in optimizer.param_groups:
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    sparse = closure = graph = False
    first: BaseException | None = None
    for _ in range(2):  # as DSD does it; then once more the way the error asks for
        for group in optimizer.param_groups:
            for p in group["params"]:
                grad = _zero_grad(p, sparse=sparse) if every_param or p.requires_grad else None
                if probe and grad is not None and not sparse:
                    grad = grad.add(1)
                if graph and grad is not None:
                    with torch.enable_grad():  # a gradient that is a function of the parameter
                        grad = p * 0 + grad
                p.grad = grad
        try:
            with torch.enable_grad() if graph else torch.no_grad():
                if closure:
                    type(optimizer).step(optimizer, _zero_loss)  # type: ignore[arg-type]
                else:
                    type(optimizer).step(optimizer)
            return
        except Exception as err:
            if first is not None:
                raise first from err
            first = err
            text = str(err).lower()
            closure = "closure" in text  # LBFGS: step(closure)
            sparse = "sparse" in text  # SparseAdam: sparse gradients only
            # SophiaH: a Hessian estimate differentiates the gradient (create_graph=True)
            graph = "grad_fn" in text or "does not require grad" in text
            if not (closure or sparse or graph):
                raise
            optimizer.state.clear()
    raise AssertionError("unreachable")  # pragma: no cover


def _zero_loss() -> torch.Tensor:
    import torch

    return torch.zeros(())


def _zero_grad(p: torch.Tensor, *, sparse: bool) -> torch.Tensor:
    import torch

    if not sparse:
        return torch.zeros_like(p)
    indices = torch.zeros((p.dim(), 0), dtype=torch.long, device=p.device)
    values = torch.zeros((0, *p.shape[p.dim() :]), dtype=p.dtype, device=p.device)
    return torch.sparse_coo_tensor(indices, values, p.shape, check_invariants=False)


def fresh_states(
    optimizer: torch.optim.Optimizer,
    /,
    *,
    kind: Kind,
    every_param: bool,
    probe: bool = False,
    seed: int | None = None,
) -> dict[int, Any]:
    """``id(live param) -> the state its optimizer's zero-gradient step gives it`` (on a twin).

    ``probe``: the step takes gradients of ones (see :func:`zero_step`). ``seed``: the
    global random number generators are seeded with it for the step (PSGD's Kron draws
    random numbers in its first step). Either way they are as they were afterwards: a
    twin's step draws nothing from the caller's sequence of random numbers.

    Raises:
        Exception: Copying or stepping failed (the caller decides what that means).
    """
    tw, stand_in = twin(optimizer, kind=kind, one_per_kind=kind == "meta")
    try:
        with rng_kept({id(p): p for p in stand_in.values()}.values()):
            if seed is not None:
                _seed(seed)
            zero_step(tw, every_param=every_param, probe=probe)
        out: dict[int, Any] = {}
        for live_id, p in stand_in.items():
            entry = tw.state.get(p)
            if isinstance(entry, Mapping):
                out[live_id] = entry
        return out
    finally:
        # the twin is thrown away: its attributes go now, so that its stand-ins (a copy of the
        # parameters) are freed at once, even when a hook's bound method makes it a cycle
        vars(tw).clear()


@contextlib.contextmanager
def rng_kept(tensors: Iterable[Any]) -> Iterator[None]:
    """The global random number generators as they were before, whatever the block draws.

    torch's CPU generator and those of the CUDA devices of ``tensors``, numpy's, Python's.
    """
    import random

    import torch

    devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
    py_state = random.getstate()
    np_random = _numpy_random()
    np_state = np_random.get_state() if np_random is not None else None
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(py_state)
            if np_random is not None:
                np_random.set_state(np_state)


def _numpy_random() -> Any:
    try:
        import numpy
    except ImportError:  # numpy is not a dependency: nothing to keep
        return None
    return numpy.random


def _seed(n: int) -> None:
    import random

    import torch

    torch.manual_seed(n)
    random.seed(n)
    np_random = _numpy_random()
    if np_random is not None:
        np_random.seed(n)


def same_state(a: Any, b: Any, depth: int = 0, *, drawn: Any = None) -> bool:
    """Whether two state entries are the same, bit for bit (tensors: dtype, shape, values).

    ``drawn``: ``b`` as made again with other random numbers; a tensor of ``b`` that
    differs from its ``drawn`` counterpart was drawn at random and is compared by dtype
    and shape only.
    """
    import torch

    if depth > _WALK_DEPTH:
        return False
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
            return False
        if a.device.type == "meta":
            return False
        if isinstance(drawn, torch.Tensor) and not same_state(b, drawn, depth):
            return True  # random: its kind is all that can be compared
        x, y = a.detach(), b.detach()
        if x.layout != torch.strided:
            x, y = x.to_dense(), y.to_dense()
        return bool(
            torch.equal(x, y)
            or (
                x.isnan().any()
                and torch.equal(x.isnan(), y.isnan())
                and torch.equal(x.nan_to_num(), y.nan_to_num())
            )
        )
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        by_key: Mapping[Any, Any] = drawn if isinstance(drawn, Mapping) else {}
        return a.keys() == b.keys() and all(
            same_state(a[k], b[k], depth + 1, drawn=by_key.get(k)) for k in a
        )
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        items = list(drawn) if isinstance(drawn, (list, tuple)) and len(drawn) == len(b) else []
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(
                same_state(x, y, depth + 1, drawn=items[i] if items else None)
                for i, (x, y) in enumerate(zip(a, b, strict=True))
            )
        )
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - an exotic value
        return a is b


def constructor_state(optimizer: torch.optim.Optimizer, /) -> set[int] | None:
    """The ids of the live parameters a new instance of the optimizer's class makes state for.

    The instance is built from the live param groups (every hyperparameter as the live
    optimizer holds it) on meta stand-ins, so it costs no memory; Adagrad makes its
    accumulators there. ``None`` when the class cannot be built that way (a constructor
    with required arguments beyond its parameters).
    """
    import torch

    stand_in: dict[int, Any] = {}
    groups = []
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            if id(p) not in stand_in:
                stand_in[id(p)] = torch.nn.Parameter(
                    torch.empty_like(p, device="meta"), requires_grad=p.requires_grad
                )
            params.append(stand_in[id(p)])
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    try:
        with rng_kept(()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            new = type(optimizer)(groups)  # type: ignore[call-arg]
    except Exception:  # noqa: BLE001 - any constructor: unknown
        return None
    by_stand_in = {id(v): k for k, v in stand_in.items()}
    return {
        by_stand_in[id(p)]
        for p, entry in new.state.items()
        if id(p) in by_stand_in and isinstance(entry, Mapping) and entry
    }


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    """The tensors in the containers of ``tree`` (dicts, lists, tuples, sets), bounded."""
    import torch

    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if id(node) in seen or depth > _WALK_DEPTH:
            continue
        seen.add(id(node))
        if isinstance(node, torch.Tensor):
            yield node
        elif isinstance(node, Mapping):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, (list, tuple, set, frozenset)):
            stack.extend((v, depth + 1) for v in node)


def _view_of(
    t: torch.Tensor, params: list[torch.Tensor], stand_in: Mapping[int, torch.Tensor]
) -> torch.Tensor | None:
    """``t`` as the same view of a parameter's stand-in, when ``t`` is a view of that parameter."""
    import torch

    try:
        if t.device.type == "meta" or t.layout != torch.strided:
            return None
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    for p in params:
        try:
            if p.device != t.device or p.untyped_storage().data_ptr() != ptr:
                continue
        except (RuntimeError, NotImplementedError):
            continue
        offset = t.storage_offset() - p.storage_offset()
        new = stand_in[id(p)]
        end = offset + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
        if offset < 0 or end >= max(new.numel(), 1) or not new.is_contiguous():
            continue  # a view of more than this parameter (a flat buffer): not mapped
        return new.detach().as_strided(t.shape, t.stride(), new.storage_offset() + offset)
    return None
