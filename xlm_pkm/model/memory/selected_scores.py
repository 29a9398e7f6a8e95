"""The key search's scores with a backward that touches only the selected keys.

A search scores every key, s[n, g, :] = keys[g] @ q[n, g], and keeps the knn best. Only those knn
scores reach the loss, so the score matrix's gradient has knn non-zeros per (n, g) out of S. Autograd
through `einsum(...).topk(...)` would still form it densely (a zero (N, G, S) tensor, then two
(N·G × S × d) products); here the backward reads only the selected rows:

    grad_q[n, g]    = Σ_k grad[n, g, k] · keys[g, idx[n, g, k]]       an embedding bag over the keys
    grad_keys[g, s] = Σ over (n, k) with idx[n, g, k] = s of grad[n, g, k] · q[n, g]
                                                                     its transpose (a bag per key)

g is a group of keys searched together: (head, half) for product keys, a head for flat keys.
On a GPU, where the (N, G, S) score gradient fits one chunk, the backward forms it after all: scattering
the knn gradients into zeros and two batched products beat the sorts and embedding bags there (3.5 ms
against 5.3 ms for the search's forward and backward at the training benchmark's shapes on an H200,
benchmarks/results/key_search_speed_cuda_before.json). The CPU keeps the selected rows, which hold no
(N, G, S) tensor; the two ways were not timed against each other there.
The forward scores the tokens in chunks of at most SCORES_AT_ONCE scores: a flat search over 1M slots
(the paper's Table 4) would otherwise hold all N·G·S of them, 72 GiB at 8k tokens and 4 heads (or, scoring in
a lower precision, of the chosen keys and their products with q, 2·N·G·knn·d, when more; compiled, the
rescoring fuses and holds neither).

The keys' gradient is built with fixed shapes: the lookups sorted by key (slot_groups.slot_runs), each of the
G·S keys one bag of an embedding bag, empty when unread. No count of the distinct keys read, so no host sync and
no graph break under torch.compile; each key's sum runs over its lookups in the same order as a grouping by the
distinct keys would (the same bits).

Score precision (memory.score_precision): the products that choose the slots may run in TF32 ("tf32": on
CUDA; float32 elsewhere) or from bfloat16 inputs ("bfloat16"); the knn chosen keys' scores are then computed
again in the search's dtype, q · keys[g, idx] (knn dot products per group), and sorted descending, so the
scores returned, and their gradients, are those of float32 for the keys chosen; only the choice may differ
near the knn-th score (keys.selection_differences measures how often). TF32 is scoped to its product by a
custom op (xlm_pkm::tf32_scores, registered when a search asks for it), which torch.compile keeps whole; a
flag set around a product in traced code would be dropped from the graph.

Selection (memory.half_topk, product keys): each row's knn best by torch.topk, or by a Triton kernel that takes
the row's maximum knn times (triton_topk.py; the op xlm_pkm::row_topk, registered when a search asks for it).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from xlm_pkm.model.memory.slot_groups import slot_runs

SCORES_AT_ONCE = 2**28  # float32 scores held by one chunk of the search (1 GiB); product keys: one chunk
DENSE_BACKWARD_DEVICES = ("cuda",)  # device types whose backward forms the score gradient (within one chunk)


class _SelectedScores(torch.autograd.Function):
    """Returns `scores`, computed by the caller without autograd, with the gradient of q · keys[idx]."""

    @staticmethod
    def forward(ctx, q, keys, indices, scores):
        ctx.save_for_backward(q, keys, indices)
        return scores.view_as(scores)

    @staticmethod
    def backward(ctx, grad):  # grad: (N, G, K)
        q, keys, indices = ctx.saved_tensors  # (N, G, d), (G, S, d), (N, G, K)
        N, G, S = q.shape[0], *keys.shape[:2]
        dense = grad.device.type in DENSE_BACKWARD_DEVICES and N * G * S <= SCORES_AT_ONCE
        grad_q, grad_keys = (dense_grads if dense else selected_grads)(q, keys, indices, grad.to(q.dtype),
                                                                       *ctx.needs_input_grad[:2])
        return grad_q, grad_keys, None, None


def selected_grads(q, keys, indices, grad, need_q: bool, need_keys: bool):
    """grad_q (N, G, d) and grad_keys (G, S, d) (None where not needed) from the selected rows only."""
    N, G, K = indices.shape
    S, d = keys.shape[1:]
    flat = (indices + torch.arange(G, device=indices.device)[:, None] * S).view(N * G, K)  # into (G·S, d)
    grad = grad.reshape(N * G, K)
    grad_q = grad_keys = None
    if need_q:
        grad_q = F.embedding_bag(flat, keys.reshape(G * S, d), per_sample_weights=grad, mode="sum").view(N, G, d)
    if need_keys:
        order, run_starts = slot_runs(flat, G * S)  # (N·G·K,) the lookups grouped by key, (G·S + 1,)
        grad_keys = F.embedding_bag(order // K, q.reshape(N * G, d), run_starts[:-1],
                                    per_sample_weights=grad.reshape(-1)[order], mode="sum")  # (G·S, d): key s, bag s
        grad_keys = grad_keys.to(keys.dtype).view(G, S, d)
    return grad_q, grad_keys


def dense_grads(q, keys, indices, grad, need_q: bool, need_keys: bool):
    """The same gradients through the (N, G, S) score gradient, zero but at the selected keys."""
    grad_scores = grad.new_zeros(*indices.shape[:2], keys.shape[1]).scatter_(2, indices, grad)  # (N, G, S)
    grad_q = torch.einsum("ngs,gsd->ngd", grad_scores, keys) if need_q else None
    grad_keys = torch.einsum("ngs,ngd->gsd", grad_scores, q) if need_keys else None
    return grad_q, grad_keys


def top_scores(q: torch.Tensor, keys: torch.Tensor, knn: int, precision: str = "float32",
               select: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """q: (N, G, d), keys: (G, S, d) -> (scores, indices), each (N, G, knn): the knn best keys of each
    group by inner product, scores descending; the same values as einsum + topk. precision: of the products
    that choose the keys, float32 | tf32 | bfloat16 (module docstring); the scores returned are in q's dtype.
    select: what takes each row's knn best, torch (torch.topk) | triton (triton_topk.py, rows up to a few
    thousand scores)."""
    G, S, d = keys.shape
    held = S if precision == "float32" else max(S, 2 * knn * d)  # per (token, group): scores, or the chosen keys
    tokens_at_once = max(1, SCORES_AT_ONCE // (G * held))
    with torch.no_grad():  # each chunk from (n, G, S) scores
        if precision == "float32":
            best = [best_of(torch.einsum("ngd,gsd->ngs", chunk, keys), knn, select)
                    for chunk in q.split(tokens_at_once)]
        else:
            best = [rescored(chunk, keys, best_of(score_products(chunk, keys, precision), knn, select)[1])
                    for chunk in q.split(tokens_at_once)]
        scores, indices = (torch.cat(parts) for parts in zip(*best)) if len(best) > 1 else best[0]
    if torch.is_grad_enabled() and (q.requires_grad or keys.requires_grad):
        scores = _SelectedScores.apply(q, keys, indices, scores)
    return scores, indices


def best_of(scores: torch.Tensor, knn: int, select: str) -> tuple[torch.Tensor, torch.Tensor]:
    """scores (..., S) -> the knn best of each row and their indices (..., knn), descending (top_scores' select)."""
    return scores.topk(knn, dim=-1) if select == "torch" else torch.ops.xlm_pkm.row_topk(scores, knn)


def score_products(q: torch.Tensor, keys: torch.Tensor, precision: str) -> torch.Tensor:
    """q: (n, G, d), keys: (G, S, d) -> (n, G, S) scores in `precision` (tf32: in q's dtype; bfloat16: bfloat16
    inputs and outputs)."""
    if precision == "tf32":
        return torch.ops.xlm_pkm.tf32_scores(q, keys)
    return torch.einsum("ngd,gsd->ngs", q.bfloat16(), keys.bfloat16())


def rescored(q: torch.Tensor, keys: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: (n, G, d), keys: (G, S, d), indices (n, G, K) -> (scores, indices) (n, G, K): the chosen keys' scores
    q · keys[g, idx] in q's dtype, sorted descending, and their indices in that order."""
    chosen = keys[torch.arange(keys.shape[0], device=keys.device)[:, None], indices]  # (n, G, K, d)
    # a product and a sum, not einsum's batched matmul: compiled, they fuse with the gather (no (n, G, K, d) tensor)
    scores, order = (q[:, :, None] * chosen).sum(-1).sort(dim=-1, descending=True)
    return scores, indices.gather(-1, order)


@functools.cache
def register_tf32_scores() -> None:
    """Registers torch.ops.xlm_pkm.tf32_scores(q (n, G, d), keys (G, S, d)) -> (n, G, S): the scores with TF32
    allowed in their product only (float32 on CUDA; elsewhere the plain product). An op, so that torch.compile
    keeps the product and its TF32 scope together; called when a search with score_precision=tf32 is built."""
    if hasattr(torch.ops.xlm_pkm, "tf32_scores"):  # registered by another copy of this module (an exported model)
        return

    @torch.library.custom_op("xlm_pkm::tf32_scores", mutates_args=())
    def tf32_scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        allowed = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            return torch.einsum("ngd,gsd->ngs", q, keys).contiguous()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = allowed

    @tf32_scores.register_fake
    def _(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        return q.new_empty(q.shape[0], keys.shape[0], keys.shape[1])


@functools.cache
def register_row_topk() -> None:
    """Registers torch.ops.xlm_pkm.row_topk(scores (..., S), knn) -> (values, indices) (..., knn): the Triton
    selection kernel (triton_topk.py) as an op that torch.compile keeps whole; called when a search with
    half_topk=triton is built."""
    if hasattr(torch.ops.xlm_pkm, "row_topk"):  # registered by another copy of this module (an exported model)
        return

    @torch.library.custom_op("xlm_pkm::row_topk", mutates_args=())
    def row_topk(scores: torch.Tensor, knn: int) -> tuple[torch.Tensor, torch.Tensor]:
        if scores.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"memory.half_topk=triton needs a CUDA device (the scores are on {scores.device}; "
                             f"TRITON_INTERPRET=1 runs the kernel on the CPU, slowly, for testing)")
        from xlm_pkm.model.memory.triton_topk import row_topk as kernel  # imports Triton only when used

        return kernel(scores, knn)

    @row_topk.register_fake
    def _(scores: torch.Tensor, knn: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (*scores.shape[:-1], knn)
        return scores.new_empty(shape), scores.new_empty(shape, dtype=torch.int64)
