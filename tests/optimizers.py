"""Test optimizers beyond torch's: a Shampoo-like one whose per-parameter state is nested."""

from __future__ import annotations

import torch


class ShampooLike(torch.optim.Optimizer):
    """Diagonal "preconditioned" SGD whose state nests: ``{"step", "precond": {"left", "right"}}``.

    Not Shampoo, but shaped like it: the per-parameter state holds a mapping of
    tensors, which DSD's flattened format spells ``state.<fqn>.precond.left``.
    """

    def __init__(self, params, lr: float = 0.01, eps: float = 1e-8) -> None:
        super().__init__(params, {"lr": lr, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["precond"] = {
                        "left": torch.zeros(p.shape[0]),
                        "right": torch.zeros(p.shape[-1] if p.dim() > 1 else 1),
                    }
                g = p.grad.reshape(p.shape[0], -1)
                state["step"] += 1
                state["precond"]["left"].add_(g.pow(2).sum(1))
                state["precond"]["right"].add_(g.pow(2).sum(0) if p.dim() > 1 else g.pow(2).sum())
                scale = state["precond"]["left"].add(group["eps"]).rsqrt().reshape(-1, 1)
                p.add_((g * scale).reshape(p.shape), alpha=-group["lr"])
        return None
