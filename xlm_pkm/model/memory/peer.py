"""PEER: every slot is a single-neuron expert (He 2024, "Mixture of A Million Experts", §2), a value store.

    memory = ProductKeyMemory(512, 512, MemoryConfig(values="peer", n_keys=1024, heads=8, knn=16))  # 1024² experts
    MemoryConfig(values="peer", peer=PeerConfig(activation="relu"))   # model.memory.peer: this store's own

The memory layer's search chooses the experts (Eq. 1, 4-5: the top-k of the product keys), its score
function gives the router scores g_i(x) (Eq. 2: softmax over the k selected, memory.score), and this
store computes, per token x (the memory's input) and per head h, over the head's k experts I^h:

    e_i(x) = σ(u_iᵀ x) v_i                              Eq. 6: expert i, one hidden neuron
    f(x)   = Σ_h Σ_{i ∈ I^h} g_i(x) e_i(x)              Eq. 3 and 7: heads summed
    s[n, l] = down[idx[n, l]] · x[n]                    (N, H·K)     u_iᵀ x: the down projection
    out[n]  = Σ_l g[n, l] σ(s[n, l]) · up[idx[n, l]]    (N, output_dim) the value read of value_read.py

`down` (n_slots, input_dim) holds the u_i, `up` (n_slots, output_dim) the v_i. Both are tables read by
slot (marked is_memory_value: the values optimizer group, sparse memory finetuning). With `sparse`
each gradient holds one row per distinct expert read, built like the value read's (slot_groups.py):
the up side *is* the value read; the down side is its transpose,

    grad_down[slot] = Σ_{(n, l) reading slot} grad_s[n, l] · x[n]     (U, input_dim), an embedding bag
    grad_x[n]       = Σ_l grad_s[n, l] · down[idx[n, l]]                an EmbeddingBag read of `down`

so no (N, H·K, dim) tensor is kept for backward. Both sides follow the memory's value-read backend
(memory.value_read): "torch" computes the forward's s = Σ_d down[idx]·x in chunks of at most
CHUNK_ELEMENTS gathered elements and the sums above by EmbeddingBag (grad_down's over the lookups
sorted by slot), as value_read.py;
"triton" launches the fused read's own kernels (triton_value_read.py: its weight-gradient kernel is
exactly the dots u_i·x, its table-gradient kernel the per-slot sums), with no gathered tensor at all.

Where the paper is silent or ambiguous, chosen here:
  - σ: "a nonlinear activation function such as ReLU or GELU" (after Eq. 6), the experiments do not say
    which: memory.peer.activation, default gelu (exact erf form; Algorithm 1 leaves `self.activation`
    open, lucidrains/PEER-pytorch defaults to GELU).
  - init: not stated. Algorithm 1 stores u and v in Flax `nn.Embed(features=d_model)`, whose default
    init is variance_scaling(1, fan_in, normal, out_axis=0), i.e. N(0, 1/features): down N(0, 1/input_dim)
    (unit-variance pre-activations for a unit-variance input), up N(0, 1/output_dim) (the table store's).
  - dimensions: u_i and v_i are "vectors with the same dimension as x" (Eq. 6), the transformer case of
    §2's f: R^n -> R^m; a memory with output_dim != input_dim gets v_i of output_dim (the general f).
  - no bias terms ("we omit bias terms here for brevity": Algorithm 1 has none), no dropout on the
    hidden neurons (none in the paper; memory.value_dropout acts on the output).
  - heads: "different heads share the same pool of experts with the same set of product keys" (§2). The
    store is shared by the heads; the keys are the key search's, one set for every head with
    memory.share_keys (as in the configs of configs/variants), else one per head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from xlm_pkm.model.memory.dtypes import compute_dtype
from xlm_pkm.model.memory.memory_settings import VALUE_STORES, MemoryConfig
from xlm_pkm.model.memory.memory_settings import PeerConfig as PeerConfig  # its section, importable from here too
from xlm_pkm.model.memory.slot_groups import table_gradient
from xlm_pkm.model.memory.value_read import read_values, slot_sums
from xlm_pkm.model.memory.value_stores import ValueStore, mark_memory_value

CHUNK_ELEMENTS = 2**24  # the forward gathers at most this many down-table elements at a time (64 MiB float32)

ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu}  # σ of Eq. 6 (memory.peer.activation)


def expert_inputs(down: torch.Tensor, indices: torch.Tensor, x: torch.Tensor, backend: str) -> torch.Tensor:
    """down (n_slots, D), indices (N, L), x (N, D) -> s (N, L), s[n, l] = down[indices[n, l]] · x[n], summed in
    at least float32. torch: in chunks of tokens (at most CHUNK_ELEMENTS gathered elements each); triton:
    the fused read's weight-gradient kernel, which computes exactly these dots (no gathered tensor)."""
    N, L = indices.shape
    dtype = torch.promote_types(compute_dtype(down), x.dtype)
    if backend == "triton":
        from xlm_pkm.model.memory.triton_value_read import fused_row_dots  # imports Triton only when used
        return fused_row_dots(down, indices, x.to(down.dtype), compute_dtype(down)).to(dtype)
    s = torch.empty(N, L, dtype=dtype, device=x.device)
    step = max(1, CHUNK_ELEMENTS // max(1, L * down.shape[1]))
    for start in range(0, N, step):
        rows = F.embedding(indices[start:start + step], down)  # (n, L, D): this chunk's experts' u_i
        s[start:start + step] = torch.einsum("nld,nd->nl", rows.to(dtype), x[start:start + step].to(dtype))
    return s


class _ExpertInputs(torch.autograd.Function):
    """s = expert_inputs(down, indices, x), with the gradients of the module docstring: x's a value read of
    `down` weighted by grad_s, down's one row per distinct slot (sparse COO, or dense)."""

    @staticmethod
    def forward(ctx, x, down, indices, sparse, backend):
        ctx.save_for_backward(x, down, indices)
        ctx.sparse, ctx.backend = sparse, backend
        return expert_inputs(down, indices, x, backend)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_s):  # grad_s: (N, L)
        x, down, indices = ctx.saved_tensors
        grad_x = grad_down = None
        if ctx.needs_input_grad[0]:  # grad_x[n] = Σ_l grad_s[n, l] · down[idx[n, l]]: a value read of `down`
            grad_x = read_values(down, indices, grad_s, False, ctx.backend).to(x.dtype)  # (N, D)
        if ctx.needs_input_grad[1]:  # grad_down[slot] = Σ grad_s · x over its lookups: the read's table gradient
            slots, rows = slot_sums(indices, grad_s, x, ctx.backend)
            grad_down = table_gradient(slots, rows, down.shape, ctx.sparse).to(down.dtype)
        return grad_x, grad_down, None, None, None


@VALUE_STORES.register("peer")
class PeerExperts(ValueStore):
    """n_slots single-neuron experts: `down` (n_slots, input_dim) the u_i, `up` (n_slots, output_dim) the
    v_i; out = Σ_heads Σ_knn g · σ(u_iᵀ x) v_i (see the module docstring)."""

    def __init__(self, cfg: MemoryConfig, input_dim: int, output_dim: int, n_slots: int):
        super().__init__(cfg, input_dim, output_dim, n_slots)
        if cfg.shard_values is True:
            raise ValueError("memory.values=peer: PEER's expert tables are not sharded; "
                             "set memory.shard_values=false")
        self.activation_name = cfg.peer.activation
        self.activation = ACTIVATIONS[cfg.peer.activation]
        self.down = mark_memory_value(nn.Parameter(torch.randn(n_slots, input_dim) * input_dim**-0.5))
        self.up = mark_memory_value(nn.Parameter(torch.randn(n_slots, output_dim) * output_dim**-0.5))

    def forward(self, x, indices, weights, sparse, backend):
        if weights.dim() != 3:
            raise ValueError("memory.values=peer reads one router score per expert; scores with a cores axis "
                             "need a store that splits values by core")
        if x.shape[-1] != self.input_dim:  # a store shared by memories of another input width
            raise ValueError(f"memory.values=peer: the experts' u_i have {self.input_dim} inputs, "
                             f"this memory's input has {x.shape[-1]}")
        N = x.shape[0]
        indices, weights = indices.reshape(N, -1), weights.reshape(N, -1)  # (N, H·K): heads summed below
        if backend == "triton":
            from xlm_pkm.model.memory.triton_value_read import run_eagerly  # imports Triton only when used
            s = run_eagerly(_ExpertInputs.apply, x, self.down, indices, sparse, backend)  # (N, H·K) u_iᵀ x
        else:
            s = _ExpertInputs.apply(x, self.down, indices, sparse, backend)
        hidden = weights * self.activation(s)  # (N, H·K) g_i(x) σ(u_iᵀ x)
        return read_values(self.up, indices, hidden, sparse, backend)  # (N, output_dim) Σ g σ(uᵀx) v_i

    def flops_per_token(self, heads: int, knn: int) -> float:
        """6 per element of the u_i and v_i read (heads · knn · (input_dim + output_dim)): Eq. 6's dot and
        scaled sum, forward and backward (the paper's P_active = (2 d_model + 1) · h · k, §2)."""
        return 6.0 * heads * knn * (self.input_dim + self.output_dim)

    def extra_repr(self) -> str:
        return (f"experts={self.n_slots}, down={self.input_dim}, up={self.output_dim}, "
                f"activation={self.activation_name}")
