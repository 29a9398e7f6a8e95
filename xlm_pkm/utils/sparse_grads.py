"""Row-sparse gradients (the memory values) coalesced without a sort when they already are.

The memory layer builds its value gradient coalesced (one row per distinct slot, ascending), but
autograd's AccumulateGrad stores it as a new sparse tensor without that flag, so `grad.coalesce()`
would sort and copy every row again (78 ms of a 370 ms step at 512² slots). Clipping, LazyAdam and
the sparse all-gather across ranks (runtime/distributed.py) take it through `coalesced`. Gradients
summed over micro-batches or ranks are truly uncoalesced and still go through `coalesce()`.
"""

from __future__ import annotations

import torch


def coalesced(grad: torch.Tensor) -> torch.Tensor:
    """grad: sparse COO (rows, ...) -> the same gradient, coalesced; no copy when its row indices are
    already strictly increasing (then only the flag is set)."""
    if grad.is_coalesced():
        return grad
    rows = grad._indices()
    if rows.shape[0] == 1 and bool((rows[0, 1:] > rows[0, :-1]).all()):
        return torch.sparse_coo_tensor(rows, grad._values(), grad.shape, is_coalesced=True, check_invariants=False)
    return grad.coalesce()
