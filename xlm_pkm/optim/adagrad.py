"""Adagrad as the all-attention paper trains it (Sukhbaatar et al. 2019; adaptive-span's code):
per-tensor step clipping, and the squared-gradient accumulator fed the raw gradient.

For each parameter p with gradient g, at learning rate lr:

    s += g²                                          (the raw gradient, never clipped)
    c = min(1, clip / ‖g‖) if clip > 0 else 1        (per tensor: its own gradient norm)
    p -= lr · c · g / (sqrt(s) + eps)

With clip = 0 this is torch.optim.Adagrad without lr decay and with initial accumulator 0.
"""

from __future__ import annotations

import math

import torch


class ClippedAdagrad(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 0.07, eps: float = 1e-10, clip: float = 0.0):
        if not (lr > 0 and eps > 0 and clip >= 0 and all(map(math.isfinite, (lr, eps, clip)))):
            raise ValueError(f"ClippedAdagrad: invalid lr {lr}, eps {eps} or clip {clip} (lr, eps > 0; clip >= 0)")
        super().__init__(params, {"lr": lr, "eps": eps, "clip": clip})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if g.is_sparse:
                    raise ValueError("ClippedAdagrad takes dense gradients")
                state = self.state[p]
                if not state:
                    state["sum"] = torch.zeros_like(p)
                state["sum"].addcmul_(g, g)
                scale = group["lr"]
                if group["clip"] > 0:
                    scale = torch.clamp(group["clip"] / (g.norm() + 1e-12), max=1.0) * scale  # no host sync
                p.addcdiv_(g * scale, state["sum"].sqrt().add_(group["eps"]), value=-1.0)
        return loss
