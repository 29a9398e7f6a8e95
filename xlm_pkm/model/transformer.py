"""TransformerLM: a causal decoder-only LM (paper §4.3) whose FFN is replaced by, or followed by, a
Product Key Memory in some layers.

    model = TransformerLM(cfg.model)       # cfg.model.vocab_size set from the data
    logits = model(tokens)                 # (B, T) int64 -> (B, T, vocab)
    cache = model.new_cache()              # incremental decoding (eval mode): feed the prompt, then
    logits = model(tokens, cache)          # one token at a time; each forward sees what came before

Each layer is a Block of sublayers (blocks.py), chosen by name (blocks.SUBLAYERS): cfg.sublayers
(["attention", "ffn"] by default), in a memory layer with the FFN replaced by the memory
(mem_mode "replace") or followed by it ("add"). Every sublayer has its own LayerNorm and residual:
post-norm (XLM) x = LN(x + drop(f(x))), pre-norm x = x + drop(f(LN(x))). Post-norm also normalises
the embeddings (XLM's layer_norm_emb); pre-norm ends with a final LayerNorm.

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
from xlm_pkm.model.attention import KVCache
from xlm_pkm.model.blocks import SUBLAYERS, Block, shared_state
from xlm_pkm.model.memory import ProductKeyMemory

logger = logging.getLogger(__name__)


def memory_layers(n_layers: int, n_memories: int) -> list[int]:
    """The 1-indexed layers holding the memories: the top one at T = L - L//4, the rest evenly below."""
    top = n_layers - n_layers // 4
    if not 0 <= n_memories <= top:
        raise ValueError(f"model.n_memories must be in [0, {top}] for {n_layers} layers, got {n_memories}")
    return [(2 * i * top + n_memories) // (2 * n_memories) for i in range(1, n_memories + 1)]


def resolve_memory_layers(cfg: ModelConfig) -> list[int]:
    """cfg.mem_layers when given (validated), else memory_layers(cfg.n_layers, cfg.n_memories)."""
    if not cfg.mem_layers:
        return memory_layers(cfg.n_layers, cfg.n_memories)
    bad = [layer for layer in cfg.mem_layers if not 1 <= layer <= cfg.n_layers]
    if bad or len(set(cfg.mem_layers)) != len(cfg.mem_layers):
        raise ValueError(f"model.mem_layers must be distinct layers in [1, {cfg.n_layers}], got {cfg.mem_layers}")
    return sorted(cfg.mem_layers)


def layer_sublayers(cfg: ModelConfig, mem_layers: list[int], layer: int) -> list[str]:
    """The sublayer names of 1-indexed `layer`: cfg.sublayers, where a memory layer's "ffn" becomes the
    memory (mem_mode replace), or the memory comes last (add, or no "ffn" to replace)."""
    names = list(cfg.sublayers)
    if layer in mem_layers:
        if cfg.mem_mode == "replace" and "ffn" in names:
            names[names.index("ffn")] = "memory"
        else:
            names.append("memory")
    return names


class TransformerLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size must be set (from the data's vocabulary) before building the model")
        self.cfg = cfg
        self.mem_layers = resolve_memory_layers(cfg)
        logger.info("memories at layers %s (%s), of %d layers", self.mem_layers, cfg.mem_mode, cfg.n_layers)
        D = cfg.dim
        self.tok_emb = nn.Embedding(cfg.vocab_size, D)
        self.pos_emb = nn.Embedding(cfg.max_len, D)
        for emb in (self.tok_emb, self.pos_emb):
            nn.init.normal_(emb.weight, mean=0.0, std=D**-0.5)
        self.emb_norm = nn.Identity() if cfg.pre_norm else nn.LayerNorm(D)
        self.dropout = nn.Dropout(cfg.dropout)

        self.plan = [layer_sublayers(cfg, self.mem_layers, layer) for layer in range(1, cfg.n_layers + 1)]
        shared = shared_state(cfg, self.plan)
        self.blocks = nn.ModuleList(Block([SUBLAYERS[name](cfg, layer, shared) for name in names], D, cfg.dropout,
                                          cfg.pre_norm) for layer, names in enumerate(self.plan, 1))
        self.final_norm = nn.LayerNorm(D) if cfg.pre_norm else nn.Identity()

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """tokens: (B, T) int64 -> logits (B, T, vocab). With a cache (new_cache()), tokens are the T
        positions after the cache.offset ones already fed, and the cache is extended by them."""
        T = tokens.shape[1]
        start = cache.offset if cache is not None else 0
        if start + T > self.cfg.max_len:
            raise ValueError(f"sequence length {start + T} exceeds model.max_len={self.cfg.max_len}")
        positions = torch.arange(start, start + T, device=tokens.device)
        x = self.dropout(self.emb_norm(self.tok_emb(tokens) + self.pos_emb(positions)))  # (B, T, D)
        for block in self.blocks:
            x = block(x, cache)
        if cache is not None:
            cache.offset += T
        return F.linear(self.final_norm(x), self.tok_emb.weight)  # (B, T, vocab), tied output

    def new_cache(self) -> KVCache:
        """An empty key/value cache for forward(tokens, cache): generating n tokens costs n one-token forwards."""
        return KVCache()

    def memories(self) -> list[tuple[int, ProductKeyMemory]]:
        """[(1-indexed layer, memory)] in layer order."""
        return [(layer, f) for layer, block in enumerate(self.blocks, 1)
                for f in block.sublayers if isinstance(f, ProductKeyMemory)]

    def memory_value_parameters(self) -> list[nn.Parameter]:
        """The value tables' parameters (marked is_memory_value), each once (also when shared); every other
        parameter is dense."""
        return [p for p in self.parameters() if getattr(p, "is_memory_value", False)]

    def set_sparse_values(self, flag: bool) -> None:
        """Sparse value-table gradients (one row per slot read; for LazyAdam) in every memory, or dense."""
        for _, m in self.memories():
            m.sparse_values = flag

    def param_counts(self) -> dict[str, int]:
        """total = dense + memory_values; then the dense parameters of each sublayer type (summed over
        layers; norms and embeddings in none of them)."""
        total = sum(p.numel() for p in self.parameters())
        values = sum(p.numel() for p in self.memory_value_parameters())
        counts = {"total": total, "dense": total - values, "memory_values": values}
        for names, block in zip(self.plan, self.blocks):
            for name, f in zip(names, block.sublayers):
                dense = sum(p.numel() for p in f.parameters() if not getattr(p, "is_memory_value", False))
                counts[name] = counts.get(name, 0) + dense
        return counts

    def dense_flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward; forward alone is 1/3 of it): each block's
        sublayers report theirs (blocks.py: 6 per dense weight, attention's 12 · seq_len · dim, the
        memories' search and value reads), plus 6 per weight of the norms and the token embedding
        (counted once, as the tied output projection). Position embeddings are a lookup: not counted.
        """
        outside = sum(p.numel() for m in (self.tok_emb, self.emb_norm, self.final_norm) for p in m.parameters())
        return 6.0 * outside + sum(block.flops_per_token(seq_len) for block in self.blocks)

    def set_memory_stats(self, enabled: bool) -> None:
        """Turn per-slot statistics of every memory on (from zero) or off (kept for reading); eval mode only."""
        for _, m in self.memories():
            m.track_stats = enabled
            if enabled:
                m.reset_stats()


if __name__ == "__main__":
    for n_layers in (6, 12, 16, 24):
        print(f"L={n_layers:2d}: " + "  ".join(f"N={n}: {memory_layers(n_layers, n)}" for n in range(4)))
