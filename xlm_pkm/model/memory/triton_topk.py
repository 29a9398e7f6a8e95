"""The knn best scores of each row as a Triton kernel (memory.half_topk=triton): product keys' half scores, rows of
n_keys (128 to 1,024) scores, knn up to 32, without a sort.

One program holds a few rows in registers and takes their maximum knn times, each time masking the one it took:
knn reductions over the row, its scores descending as they come, equal scores leftmost first. torch.topk on such
rows takes a multi-block radix select; this is the alternative measured against it
(benchmarks/key_search_speed.py). Scores are finite; the values come back in the scores' dtype.

On a machine without a GPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set before Triton is
imported), which the tests use to check it against torch.topk.
"""

from __future__ import annotations

import torch

try:  # imported only where Triton is installed (selected_scores.py); transformers' remote-code check skips a try
    import triton
    import triton.language as tl
except ImportError as e:
    raise ImportError(f"the Triton half top-k needs Triton ({e}): use model.memory.half_topk=torch") from None

from xlm_pkm.model.memory.dtypes import compute_dtype

SCORES_PER_PROGRAM = 2048  # the rows a program holds: 2,048 // n_keys of them (at least one)


@triton.jit
def _row_topk_kernel(scores, values, indices, n_rows, S, K, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,)
    cols = tl.arange(0, BLOCK_S)  # (BLOCK_S,)
    rows_ok = rows < n_rows
    rows = rows.to(tl.int64)
    x = tl.load(scores + rows[:, None] * S + cols[None, :], mask=rows_ok[:, None] & (cols[None, :] < S),
                other=float("-inf")).to(values.dtype.element_ty)  # (BLOCK_R, BLOCK_S)
    for k in range(0, K):
        best, at = tl.max(x, axis=1, return_indices=True, return_indices_tie_break_left=True)  # (BLOCK_R,) each
        tl.store(values + rows * K + k, best, mask=rows_ok)
        tl.store(indices + rows * K + k, at.to(tl.int64), mask=rows_ok)
        x = tl.where(cols[None, :] == at[:, None], float("-inf"), x)


def row_topk(scores: torch.Tensor, knn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores (..., S) -> values (..., knn) descending, in scores' dtype, and their indices (..., knn) int64:
    torch.topk(scores, knn) (among equal scores, the leftmost first)."""
    *lead, S = scores.shape
    rows = scores.reshape(-1, S).contiguous()  # (R, S)
    values = torch.empty(rows.shape[0], knn, dtype=compute_dtype(scores), device=scores.device)
    indices = torch.empty(rows.shape[0], knn, dtype=torch.int64, device=scores.device)
    block_s = triton.next_power_of_2(S)
    block_r = max(1, SCORES_PER_PROGRAM // block_s)
    _row_topk_kernel[(triton.cdiv(rows.shape[0], block_r),)](rows, values, indices, rows.shape[0], S, knn,
                                                             BLOCK_R=block_r, BLOCK_S=block_s)
    return values.to(scores.dtype).view(*lead, knn), indices.view(*lead, knn)
