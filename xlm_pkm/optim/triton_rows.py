"""The sparse value optimizers' row updates as Triton kernels, for GPUs (fused_rows.py: optim.fused_values).

A step's gradient, sparse COO with rows (N,) in any order and repeated where several micro-batches or several
memories read a row, is taken as it is: its rows are sorted into runs of equal rows (utils/sparse_grads.row_runs,
no host sync), and the program of a run's first position sums the run's entries in float32 and updates its row;
every other program does nothing. One program per (position, block of columns): each gradient entry, and each row
of the parameter and of its state, is read once and written once. The clip scale (grad_scale divides the gradient)
and the skip flag (found_inf: nothing is written) are read on the device.

On a machine without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before Triton is
imported): the tests check them there against fused_rows.py's CPU functions and today's optimizers.
"""

from __future__ import annotations

import torch

try:  # imported only where a sparse gradient is on a GPU (fused_rows.py, clipping.py), or by the tests
    import triton
    import triton.language as tl
except ImportError as e:
    raise ImportError(f"optim.fused_values on a GPU needs Triton ({e})") from None

from xlm_pkm.utils.sparse_grads import row_runs


@triton.jit
def _run_sum(grad, order, run_end, pos, cols, cols_ok, D, BLOCK_D: tl.constexpr):
    """The entries of the run that sorted position `pos` begins, summed: (BLOCK_D,) float32 (zeros: no run)."""
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in range(pos, tl.load(run_end + pos)):
        entry = tl.load(order + j)
        acc += tl.load(grad + entry * D + cols, mask=cols_ok, other=0).to(tl.float32)
    return acc


@triton.jit
def _norm_kernel(grad, order, run_end, squares, D, BLOCK_D: tl.constexpr):
    pos = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for start in range(0, D, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)  # (BLOCK_D,)
        g = _run_sum(grad, order, run_end, pos, cols, cols < D, D, BLOCK_D)
        acc += g * g
    tl.store(squares + pos, tl.sum(acc, axis=0))


@triton.jit
def _lazy_adam_kernel(param, exp_avg, exp_avg_sq, grad, sorted_rows, order, run_end, grad_scale, found_inf, bias,
                      D, lr, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, BLOCK_D: tl.constexpr):
    pos = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    cols_ok = cols < D
    g = _run_sum(grad, order, run_end, pos, cols, cols_ok, D, BLOCK_D) / tl.load(grad_scale)
    live = (tl.load(run_end + pos) > pos) & (tl.load(found_inf) == 0)  # (): pos begins a run, the step is taken
    ok = cols < tl.where(live, D, 0)  # (BLOCK_D,): the row's columns, or none
    at = tl.load(sorted_rows + pos) * D + cols
    p = tl.load(param + at, mask=ok, other=0).to(tl.float32)
    m = tl.load(exp_avg + at, mask=ok, other=0).to(tl.float32)
    v = tl.load(exp_avg_sq + at, mask=ok, other=0).to(tl.float32)
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + one_minus_beta2 * g * g
    denom = tl.sqrt_rn(v) / tl.load(bias) + eps  # bias: sqrt(1 - beta2^t), 1 / (1 - beta1^t)
    update = m / denom * tl.load(bias + 1) + weight_decay * p
    tl.store(exp_avg + at, m.to(exp_avg.dtype.element_ty), mask=ok)
    tl.store(exp_avg_sq + at, v.to(exp_avg_sq.dtype.element_ty), mask=ok)
    tl.store(param + at, (p - lr * update).to(param.dtype.element_ty), mask=ok)


@triton.jit
def _adagrad_kernel(param, state_sum, grad, sorted_rows, order, run_end, grad_scale, found_inf, D, lr, eps,
                    BLOCK_D: tl.constexpr):
    pos = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    cols_ok = cols < D
    g = _run_sum(grad, order, run_end, pos, cols, cols_ok, D, BLOCK_D) / tl.load(grad_scale)
    live = (tl.load(run_end + pos) > pos) & (tl.load(found_inf) == 0)
    ok = cols < tl.where(live, D, 0)
    at = tl.load(sorted_rows + pos) * D + cols
    p = tl.load(param + at, mask=ok, other=0).to(tl.float32)
    s = tl.load(state_sum + at, mask=ok, other=0).to(tl.float32) + g * g
    tl.store(state_sum + at, s.to(state_sum.dtype.element_ty), mask=ok)
    tl.store(param + at, (p - lr * (g / (tl.sqrt_rn(s) + eps))).to(param.dtype.element_ty), mask=ok)


def _block(D: int) -> int:
    """Columns per program: a whole row up to 1,024 (4 KB of float32)."""
    return min(triton.next_power_of_2(D), 1024)


def _entries(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """grad: sparse COO (S, D) -> its rows (N,), entries (N, D) contiguous, D."""
    values, D = grad._values(), grad.shape[1:].numel()
    return grad._indices()[0], values.reshape(values.shape[0], D).contiguous(), D


def summed_rows_norm(grad: torch.Tensor) -> torch.Tensor:
    """grad: sparse COO (S, D), rows repeated or not -> () float32, the 2-norm of grad.coalesce(): each row's
    entries summed before squaring, no host sync."""
    rows, values, D = _entries(grad)
    sorted_rows, order, run_end = row_runs(rows)
    squares = torch.zeros(rows.numel(), dtype=torch.float32, device=values.device)  # (N,): 0 but at a run's start
    if rows.numel():
        block = _block(D)
        _norm_kernel[(rows.numel(),)](values, order, run_end, squares, D, BLOCK_D=block)
    return squares.sum().sqrt()


def lazy_adam_rows_(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
                    grad_scale: torch.Tensor, found_inf: torch.Tensor, bias: torch.Tensor, *, lr: float,
                    betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """LazyAdam's update (lazy_adam.py) of the rows of `grad` (sparse COO, rows repeated or not) divided by
    grad_scale (), unless found_inf () is set; bias (2,): sqrt(1 - beta2^t), 1 / (1 - beta1^t)."""
    rows, values, D = _entries(grad)
    if rows.numel():
        sorted_rows, order, run_end = row_runs(rows)
        block = _block(D)
        _lazy_adam_kernel[(rows.numel(), triton.cdiv(D, block))](
            param, exp_avg, exp_avg_sq, values, sorted_rows, order, run_end, grad_scale, found_inf, bias, D, lr,
            1 - betas[0], betas[1], 1 - betas[1], eps, weight_decay, BLOCK_D=block)
        torch.autograd.graph.increment_version([param, exp_avg, exp_avg_sq])  # written in place, as an in-place op


def adagrad_rows_(param: torch.Tensor, state_sum: torch.Tensor, grad: torch.Tensor, grad_scale: torch.Tensor,
                  found_inf: torch.Tensor, *, lr: float, eps: float) -> None:
    """Adagrad's update (fused_rows.py) of the rows of `grad` (sparse COO, rows repeated or not) divided by
    grad_scale (), unless found_inf () is set."""
    rows, values, D = _entries(grad)
    if rows.numel():
        sorted_rows, order, run_end = row_runs(rows)
        block = _block(D)
        _adagrad_kernel[(rows.numel(), triton.cdiv(D, block))](
            param, state_sum, values, sorted_rows, order, run_end, grad_scale, found_inf, D, lr, eps, BLOCK_D=block)
        torch.autograd.graph.increment_version([param, state_sum])  # written in place, as an in-place op
