"""The key search's scores with a backward that touches only the selected keys.

A search scores every key, s[n, g, :] = keys[g] @ q[n, g], and keeps the knn best. Only those knn
scores reach the loss, so the score matrix's gradient has knn non-zeros per (n, g) out of S. Autograd
through `einsum(...).topk(...)` would still form it densely (a zero (N, G, S) tensor, then two
(N·G × S × d) products); here the backward reads only the selected rows:

    grad_q[n, g]    = Σ_k grad[n, g, k] · keys[g, idx[n, g, k]]       an embedding bag over the keys
    grad_keys[g, s] = Σ over (n, k) with idx[n, g, k] = s of grad[n, g, k] · q[n, g]
                                                                     its transpose (value_read.slot_sums)

g is a group of keys searched together: (head, half) for product keys, a head for flat keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xlm_pkm.model.memory.slot_groups import table_gradient
from xlm_pkm.model.memory.value_read import slot_sums


class _SelectedScores(torch.autograd.Function):
    """Returns `scores`, computed by the caller without autograd, with the gradient of q · keys[idx]."""

    @staticmethod
    def forward(ctx, q, keys, indices, scores):
        ctx.save_for_backward(q, keys, indices)
        return scores.view_as(scores)

    @staticmethod
    def backward(ctx, grad):  # grad: (N, G, K)
        q, keys, indices = ctx.saved_tensors  # (N, G, d), (G, S, d), (N, G, K)
        N, G, K = indices.shape
        S, d = keys.shape[1:]
        flat = (indices + torch.arange(G, device=indices.device)[:, None] * S).view(N * G, K)  # into (G·S, d)
        grad = grad.reshape(N * G, K).to(q.dtype)
        grad_q = grad_keys = None
        if ctx.needs_input_grad[0]:
            grad_q = F.embedding_bag(flat, keys.reshape(G * S, d), per_sample_weights=grad, mode="sum").view(N, G, d)
        if ctx.needs_input_grad[1]:
            rows_read, rows = slot_sums(flat, grad, q.reshape(N * G, d))  # (U,), (U, d)
            grad_keys = table_gradient(rows_read, rows.to(keys.dtype), (G * S, d), sparse=False).view(G, S, d)
        return grad_q, grad_keys, None, None


def top_scores(q: torch.Tensor, keys: torch.Tensor, knn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q: (N, G, d), keys: (G, S, d) -> (scores, indices), each (N, G, knn): the knn best keys of each
    group by inner product, scores descending; the same values as einsum + topk."""
    with torch.no_grad():
        scores, indices = torch.einsum("ngd,gsd->ngs", q, keys).topk(knn, dim=-1)  # from (N, G, S)
    if torch.is_grad_enabled() and (q.requires_grad or keys.requires_grad):
        scores = _SelectedScores.apply(q, keys, indices, scores)
    return scores, indices
