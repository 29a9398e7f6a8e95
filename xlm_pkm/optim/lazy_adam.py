"""Lazy Adam for row-sparse gradients (the memory values): only the rows in the gradient move.

For the rows r of a step's (coalesced) sparse gradient g, with the optimizer's global step t:

    m[r] = b1 m[r] + (1 - b1) g          v[r] = b2 v[r] + (1 - b2) g²
    p[r] -= lr · (m[r] / (1 - b1^t)) / (sqrt(v[r] / (1 - b2^t)) + eps) + lr · wd · p[r]

which is torch.optim.AdamW's update restricted to those rows; the other rows, and their moments,
do not change. Bias correction uses the global step t (not a per-row count), so a row read for the
first time late in training gets a small first update, as its moments start from zero. The moments
are dense tables allocated once, at the first step; a step gathers and scatters only the rows read,
so its cost follows the number of rows read, not the table size; on CPU the rows go in chunks of
CHUNK_BYTES, each row's arithmetic the same. (torch.optim.SparseAdam does the
same work through sparse masks, about 2.4x slower here, and places eps before bias correction.)
A bfloat16 table keeps float32 moments, and its rows' update is rounded stochastically
(stochastic_rounding.py, the bits of (rounding_seed, the table's index, t, row, column)).
"""

from __future__ import annotations

import math

import torch

from xlm_pkm.optim.stochastic_rounding import Float32State, add_rows_, state_dtype, table_streams
from xlm_pkm.utils.sparse_grads import coalesced

CHUNK_BYTES = 2**20  # on CPU, rows are updated this many bytes of each tensor at a time: the temporaries
                     # stay in cache, and only the gathers and scatters go to memory (1.7x faster at 512²)


class LazyAdam(Float32State, torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, rounding_seed: int = 0):
        checks = {"lr": (lr, lr > 0), "eps": (eps, eps > 0), "weight_decay": (weight_decay, weight_decay >= 0),
                  "betas": (betas, all(0 <= b < 1 for b in betas))}
        for name, (value, ok) in checks.items():
            if not (ok and all(map(math.isfinite, value if isinstance(value, tuple) else (value,)))):
                raise ValueError(f"LazyAdam: invalid {name} {value} (lr, eps > 0; betas in [0, 1); finite)")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.rounding_seed = rounding_seed

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        streams = table_streams(self, self.rounding_seed)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not p.grad.is_sparse:
                    raise ValueError("LazyAdam needs sparse gradients (optim.values_optimizer=lazy_adam sets them)")
                grad = coalesced(p.grad)
                rows, g = grad.indices()[0], grad.values()  # (U,), (U, dim)
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=state_dtype(p))
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=state_dtype(p))
                state["step"] += 1
                for chunk_rows, chunk_g in row_chunks(p, rows, g):
                    update_rows(p, state, chunk_rows, chunk_g, group, state["step"], streams[p])
        return loss


def row_chunks(p: torch.Tensor, rows: torch.Tensor, g: torch.Tensor):
    """rows (U,), g (U, dim) -> (rows, g) in chunks of CHUNK_BYTES of g on CPU, whole on a GPU."""
    chunk = rows.numel() if p.is_cuda else max(1, CHUNK_BYTES // (math.prod(g.shape[1:]) * g.element_size()))
    for start in range(0, rows.numel(), chunk):
        yield rows[start:start + chunk], g[start:start + chunk]


def update_rows(p: torch.Tensor, state: dict, rows: torch.Tensor, g: torch.Tensor, group: dict, t: float,
                key: int) -> None:
    """The update of the module docstring on `rows` (C,) of p and its moments, g (C, dim) their gradient, at step t;
    key: p's rounding stream (stochastic_rounding.stream; a bfloat16 p only)."""
    beta1, beta2 = group["betas"]
    m = state["exp_avg"].index_select(0, rows).lerp_(g, 1 - beta1)  # (C, dim)
    v = state["exp_avg_sq"].index_select(0, rows).mul_(beta2).addcmul_(g, g, value=1 - beta2)
    state["exp_avg"].index_copy_(0, rows, m)
    state["exp_avg_sq"].index_copy_(0, rows, v)
    denom = v.sqrt_().div_(math.sqrt(1 - beta2**t)).add_(group["eps"])
    update = m.div_(denom).mul_(1 / (1 - beta1**t))  # (C, dim)
    if group["weight_decay"]:
        update.add_(p.index_select(0, rows), alpha=group["weight_decay"])
    add_rows_(p, rows, update, -group["lr"], key, t)
