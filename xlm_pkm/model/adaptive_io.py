"""Adaptive input (Baevski & Auli 2019) and adaptive softmax (Grave et al. 2017) with tied weights,
for word-level vocabularies sorted by frequency (id 0 the most frequent).

    emb = AdaptiveEmbedding(vocab, 512, cutoffs=[20000, 40000, 200000], factor=4)
    x = emb(tokens)                        # (B, T) -> (B, T, 512), scaled by √512
    out = AdaptiveLogSoftmax(emb)          # shares emb's tables and projections
    nll = out(hidden, targets)             # (N, 512), (N,) -> (N,) negative log-likelihoods
    logp = out.log_prob(hidden)            # (N, vocab) every token's log-probability (small vocabularies)

The cutoffs split the ids into clusters c = 0..K ([0, 20k), [20k, 40k), [40k, 200k), [200k, V)).
Cluster c has a table E_c of (size_c, d_c) with d_c = dim / factor^c (512/128/32/8) and a
projection P_c of (dim, d_c). Input: emb(t) = √dim · P_c E_c[t]. Output: the head scores
h·P_0 against E_0's rows (+ bias) and K cluster logits (a linear map of h·P_0); a token of cluster
c ≥ 1 has log p = log p_head(cluster c) + log softmax_c(h·P_c E_c^T + b_c). E_c and P_c are the
input's (tied); the output biases and the cluster map are the output's own. torch's
AdaptiveLogSoftmaxWithLoss has no per-cluster projection shared with an input and no way to tie its
head to a table, hence this module.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def cluster_bounds(vocab_size: int, cutoffs: list[int]) -> list[tuple[int, int]]:
    """[(first id, end id)] of each cluster; cutoffs must increase strictly inside (0, vocab_size)."""
    if not cutoffs or any(b <= a for a, b in zip([0] + cutoffs, cutoffs + [vocab_size])):
        raise ValueError(f"adaptive cutoffs must increase strictly in (0, vocab_size={vocab_size}), got {cutoffs}")
    edges = [0] + list(cutoffs) + [vocab_size]
    return list(zip(edges[:-1], edges[1:]))


def _at_least_float32(logits: torch.Tensor) -> torch.Tensor:
    """Half-precision logits up to float32 for the softmax; float32 and float64 kept as they are."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


class AdaptiveEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int, cutoffs: list[int], factor: int = 4):
        super().__init__()
        self.bounds = cluster_bounds(vocab_size, cutoffs)
        self.vocab_size, self.dim = vocab_size, dim
        sizes = [dim // factor**c for c in range(len(self.bounds))]
        if min(sizes) < 1:
            raise ValueError(f"adaptive factor {factor} leaves cluster {len(sizes) - 1} no dimension (dim {dim})")
        self.tables = nn.ParameterList(nn.Parameter(torch.randn(end - start, d))  # (size_c, d_c), N(0, 1)
                                       for (start, end), d in zip(self.bounds, sizes))
        self.projections = nn.ParameterList(nn.Parameter(nn.init.kaiming_uniform_(torch.empty(dim, d), a=math.sqrt(5)))
                                            for d in sizes)  # (dim, d_c), nn.Linear(d_c, dim)'s init

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (...) int64 -> (..., dim)."""
        flat = tokens.reshape(-1)
        out = torch.zeros(flat.shape[0], self.dim, dtype=self.projections[0].dtype, device=flat.device)
        for (start, end), table, proj in zip(self.bounds, self.tables, self.projections):
            rows = ((flat >= start) & (flat < end)).nonzero().squeeze(1)
            out.index_copy_(0, rows, (table[flat[rows] - start] @ proj.t()).to(out.dtype))  # (n_c, dim) rows
        return (out * math.sqrt(self.dim)).view(*tokens.shape, self.dim)


class AdaptiveLogSoftmax(nn.Module):
    def __init__(self, embedding: AdaptiveEmbedding):
        super().__init__()
        self.embedding = embedding  # tied: its tables and projections are the output's too
        self.n_clusters = len(embedding.bounds) - 1
        self.biases = nn.ParameterList(nn.Parameter(torch.zeros(end - start)) for start, end in embedding.bounds)
        self.cluster = nn.Linear(embedding.tables[0].shape[1], self.n_clusters)  # on h·P_0

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, dim) -> (N, size_0 + K) log-probabilities: the shortlist tokens, then clusters 1..K."""
        z = hidden @ self.embedding.projections[0]  # (N, d_0)
        logits = torch.cat([z @ self.embedding.tables[0].t() + self.biases[0], self.cluster(z)], -1)
        return F.log_softmax(_at_least_float32(logits), -1)

    def _tail(self, hidden: torch.Tensor, c: int) -> torch.Tensor:
        """(n, dim) -> (n, size_c) log-probabilities within cluster c ≥ 1."""
        z = hidden @ self.embedding.projections[c]  # (n, d_c)
        return F.log_softmax(_at_least_float32(z @ self.embedding.tables[c].t() + self.biases[c]), -1)

    def log_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, dim) -> (N, vocab): every token's log-probability (memory N × vocab)."""
        head = self._head(hidden)
        shortlist = self.embedding.bounds[0][1]
        parts = [head[:, :shortlist]]
        for c in range(1, self.n_clusters + 1):
            parts.append(head[:, shortlist + c - 1, None] + self._tail(hidden, c))
        return torch.cat(parts, -1)

    def forward(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """hidden (N, dim), target (N,) -> nll (N,), float32 or the model's float64; tails computed only for their
        targets."""
        head = self._head(hidden)
        shortlist = self.embedding.bounds[0][1]
        logp = head.gather(1, target.clamp(max=shortlist - 1)[:, None]).squeeze(1)  # right for shortlist targets
        for c, (start, end) in enumerate(self.embedding.bounds[1:], 1):
            rows = ((target >= start) & (target < end)).nonzero().squeeze(1)
            if rows.numel():
                tail = self._tail(hidden[rows], c).gather(1, (target[rows] - start)[:, None]).squeeze(1)
                logp = logp.index_copy(0, rows, head[rows, shortlist + c - 1] + tail)
        return -logp
