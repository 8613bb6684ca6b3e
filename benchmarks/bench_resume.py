"""End-to-end optimizer resume: ``resume_optimizer`` against the by-hand DSD path, same run.

    python benchmarks/bench_resume.py            # 5k..40k parameters (~280k flat keys at 20k),
                                                 # ~7 minutes on 2 CPUs
    python benchmarks/bench_resume.py --quick    # CI smoke run: 500..2,000 parameters, ~15 s

Real CPU tensors: a model of many small ``torch.nn.Linear(4, 4)`` layers (2 parameters each,
so the key count is large: 14 flat AdamW keys per parameter), trained one ``AdamW`` step and
saved with ``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`` and
``torch.save``. The model resumed is that model plus a new 2-parameter head the checkpoint
lacks (its state has to be backfilled: the case dsdmerge exists for). Every round builds a
fresh model and optimizer (untimed, same seed) for each path, then times:

* ``resume_optimizer``: ``torch.load(path, weights_only=True)``, then
  ``dsdmerge.integrations.resume_optimizer(model, optimizer, loaded)`` (default
  ``fresh="as_fresh"``: the new head starts without state, like a new optimizer);
* ``resume_optimizer (fresh='reference')``: the same with DSD's zero-gradient state for the
  head, which gives exactly the by-hand result;
* ``by hand``: ``torch.load``, ``get_optimizer_state_dict`` (the fresh reference),
  ``dsdmerge.merge(loaded, ref)``, ``set_optimizer_state_dict``, all flattened.

The paths run interleaved, one sample of each per round (the order rotates), medians over
the rounds; 5 rounds (quick: 3), 3 at the sizes above the main one (20k; quick 2k). The
helper's internals are timed by wrapping them in this process only (the library is not
edited): see ``SHARES`` for what each share covers. The by-hand path grows quadratically
(``Optimizer.load_state_dict`` asks ``param_id in group["params"]``, a list scan, for every
state tensor it loads); it is skipped at a size where it would take over ``BY_HAND_CAP_S``.

Every run checks the result, at every size: the optimizers' ``state_dict()`` agree tensor
for tensor with equal param groups (the by-hand path and ``fresh='reference'`` entirely; the
default ``fresh='as_fresh'`` everywhere but the new head, which it leaves without state), the
state is the checkpoint's, and one more training step gives the new head state on every path.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # run from a checkout without installing
    sys.path.insert(1, str(HERE.parent))

import dsdmerge as dm  # noqa: E402
import dsdmerge.integrations.resume as resume_module  # noqa: E402
from dsdmerge.integrations import resume_optimizer  # noqa: E402

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
DIM = 4  # Linear(4, 4): a 4x4 weight and a bias of 4, tiny tensors, many keys
TRAINED_LR = 5e-5  # the checkpoint's (scheduled) lr; a fresh optimizer has FRESH_LR
FRESH_LR = 1e-3

SIZES = [5_000, 10_000, 20_000, 40_000]  # parameters of the checkpointed model
QUICK_SIZES = [500, 1_000, 2_000]
MAIN, QUICK_MAIN = 20_000, 2_000  # the size of the end-to-end table
BY_HAND_CAP_S = 60.0  # the by-hand path is skipped at sizes where it would take longer

HELPER = "resume_optimizer"
HELPER_REF = "resume_optimizer (fresh='reference')"
BY_HAND = "by hand"
PATHS = (HELPER, HELPER_REF, BY_HAND)

SHARES = {
    "load": "`torch.load(path, weights_only=True)` of the flattened checkpoint (same for all)",
    "unflatten": "resume_optimizer only: the flat checkpoint made nested (`resume._nested`)",
    "reference": "what the optimizer accepts. resume_optimizer: `Slots.of` (the live "
    "optimizer's `state_dict()`, parameters named by fqn), `Slots.reference` and, with "
    "fresh='reference', `init_state` (DSD's zero-gradient step on a throwaway copy); "
    "by hand: `get_optimizer_state_dict` (DSD's zero-gradient step on the live optimizer)",
    "merge": "resume_optimizer: `_pipeline.run` (diff, policy, merge of the nested dicts); "
    "by hand: `dsdmerge.merge(loaded, ref)` on the flat dicts",
    "set": "loading into the optimizer. resume_optimizer: `Slots.load_dicts` (int-keyed "
    "dicts) and `Optimizer.load_state_dict`; by hand: `set_optimizer_state_dict` (its "
    "unflatten, then `Optimizer.load_state_dict`)",
    "other": "the rest of the total (not wrapped: argument and policy checks, layout "
    "detection, every state tensor checked against the optimizer's own fresh state on a "
    "meta twin, the set of states to keep)",
}
SHARE_NAMES = tuple(SHARES)


# --------------------------------------------------------------------------------------
# the model


class Net(torch.nn.Module):
    """``layers`` small Linear layers side by side (2 parameters each), and maybe a new head."""

    def __init__(self, layers: int, *, head: bool) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM) for _ in range(layers))
        self.head = torch.nn.Linear(DIM, 2) if head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.stack([layer(x).square().mean() for layer in self.layers]).sum()
        if self.head is not None:
            out = out + self.head(x).square().mean()
        return out


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    """Two groups, as trainers make them: weights with weight decay, biases without."""
    named = list(model.named_parameters())
    decay = [p for n, p in named if n.endswith("weight")]
    no_decay = [p for n, p in named if not n.endswith("weight")]
    groups: list[dict[str, Any]] = [
        {"params": decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=FRESH_LR)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    gen = torch.Generator().manual_seed(7)
    model(torch.randn(3, DIM, generator=gen)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def save_checkpoint(params: int, path: Path) -> int:
    """The old model (no head) trained one step; its flattened optimizer state saved."""
    torch.manual_seed(0)
    model = Net(params // 2, head=False)
    opt = adamw(model)
    train_step(model, opt)
    for g in opt.param_groups:
        g["lr"] = TRAINED_LR
    sd = get_optimizer_state_dict(model, opt, options=FLAT)
    torch.save(sd, path)
    return len(sd)


def fresh_model(params: int) -> tuple[Net, torch.optim.AdamW]:
    """The model resumed: the same layers (same seed on every path) and a new head."""
    torch.manual_seed(1)
    model = Net(params // 2, head=True)
    return model, adamw(model)


# --------------------------------------------------------------------------------------
# timing the shares


class Probe:
    """Seconds per share of the current sample (wrapped functions add to theirs)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._gc_start: float | None = None

    @contextlib.contextmanager
    def timing(self, share: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self.seconds[share] = self.seconds.get(share, 0.0) + elapsed

    def on_gc(self, phase: str, info: dict[str, Any]) -> None:
        """A ``gc.callbacks`` entry: the time in the collector's passes, as share ``gc``."""
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            elapsed = time.perf_counter() - self._gc_start
            self.seconds["gc"] = self.seconds.get("gc", 0.0) + elapsed

    def wrap(self, share: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.timing(share):
                return fn(*args, **kwargs)

        return timed


PROBE = Probe()

# what resume_optimizer calls, wrapped in this process: (owner, attribute, probe name)
_MODULE_PROBES = [
    ("_nested", "unflatten"),
    ("init_state", "init_state"),
    ("run", "merge"),
]
_SLOTS_PROBES = [("of", "slots_of"), ("reference", "slots_reference"), ("load_dicts", "load_dicts")]


@contextlib.contextmanager
def probed() -> Iterator[list[str]]:
    """Wrap resume_optimizer's internals (those that exist) for the block; yields their names."""
    patched: list[tuple[Any, str, Any]] = []
    names: list[str] = []
    try:
        for attr, share in _MODULE_PROBES:
            fn = resume_module.__dict__.get(attr)
            if callable(fn):
                patched.append((resume_module, attr, fn))
                setattr(resume_module, attr, PROBE.wrap(share, fn))
                names.append(f"resume.{attr}")
        slots = resume_module.__dict__.get("Slots")
        for attr, share in _SLOTS_PROBES:
            raw = vars(slots).get(attr) if isinstance(slots, type) else None
            if isinstance(raw, classmethod):
                patched.append((slots, attr, raw))
                setattr(slots, attr, classmethod(PROBE.wrap(share, raw.__func__)))
            elif callable(raw):
                patched.append((slots, attr, raw))
                setattr(slots, attr, PROBE.wrap(share, raw))
            else:
                continue
            names.append(f"Slots.{attr}")
        yield names
    finally:
        for owner, attr, original in reversed(patched):
            setattr(owner, attr, original)


def probe_optimizer(opt: torch.optim.Optimizer) -> None:
    """Time this optimizer's ``load_state_dict`` (DSD finds it with ``getattr`` too)."""
    opt.load_state_dict = PROBE.wrap("optimizer_load", opt.load_state_dict)  # type: ignore[method-assign]


def shares_of(path: str, total: float, raw: dict[str, float]) -> dict[str, float]:
    """One sample's shares (see ``SHARES``) from the probes; ``other`` is the rest."""
    get = raw.get
    if path == BY_HAND:
        s = {
            "load": get("load", 0.0),
            "unflatten": 0.0,
            "reference": get("reference", 0.0),
            "merge": get("merge", 0.0),
            "set": get("set", 0.0),
        }
    else:
        s = {
            "load": get("load", 0.0),
            "unflatten": get("unflatten", 0.0),
            "reference": get("slots_of", 0.0)
            + get("slots_reference", 0.0)
            + get("init_state", 0.0),
            "merge": get("merge", 0.0),
            "set": get("load_dicts", 0.0) + get("optimizer_load", 0.0),
        }
    s["other"] = max(0.0, total - sum(s.values()))
    s["optimizer_load"] = get("optimizer_load", 0.0)  # part of "set", reported on its own
    s["gc"] = get("gc", 0.0)  # the collector's passes, wherever they fell (across the shares)
    s["total"] = total
    s["excl_load"] = total - s["load"]
    return s


# --------------------------------------------------------------------------------------
# the paths


def run_helper(path: Path, fresh: str) -> Callable[[Net, torch.optim.AdamW], Any]:
    def fn(model: Net, opt: torch.optim.AdamW) -> Any:
        with PROBE.timing("load"):
            loaded = torch.load(path, weights_only=True)
        return resume_optimizer(model, opt, loaded, fresh=fresh)  # type: ignore[arg-type]

    return fn


def run_by_hand(path: Path) -> Callable[[Net, torch.optim.AdamW], Any]:
    def fn(model: Net, opt: torch.optim.AdamW) -> Any:
        with PROBE.timing("load"):
            loaded = torch.load(path, weights_only=True)
        with PROBE.timing("reference"):
            ref = get_optimizer_state_dict(model, opt, options=FLAT)
        with PROBE.timing("merge"):
            merged = dm.merge(loaded, ref)
        with PROBE.timing("set"):
            set_optimizer_state_dict(model, opt, merged, options=FLAT)
        return None

    return fn


# --------------------------------------------------------------------------------------
# checks


def _equal_entries(a: dict[str, Any], b: dict[str, Any], where: str) -> None:
    assert a.keys() == b.keys(), (where, sorted(a), sorted(b))
    for k, v in a.items():
        w = b[k]
        if isinstance(v, torch.Tensor):
            assert isinstance(w, torch.Tensor), (where, k)
            assert v.dtype == w.dtype, (where, k, v.dtype, w.dtype)
            assert torch.equal(v, w), (where, k, v, w)
        else:
            assert v == w, (where, k, v, w)


def _equal_states(
    a: dict[str, Any], b: dict[str, Any], where: str, *, skip: frozenset[int] = frozenset()
) -> None:
    assert a["param_groups"] == b["param_groups"], where
    sa = {k: v for k, v in a["state"].items() if k not in skip}
    sb = {k: v for k, v in b["state"].items() if k not in skip}
    assert sa.keys() == sb.keys(), (where, sorted(sa.keys() ^ sb.keys()))
    for pid, entry in sa.items():
        _equal_entries(entry, sb[pid], f"{where}, param {pid}")


def head_ids(model: Net, opt: torch.optim.Optimizer) -> frozenset[int]:
    assert model.head is not None
    order = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    return frozenset(order[id(p)] for p in model.head.parameters())


def check(
    runs: dict[str, tuple[Net, torch.optim.AdamW]], path: Path, *, full: bool
) -> dict[str, Any]:
    """Assert that the paths agree; with ``full``, also with the checkpoint, and step once more."""
    model, opt = runs[HELPER]
    heads = head_ids(model, opt)
    sd = {name: o.state_dict() for name, (_, o) in runs.items()}
    for name, o_sd in sd.items():
        assert all(g["lr"] == TRAINED_LR for g in o_sd["param_groups"]), f"{name}: lr not resumed"
    # as_fresh: no state for the head (as a new optimizer); every other parameter's state is
    # the checkpoint's, tensor for tensor
    assert not heads & sd[HELPER]["state"].keys(), "as_fresh gave the new head state"
    checked = 0
    if full:
        loaded = torch.load(path, weights_only=True)
        pid_of = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
        for fqn, p in model.named_parameters():
            if fqn.startswith("head."):
                continue
            entry = sd[HELPER]["state"][pid_of[id(p)]]
            want = {n: loaded[f"state.{fqn}.{n}"] for n in ("step", "exp_avg", "exp_avg_sq")}
            _equal_entries(entry, want, f"{HELPER} vs checkpoint, {fqn}")
            checked += 1
        del loaded
    if HELPER_REF in sd:
        assert heads <= sd[HELPER_REF]["state"].keys()
        _equal_states(sd[HELPER], sd[HELPER_REF], f"{HELPER} vs {HELPER_REF}", skip=heads)
    if BY_HAND in sd:
        # the same, tensor for tensor, but for the head, which DSD's step gave state
        _equal_states(sd[HELPER], sd[BY_HAND], f"{HELPER} vs {BY_HAND}", skip=heads)
        hs = [sd[BY_HAND]["state"][pid] for pid in heads]
        assert all(float(e["step"]) == 1.0 and not e["exp_avg"].any() for e in hs)
        if HELPER_REF in sd:
            _equal_states(sd[HELPER_REF], sd[BY_HAND], f"{HELPER_REF} vs {BY_HAND}")
    out: dict[str, Any] = {"params_checked_against_checkpoint": checked}
    if not full:
        return out
    for m, o in runs.values():
        train_step(m, o)
    after = {name: o.state_dict() for name, (_, o) in runs.items()}
    head_steps = {}
    for name, o_sd in after.items():
        assert heads <= o_sd["state"].keys(), f"{name}: the head has no state after a step"
        head_steps[name] = float(o_sd["state"][min(heads)]["step"])
    assert head_steps[HELPER] == 1.0  # its first step, as with a new optimizer
    for name in after:
        if name != HELPER:
            _equal_states(after[HELPER], after[name], f"stepped: {HELPER} vs {name}", skip=heads)
    if HELPER_REF in after and BY_HAND in after:
        _equal_states(after[HELPER_REF], after[BY_HAND], f"stepped: {HELPER_REF} vs {BY_HAND}")
    out["head_step_after_one_more_step"] = head_steps
    return out


# --------------------------------------------------------------------------------------
# measuring


def measure_size(params: int, rounds: int, *, by_hand: bool, tmp: Path) -> dict[str, Any]:
    """Every path at one size: ``rounds`` interleaved samples each (fresh model per sample)."""
    path = tmp / f"optim-{params}.pt"
    keys = save_checkpoint(params, path)
    cases: dict[str, Callable[[Net, torch.optim.AdamW], Any]] = {
        HELPER: run_helper(path, "as_fresh"),
        HELPER_REF: run_helper(path, "reference"),
    }
    if by_hand:
        cases[BY_HAND] = run_by_hand(path)
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in cases}
    checked: dict[str, Any] = {}
    missing: dict[str, int] = {}
    for i in range(rounds):
        runs: dict[str, tuple[Net, torch.optim.AdamW]] = {}
        gc.collect()
        gc.freeze()  # what exists between rounds (torch's own objects): out of every pass
        try:
            names = list(cases)
            # the order rotates from round to round, so that every path takes each place in
            # turn: where a sample falls moves where the collector's passes fall in it
            for name in names[i % len(names) :] + names[: i % len(names)]:
                fn = cases[name]
                model, opt = fresh_model(params)  # untimed
                probe_optimizer(opt)
                # no sample pays for another's garbage, and what exists before it (the models
                # of the samples before) is frozen out of the collector's passes during it
                gc.collect()
                gc.freeze()
                PROBE.seconds = {}
                start = time.perf_counter()
                diff = fn(model, opt)
                total = time.perf_counter() - start
                samples[name].append(shares_of(name, total, PROBE.seconds))
                if diff is not None:
                    missing[name] = len(diff.missing)
                del diff
                vars(opt).pop("load_state_dict", None)  # the probe (a reference cycle)
                runs[name] = (model, opt)
            # the paths agree, every round; on the first, with the checkpoint and after a step
            verdict = check(runs, path, full=i == 0)
            checked = checked or verdict
        finally:
            gc.unfreeze()
        del runs
    path.unlink()
    med = {
        name: {k: statistics.median(s[k] for s in ss) for k in ss[0]}
        for name, ss in samples.items()
    }
    return {
        "params": params,
        "model_params": params + 2,  # the new head's weight and bias
        "keys": keys,
        "missing": missing,
        "rounds": rounds,
        "seconds": med,
        "samples": samples,
        "check": checked,
    }


def run(*, quick: bool, rounds: int | None = None) -> dict[str, Any]:
    """Measure every size; the by-hand path is capped at ``BY_HAND_CAP_S``."""
    sizes = QUICK_SIZES if quick else SIZES
    main = QUICK_MAIN if quick else MAIN
    base_rounds = rounds or (3 if quick else 5)
    rows = []
    skipped: list[int] = []
    prev: tuple[int, float] | None = None  # (params, by-hand seconds) at the last size
    gc.callbacks.append(PROBE.on_gc)
    with contextlib.ExitStack() as stack:
        stack.callback(gc.callbacks.remove, PROBE.on_gc)
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        names = stack.enter_context(probed())
        for params in sizes:
            # at sizes above the main one, fewer rounds (their time is mostly the by-hand path)
            r = base_rounds if rounds or params <= main else max(3, base_rounds // 2)
            by_hand = True
            if prev is not None:
                predicted = prev[1] * (params / prev[0]) ** 2  # the by-hand path is quadratic
                by_hand = predicted <= BY_HAND_CAP_S and prev[1] <= BY_HAND_CAP_S
            if not by_hand:
                skipped.append(params)
            t0 = time.perf_counter()
            row = measure_size(params, r, by_hand=by_hand, tmp=Path(tmp))
            row["wall_s"] = time.perf_counter() - t0
            if BY_HAND in row["seconds"]:
                prev = (params, row["seconds"][BY_HAND]["total"])
            rows.append(row)
            s = row["seconds"]
            cells = "  ".join(f"{name} {fmt_s(v['excl_load'])}" for name, v in s.items())
            print(
                f"  {params:>7,} params, {row['keys']:>9,} keys ({r} rounds, "
                f"{row['wall_s']:.0f} s): torch.load {fmt_s(s[HELPER]['load'])}, "
                f"excl. load: {cells}",
                flush=True,
            )
    return {
        "main": next(row for row in rows if row["params"] == main),
        "scaling": rows,
        "by_hand_skipped": skipped,
        "by_hand_cap_s": BY_HAND_CAP_S,
        "probed": names,
        "quick": quick,
    }


# --------------------------------------------------------------------------------------
# report


TARGET, AIM = 1.0, 0.7


def fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if seconds < 10 else f"{seconds:,.1f} s"


def ratios(s: dict[str, dict[str, float]]) -> list[tuple[str, float]]:
    """(target name, measured) for each helper path against the by-hand path."""
    if BY_HAND not in s:
        return []
    h = s[BY_HAND]
    out = []
    for name in (HELPER, HELPER_REF):
        out.append((f"{name} / by hand, excl. torch.load", s[name]["excl_load"] / h["excl_load"]))
        out.append((f"{name} / by hand, incl. torch.load", s[name]["total"] / h["total"]))
    return out


def report(result: dict[str, Any]) -> str:
    m = result["main"]
    s = m["seconds"]
    lines = [
        f"End-to-end optimizer resume (no DeepSeek shapes): {m['params']:,} parameters of "
        f"`Linear({DIM}, {DIM})` layers, AdamW after one step, CPU tensors; "
        f"{m['keys']:,} flat checkpoint keys, a new 2-parameter head to backfill "
        f"({m['missing'][HELPER]} missing keys); median of {m['rounds']} rounds.",
        "",
        "| path | total | "
        + " | ".join(SHARE_NAMES)
        + " | of which Optimizer.load_state_dict | of which cyclic GC |",
        "|---|---:|" + "---:|" * (len(SHARE_NAMES) + 2),
    ]
    for name, v in s.items():
        total = v["total"]
        cells = [
            "-" if name == BY_HAND and k == "unflatten" else f"{fmt_s(v[k])} ({v[k] / total:.0%})"
            for k in SHARE_NAMES
        ]
        lines.append(
            f"| {name} | {fmt_s(total)} | "
            + " | ".join(cells)
            + f" | {fmt_s(v['optimizer_load'])} | {fmt_s(v['gc'])} |"
        )
    lines += ["", "Shares (each a median over the rounds, so they need not add up exactly):", ""]
    lines += [f"- **{k}**: {what}." for k, what in SHARES.items()]
    lines.append(
        "- **of which Optimizer.load_state_dict**: the optimizer's own load, inside *set* "
        "(the by-hand path passes it plain `params` lists, whose `in` is a scan per state "
        "tensor)."
    )
    lines.append(
        "- **of which cyclic GC**: the time in the garbage collector's passes (`gc.callbacks`) "
        "wherever they fell, in any share; DSD's get/set pause the collector, so passes fall "
        "mostly in `torch.load`. Before each sample the collector runs and what exists is "
        "frozen out of its passes (`gc.freeze`), and the order of the paths rotates each round."
    )
    lines.append(
        f"- Wrapped in this process only (the library is not edited): "
        f"{', '.join(f'`{n}`' for n in result['probed']) or 'nothing'}, and each optimizer's "
        "`load_state_dict`; what is not wrapped counts as *other*."
    )
    lines += [
        "",
        "| target | measured | bound | aim | met |",
        "|---|---:|---:|---:|:-:|",
    ]
    rs = ratios(s)
    for name, v in rs:
        lines.append(
            f"| {name} | {v:.2f} | <= {TARGET} | {AIM} | {'yes' if v <= TARGET else 'NO'} |"
        )
    if not rs:
        lines.append(f"| {HELPER} / by hand | - | <= {TARGET} | {AIM} | - |")
    lines += ["", scaling_table(result)]
    return "\n".join(lines)


def scaling_table(result: dict[str, Any]) -> str:
    rows = result["scaling"]
    lines = [
        "Scaling, seconds excluding `torch.load` (median) and microseconds per parameter:",
        "",
        "| params | flat keys | torch.load | "
        + " | ".join(f"{name} | µs/param" for name in PATHS)
        + f" | {HELPER} / by hand |",
        "|---:|---:|---:|" + "---:|" * (2 * len(PATHS) + 1),
    ]
    for row in rows:
        s, n = row["seconds"], row["params"]
        cells = []
        for name in PATHS:
            if name in s:
                cells += [fmt_s(s[name]["excl_load"]), f"{s[name]['excl_load'] / n * 1e6:,.1f}"]
            else:
                cells += ["-", "-"]
        ratio = f"{s[HELPER]['excl_load'] / s[BY_HAND]['excl_load']:.2f}" if BY_HAND in s else "-"
        lines.append(
            f"| {n:,} | {row['keys']:,} | {fmt_s(s[HELPER]['load'])} | "
            + " | ".join(cells)
            + f" | {ratio} |"
        )
    growth = per_param_growth(rows)
    if growth:
        small, big, g = growth
        parts = ", ".join(f"{name} {v:.2f}" for name, v in g.items())
        lines += [
            "",
            f"Time per parameter at {big:,} over at {small:,} parameters ({big / small:.0f}x "
            f"the parameters; linear: 1.0, quadratic: {big / small:.0f}): {parts}.",
        ]
    if result["by_hand_skipped"]:
        at = ", ".join(f"{n:,}" for n in result["by_hand_skipped"])
        lines += [
            "",
            f"The by-hand path was skipped ('-') at {at} "
            f"parameters: it would take over {result['by_hand_cap_s']:.0f} s (quadratic from "
            "the size before).",
        ]
    return "\n".join(lines)


def per_param_growth(rows: list[dict[str, Any]]) -> tuple[int, int, dict[str, float]] | None:
    if len(rows) < 2:
        return None
    small, big = rows[0], rows[-1]
    out = {}
    for name in PATHS:
        if name in small["seconds"] and name in big["seconds"]:
            per_small = small["seconds"][name]["excl_load"] / small["params"]
            per_big = big["seconds"][name]["excl_load"] / big["params"]
            out[name] = per_big / per_small
    if not out:
        return None
    return small["params"], big["params"], out


# --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CI smoke run: 500..2,000 parameters")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 5, quick 3)")
    ap.add_argument("--json", type=Path, help="write all results as JSON here")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    load = os.getloadavg()[0]
    print(
        f"dsdmerge {dm.__version__}, torch {torch.__version__}, "
        f"Python {platform.python_version()}, {os.cpu_count()} CPUs, load average {load:.1f}",
        flush=True,
    )
    result = run(quick=args.quick, rounds=args.rounds)
    result["env"] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "load_average_start": load,
        "load_average_end": os.getloadavg()[0],
        "wall_s": time.perf_counter() - started,
        "argv": sys.argv[1:] if argv is None else argv,
    }
    env = result["env"]
    print()
    print(report(result))
    print(
        f"\nMeasured with `python benchmarks/bench_resume.py {' '.join(env['argv'])}` in "
        f"{env['wall_s']:.0f} s: Python {env['python']}, torch {env['torch']}, {env['cpus']} "
        f"CPUs, load average {env['load_average_start']:.1f} at start and "
        f"{env['load_average_end']:.1f} at end."
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
