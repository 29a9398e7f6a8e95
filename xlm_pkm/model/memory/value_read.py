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

A bfloat16 table (MemoryConfig.value_dtype) is read in float32: the output and the table's gradient rows are
float32 (at_least_float32), the sums too. Triton's kernels load its rows and sum in float32; the torch read,
whose EmbeddingBag sums in the table's dtype, reads the distinct rows of the step's lookups in float32
(`float32_rows`: U rows, not a float32 copy of the table) and sums those.

MemoryConfig.read_backward: "two_pass" (the weights' and the table's gradients by one kernel each) or
"one_pass" (one kernel for both, reading each table row once), Triton's backward (triton_value_read.py).

MemoryConfig.read_op: "eager" runs the read as above; a compiled model runs the Triton read eagerly
between its graphs (torch.compiler.disable) and breaks its graph at the sparse gradient's data-dependent
size. "custom_op" runs it as the torch.library custom op xlm_pkm::read_values, defined on first use
(`read_values_op`), which torch.compile keeps as one node of its graph: for either backend, the same
computation (torch: EmbeddingBag's forward, its backward kernels and the sparse rows above, bit for bit),
with a fake implementation for shapes and a backward that is a second custom op,
xlm_pkm::read_values_backward, returning (grad_weights, grad_table), the table's dense or sparse COO.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch
import torch.nn.functional as F
from torch import Tensor

from xlm_pkm.model.memory.dtypes import compute_dtype
from xlm_pkm.model.memory.slot_groups import group_by_slot, table_gradient


class _AttachTableGrad(torch.autograd.Function):
    """Identity on `read`; its backward also returns the gradient of `table`, sparse or dense, of grad_out's dtype."""

    @staticmethod
    def forward(ctx, read, table, indices, weights, sparse):
        ctx.save_for_backward(indices, weights)
        ctx.table_shape, ctx.sparse = table.shape, sparse
        return read.view_as(read)

    @staticmethod
    def backward(ctx, grad_out):  # grad_out: (N, dim)
        indices, weights = ctx.saved_tensors  # (N, L) each
        slots, rows = slot_sums(indices, weights, grad_out)  # (U,), (U, dim): each slot's lookups summed
        grad_table = table_gradient(slots, rows.to(grad_out.dtype), ctx.table_shape, sparse=ctx.sparse)
        return grad_out, grad_table, None, None, None


def float32_rows(table: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the torch read sums: table (S, D), indices (N, L) as they are when the table is float32 (or float64);
    a lower-precision table's distinct rows read, rows (U, D) float32, and indices (N, L) into them."""
    if table.dtype == compute_dtype(table):
        return table, indices
    slots, lookups = torch.unique(indices, return_inverse=True)  # (U,), (N, L)
    return table.index_select(0, slots).float(), lookups


def slot_sums(indices: torch.Tensor, weights: torch.Tensor, vectors: torch.Tensor,
              backend: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """indices, weights (N, L), vectors (N, D) -> slots (U,) the distinct slots read, rows (U, D) in at least
    float32: rows[u] = Σ over the lookups (n, l) of slots[u] of weights[n, l] · vectors[n]. With vectors = the
    output gradient, the table's gradient rows (module docstring); PEER's down table uses it with its inputs."""
    rows_dtype = compute_dtype(vectors)  # float32 sums for fp16/bf16
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


def choose_backend(value_read: str, device: torch.device, read_backward: str = "two_pass") -> str | None:
    """"auto" -> "triton" on CUDA when Triton is installed, else "torch"; "torch" -> "torch";
    "triton" -> "triton" where its kernels run; None where the choice cannot run (resolve_backend says why):
    "triton" where its kernels do not, "torch" with read_backward "one_pass" (a Triton kernel)."""
    if value_read == "auto":
        backend = "triton" if device.type == "cuda" and triton_usable(device) else "torch"
    else:
        backend = None if value_read == "triton" and not triton_usable(device) else value_read
    return None if backend == "torch" and read_backward == "one_pass" else backend  # auto: whichever runs


def resolve_backend(value_read: str, device: torch.device, read_backward: str = "two_pass") -> str:
    """choose_backend, raising where the chosen backend cannot run."""
    backend = choose_backend(value_read, device, read_backward)
    if backend is None and value_read == "triton":
        raise ValueError(f"memory value_read=triton needs Triton and a CUDA device (tensors are on {device}; "
                         f"TRITON_INTERPRET=1 runs the kernels on CPU, slowly, for testing)")
    if backend is None:
        raise ValueError(f"model.memory.read_backward=one_pass is a Triton kernel, but model.memory.value_read="
                         f"{value_read} reads with torch on {device}: set read_backward=two_pass or value_read=triton")
    return backend


def read_values(table: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, sparse: bool,
                backend: str = "torch", read_backward: str = "two_pass", read_op: str = "eager") -> torch.Tensor:
    """table: (n_slots, dim); indices, weights: (N, L) -> (N, dim) weighted sums of the rows read, in the
    table's dtype, at least float32. backend: "torch" or "triton" (a resolved choice); read_backward: Triton's
    "two_pass" or "one_pass"; read_op: "eager" or "custom_op" (the module docstring)."""
    if backend == "torch":
        weights = weights.to(compute_dtype(table))
    if read_op == "custom_op":
        return read_values_op()(table, indices, weights, sparse, backend, read_backward)
    if backend == "triton":
        from xlm_pkm.model.memory.triton_value_read import fused_read_values  # imports Triton only when used
        return fused_read_values(table, indices, weights, sparse, read_backward)
    if not sparse and table.dtype == compute_dtype(table):
        return F.embedding_bag(indices, table, per_sample_weights=weights, mode="sum")
    rows, lookups = float32_rows(table.detach(), indices)  # the table itself, or the distinct rows read
    read = F.embedding_bag(lookups, rows, per_sample_weights=weights, mode="sum")  # (N, dim)
    return _AttachTableGrad.apply(read, table, indices, weights.detach(), sparse)


def embedding_bag_grads(table: Tensor, indices: Tensor, weights: Tensor, grad_out: Tensor, sparse: bool,
                        table_grad: bool, weights_grad: bool) -> tuple[Tensor | None, Tensor | None]:
    """The torch read's (grad_table, grad_weights), each None unless asked for, by the kernels autograd runs
    for it: EmbeddingBag's backward (each token a bag of its L lookups) and, sparse, the slot sums."""
    N, L = indices.shape
    lookups = indices.reshape(-1)  # (N*L,)
    offsets = torch.arange(0, N * L, L, device=indices.device)  # (N,) where each token's bag begins
    bag_of = torch.arange(N * L, device=indices.device) // L  # (N*L,) each lookup's token
    grad_table = grad_weights = None
    if weights_grad:
        rows, looked_up = float32_rows(table, indices)  # what the forward summed
        grad_weights = torch.ops.aten._embedding_bag_per_sample_weights_backward(
            grad_out, rows, looked_up.reshape(-1), offsets, bag_of, 0).view(N, L)  # mode 0: sum
    if table_grad and sparse:
        slots, rows = slot_sums(indices, weights, grad_out)  # (U,), (U, dim)
        grad_table = table_gradient(slots, rows.to(grad_out.dtype), table.shape, sparse=True)
    elif table_grad:
        unused = offsets.new_zeros(N)  # bag sizes and max indices: mode sum reads neither
        grad_table = torch.ops.aten._embedding_bag_backward(grad_out, lookups, offsets, bag_of, unused, unused,
                                                            table.shape[0], False, 0, False, weights.reshape(-1))
    return grad_table, grad_weights


def read_values_op():
    """The custom op xlm_pkm::read_values(table, indices, weights, sparse, backend, read_backward), defined by
    the first call: call it once eagerly (a table store built with read_op=custom_op does) before a compiled
    graph uses it, which then finds it in torch.ops."""
    if not hasattr(torch.ops.xlm_pkm, "read_values"):
        _define_read_ops()
    return torch.ops.xlm_pkm.read_values


def _define_read_ops() -> None:
    @torch.library.custom_op("xlm_pkm::read_values", mutates_args=())
    def read(table: Tensor, indices: Tensor, weights: Tensor, sparse: bool, backend: str,
             read_backward: str) -> Tensor:
        if backend == "triton":
            from xlm_pkm.model.memory.triton_value_read import fused_read
            return fused_read(table, indices, weights)
        rows, lookups = float32_rows(table, indices)
        return F.embedding_bag(lookups, rows, per_sample_weights=weights, mode="sum")

    @read.register_fake
    def _(table, indices, weights, sparse, backend, read_backward):
        return table.new_empty(indices.shape[0], table.shape[1], dtype=compute_dtype(table))

    @torch.library.custom_op("xlm_pkm::read_values_backward", mutates_args=())
    def read_backward_op(grad_out: Tensor, table: Tensor, indices: Tensor, weights: Tensor, sparse: bool,
                         backend: str, read_backward: str, table_grad: bool,
                         weights_grad: bool) -> tuple[Tensor, Tensor]:
        """-> (grad_weights, grad_table), each empty unless asked for."""
        if backend == "triton":
            from xlm_pkm.model.memory.triton_value_read import fused_read_grads
            grads = fused_read_grads(table, indices, weights, grad_out, sparse, read_backward, table_grad,
                                     weights_grad)
        else:
            grads = embedding_bag_grads(table, indices, weights, grad_out, sparse, table_grad, weights_grad)
        grad_table, grad_weights = grads
        return (weights.new_empty(0) if grad_weights is None else grad_weights,
                table.new_empty(0, dtype=compute_dtype(table)) if grad_table is None else grad_table)

    @read_backward_op.register_fake
    def _(grad_out, table, indices, weights, sparse, backend, read_backward, table_grad, weights_grad):
        grad_table = table.new_empty(table.shape if table_grad else (0,), dtype=compute_dtype(table))
        return (weights.new_empty(weights.shape if weights_grad else (0,)),
                grad_table.to_sparse(1) if sparse and table_grad else grad_table)

    def setup_context(ctx, inputs, output):
        table, indices, weights, *settings = inputs  # settings: sparse, backend, read_backward
        ctx.save_for_backward(table, indices, weights)
        ctx.settings = settings

    def backward(ctx, grad_out):  # grad_out: (N, dim)
        table, indices, weights = ctx.saved_tensors
        table_grad, weights_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        grad_weights, grad_table = read_backward_op(grad_out, table, indices, weights, *ctx.settings,
                                                    table_grad, weights_grad)
        return grad_table if table_grad else None, None, grad_weights if weights_grad else None, None, None, None

    read.register_autograd(backward, setup_context=setup_context)
