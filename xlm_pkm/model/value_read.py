"""The memory's value read, out[n] = Σ_l w[n, l] · values[idx[n, l]], with a dense or sparse table gradient.

Dense (the default): `nn.EmbeddingBag` autograd; the table's gradient is a dense (n_slots, dim) tensor.

Sparse: the gradient holds one row per *distinct* slot read in the step, so its size (and an
optimizer step on it) does not grow with the table. `nn.EmbeddingBag(sparse=True)` is no good for
this: its gradient has one row per lookup (tokens·heads·knn rows, uncoalesced), more than the dense
gradient at the paper's batch sizes. Here the rows come from a sparse-dense product, with no
(lookups, dim) intermediate:

    grad_rows = S @ grad_out      S: (U, N) sparse, S[u, n] = Σ_l w[n, l] · [idx[n, l] = slot_u]

S is built in CSR form from the lookups sorted by slot (a stable sort, so results are deterministic).
The weights' gradient still comes from EmbeddingBag's own backward (on the detached table); the
table's gradient is attached by an identity function whose backward adds it.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")  # used internally only


class _AttachSparseTableGrad(torch.autograd.Function):
    """Identity on `read`; its backward also returns the sparse gradient of `table`."""

    @staticmethod
    def forward(ctx, read, table, indices, weights):
        ctx.save_for_backward(indices, weights)
        ctx.table_shape = table.shape
        return read.view_as(read)

    @staticmethod
    def backward(ctx, grad_out):  # grad_out: (N, dim)
        indices, weights = ctx.saved_tensors  # (N, L) each
        N, L = indices.shape
        slots_read, order = torch.sort(indices.reshape(-1), stable=True)  # (N*L,) lookups grouped by slot
        slots, counts = torch.unique_consecutive(slots_read, return_counts=True)  # (U,) distinct slots
        row_starts = F.pad(torch.cumsum(counts, 0), (1, 0))  # (U + 1,)
        selection = torch.sparse_csr_tensor(row_starts, order // L, weights.reshape(-1)[order].to(grad_out.dtype),
                                            (slots.numel(), N), check_invariants=False)  # (U, N)
        rows = selection @ grad_out  # (U, dim): the lookups of each slot summed
        grad_table = torch.sparse_coo_tensor(slots.unsqueeze(0), rows, ctx.table_shape, is_coalesced=True,
                                             check_invariants=False)
        return grad_out, grad_table, None, None


def read_values(table: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, sparse: bool) -> torch.Tensor:
    """table: (n_slots, dim); indices, weights: (N, L) -> (N, dim) weighted sums of the rows read."""
    if not sparse:
        return F.embedding_bag(indices, table, per_sample_weights=weights, mode="sum")
    read = F.embedding_bag(indices, table.detach(), per_sample_weights=weights, mode="sum")  # (N, dim)
    return _AttachSparseTableGrad.apply(read, table, indices, weights.detach())
