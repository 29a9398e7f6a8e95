"""The memory's value read as Triton kernels: out[n] = Σ_l w[n, l] · table[idx[n, l]], for GPUs.

Forward: one program per (token, block of columns) gathers the token's L = heads·knn rows and sums
them in float32, so no (N, L, dim) tensor is formed and each table row is read once per lookup.

Backward, two passes (MemoryConfig.read_backward="two_pass", the default):
  - weights: grad_w[n, l] = grad_out[n] · table[idx[n, l]], one program per (token, block of lookups);
  - table: the lookups are sorted by slot (slot_groups.group_by_slot, the same grouping as the
    reference path), and one program per (distinct slot, block of columns) sums w · grad_out over its
    own run of lookups. Every output row has exactly one writer: no atomics, so no contention on hot
    slots and a deterministic result. The rows come out as the sparse gradient directly, or are
    scattered into a dense one.
One pass ("one_pass"): one program per slot run gives both, reading the slot's table row once instead of
once per lookup: for each block of columns, the row's block, then over the run's lookups the table
gradient's block (Σ w · grad_out) and each lookup's part of its dot (added to grad_w). A dense gradient
takes every slot's run (slot_groups.slot_runs: fixed shapes, no host sync, unread slots get zero rows);
a sparse one the distinct slots read (group_by_slot: their count is the gradient's size, one host sync).
Any float table dtype (float32, float16, bfloat16); accumulation is float32 throughout, and the output and the
table's gradient rows are of the table's dtype, at least float32 (a bfloat16 table: float32, value_read.py).

On a machine without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set
before Triton is imported), which the tests use to check them against the PyTorch reference.
"""

from __future__ import annotations

import math

import torch

try:  # imported only where Triton is installed (value_read.py); transformers' remote-code check skips a try
    import triton
    import triton.language as tl
except ImportError as e:
    raise ImportError(f"the fused value read needs Triton ({e}): use model.memory.value_read=torch") from None

from xlm_pkm.model.memory.dtypes import compute_dtype
from xlm_pkm.model.memory.slot_groups import group_by_slot, slot_runs, table_gradient


@triton.jit
def _read_kernel(table, indices, weights, out, L, D, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    cols_ok = cols < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for start in range(0, L, BLOCK_L):
        look = start + tl.arange(0, BLOCK_L)  # (BLOCK_L,) lookups of token n
        look_ok = look < L
        slot = tl.load(indices + n * L + look, mask=look_ok, other=0)  # (BLOCK_L,) int64
        w = tl.load(weights + n * L + look, mask=look_ok, other=0).to(tl.float32)
        rows = tl.load(table + slot[:, None] * D + cols[None, :], mask=look_ok[:, None] & cols_ok[None, :],
                       other=0).to(tl.float32)  # (BLOCK_L, BLOCK_D)
        acc += tl.sum(w[:, None] * rows, axis=0)
    tl.store(out + n * D + cols, acc.to(out.dtype.element_ty), mask=cols_ok)


@triton.jit
def _weights_grad_kernel(table, indices, grad_out, grad_weights, L, D,
                         BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    look = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)  # (BLOCK_L,)
    look_ok = look < L
    slot = tl.load(indices + n * L + look, mask=look_ok, other=0)  # (BLOCK_L,)
    acc = tl.zeros((BLOCK_L,), dtype=tl.float32)
    for start in range(0, D, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)  # (BLOCK_D,)
        cols_ok = cols < D
        g = tl.load(grad_out + n * D + cols, mask=cols_ok, other=0).to(tl.float32)  # (BLOCK_D,)
        rows = tl.load(table + slot[:, None] * D + cols[None, :], mask=look_ok[:, None] & cols_ok[None, :],
                       other=0).to(tl.float32)  # (BLOCK_L, BLOCK_D)
        acc += tl.sum(rows * g[None, :], axis=1)
    tl.store(grad_weights + n * L + look, acc.to(grad_weights.dtype.element_ty), mask=look_ok)


@triton.jit
def _run_block(order, weights, grad_out, start, end, cols, cols_ok, L, D, BLOCK_E: tl.constexpr):
    """One block of a slot's run of lookups (positions start.. in the slot-sorted `order`, the run ending at `end`):
    their flat indices n * L + l (BLOCK_E,), which are in the run, their weights (BLOCK_E,) and the output-gradient
    rows' `cols` (BLOCK_E, BLOCK_D), in float32."""
    entry = start + tl.arange(0, BLOCK_E)  # (BLOCK_E,) positions in the sorted lookups
    entry_ok = entry < end
    lookup = tl.load(order + entry, mask=entry_ok, other=0)  # (BLOCK_E,) flat index n * L + l
    w = tl.load(weights + lookup, mask=entry_ok, other=0).to(tl.float32)
    g = tl.load(grad_out + (lookup // L)[:, None] * D + cols[None, :],
                mask=entry_ok[:, None] & cols_ok[None, :], other=0).to(tl.float32)  # (BLOCK_E, BLOCK_D)
    return lookup, entry_ok, w, g


@triton.jit
def _table_grad_kernel(grad_out, weights, order, row_starts, rows_out, L, D,
                       BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
    u = tl.program_id(0).to(tl.int64)  # the u-th distinct slot read
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    cols_ok = cols < D
    first = tl.load(row_starts + u)
    end = tl.load(row_starts + u + 1)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for start in range(first, end, BLOCK_E):
        lookup, entry_ok, w, g = _run_block(order, weights, grad_out, start, end, cols, cols_ok, L, D, BLOCK_E)
        acc += tl.sum(w[:, None] * g, axis=0)
    tl.store(rows_out + u * D + cols, acc.to(rows_out.dtype.element_ty), mask=cols_ok)


@triton.jit
def _one_pass_grad_kernel(table, grad_out, weights, slots, order, row_starts, rows_out, grad_weights, L, D,
                          BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
    u = tl.program_id(0).to(tl.int64)  # the u-th run: the lookups of slot slots[u]
    slot = tl.load(slots + u)
    first = tl.load(row_starts + u)
    end = tl.load(row_starts + u + 1)
    for col_start in range(0, D, BLOCK_D):
        cols = col_start + tl.arange(0, BLOCK_D)  # (BLOCK_D,)
        cols_ok = cols < D
        row = tl.load(table + slot * D + cols, mask=cols_ok, other=0).to(tl.float32)  # (BLOCK_D,) once a run
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for start in range(first, end, BLOCK_E):
            lookup, entry_ok, w, g = _run_block(order, weights, grad_out, start, end, cols, cols_ok, L, D, BLOCK_E)
            acc += tl.sum(w[:, None] * g, axis=0)
            dots = tl.sum(g * row[None, :], axis=1)  # (BLOCK_E,) these columns' part of each lookup's dot
            dots += tl.load(grad_weights + lookup, mask=entry_ok & (col_start > 0), other=0)
            tl.store(grad_weights + lookup, dots, mask=entry_ok)  # float32; each lookup is in one run only
        tl.store(rows_out + u * D + cols, acc.to(rows_out.dtype.element_ty), mask=cols_ok)
        tl.debug_barrier()  # the next block of columns reads back grad_weights, maybe from other threads


def _blocks(L: int, D: int, elem: int) -> tuple[int, int]:
    """The read's (lookups, columns) per tile, powers of two: 2 KB of each row (512 float32 columns, 1,024
    bfloat16) and 16K elements at most (a (32, 512) tile in float32, (16, 1,024) in bfloat16: no spilled
    registers). Narrower rows left bfloat16 at a third of HBM bandwidth (docs/benchmarks.md#on-a-gpu)."""
    block_d = min(triton.next_power_of_2(D), 2048 // elem)
    return min(triton.next_power_of_2(L), 16384 // block_d), block_d


def _grad_blocks(rows: float, D: int, most_rows: int = 32) -> tuple[int, int]:
    """The backward kernels' (rows, columns) per tile for `rows` rows per program (a token's L lookups; a
    slot's mean number of reads): up to `most_rows` rows, up to 2,048 elements, powers of two. Small tiles keep
    the registers low and many programs on an SM, which hides the latency of a slot's dependent loads
    (docs/benchmarks.md#on-a-gpu: the 32 × 256 tile it replaces)."""
    block_r = min(most_rows, triton.next_power_of_2(max(1, math.ceil(rows))))
    return block_r, min(triton.next_power_of_2(D), 1024, 2048 // block_r)


TABLE_GRAD_ROWS = 4  # a slot sum's lookups per loop turn, at most, and its warps: at 8 reads a slot, 4.6x (fp32)
TABLE_GRAD_WARPS = 2  # and 11x (bf16) faster than (16, 128) on 4 (benchmarks/results/value_read_tiles_cuda_before.json)


def fused_row_dots(table: torch.Tensor, indices: torch.Tensor, vectors: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """table (S, D), indices (N, L), vectors (N, D) -> (N, L) in `dtype`: out[n, l] = table[indices[n, l]] ·
    vectors[n] (the read's weight gradient; PEER's u_iᵀx), summed in float32."""
    table, indices, vectors = table.contiguous(), indices.contiguous(), vectors.contiguous()
    (N, L), D = indices.shape, table.shape[1]
    block_l, block_d = _grad_blocks(L, D)
    out = torch.empty(N, L, dtype=dtype, device=table.device)
    if N:
        _weights_grad_kernel[(N, triton.cdiv(L, block_l))](table, indices, vectors, out, L, D,
                                                           BLOCK_L=block_l, BLOCK_D=block_d)
    return out


def fused_slot_sums(indices: torch.Tensor, weights: torch.Tensor, vectors: torch.Tensor,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """indices, weights (N, L), vectors (N, D) -> slots (U,) the distinct slots read, rows (U, D) in `dtype`:
    rows[u] = Σ over the lookups (n, l) of slots[u] of weights[n, l] · vectors[n] (the read's table gradient)."""
    weights, vectors = weights.contiguous(), vectors.contiguous()
    L, D = indices.shape[1], vectors.shape[1]
    slots, order, row_starts = group_by_slot(indices)  # (U,), (N*L,), (U + 1,)
    rows = torch.empty(slots.numel(), D, dtype=dtype, device=vectors.device)  # (U, D)
    if slots.numel():
        block_e, block_d = _grad_blocks(indices.numel() / slots.numel(), D, TABLE_GRAD_ROWS)  # a slot's mean reads
        _table_grad_kernel[(slots.numel(), triton.cdiv(D, block_d))](
            vectors, weights, order, row_starts, rows, L, D, BLOCK_E=block_e, BLOCK_D=block_d,
            num_warps=TABLE_GRAD_WARPS)
    return slots, rows


def one_pass_grads(table: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, grad_out: torch.Tensor,
                   sparse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """table (S, D), indices, weights (N, L), grad_out (N, D) -> the read's (grad_table, grad_weights) by one kernel
    that reads each slot's row once (module docstring). Dense: one run per slot, no host sync; sparse: one per
    distinct slot read, whose count (the sparse gradient's size) is one host sync."""
    table, indices, weights, grad_out = (t.contiguous() for t in (table, indices, weights, grad_out))
    (N, L), (S, D) = indices.shape, table.shape
    if sparse:
        slots, order, row_starts = group_by_slot(indices)  # (U,), (N*L,), (U + 1,)
    else:
        slots = torch.arange(S, device=table.device)  # (S,): every slot a run, empty when unread
        order, row_starts = slot_runs(indices, S)  # (N*L,), (S + 1,)
    rows = torch.empty(slots.numel(), D, dtype=compute_dtype(table), device=table.device)  # (U or S, D)
    grad_weights = torch.empty(N, L, dtype=torch.float32, device=table.device)
    if slots.numel():
        block_e, block_d = _grad_blocks(indices.numel() / slots.numel(), D, TABLE_GRAD_ROWS)  # a run's mean length
        _one_pass_grad_kernel[(slots.numel(),)](table, grad_out, weights, slots, order, row_starts, rows,
                                                grad_weights, L, D, BLOCK_E=block_e, BLOCK_D=block_d,
                                                num_warps=TABLE_GRAD_WARPS)
    grad_table = table_gradient(slots, rows, table.shape, sparse=True) if sparse else rows
    return grad_table, grad_weights.to(weights.dtype)


def fused_read(table: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """table: (S, D); indices: (N, L) int64; weights: (N, L) -> (N, D) in out_dtype (default: the table's, at least
    float32), summed in float32 (the forward)."""
    table, indices, weights = table.contiguous(), indices.contiguous(), weights.contiguous()
    (N, L), D = indices.shape, table.shape[1]
    block_l, block_d = _blocks(L, D, table.element_size())
    out = torch.empty(N, D, dtype=out_dtype or compute_dtype(table), device=table.device)
    if N:
        _read_kernel[(N, triton.cdiv(D, block_d))](table, indices, weights, out, L, D,
                                                   BLOCK_L=block_l, BLOCK_D=block_d)
    return out


def fused_read_grads(table: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, grad_out: torch.Tensor,
                     sparse: bool, read_backward: str, table_grad: bool,
                     weights_grad: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The read's (grad_table, grad_weights), each None unless asked for: both by one kernel with read_backward
    "one_pass" or "auto" (when both are asked for), else by one kernel each ("two_pass")."""
    if read_backward in ("one_pass", "auto") and table_grad and weights_grad:
        return one_pass_grads(table, indices, weights, grad_out, sparse)
    grad_table = grad_weights = None
    if weights_grad:
        grad_weights = fused_row_dots(table, indices, grad_out, weights.dtype)  # (N, L)
    if table_grad:
        slots, rows = fused_slot_sums(indices, weights, grad_out, compute_dtype(table))  # (U,), (U, D)
        grad_table = table_gradient(slots, rows, table.shape, sparse)
    return grad_table, grad_weights


class FusedValueRead(torch.autograd.Function):
    """table: (S, D); indices: (N, L) int64; weights: (N, L) -> (N, D) in the table's dtype, at least float32."""

    @staticmethod
    def forward(ctx, table, indices, weights, sparse: bool, read_backward: str):
        ctx.save_for_backward(table, indices, weights)
        ctx.sparse, ctx.read_backward = sparse, read_backward
        return fused_read(table, indices, weights)

    @staticmethod
    def backward(ctx, grad_out):  # grad_out: (N, D)
        table, indices, weights = ctx.saved_tensors
        grad_table, grad_weights = fused_read_grads(table, indices, weights, grad_out, ctx.sparse,
                                                    ctx.read_backward, ctx.needs_input_grad[0],
                                                    ctx.needs_input_grad[2])
        return grad_table, None, grad_weights, None, None


@torch.compiler.disable  # the kernels launch eagerly; a compiled model runs around them
def run_eagerly(function, *args):
    """function(*args) outside any compiled graph: for the autograd functions of other modules that launch
    these kernels (peer.py). Here, not there: torch.compiler.disable imports torch._dynamo, which sets
    TORCHINDUCTOR_CACHE_DIR in the environment, and importing the memory layer must change nothing."""
    return function(*args)


@torch.compiler.disable  # the kernels launch eagerly; a compiled model runs around them
def fused_read_values(table: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, sparse: bool,
                      read_backward: str = "two_pass") -> torch.Tensor:
    return FusedValueRead.apply(table, indices, weights, sparse, read_backward)
