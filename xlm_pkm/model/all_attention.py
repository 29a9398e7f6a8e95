"""All-attention (Sukhbaatar et al. 2019, arXiv 1907.01470): context attention with relative positions,
a cache of previous blocks, an adaptive span and, optionally, persistent vectors in the same softmax.

    positions = RelativePositions(head_dim=64, max_span=8192)          # ONE table for all layers
    attn = AllAttention(512, 8, positions, n_persistent=1024, dropout=0.3,
                        span=AdaptiveSpan(8, 8192, ramp=32, loss_coeff=1e-7))
    y = attn(x, cache)                     # x (B, M, D) the block, cache (B, C, D) -> y (B, M, D)
    cache = attn.next_cache(cache, x)      # the layer's last input hidden states, detached

With n_persistent = 0 this is the attention of the adaptive-span transformer (the paper's baseline,
which keeps its FFN). The layer of either model is post-norm: x ← LayerNorm(x + AllAttention(x)),
no dropout on the residual branch; the all-attention network has no FFN after it.

Per head h (head dim d_h, queries q from the block, keys/values projected without bias from
[cache; block]), a query attends to the previous tokens at offsets x = 0..L-1 (x = 0: the token just
before it; not itself) and to its head's N persistent vectors:

    context logit    (q·k_x + q·p_x) / √d_h        p_x: column x of the shared d_h × S table
    persistent logit q·(√d_h·u_n) / √d_h = q·u_n   no position term
    a = softmax over [context; persistent]
    with a span: context part × m(x) (adaptive_span.py), persistent part × 1, a ← a / (Σa + 1e-8)
    output = dropout(a_ctx)·v + dropout(a_pers)·(√N·u'_n)

The stored persistent keys u ~ N(0, 1/d_h) and values u' ~ N(0, 1/N) are used scaled by √d_h and √N,
so the vectors in use start at unit variance. L = S without an adaptive span, else the span in use
(keys further back have mask 0 and are trimmed); the cache holds the last `cache_length()` inputs.
A query whose window holds no token (a stream's first token without a cache) sees only the
persistent vectors, or outputs 0 without them.

The paper's ablations (§5.4), by `mixing`: "joint" (all-attn, the model), "split" (attn-split: a
softmax over the context, span-masked and renormalised alone, and another over the persistent
vectors, outputs summed), "head_split" (the first H//2 heads see only the context, the others only
their persistent vectors; only those heads hold persistent vectors, hence fewer parameters).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from xlm_pkm.model.adaptive_span import AdaptiveSpan

MIXINGS = ("joint", "split", "head_split")


class RelativePositions(nn.Module):
    """The learned key-side relative position embeddings, d_h × S, N(0, 1); shared by every head and
    every layer (build one and pass it to each layer)."""

    def __init__(self, head_dim: int, max_span: int):
        super().__init__()
        self.table = nn.Parameter(torch.randn(head_dim, max_span))  # (d_h, S): column x for offset x


class AllAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, positions: RelativePositions, n_persistent: int = 0,
                 dropout: float = 0.0, span: AdaptiveSpan | None = None, adaptive_cache: bool = True,
                 mixing: str = "joint"):
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"model.dim ({dim}) must be divisible by model.n_heads ({n_heads})")
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        if positions.table.shape[0] != self.head_dim:
            raise ValueError(f"relative position table has {positions.table.shape[0]} rows, heads have "
                             f"{self.head_dim} dimensions")
        self.max_span = positions.table.shape[1]
        if span is not None and span.max_span != self.max_span:
            raise ValueError(f"adaptive span max {span.max_span} != relative position table span {self.max_span}")
        self.positions, self.span, self.adaptive_cache = positions, span, adaptive_cache
        self.query, self.key, self.value, self.out = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        if mixing not in MIXINGS or (mixing == "head_split" and (n_heads < 2 or not n_persistent)):
            raise ValueError(f"persistent mixing {mixing!r} needs one of {', '.join(MIXINGS)} (head_split: 2 heads "
                             f"and persistent vectors or more), got {n_heads} heads, {n_persistent} vectors")
        self.n_persistent, self.mixing = n_persistent, mixing
        # heads 0..H_c-1 see the context, the last H_p heads have persistent vectors (head_split: halves)
        self.context_heads = n_heads // 2 if mixing == "head_split" else n_heads
        self.persistent_heads = (n_heads - n_heads // 2 if mixing == "head_split" else n_heads) if n_persistent else 0
        if n_persistent:  # stored u, u'; used √d_h·u, √N·u'
            shape = (self.persistent_heads, n_persistent, self.head_dim)
            self.persistent_keys = nn.Parameter(torch.randn(shape) / math.sqrt(self.head_dim))
            self.persistent_values = nn.Parameter(torch.randn(shape) / math.sqrt(n_persistent))
        self.dropout = nn.Dropout(dropout)

    def window(self) -> int:
        """L: the offsets a query can see (the adaptive span in use, else S)."""
        return self.span.span_in_use() if self.span is not None else self.max_span

    def cache_length(self, window: int | None = None) -> int:
        """Input hidden states to keep for the next block: S, or with an adaptive span and adaptive_cache
        (the authors' --adapt-span-cache) min(S, span in use + 64). window: window() when already read."""
        return self.span.cache_length(window) if self.span is not None and self.adaptive_cache else self.max_span

    def next_cache(self, cache: torch.Tensor, x: torch.Tensor, length: int | None = None) -> torch.Tensor:
        """The last `length` (default cache_length()) rows of [cache; x], detached: (B, C', D)."""
        return torch.cat([cache, x], 1)[:, -(length or self.cache_length()):].detach()

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        B, T, _ = t.shape
        return t.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, d_h)

    def forward(self, x: torch.Tensor, cache: torch.Tensor, window: int | None = None) -> torch.Tensor:
        """x: (B, M, D) the current block; cache: (B, C, D) the preceding inputs (C may be 0) -> (B, M, D).
        window: window() when the caller already read it."""
        B, M, D = x.shape
        L = self.window() if window is None else window
        cache = cache[:, max(cache.shape[1] - L, 0):]  # keys further back than L are never seen
        C = cache.shape[1]
        h = torch.cat([cache, x], 1)  # (B, C + M, D)
        q, k, v = self._heads(self.query(x)), self._heads(self.key(h)), self._heads(self.value(h))
        # offset of key j from query i: the query sits at position C + i of h; valid keys are 0..L-1 back
        i = torch.arange(M, device=x.device)[:, None]
        j = torch.arange(C + M, device=x.device)[None, :]
        offset = C + i - j - 1  # (M, C + M)
        valid = (offset >= 0) & (offset < L)
        offset = offset.clamp(0, L - 1)
        pos = q @ self.positions.table[:, :L]  # (B, H, M, L): q·p_x for every offset x
        pos = pos.gather(-1, offset.expand(B, self.n_heads, M, C + M))  # (B, H, M, C + M)
        logits = (q @ k.transpose(-1, -2) + pos) / math.sqrt(self.head_dim)  # (B, H, M, C + M)
        logits = logits.masked_fill(~valid, torch.finfo(logits.dtype).min)
        context_mask = valid.to(q.dtype)  # (M, C + M): a row with no valid key must not spread over invalid ones
        if self.span is not None:
            context_mask = context_mask * self.span.mask(L).to(q.dtype)[:, offset]  # (H, M, C + M)
        Hp = self.persistent_heads
        pers = None
        if self.n_persistent:  # the last Hp heads: (B, Hp, M, N), q·(√d_h u)/√d_h = q·u
            pers = q[:, self.n_heads - Hp:] @ self.persistent_keys.transpose(-1, -2)
        if self.mixing == "joint" and pers is not None:  # one softmax over [context; persistent]
            weights = F.softmax(torch.cat([logits, pers], -1).float(), -1).to(q.dtype)
            context, persistent = weights[..., : C + M] * context_mask, weights[..., C + M:]
            if self.span is not None:
                total = context.sum(-1, keepdim=True) + persistent.sum(-1, keepdim=True) + 1e-8
                context, persistent = context / total, persistent / total
        else:  # context alone (and, split / head_split, the persistent vectors in their own softmax)
            context = F.softmax(logits.float(), -1).to(q.dtype) * context_mask
            if self.span is not None:
                context = context / (context.sum(-1, keepdim=True) + 1e-8)
            persistent = None if pers is None else F.softmax(pers.float(), -1).to(q.dtype)
        if self.context_heads < self.n_heads:  # head_split: the persistent heads see no context
            sees_context = torch.arange(self.n_heads, device=x.device) < self.context_heads  # (H,)
            context = context * sees_context.to(q.dtype)[:, None, None]
        y = self.dropout(context) @ v  # (B, H, M, d_h)
        if persistent is not None:
            read = self.dropout(persistent) @ (self.persistent_values * math.sqrt(self.n_persistent))  # (B, Hp, M, d_h)
            y = torch.cat([y[:, : self.n_heads - Hp], y[:, self.n_heads - Hp:] + read], 1)
        return self.out(y.transpose(1, 2).reshape(B, M, D))
