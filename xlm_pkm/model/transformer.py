"""TransformerLM: a causal decoder-only LM (paper §4.3) whose FFN is replaced by, or followed by, a
Product Key Memory in some layers.

    model = TransformerLM(cfg.model)       # cfg.model.vocab_size set from the data
    logits = model(tokens)                 # (B, T) int64 -> (B, T, vocab)
    cache = model.new_cache()              # incremental decoding (eval mode): each call feeds the
    logits = model(tokens, cache=cache)    # next tokens, at positions after those already cached

Block l (1-indexed) is self-attention, then the feed-forward sublayers: [FFN], or [PKM] when l is a
memory layer with mem_mode "replace", or [FFN, PKM] with mem_mode "add". Every sublayer f has its
own LayerNorm and residual: post-norm (XLM) x = LN(x + drop(f(x))), pre-norm x = x + drop(f(LN(x))).
Post-norm also normalises the embeddings (XLM's layer_norm_emb); pre-norm ends with a final LayerNorm.

Init: token and position embeddings N(0, dim^-0.5) as XLM; linear layers PyTorch's default;
the output projection is tied to the token embeddings (no bias).

Memory placement (`memory_layers`): with L layers and N memories, the top memory sits at
T = L - floor(L/4), leaving a quarter of the layers above it to process what was read (Table 3:
best at an intermediate layer, worst right before the softmax), and the others evenly below it:
layer_i = floor(i·T/N + 1/2), i = 1..N. L=16,N=2 -> [6, 12]; L=6,N=1 -> [5]; L=12,N=1 -> [9];
L=24,N=3 -> [6, 12, 18]. `python -m xlm_pkm.model.transformer` prints the rule for the paper's sizes.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from xlm_pkm.config import ModelConfig
from xlm_pkm.model.memory import ProductKeyMemory, value_table

logger = logging.getLogger(__name__)


def memory_layers(n_layers: int, n_memories: int) -> list[int]:
    """The 1-indexed layers holding the memories: the top one at T = L - L//4, the rest evenly below."""
    top = n_layers - n_layers // 4
    if not 0 <= n_memories <= top:
        raise ValueError(f"model.n_memories must be in [0, {top}] for {n_layers} layers, got {n_memories}")
    return [(2 * i * top + n_memories) // (2 * n_memories) for i in range(1, n_memories + 1)]


def resolve_memory_layers(cfg: ModelConfig) -> list[int]:
    """cfg.mem_layers when given (validated), else memory_layers(cfg.n_layers, cfg.n_memories)."""
    if cfg.mem_mode not in ("replace", "add"):
        raise ValueError(f"model.mem_mode must be replace or add, got {cfg.mem_mode!r}")
    if not cfg.mem_layers:
        return memory_layers(cfg.n_layers, cfg.n_memories)
    bad = [layer for layer in cfg.mem_layers if not 1 <= layer <= cfg.n_layers]
    if bad or len(set(cfg.mem_layers)) != len(cfg.mem_layers):
        raise ValueError(f"model.mem_layers must be distinct layers in [1, {cfg.n_layers}], got {cfg.mem_layers}")
    return sorted(cfg.mem_layers)


class KVCache:
    """Incremental decoding state: per attention layer, [keys, values] of the tokens fed so far, each
    (B, n_heads, T_past, head_dim) ([None, None] before the first call); `length` is T_past, the
    position of the next token. Memory and FFN sublayers act on each token alone (the memory's
    BatchNorm on its running statistics, in eval mode), so they need no cache."""

    def __init__(self, n_layers: int):
        self.layers: list[list[torch.Tensor | None]] = [[None, None] for _ in range(n_layers)]

    @property
    def length(self) -> int:
        keys = self.layers[0][0]
        return 0 if keys is None else keys.shape[2]


class SelfAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, attention_dropout: float):
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"model.dim ({dim}) must be divisible by model.n_heads ({n_heads})")
        self.n_heads, self.attention_dropout = n_heads, attention_dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, pad_mask=None, cache: list | None = None) -> torch.Tensor:
        """cache: this layer's [keys, values] of the earlier tokens (KVCache), extended in place."""
        B, T, D = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.n_heads, D // self.n_heads)  # (B, T, 3, nh, hd)
        q, k, v = qkv.transpose(1, 3).unbind(2)  # (B, nh, T, hd) each
        past = 0
        if cache is not None:
            if cache[0] is not None:
                past = cache[0].shape[2]
                k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)  # (B, nh, past + T, hd)
            cache[:] = [k, v]
        # query i (position past + i) sees keys 0..past + i
        mask = None if past == 0 else torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(past)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=past == 0,
                                           dropout_p=self.attention_dropout if self.training else 0.0)  # (B, nh, T, hd)
        return self.out(y.transpose(1, 2).reshape(B, T, D))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor, pad_mask=None) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Self-attention then the feed-forward sublayers (FFN and/or memory), each with norm and residual."""

    def __init__(self, sublayers: list[nn.Module], dim: int, dropout: float, pre_norm: bool):
        super().__init__()
        self.sublayers = nn.ModuleList(sublayers)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in sublayers)
        self.dropout, self.pre_norm = nn.Dropout(dropout), pre_norm

    def forward(self, x: torch.Tensor, pad_mask: torch.Tensor | None = None, cache: list | None = None) -> torch.Tensor:
        for f, norm in zip(self.sublayers, self.norms):
            args = (pad_mask, cache) if isinstance(f, SelfAttention) else (pad_mask,)
            if self.pre_norm:
                x = x + self.dropout(f(norm(x), *args))
            else:
                x = norm(x + self.dropout(f(x, *args)))
        return x


class TransformerLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size must be set (from the data's vocabulary) before building the model")
        self.cfg = cfg
        self.mem_layers = resolve_memory_layers(cfg)
        logger.info("memories at layers %s (%s), of %d layers", self.mem_layers, cfg.mem_mode, cfg.n_layers)
        D, mcfg = cfg.dim, cfg.memory
        self.tok_emb = nn.Embedding(cfg.vocab_size, D)
        self.pos_emb = nn.Embedding(cfg.max_len, D)
        for emb in (self.tok_emb, self.pos_emb):
            nn.init.normal_(emb.weight, mean=0.0, std=D**-0.5)
        self.emb_norm = nn.Identity() if cfg.pre_norm else nn.LayerNorm(D)
        self.dropout = nn.Dropout(cfg.dropout)

        shared = value_table(mcfg.n_keys**2, D) if mcfg.share_values and self.mem_layers else None
        blocks = []
        for layer in range(1, cfg.n_layers + 1):
            sublayers = [SelfAttention(D, cfg.n_heads, cfg.attention_dropout)]
            if layer not in self.mem_layers or cfg.mem_mode == "add":
                sublayers.append(FeedForward(D, cfg.ffn_dim or 4 * D))
            if layer in self.mem_layers:
                sublayers.append(ProductKeyMemory.from_config(mcfg, D, D, values=shared))
            blocks.append(Block(sublayers, D, cfg.dropout, cfg.pre_norm))
        self.blocks = nn.ModuleList(blocks)
        self.final_norm = nn.LayerNorm(D) if cfg.pre_norm else nn.Identity()

    def forward(self, tokens: torch.Tensor, pad_mask: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """tokens: (B, T) int64; pad_mask: (B, T) bool, True at padding (optional) -> logits (B, T, vocab).
        With a cache (new_cache()), tokens follow those fed before: positions start at cache.length."""
        start, T = (cache.length if cache is not None else 0), tokens.shape[1]
        if start + T > self.cfg.max_len:
            raise ValueError(f"sequence length {start + T} exceeds model.max_len={self.cfg.max_len}")
        positions = torch.arange(start, start + T, device=tokens.device)
        x = self.dropout(self.emb_norm(self.tok_emb(tokens) + self.pos_emb(positions)))  # (B, T, D)
        for i, block in enumerate(self.blocks):
            x = block(x, pad_mask, None if cache is None else cache.layers[i])
        return F.linear(self.final_norm(x), self.tok_emb.weight)  # (B, T, vocab), tied output

    def new_cache(self) -> KVCache:
        """An empty key/value cache for incremental decoding (use in eval mode)."""
        return KVCache(len(self.blocks))

    def memories(self) -> list[tuple[int, ProductKeyMemory]]:
        """[(1-indexed layer, memory)] in layer order."""
        return [(layer, f) for layer, block in enumerate(self.blocks, 1)
                for f in block.sublayers if isinstance(f, ProductKeyMemory)]

    def memory_value_parameters(self) -> list[nn.Parameter]:
        """The value tables' parameters, each once (also when shared); every other parameter is dense."""
        unique = {id(m.values.weight): m.values.weight for _, m in self.memories()}
        return list(unique.values())

    def set_sparse_values(self, flag: bool) -> None:
        """Value tables get sparse gradients (one row per slot read) when True."""
        for _, m in self.memories():
            m.sparse = flag

    def param_counts(self) -> dict[str, int]:
        total = sum(p.numel() for p in self.parameters())
        values = sum(p.numel() for p in self.memory_value_parameters())
        return {"total": total, "dense": total - values, "memory_values": values}

    def dense_flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward; forward alone is 1/3 of it):

            6 · (dense params − position embeddings)    matmuls; the tied token embedding counts once,
                                                         as the output projection; memory keys count
                                                         as the search (one multiply-add per key weight)
          + 6 · Σ_memories heads · knn · dim             the weighted value reads
          + 12 · n_layers · seq_len · dim                attention scores and mixing (PaLM's convention,
                                                         full, not causally halved, T × T)
        """
        params = self.param_counts()["dense"] - self.pos_emb.weight.numel()
        reads = sum(m.heads * m.knn * m.output_dim for _, m in self.memories())
        return 6.0 * (params + reads) + 12.0 * self.cfg.n_layers * seq_len * self.cfg.dim

    def set_memory_stats(self, enabled: bool) -> None:
        """Turn per-slot statistics of every memory on (from zero) or off (kept for reading); eval mode only."""
        for _, m in self.memories():
            m.track_stats = enabled
            if enabled:
                m.reset_stats()


if __name__ == "__main__":
    for n_layers in (6, 12, 16, 24):
        print(f"L={n_layers:2d}: " + "  ".join(f"N={n}: {memory_layers(n_layers, n)}" for n in range(4)))
