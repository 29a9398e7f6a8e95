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

Family all_attention (cfg.family; Sukhbaatar et al. 2019), for the all_attention / span_attention
sublayers: no absolute positions (one relative table shared by those sublayers) and no max_len,
N(0, 1) token embeddings without a norm, an output Linear with bias or, with cfg.adaptive_cutoffs,
the tied adaptive input/softmax (adaptive_io.py); cfg.dropout on the embeddings and the last
hidden state only. The all-attention network is sublayers [all_attention] (post-norm
x = LN(x + AllAttn(x)), no FFN); the adaptive-span transformer is [span_attention, ffn]. Those
sublayers keep a cache of their stream between forwards, so consecutive blocks of the same B
streams continue each other:

    loss = model(x, targets=y).mean() + model.aux_loss()   # span and memory loss terms, training only
    loss.backward(); optimizer.step(); model.clamp_spans()
    state = model.stream_state()           # save with the data position; reset_stream_state() for
    model.load_stream_state(state)         # new streams; model.eval() starts evaluation streams afresh

Engram (cfg.engram.layers; model/memory/engram.py): a sublayer first in each of those layers, reading
rows of hashed N-grams that `ngram_hash` computes once per forward from the token ids, for every Engram
layer (in decoding the cache keeps the N-1 tokens before); set_token_compression stores the vocabulary's
canonical ids in the model.

Memory placement (`memory_layers`): with L layers and N memories, the top memory sits at
T = L - floor(L/4), leaving a quarter of the layers above it to process what was read (Table 3:
best at an intermediate layer, worst right before the softmax), and the others evenly below it:
layer_i = floor(i·T/N + 1/2), i = 1..N. L=16,N=2 -> [6, 12]; L=6,N=1 -> [5]; L=12,N=1 -> [9];
L=24,N=3 -> [6, 12, 18]. `python -m xlm_pkm.model.transformer` prints the rule for the paper's sizes.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from xlm_pkm.model.adaptive_io import AdaptiveEmbedding, AdaptiveLogSoftmax
from xlm_pkm.model.adaptive_span import AdaptiveSpan
from xlm_pkm.model.attention import KVCache
from xlm_pkm.model.blocks import SUBLAYERS, Block, shared_state
from xlm_pkm.model.memory.engram import Engram
from xlm_pkm.model.memory.pkm import ProductKeyMemory
from xlm_pkm.model.memory.value_stores import is_memory_value
from xlm_pkm.model.memory_host import MemoryHost
from xlm_pkm.model.model_settings import ModelConfig
from xlm_pkm.model.stream_attention import StreamAttention

logger = logging.getLogger(__name__)


def model_config_digest(model: dict) -> str:
    """sha256 of a ModelConfig as a dict of JSON values (a stored config's `model` section): recorded with an
    exported folder's weights, so that a loader tells an edited architecture from the one they were trained with."""
    return hashlib.sha256(json.dumps(model, sort_keys=True).encode()).hexdigest()


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
    memory (mem_mode replace), or the memory comes last (add, or no "ffn" to replace); an Engram layer
    (model.engram.layers) starts with "engram", before the attention, as the Engram paper places it."""
    names = (["engram"] if layer in cfg.engram.layers else []) + list(cfg.sublayers)
    if layer in mem_layers:
        if cfg.mem_mode == "replace" and "ffn" in names:
            names[names.index("ffn")] = "memory"
        else:
            names.append("memory")
    return names


class TransformerLM(MemoryHost, nn.Module):
    def __init__(self, cfg: ModelConfig, built: Callable[[int, Block], Block] | None = None):
        """The model of `cfg`, its weights drawn in the order of its parts. `built(index, block)`, when given,
        takes each block as soon as its weights are drawn and returns the block to keep: runtime/fsdp.py takes a
        rank's shards of it and keeps an empty copy, so that the whole model is never held at once."""
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size must be set (from the data's vocabulary) before building the model")
        self.cfg = cfg
        self.mem_layers = resolve_memory_layers(cfg)
        logger.info("memories at layers %s (%s), of %d layers", self.mem_layers, cfg.mem_mode, cfg.n_layers)
        D, V, xlm = cfg.dim, cfg.vocab_size, cfg.family == "transformer"
        if cfg.adaptive_cutoffs:
            self.tok_emb = AdaptiveEmbedding(V, D, cfg.adaptive_cutoffs, cfg.adaptive_factor)
            self.output = AdaptiveLogSoftmax(self.tok_emb)  # tied to the adaptive input
        else:
            self.tok_emb = nn.Embedding(V, D)
            self.output = None if xlm else nn.Linear(D, V)  # None: tied to tok_emb
        self.pos_emb = nn.Embedding(cfg.max_len, D) if xlm else None
        if xlm:
            for emb in (self.tok_emb, self.pos_emb):
                nn.init.normal_(emb.weight, mean=0.0, std=D**-0.5)
        self.emb_norm = nn.LayerNorm(D) if xlm and not cfg.pre_norm else nn.Identity()
        self.dropout = nn.Dropout(cfg.dropout)

        self.plan = [layer_sublayers(cfg, self.mem_layers, layer) for layer in range(1, cfg.n_layers + 1)]
        shared = shared_state(cfg, self.plan)
        self.ngram_hash = shared.get("ngram_hash")  # Engram's rows of every layer, once per forward
        residual_dropout = cfg.dropout if xlm else 0.0
        self.blocks = nn.ModuleList()
        for layer, names in enumerate(self.plan, 1):
            shared["layer"] = layer
            block = Block([SUBLAYERS[name](cfg, shared) for name in names], D, residual_dropout, cfg.pre_norm)
            self.blocks.append(block if built is None else built(layer - 1, block))
        self.final_norm = nn.LayerNorm(D) if cfg.pre_norm else nn.Identity()

    def hidden(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """tokens (B, T) int64 -> the last hidden states (B, T, D), before the output layer."""
        T = tokens.shape[1]
        start = cache.offset if cache is not None else 0
        x = self.tok_emb(tokens)  # (B, T, D)
        if self.pos_emb is not None:
            if start + T > self.cfg.max_len:
                raise ValueError(f"sequence length {start + T} exceeds model.max_len={self.cfg.max_len}")
            x = self.emb_norm(x + self.pos_emb(torch.arange(start, start + T, device=tokens.device)))
        x = self.dropout(x)
        rows = self.ngram_hash(tokens, cache) if self.ngram_hash is not None else None  # (B, T, engrams, (N-1)·K)
        engram_layers = self.cfg.engram.layers
        for layer, block in enumerate(self.blocks, 1):
            x = block(x, cache, rows[:, :, engram_layers.index(layer)] if layer in engram_layers else None)
        if cache is not None:
            cache.offset += T
        x = self.final_norm(x)
        return x if self.pos_emb is not None else self.dropout(x)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None,
                targets: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: (B, T) int64 -> logits (B, T, vocab) (with adaptive_cutoffs: log-probabilities, which
        are logits too); with targets (B, T): the float32 negative log-likelihood of each target
        (B, T) instead, without building the (B, T, vocab) log-probabilities of an adaptive softmax.
        With a cache (new_cache()), tokens are the T positions after the cache.offset ones already fed,
        and the cache is extended by them. All-attention sublayers also carry their stream cache from
        one forward to the next (stream_state())."""
        h = self.hidden(tokens, cache)  # (B, T, D)
        if targets is not None and isinstance(self.output, AdaptiveLogSoftmax):
            return self.output(h.flatten(0, 1), targets.flatten()).view(targets.shape)
        if self.output is None:
            logits = F.linear(h, self.tok_emb.weight)  # (B, T, vocab), tied output
        elif isinstance(self.output, AdaptiveLogSoftmax):
            logits = self.output.log_prob(h.flatten(0, 1)).view(*h.shape[:2], -1)
        else:
            logits = self.output(h)
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none").view(targets.shape)

    def stream_layers(self) -> list[StreamAttention]:
        """The sublayers that carry a stream cache (all_attention, span_attention), in layer order."""
        return [f for block in self.blocks for f in block.sublayers if isinstance(f, StreamAttention)]

    def stream_state(self) -> list[torch.Tensor | None]:
        """Each stream layer's cache (B, C, D) for the current mode's streams (training or evaluation:
        model.eval() starts evaluation streams afresh, model.train() returns to the training ones),
        detached; None before the first block. Save the training one with the data position to resume
        exactly."""
        return [f.past for f in self.stream_layers()]

    def load_stream_state(self, state: list[torch.Tensor | None]) -> None:
        layers = self.stream_layers()
        if len(state) != len(layers):
            raise ValueError(f"stream state has {len(state)} caches, the model has {len(layers)} stream layers")
        for f, past in zip(layers, state):
            f.past = None if past is None else past.to(next(self.parameters()).device)

    def reset_stream_state(self, training: bool | None = None) -> None:
        """New streams, in training or evaluation (default: both): every stream layer starts again from
        a zero cache."""
        for f in self.stream_layers():
            f.reset(training)

    def spans(self) -> list[AdaptiveSpan]:
        """The adaptive spans of the stream layers, in layer order."""
        return [f.attention.span for f in self.stream_layers() if f.attention.span is not None]

    def span_loss(self) -> torch.Tensor:
        """Σ_layers coeff · S · mean z: add to the training loss (not to evaluation's)."""
        return sum((span.span_loss() for span in self.spans()), torch.zeros((), device=next(self.parameters()).device))

    def has_aux_loss(self) -> bool:
        """Whether training adds aux_loss(): adaptive spans, or a memory whose key search has a loss term."""
        return bool(self.spans()) or any(hasattr(m.keys, "aux_loss") for _, m in self.memories())

    def aux_loss(self) -> torch.Tensor:
        """The training-only loss terms: span_loss() and every memory's aux_loss() (UltraMem's core loss)."""
        terms = [m.aux_loss() for _, m in self.memories()]
        return sum((t for t in terms if t is not None), self.span_loss())

    def clamp_spans(self) -> None:
        """Keep every span ratio in [0, 1]: call after each optimizer update."""
        for span in self.spans():
            span.clamp_()

    def new_cache(self) -> KVCache:
        """An empty key/value cache for forward(tokens, cache): generating n tokens costs n one-token forwards."""
        return KVCache()

    def memories(self) -> list[tuple[int, ProductKeyMemory]]:
        return [(layer, f) for layer, block in enumerate(self.blocks, 1)
                for f in block.sublayers if isinstance(f, ProductKeyMemory)]

    def engrams(self) -> list[tuple[int, Engram]]:
        return [(layer, f) for layer, block in enumerate(self.blocks, 1)
                for f in block.sublayers if isinstance(f, Engram)]

    def param_counts(self) -> dict[str, int]:
        """total = dense + memory_values; then the dense parameters of each sublayer type (summed over
        layers, a shared one such as the relative position table counted once, at its first user;
        norms and embeddings in none of them). Sharded value tables count whole (all ranks' columns)."""
        values = self.memory_value_count()
        dense = sum(p.numel() for p in self.parameters() if not is_memory_value(p))
        counts = {"total": dense + values, "dense": dense, "memory_values": values}
        seen: set[int] = set()
        for names, block in zip(self.plan, self.blocks):
            for name, f in zip(names, block.sublayers):
                params = [p for p in f.parameters() if not is_memory_value(p) and id(p) not in seen]
                seen.update(id(p) for p in params)
                counts[name] = counts.get(name, 0) + sum(p.numel() for p in params)
        return counts

    def dense_flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward; forward alone is 1/3 of it): each block's
        sublayers report theirs (blocks.py: 6 per dense weight, attention's 12 · seq_len · dim, the
        memories' search and value reads, the stream attentions' at their current span), plus 6 per
        weight of the norms and the output projection (the tied token embedding counted once, as the
        output; the adaptive softmax counted whole, an upper bound). Embeddings are lookups: not counted.
        """
        output = self.tok_emb if self.output is None else self.output
        outside = sum(p.numel() for m in (output, self.emb_norm, self.final_norm) for p in m.parameters())
        return 6.0 * outside + sum(block.flops_per_token(seq_len) for block in self.blocks)


if __name__ == "__main__":
    for n_layers in (6, 12, 16, 24):
        print(f"L={n_layers:2d}: " + "  ".join(f"N={n}: {memory_layers(n_layers, n)}" for n in range(4)))
