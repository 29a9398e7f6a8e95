"""Row-sparse gradients (the memory values): coalesced without a sort when they already are, or grouped into
runs of equal rows without coalescing them.

The memory layer builds its value gradient coalesced (one row per distinct slot, ascending), but
autograd's AccumulateGrad stores it as a new sparse tensor without that flag, so `grad.coalesce()`
would sort and copy every row again (78 ms of a 370 ms step at 512² slots). Clipping, LazyAdam and
the sparse all-gather across ranks (runtime/distributed.py) take it through `coalesced`. Gradients
summed over micro-batches or ranks are truly uncoalesced and still go through `coalesce()`.

`coalesced` reads a flag on the host (a sync on a GPU); `row_runs` has fixed shapes and no sync: a kernel that
sums each run (optim/triton_rows.py) takes the gradient as it is, whether its rows repeat or not.
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


def row_runs(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rows (N,): a sparse gradient's row indices, in any order, repeats allowed -> sorted_rows (N,); order (N,)
    the entries grouped by row (a stable sort: a row's entries keep their order); run_end (N,): the end of the
    run of equal rows that sorted position i begins, or i itself where i begins none (an empty run). Fixed
    shapes, no host sync."""
    sorted_rows, order = torch.sort(rows, stable=True)  # (N,), (N,)
    positions = torch.arange(rows.numel(), device=rows.device)  # (N,)
    begins = torch.searchsorted(sorted_rows, sorted_rows) == positions  # (N,): the first entry of its row
    return sorted_rows, order, torch.where(begins, torch.searchsorted(sorted_rows, sorted_rows, right=True), positions)
