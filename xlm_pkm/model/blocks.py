"""The block types a transformer layer is made of, by name: ModelConfig.sublayers and the memory
placement choose them per layer (transformer.layer_sublayers), this registry builds them.

    module = SUBLAYERS["attention"](cfg, layer, shared)   # cfg: ModelConfig; layer: 1-indexed

Every sublayer maps (B, T, dim) to (B, T, dim) and reports `flops_per_token(seq_len)`, its training
FLOPs (forward + backward) per token; one that attends to past positions sets `uses_cache = True`
and takes forward(x, cache) (attention.KVCache). `shared` holds what several layers share, built
before every layer (shared_state). A Block wraps a layer's sublayers, each with its own LayerNorm
and residual. A new block type is its module, its builder registered here, and a config naming it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xlm_pkm.config import ModelConfig
from xlm_pkm.model.attention import KVCache, SelfAttention
from xlm_pkm.model.keys import KEY_SEARCHES
from xlm_pkm.model.memory import ProductKeyMemory, value_table
from xlm_pkm.registry import Registry

SUBLAYERS = Registry("block sublayer")


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))

    def flops_per_token(self, seq_len: int) -> float:
        return 6.0 * sum(p.numel() for p in self.parameters())


@SUBLAYERS.register("attention")
def attention(cfg: ModelConfig, layer: int, shared: dict) -> nn.Module:
    return SelfAttention(cfg.dim, cfg.n_heads, cfg.attention_dropout)


@SUBLAYERS.register("ffn")
def feed_forward(cfg: ModelConfig, layer: int, shared: dict) -> nn.Module:
    return FeedForward(cfg.dim, cfg.ffn_dim or 4 * cfg.dim)


@SUBLAYERS.register("memory")
def memory(cfg: ModelConfig, layer: int, shared: dict) -> nn.Module:
    return ProductKeyMemory(cfg.dim, cfg.dim, cfg.memory, values=shared.get("values"))


def shared_state(cfg: ModelConfig, plan: list[list[str]]) -> dict:
    """What the sublayers of `plan` (each layer's sublayer names) share: with memory.share_values, one
    value table for every memory, sized by the key search."""
    if cfg.memory.share_values and any("memory" in names for names in plan):
        return {"values": value_table(KEY_SEARCHES[cfg.memory.key_type].slots(cfg.memory), cfg.dim)}
    return {}


class Block(nn.Module):
    """A layer's sublayers f, each with its LayerNorm and residual: post-norm (XLM) x = LN(x + drop(f(x))),
    pre-norm x = x + drop(f(LN(x)))."""

    def __init__(self, sublayers: list[nn.Module], dim: int, dropout: float, pre_norm: bool):
        super().__init__()
        self.sublayers = nn.ModuleList(sublayers)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in sublayers)
        self.dropout, self.pre_norm = nn.Dropout(dropout), pre_norm

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        for f, norm in zip(self.sublayers, self.norms):
            past = (cache,) if cache is not None and getattr(f, "uses_cache", False) else ()
            if self.pre_norm:
                x = x + self.dropout(f(norm(x), *past))
            else:
                x = norm(x + self.dropout(f(x, *past)))
        return x

    def flops_per_token(self, seq_len: int) -> float:
        norms = sum(p.numel() for p in self.norms.parameters())
        return 6.0 * norms + sum(f.flops_per_token(seq_len) for f in self.sublayers)
