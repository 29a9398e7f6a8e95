"""The memory's value read, out[n] = Σ_l w[n, l] · values[idx[n, l]], with a dense or sparse table gradient.

Two backends: "torch", the reference and the default on CPU: `nn.EmbeddingBag`, with the sparse
gradient below; "triton", the default on CUDA when Triton is installed: fused kernels
(triton_value_read.py). MemoryConfig.value_read ("auto", "torch" or "triton") is resolved to one of
them by `choose_backend` when a memory is built or moved to a device, never in its forward.

Dense gradient: a (n_slots, dim) tensor. Sparse gradient: one row per *distinct* slot read in the
step, so its size (and an optimizer step on it) does not grow with the table.
`nn.EmbeddingBag(sparse=True)` is no good for this: its gradient has one row per lookup
(tokens·heads·knn rows, uncoalesced), more than the dense gradient at the paper's batch sizes. The
reference builds the rows as the read's transpose, itself an embedding bag, with no (lookups, dim)
intermediate and no dense (U, N) or (n_slots, dim) buffer:

    grad_rows[u] = Σ over the lookups (n, l) of slot_u of w[n, l] · grad_out[n]

the lookups sorted by slot (a stable sort, so the sums' order and the results are deterministic), each
slot's run one bag over the rows of grad_out.
The weights' gradient still comes from EmbeddingBag's own backward (on the detached table); the
table's gradient is attached by an identity function whose backward adds it.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch
import torch.nn.functional as F

from xlm_pkm.model.memory.dtypes import at_least_float32
from xlm_pkm.model.memory.slot_groups import group_by_slot, table_gradient


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
        slots, rows = slot_sums(indices, weights, grad_out)  # (U,), (U, dim): each slot's lookups summed
        return grad_out, table_gradient(slots, rows.to(grad_out.dtype), ctx.table_shape, sparse=True), None, None


def slot_sums(indices: torch.Tensor, weights: torch.Tensor, vectors: torch.Tensor,
              backend: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """indices, weights (N, L), vectors (N, D) -> slots (U,) the distinct slots read, rows (U, D) in at least
    float32: rows[u] = Σ over the lookups (n, l) of slots[u] of weights[n, l] · vectors[n]. With vectors = the
    output gradient, the table's gradient rows (module docstring); PEER's down table uses it with its inputs."""
    rows_dtype = at_least_float32(vectors).dtype  # float32 sums for fp16/bf16
    if backend == "triton":
        from xlm_pkm.model.memory.triton_value_read import fused_slot_sums
        return fused_slot_sums(indices, weights, vectors, rows_dtype)
    slots, order, row_starts = group_by_slot(indices)  # (U,), (N*L,), (U + 1,)
    lookup_weights = weights.reshape(-1)[order].to(rows_dtype)  # (N*L,) grouped by slot
    rows = F.embedding_bag(order // indices.shape[1], vectors.to(rows_dtype), row_starts[:-1],
                           per_sample_weights=lookup_weights, mode="sum")  # (U, D): slot u's run is bag u
    return slots, rows


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_usable(device: torch.device) -> bool:
    """Triton kernels run here: on CUDA with Triton installed, or anywhere under TRITON_INTERPRET=1."""
    return triton_installed() and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def choose_backend(value_read: str, device: torch.device) -> str | None:
    """"auto" -> "triton" on CUDA when Triton is installed, else "torch"; "torch" -> "torch";
    "triton" -> "triton" where its kernels run, else None (resolve_backend says why)."""
    if value_read == "auto":
        return "triton" if device.type == "cuda" and triton_usable(device) else "torch"
    return None if value_read == "triton" and not triton_usable(device) else value_read


def resolve_backend(value_read: str, device: torch.device) -> str:
    """choose_backend, raising where the chosen backend cannot run."""
    backend = choose_backend(value_read, device)
    if backend is None:
        raise ValueError(f"memory value_read=triton needs Triton and a CUDA device (tensors are on {device}; "
                         f"TRITON_INTERPRET=1 runs the kernels on CPU, slowly, for testing)")
    return backend


def read_values(table: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, sparse: bool,
                backend: str = "torch") -> torch.Tensor:
    """table: (n_slots, dim); indices, weights: (N, L) -> (N, dim) weighted sums of the rows read, in the
    table's dtype. backend: "torch" or "triton" (a resolved choice, see the module docstring)."""
    if backend == "triton":
        from xlm_pkm.model.memory.triton_value_read import fused_read_values  # imports Triton only when used
        return fused_read_values(table, indices, weights, sparse)
    weights = weights.to(table.dtype)
    if not sparse:
        return F.embedding_bag(indices, table, per_sample_weights=weights, mode="sum")
    read = F.embedding_bag(indices, table.detach(), per_sample_weights=weights, mode="sum")  # (N, dim)
    return _AttachSparseTableGrad.apply(read, table, indices, weights.detach())
