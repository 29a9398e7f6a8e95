"""The key search's scores with a backward that touches only the selected keys.

A search scores every key, s[n, g, :] = keys[g] @ q[n, g], and keeps the knn best. Only those knn
scores reach the loss, so the score matrix's gradient has knn non-zeros per (n, g) out of S. Autograd
through `einsum(...).topk(...)` would still form it densely (a zero (N, G, S) tensor, then two
(N·G × S × d) products); here the backward reads only the selected rows:

    grad_q[n, g]    = Σ_k grad[n, g, k] · keys[g, idx[n, g, k]]       an embedding bag over the keys
    grad_keys[g, s] = Σ over (n, k) with idx[n, g, k] = s of grad[n, g, k] · q[n, g]
                                                                     its transpose (value_read.slot_sums)

g is a group of keys searched together: (head, half) for product keys, a head for flat keys.
On a GPU, where the (N, G, S) score gradient fits one chunk, the backward forms it after all: scattering
the knn gradients into zeros and two batched products beat the sorts and embedding bags there (3.5 ms
against 5.3 ms for the search's forward and backward at the training benchmark's shapes on an H200,
benchmarks/results/key_search_speed_cuda_before.json). The CPU keeps the selected rows, which hold no
(N, G, S) tensor; the two ways were not timed against each other there.
The forward scores the tokens in chunks of at most SCORES_AT_ONCE scores: a flat search over 1M slots
(the paper's Table 4) would otherwise hold all N·G·S of them, 72 GiB at 8k tokens and 4 heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xlm_pkm.model.memory.slot_groups import table_gradient
from xlm_pkm.model.memory.value_read import slot_sums

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
        rows_read, rows = slot_sums(flat, grad, q.reshape(N * G, d))  # (U,), (U, d)
        grad_keys = table_gradient(rows_read, rows.to(keys.dtype), (G * S, d), sparse=False).view(G, S, d)
    return grad_q, grad_keys


def dense_grads(q, keys, indices, grad, need_q: bool, need_keys: bool):
    """The same gradients through the (N, G, S) score gradient, zero but at the selected keys."""
    grad_scores = grad.new_zeros(*indices.shape[:2], keys.shape[1]).scatter_(2, indices, grad)  # (N, G, S)
    grad_q = torch.einsum("ngs,gsd->ngd", grad_scores, keys) if need_q else None
    grad_keys = torch.einsum("ngs,ngd->gsd", grad_scores, q) if need_keys else None
    return grad_q, grad_keys


def top_scores(q: torch.Tensor, keys: torch.Tensor, knn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q: (N, G, d), keys: (G, S, d) -> (scores, indices), each (N, G, knn): the knn best keys of each
    group by inner product, scores descending; the same values as einsum + topk."""
    tokens_at_once = max(1, SCORES_AT_ONCE // (keys.shape[0] * keys.shape[1]))
    with torch.no_grad():  # each chunk from (n, G, S) scores
        best = [torch.einsum("ngd,gsd->ngs", chunk, keys).topk(knn, dim=-1) for chunk in q.split(tokens_at_once)]
        scores, indices = (torch.cat(parts) for parts in zip(*best)) if len(best) > 1 else best[0]
    if torch.is_grad_enabled() and (q.requires_grad or keys.requires_grad):
        scores = _SelectedScores.apply(q, keys, indices, scores)
    return scores, indices
