"""Row-wise Adagrad for row-sparse gradients (the memory values): one accumulator per row, not per element.

FBGEMM's exact row-wise Adagrad (its `EXACT_ROWWISE_ADAGRAD` for embedding tables). For each row r of a
step's (coalesced) sparse gradient g, g_r its d elements:

    G[r] += mean(g_r²)                      (the mean over the row's d elements)
    p[r] -= lr · g_r / (sqrt(G[r]) + eps)

Rows not read do not move, and neither does their G. The state is G, one float32 per row (rows,), so the
optimizer costs 4/d bytes per parameter element where Adagrad costs 4 and Adam 8; and `step`, the steps taken
(a float32 () tensor on the table's device, as fused_rows.py keeps LazyAdam's). On the CPU the rows go in chunks
of lazy_adam.CHUNK_BYTES, each row's arithmetic the same. optim.fused_values: fused_rows.FusedRowwiseAdagrad.
A bfloat16 table's rows are updated in float32 and rounded stochastically (stochastic_rounding.py, the bits of
(rounding_seed, the table's index, step, row, column)).

Each row's G is the mean over all its columns: a table split by column over processes
(model.memory.shard_values) would need them all, and is refused (optimizers.Optimizers).
"""

from __future__ import annotations

import math

import torch

from xlm_pkm.optim.lazy_adam import row_chunks
from xlm_pkm.optim.stochastic_rounding import Float32State, add_rows_, table_streams
from xlm_pkm.utils.sparse_grads import coalesced


class RowwiseAdagrad(Float32State, torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-2, eps: float = 1e-10, rounding_seed: int = 0):
        if not (lr > 0 and eps > 0 and math.isfinite(lr) and math.isfinite(eps)):
            raise ValueError(f"RowwiseAdagrad: invalid lr {lr} or eps {eps} (both > 0 and finite)")
        super().__init__(params, {"lr": lr, "eps": eps})
        self.rounding_seed = rounding_seed

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        streams = table_streams(self, self.rounding_seed)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = sparse_rows_grad(p, "RowwiseAdagrad")
                state = init_state(self.state[p], p)
                state["step"] += 1
                for rows, g in row_chunks(p, grad.indices()[0], grad.values()):
                    update_rows(p, state, rows, g, group, streams[p])
        return loss


def sparse_rows_grad(p: torch.Tensor, name: str) -> torch.Tensor:
    """p's gradient, coalesced; a one-line ValueError if it is dense or p is not a (rows, dim) table."""
    if not p.grad.is_sparse or p.dim() != 2:
        kind = "sparse" if p.grad.is_sparse else "dense"
        raise ValueError(f"{name} updates the rows of a (rows, dim) table from a sparse gradient (optim."
                         f"values_optimizer=rowwise_adagrad sets them), got a {kind} gradient of shape "
                         f"{tuple(p.shape)}")
    return coalesced(p.grad)


def init_state(state: dict, p: torch.Tensor) -> dict:
    """The state of the module docstring, allocated at the first step: row_sum G (rows,), step ()."""
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        state["row_sum"] = torch.zeros(p.shape[0], dtype=torch.float32, device=p.device)
    return state


def update_rows(p: torch.Tensor, state: dict, rows: torch.Tensor, g: torch.Tensor, group: dict, key: int) -> None:
    """The update of the module docstring on `rows` (C,) of p and G, g (C, dim) their gradient; key: p's rounding
    stream (stochastic_rounding.stream; a bfloat16 p only)."""
    G = state["row_sum"].index_select(0, rows).add_(g.float().square().mean(1))  # (C,)
    state["row_sum"].index_copy_(0, rows, G)
    add_rows_(p, rows, g / G.sqrt_().add_(group["eps"]).unsqueeze(1), -group["lr"], key, state["step"])
