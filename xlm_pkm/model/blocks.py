"""The block types a transformer layer is made of, by name: ModelConfig.sublayers and the memory
placement choose them per layer (transformer.layer_sublayers), this registry builds them.

    module = SUBLAYERS["attention"](cfg, shared)   # cfg: ModelConfig

Every sublayer maps (B, T, dim) to (B, T, dim) and reports `flops_per_token(seq_len)`, its training
FLOPs (forward + backward) per token; one that attends to past positions sets `uses_cache = True`
and takes forward(x, cache) (attention.KVCache); Engram sets `uses_ngrams = True` and takes
forward(x, rows[, cache]), its layer's rows of the model's N-gram hash; all_attention and span_attention
(stream_attention.py) instead keep their own cache of the stream between forwards. `shared` holds what
several layers share, built before every layer (shared_state), and "layer", the 1-indexed layer being
built. A Block wraps a layer's sublayers, each with its own LayerNorm and residual. A new block type is
its module, its builder registered here (into SUBLAYERS, model_settings.py's), and a config naming it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xlm_pkm.model.adaptive_span import AdaptiveSpan
from xlm_pkm.model.all_attention import AllAttention, RelativePositions
from xlm_pkm.model.attention import KVCache, SelfAttention
from xlm_pkm.model.memory.engram import Engram
from xlm_pkm.model.memory.keys import KEY_SEARCHES
from xlm_pkm.model.memory.ngram_hash import NgramHash
from xlm_pkm.model.memory.pkm import ProductKeyMemory
from xlm_pkm.model.memory.value_stores import VALUE_STORES
from xlm_pkm.model.model_settings import CONTEXT_SUBLAYERS, SUBLAYERS, ModelConfig
from xlm_pkm.model.stream_attention import StreamAttention


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))

    def flops_per_token(self, seq_len: int) -> float:
        return 6.0 * sum(p.numel() for p in self.parameters())


@SUBLAYERS.register("attention")
def attention(cfg: ModelConfig, shared: dict) -> nn.Module:
    return SelfAttention(cfg.dim, cfg.n_heads, cfg.attention_dropout)


@SUBLAYERS.register("ffn")
def feed_forward(cfg: ModelConfig, shared: dict) -> nn.Module:
    return FeedForward(cfg.dim, cfg.ffn_dim or 4 * cfg.dim)


@SUBLAYERS.register("memory")
def memory(cfg: ModelConfig, shared: dict) -> nn.Module:
    return ProductKeyMemory(cfg.dim, cfg.dim, cfg.memory, shared_values=shared.get("values"))


@SUBLAYERS.register("engram")
def engram(cfg: ModelConfig, shared: dict) -> nn.Module:
    """Engram's hashed N-gram memory (model/memory/engram.py): first in each layer of model.engram.layers."""
    index = cfg.engram.layers.index(shared["layer"])
    return Engram(cfg.engram, cfg.dim, shared["ngram_hash"].layer_rows(index))


def _stream_attention(cfg: ModelConfig, shared: dict, n_persistent: int) -> StreamAttention:
    s = cfg.span
    span = AdaptiveSpan(cfg.n_heads, s.max_span, s.ramp, s.loss_coeff) if s.adaptive else None
    return StreamAttention(AllAttention(cfg.dim, cfg.n_heads, shared["positions"], n_persistent,
                                        cfg.attention_dropout, span, s.adaptive_cache, cfg.persistent_mixing))


@SUBLAYERS.register("all_attention")
def all_attention(cfg: ModelConfig, shared: dict) -> nn.Module:
    """Context attention and model.persistent_vectors persistent vectors per head in one softmax
    (Sukhbaatar et al. 2019): the all-attention network's only sublayer."""
    return _stream_attention(cfg, shared, cfg.persistent_vectors)


@SUBLAYERS.register("span_attention")
def span_attention(cfg: ModelConfig, shared: dict) -> nn.Module:
    """The same context attention without persistent vectors: the adaptive-span transformer's, before its FFN."""
    return _stream_attention(cfg, shared, 0)


def shared_state(cfg: ModelConfig, plan: list[list[str]]) -> dict:
    """What the sublayers of `plan` (each layer's sublayer names) share: with memory.share_values, one
    value store for every memory, sized by the key search; for the context attentions, the relative
    position table (d_h x max_span); with Engram layers, the N-gram hash (its table sizes; the model owns
    it and computes every Engram layer's rows once per forward)."""
    shared = {}
    if cfg.engram.layers:
        shared["ngram_hash"] = NgramHash(cfg.engram, cfg.vocab_size)
    if cfg.memory.share_values and any("memory" in names for names in plan):
        n_slots = KEY_SEARCHES[cfg.memory.key_type].slots(cfg.memory)
        shared["values"] = VALUE_STORES[cfg.memory.values](cfg.memory, cfg.dim, cfg.dim, n_slots)
    if any(name in CONTEXT_SUBLAYERS for names in plan for name in names):
        shared["positions"] = RelativePositions(cfg.dim // cfg.n_heads, cfg.span.max_span)
    return shared


class Block(nn.Module):
    """A layer's sublayers f, each with its LayerNorm and residual: post-norm (XLM) x = LN(x + drop(f(x))),
    pre-norm x = x + drop(f(LN(x)))."""

    def __init__(self, sublayers: list[nn.Module], dim: int, dropout: float, pre_norm: bool):
        super().__init__()
        self.sublayers = nn.ModuleList(sublayers)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in sublayers)
        self.dropout, self.pre_norm = nn.Dropout(dropout), pre_norm

    def forward(self, x: torch.Tensor, cache: KVCache | None = None,
                ngram_rows: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, dim); ngram_rows (B, T, (N-1)·K): this layer's rows of the N-gram hash, for its Engram."""
        for f, norm in zip(self.sublayers, self.norms):
            args = (ngram_rows,) if getattr(f, "uses_ngrams", False) else ()
            args += (cache,) if cache is not None and getattr(f, "uses_cache", False) else ()
            if self.pre_norm:
                x = x + self.dropout(f(norm(x), *args))
            else:
                x = norm(x + self.dropout(f(x, *args)))
        return x

    def flops_per_token(self, seq_len: int) -> float:
        norms = sum(p.numel() for p in self.norms.parameters())
        return 6.0 * norms + sum(f.flops_per_token(seq_len) for f in self.sublayers)
