"""DeepSpeed runs for tests/test_frameworks_deepspeed.py, in a process of their own.

``python deepspeed_worker.py OUT PORT``: one rank (gloo, CPU). For every scenario of
tests/frameworks.py: an old ZeRO-0 run saves at step 2 (``engine.save_checkpoint``);
the changed model resumes it through the hooks (``engine.load_checkpoint``) to step 4
and saves; that save is resumed again to step 6; what the engine holds at 4 and 6 is
written to ``OUT/<scenario>-<step>.pt``. The framework alone is run too, and ZeRO-1.
``OUT/outcomes.json`` says what each run did.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from frameworks import SCENARIOS, Net, adamw, batch, named_state, snapshot

MODEL = {"policy", "allow_missing", "allow_unexpected", "rename", "on_shape_mismatch"}


def engine(model, stage, *, recipe=None, names=True):
    import deepspeed

    from dsdmerge.integrations import (
        install_load_hook,
        install_model_load_hook,
        record_param_names,
    )

    optimizer = adamw(model)  # the client optimizer
    hooks = None
    if names:
        record_param_names(optimizer, model)
    if recipe is not None:
        hooks = (
            install_load_hook(optimizer, model, **recipe),
            install_model_load_hook(model, **{k: v for k, v in recipe.items() if k in MODEL}),
        )
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }
    eng, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return eng, optimizer, hooks


def steps(eng, start, n):
    for step in range(start, start + n):
        eng.backward(eng(batch(step)))
        eng.step()


def main(out: Path) -> None:
    import deepspeed
    import deepspeed.comm.torch

    import dsdmerge as dm

    # the shared-memory all-reduce op is compiled (a C++ build) on first use; one rank never
    # needs it. (The module, not deepspeed.comm's attribute "torch", which is torch itself.)
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    outcomes = {}
    for name, (old_opts, new_opts, recipe) in SCENARIOS.items():
        ckpt = out / name
        eng, optimizer, _ = engine(Net(**old_opts), 0)
        steps(eng, 0, 2)
        eng.save_checkpoint(str(ckpt), tag="2")
        torch.save(snapshot(eng.module, optimizer), out / f"{name}-old.pt")

        again = {k: v for k, v in recipe.items() if k != "rename"}
        for tag, options in (("2", recipe), ("4", again)):
            eng, optimizer, (o_hook, m_hook) = engine(Net(**new_opts), 0, recipe=options)
            eng.load_checkpoint(str(ckpt), tag=tag)
            assert o_hook.loads == 1, o_hook
            assert m_hook.loads == 1, m_hook
            start = int(tag)
            steps(eng, start, 2)
            torch.save(snapshot(eng.module, optimizer), out / f"{name}-{start + 2}.pt")
            eng.save_checkpoint(str(ckpt), tag=str(start + 2))

        # the framework alone
        eng, optimizer, _ = engine(Net(**new_opts), 0, names=False)
        try:
            eng.load_checkpoint(str(ckpt), tag="2")
        except Exception as err:  # noqa: BLE001 (what DeepSpeed raises, recorded)
            outcomes[name] = f"crash: {type(err).__name__}: {str(err)[:200]}"
        else:
            torch.save(named_state(eng.module, optimizer), out / f"{name}-alone.pt")
            outcomes[name] = "loaded"

    # ZeRO-1: flat partitions, refused by the hook with what to do
    eng, optimizer, _ = engine(Net(), 1)
    steps(eng, 0, 2)
    eng.save_checkpoint(str(out / "zero1"), tag="2")
    eng, optimizer, _ = engine(Net(), 1, recipe={"policy": "strict"})
    try:
        eng.load_checkpoint(str(out / "zero1"), tag="2")
    except dm.DSDMergeError as err:
        outcomes["zero1"] = f"refused: {type(err).__name__}: {err}"
    else:
        outcomes["zero1"] = "loaded"
    (out / "outcomes.json").write_text(json.dumps(outcomes, indent=1))


if __name__ == "__main__":
    out, port = Path(sys.argv[1]), sys.argv[2]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1"
    )
    try:
        main(out)
    except BaseException:  # noqa: BLE001 (printed for the test, then a failing exit)
        traceback.print_exc()
        sys.exit(1)
