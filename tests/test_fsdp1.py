"""FSDP1 (FullyShardedDataParallel) in one gloo process on CPU: what resume_optimizer does.

With ``use_orig_params=True`` the optimizer holds the original parameters: the resume maps
them by fqn and loads through DSD's ``set_optimizer_state_dict``. With flat parameters
(``use_orig_params=False``) it refuses, before anything changes, saying what to do instead.
Each case runs in a fresh interpreter (a process group is process-wide state).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import copy, os, sys, warnings
    import torch, torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    import dsdmerge as dm
    from dsdmerge.integrations import resume_optimizer

    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    dist.init_process_group("gloo", rank=0, world_size=1)
    orig = sys.argv[1] == "orig"

    def build():
        torch.manual_seed(0)
        inner = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        model = FSDP(inner, use_orig_params=orig, device_id=torch.device("cpu"))
        return model, torch.optim.Adam(model.parameters(), lr=0.01)

    model, optim = build()
    for _ in range(2):
        model(torch.ones(3, 4)).sum().backward()
        optim.step()
        optim.zero_grad()
    saved = copy.deepcopy(get_optimizer_state_dict(model, optim))
    model2, optim2 = build()
    before = [p.detach().clone() for p in model2.parameters()]
    try:
        resume_optimizer(model2, optim2, saved, policy="strict")
    except dm.DSDMergeError as err:
        assert not orig, err
        assert "use_orig_params=True" in str(err), err
        assert not optim2.state
        assert all(torch.equal(a, b) for a, b in zip(before, model2.parameters()))
        print("refused")
    else:
        assert orig
        a = get_optimizer_state_dict(model2, optim2)["state"]
        b = saved["state"]
        assert sorted(a) == sorted(b), (sorted(a), sorted(b))
        assert all(torch.equal(a[k]["exp_avg"], b[k]["exp_avg"]) for k in b)
        print("resumed")
    dist.destroy_process_group()
    """
)


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.mark.parametrize(("params", "expect"), [("orig", "resumed"), ("flat", "refused")])
def test_fsdp1(params, expect):
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, params, _port()],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert expect in done.stdout
