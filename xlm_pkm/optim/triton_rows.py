"""The sparse value optimizers' row updates as Triton kernels, for GPUs (fused_rows.py: optim.fused_values).

A step's gradient, sparse COO with rows (N,) in any order and repeated where several micro-batches or several
memories read a row, is taken as it is: its rows are sorted into runs of equal rows (utils/sparse_grads.row_runs,
no host sync), and the program of a run's first position sums the run's entries in float32 and updates its row;
every other program does nothing. One program per (position, block of columns): each gradient entry, and each row
of the parameter and of its state, is read once and written once (row-wise Adagrad, which needs a row's whole
gradient, the mean of its squares, before it updates any column: one program per position, holding the row). The
clip scale (grad_scale divides the gradient) and the skip flag (found_inf: nothing is written) are read on the
device. A bfloat16 parameter's new values (computed in float32) are stored rounded stochastically with the bits
of (key, step, row, column), the stream and hash of optim/stochastic_rounding.py, bit for bit (_stored).

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
def _mix(x):
    """stochastic_rounding.mix on uint32."""
    x ^= x >> 16
    x *= 0x21F0AAAD
    x ^= x >> 15
    x *= 0x735A2D97
    return x ^ (x >> 15)


@triton.jit
def _stored(x, param, key, step, row, cols, NEAREST: tl.constexpr):
    """x (BLOCK_D,) float32, the new values of the columns `cols` of `row` -> as param stores them: in its dtype,
    a bfloat16 param's rounded stochastically (stochastic_rounding.round_bfloat16 with random_bits(key, step)), or
    to nearest (even) with NEAREST (optim.values_rounding=nearest)."""
    if param.dtype.element_ty == tl.bfloat16 and NEAREST:  # ties to even, written out: as torch's .to(bfloat16)
        x_bits = x.to(tl.int32, bitcast=True)
        return ((x_bits + 0x7FFF + ((x_bits >> 16) & 1)) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    elif param.dtype.element_ty == tl.bfloat16:
        h = _mix(_mix(key.to(tl.uint32) ^ tl.load(step).to(tl.uint32)) ^ row.to(tl.uint32))  # ()
        bits = (_mix(h ^ cols.to(tl.uint32)) >> 16).to(tl.int32)  # (BLOCK_D,) in [0, 2^16)
        return ((x.to(tl.int32, bitcast=True) + bits) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(param.dtype.element_ty)


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
                      step, key, D, lr, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay,
                      BLOCK_D: tl.constexpr, NEAREST: tl.constexpr):
    pos = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    cols_ok = cols < D
    g = _run_sum(grad, order, run_end, pos, cols, cols_ok, D, BLOCK_D) / tl.load(grad_scale)
    live = (tl.load(run_end + pos) > pos) & (tl.load(found_inf) == 0)  # (): pos begins a run, the step is taken
    ok = cols < tl.where(live, D, 0)  # (BLOCK_D,): the row's columns, or none
    row = tl.load(sorted_rows + pos)
    at = row * D + cols
    p = tl.load(param + at, mask=ok, other=0).to(tl.float32)
    m = tl.load(exp_avg + at, mask=ok, other=0).to(tl.float32)
    v = tl.load(exp_avg_sq + at, mask=ok, other=0).to(tl.float32)
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + one_minus_beta2 * g * g
    denom = tl.sqrt_rn(v) / tl.load(bias) + eps  # bias: sqrt(1 - beta2^t), 1 / (1 - beta1^t)
    update = m / denom * tl.load(bias + 1) + weight_decay * p
    tl.store(exp_avg + at, m.to(exp_avg.dtype.element_ty), mask=ok)
    tl.store(exp_avg_sq + at, v.to(exp_avg_sq.dtype.element_ty), mask=ok)
    tl.store(param + at, _stored(p - lr * update, param, key, step, row, cols, NEAREST), mask=ok)


@triton.jit
def _adagrad_kernel(param, state_sum, grad, sorted_rows, order, run_end, grad_scale, found_inf, step, key, D, lr,
                    eps, BLOCK_D: tl.constexpr, NEAREST: tl.constexpr):
    pos = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    cols_ok = cols < D
    g = _run_sum(grad, order, run_end, pos, cols, cols_ok, D, BLOCK_D) / tl.load(grad_scale)
    live = (tl.load(run_end + pos) > pos) & (tl.load(found_inf) == 0)
    ok = cols < tl.where(live, D, 0)
    row = tl.load(sorted_rows + pos)
    at = row * D + cols
    p = tl.load(param + at, mask=ok, other=0).to(tl.float32)
    s = tl.load(state_sum + at, mask=ok, other=0).to(tl.float32) + g * g
    tl.store(state_sum + at, s.to(state_sum.dtype.element_ty), mask=ok)
    new = p - lr * (g / (tl.sqrt_rn(s) + eps))
    tl.store(param + at, _stored(new, param, key, step, row, cols, NEAREST), mask=ok)


@triton.jit
def _rowwise_adagrad_kernel(param, row_sum, grad, sorted_rows, order, run_end, grad_scale, found_inf, step, key,
                            D, lr, eps, BLOCK_D: tl.constexpr, NEAREST: tl.constexpr):
    pos = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)  # (BLOCK_D,): the whole row (BLOCK_D >= D)
    cols_ok = cols < D
    g = _run_sum(grad, order, run_end, pos, cols, cols_ok, D, BLOCK_D) / tl.load(grad_scale)  # (BLOCK_D,)
    live = (tl.load(run_end + pos) > pos) & (tl.load(found_inf) == 0)
    row = tl.load(sorted_rows + pos)
    G = tl.load(row_sum + row, mask=live, other=0) + tl.sum(g * g, axis=0) / D  # ()
    tl.store(row_sum + row, G, mask=live)
    ok = cols < tl.where(live, D, 0)
    at = row * D + cols
    p = tl.load(param + at, mask=ok, other=0).to(tl.float32)
    new = p - lr * (g / (tl.sqrt_rn(G) + eps))
    tl.store(param + at, _stored(new, param, key, step, row, cols, NEAREST), mask=ok)


@triton.jit
def _sgd_kernel(param, grad, sorted_rows, order, run_end, grad_scale, found_inf, step, key, D, lr,
                BLOCK_D: tl.constexpr, NEAREST: tl.constexpr):
    pos = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    cols_ok = cols < D
    g = _run_sum(grad, order, run_end, pos, cols, cols_ok, D, BLOCK_D) / tl.load(grad_scale)
    live = (tl.load(run_end + pos) > pos) & (tl.load(found_inf) == 0)
    ok = cols < tl.where(live, D, 0)
    row = tl.load(sorted_rows + pos)
    at = row * D + cols
    p = tl.load(param + at, mask=ok, other=0).to(tl.float32)
    tl.store(param + at, _stored(p - lr * g, param, key, step, row, cols, NEAREST), mask=ok)


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
                    grad_scale: torch.Tensor, found_inf: torch.Tensor, bias: torch.Tensor, step: torch.Tensor,
                    key: int | None,
                    *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """LazyAdam's update (lazy_adam.py) of the rows of `grad` (sparse COO, rows repeated or not) divided by
    grad_scale (), unless found_inf () is set; bias (2,): sqrt(1 - beta2^t), 1 / (1 - beta1^t); step () float32 t and
    key (stochastic_rounding.stream; None: to nearest): a bfloat16 param's rounding."""
    rows, values, D = _entries(grad)
    if rows.numel():
        sorted_rows, order, run_end = row_runs(rows)
        block = _block(D)
        _lazy_adam_kernel[(rows.numel(), triton.cdiv(D, block))](
            param, exp_avg, exp_avg_sq, values, sorted_rows, order, run_end, grad_scale, found_inf, bias, step,
            key or 0, D,
            lr, 1 - betas[0], betas[1], 1 - betas[1], eps, weight_decay, BLOCK_D=block, NEAREST=key is None)
        torch.autograd.graph.increment_version([param, exp_avg, exp_avg_sq])  # written in place, as an in-place op


def adagrad_rows_(param: torch.Tensor, state_sum: torch.Tensor, grad: torch.Tensor, grad_scale: torch.Tensor,
                  found_inf: torch.Tensor, step: torch.Tensor, key: int | None, *, lr: float, eps: float) -> None:
    """Adagrad's update (fused_rows.py) of the rows of `grad` (sparse COO, rows repeated or not) divided by
    grad_scale (), unless found_inf () is set; step, key: a bfloat16 param's rounding (as lazy_adam_rows_')."""
    rows, values, D = _entries(grad)
    if rows.numel():
        sorted_rows, order, run_end = row_runs(rows)
        block = _block(D)
        _adagrad_kernel[(rows.numel(), triton.cdiv(D, block))](
            param, state_sum, values, sorted_rows, order, run_end, grad_scale, found_inf, step, key or 0, D, lr, eps,
            BLOCK_D=block, NEAREST=key is None)
        torch.autograd.graph.increment_version([param, state_sum])  # written in place, as an in-place op


def rowwise_adagrad_rows_(param: torch.Tensor, row_sum: torch.Tensor, grad: torch.Tensor, grad_scale: torch.Tensor,
                          found_inf: torch.Tensor, step: torch.Tensor, key: int | None, *, lr: float,
                          eps: float) -> None:
    """Row-wise Adagrad's update (rowwise_adagrad.py) of the rows of `grad` (sparse COO, rows repeated or not)
    divided by grad_scale (), unless found_inf () is set; row_sum (rows,) float32; step, key: a bfloat16 param's
    rounding (as lazy_adam_rows_')."""
    rows, values, D = _entries(grad)
    if rows.numel():
        sorted_rows, order, run_end = row_runs(rows)
        _rowwise_adagrad_kernel[(rows.numel(),)](
            param, row_sum, values, sorted_rows, order, run_end, grad_scale, found_inf, step, key or 0, D, lr, eps,
            BLOCK_D=triton.next_power_of_2(D), NEAREST=key is None)
        torch.autograd.graph.increment_version([param, row_sum])  # written in place, as an in-place op


def sgd_rows_(param: torch.Tensor, grad: torch.Tensor, grad_scale: torch.Tensor, found_inf: torch.Tensor,
              step: torch.Tensor, key: int | None, *, lr: float) -> None:
    """SGD's update of the rows of `grad` (sparse COO, rows repeated or not) divided by grad_scale (), unless
    found_inf () is set; step, key: a bfloat16 param's rounding (as lazy_adam_rows_')."""
    rows, values, D = _entries(grad)
    if rows.numel():
        sorted_rows, order, run_end = row_runs(rows)
        block = _block(D)
        _sgd_kernel[(rows.numel(), triton.cdiv(D, block))](
            param, values, sorted_rows, order, run_end, grad_scale, found_inf, step, key or 0, D, lr, BLOCK_D=block,
            NEAREST=key is None)
        torch.autograd.graph.increment_version([param])  # written in place, as an in-place op
