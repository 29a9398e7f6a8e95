"""The key search's top-k as a Triton kernel, for GPUs: x (R, S) -> the columns of each row's k largest.

torch.topk (a radix select in several passes) took a third of the memory layer's device time on an
H200 (benchmarks/results/profiles/profile_memory_layer_512_bf16_cuda.txt). Here one program sorts
BLOCK_R rows in registers (tl.sort, a bitonic sort) and keeps the first k columns. A score and its column
travel as one int64 key, so one sort orders both:

    key = order(bits(s)) · 2³² + column,    order(b) = b XOR ((b >> 31) AND 0x7FFFFFFF)

where bits(s) is the float32's bit pattern as an int32: order is monotone in s (negative floats have
their magnitude bits flipped), so the keys sorted descending give the scores descending; equal scores
go to the higher column. The padding columns (past S) get the smallest int64 and are never kept.
On a machine without a GPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1), which the
tests use to check it against torch.topk.
"""

from __future__ import annotations

import torch

try:  # imported only where Triton is installed (selected_scores.top_k)
    import triton
    import triton.language as tl
except ImportError as e:
    raise ImportError(f"the Triton top-k needs Triton ({e})") from None

TILE_ELEMENTS = 4096  # a program's rows × padded columns: 8 rows of 512 scores, 4 of 1,024


@triton.jit
def _topk_kernel(x, indices, R, S, K, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,)
    cols = tl.arange(0, BLOCK_S)  # (BLOCK_S,)
    in_row = cols[None, :] < S  # (1, BLOCK_S)
    s = tl.load(x + rows[:, None] * S + cols[None, :], mask=(rows[:, None] < R) & in_row, other=0.0)
    bits = s.to(tl.float32).to(tl.int32, bitcast=True)  # (BLOCK_R, BLOCK_S)
    order = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # monotone in s
    key = (order.to(tl.int64) << 32) | cols[None, :].to(tl.int64)
    key = tl.where(in_row, key, -9223372036854775807 - 1)  # padding: the smallest int64, sorted last
    key = tl.sort(key, dim=1, descending=True)
    keep = (rows[:, None] < R) & (cols[None, :] < K)
    tl.store(indices + rows[:, None] * K + cols[None, :], key & 0xFFFFFFFF, mask=keep)


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """x (..., S) float -> (..., k) int64: the columns of the k largest of each row, largest first."""
    S = x.shape[-1]
    if not 0 < k <= S:
        raise ValueError(f"top-{k} of rows of {S}")
    rows = x.reshape(-1, S).contiguous()  # (R, S)
    block_s = triton.next_power_of_2(S)
    block_r = max(1, TILE_ELEMENTS // block_s)
    out = torch.empty(rows.shape[0], k, dtype=torch.int64, device=x.device)  # (R, k)
    if rows.shape[0]:
        _topk_kernel[(triton.cdiv(rows.shape[0], block_r),)](rows, out, rows.shape[0], S, k,
                                                              BLOCK_R=block_r, BLOCK_S=block_s)
    return out.view(*x.shape[:-1], k)
