"""Causal multi-head self-attention, with a key/value cache for incremental decoding.

    y = attention(x)                 # (B, T, D) -> (B, T, D), causal
    cache = KVCache()
    y = attention(x, cache)          # x: the T positions after the cache.offset ones already fed; their
                                     # keys and values are appended to the cache, the queries attend
                                     # to everything cached up to themselves

TransformerLM.new_cache() makes the cache of a whole model; its forward(tokens, cache) advances
`offset` once all layers have run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Windows:
    """Per windowed module (Engram's N-gram hash and convolution) its last inputs, between the forwards of an
    incremental decode: KVCache's, and a retrofit's beside transformers' cache (model/retrofit.py)."""

    def __init__(self):
        self.inputs: dict[nn.Module, torch.Tensor] = {}

    def window(self, layer: nn.Module, x: torch.Tensor, initial: torch.Tensor) -> torch.Tensor:
        """x (B, T, ...) of the new positions -> (B, P + T, ...): the P = initial.shape[1] inputs before them
        (`initial` at the first call), then x; keeps the last P for the next call."""
        P = initial.shape[1]
        out = torch.cat([self.inputs.get(layer, initial), x], 1)
        self.inputs[layer] = out[:, out.shape[1] - P:]
        return out


class KVCache(Windows):
    """The past of an incremental decode: per attention sublayer its keys and values (B, n_heads, S, head_dim),
    per windowed module its last inputs (Windows), and the number of positions already fed (S = offset for every
    sublayer between forwards)."""

    def __init__(self):
        super().__init__()
        self.offset = 0
        self.layers: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}

    def extend(self, layer: nn.Module, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: (B, nh, T, hd) of the new positions -> (B, nh, offset + T, hd), the past included, kept."""
        if layer in self.layers:
            past_k, past_v = self.layers[layer]
            k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        self.layers[layer] = k, v
        return k, v


class SelfAttention(nn.Module):
    uses_cache = True  # Block passes the model's KVCache to forward

    def __init__(self, dim: int, n_heads: int, attention_dropout: float):
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"model.dim ({dim}) must be divisible by model.n_heads ({n_heads})")
        self.dim, self.n_heads, self.attention_dropout = dim, n_heads, attention_dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, D // self.n_heads).transpose(1, 3).unbind(2)  # (B, nh, T, hd)
        mask, causal = None, True
        if cache is not None:
            past = cache.offset
            k, v = cache.extend(self, k, v)  # (B, nh, past + T, hd)
            if past:  # query t (position past + t) sees keys 0..past + t: all of them when T = 1 (decoding)
                causal = False
                mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(past) if T > 1 else None
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                           dropout_p=self.attention_dropout if self.training else 0.0)  # (B, nh, T, hd)
        return self.out(y.transpose(1, 2).reshape(B, T, D))

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per weight, plus 12 · seq_len · dim for the scores and the mixing
        (PaLM's convention: full T × T, not causally halved)."""
        return 6.0 * sum(p.numel() for p in self.parameters()) + 12.0 * seq_len * self.dim
