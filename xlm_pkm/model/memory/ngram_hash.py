"""Engram's multi-head N-gram hashing (DeepSeek-AI 2026, arXiv 2601.07372, §2.2, Eq. 1-2), computed once per
batch for every Engram layer of a model, from the token ids alone.

    hash = NgramHash(cfg.engram, vocab_size)      # cfg: ModelConfig
    hash.set_compression(compress_vocabulary(dictionary.words))   # token_compression.py; stored with the model
    rows = hash(tokens)                           # (B, T) -> (B, T, layers, (N-1)·K) rows of each layer's table
    rows = hash(tokens, cache)                    # incremental decoding: the N-1 tokens before come from the cache

With x'_t the canonical id of token t (token_compression.py) and, for the Engram layer l, odd multipliers
m_0..m_{N-1}, the N-gram of order n ending at t goes to row z of head k's table (the reference code's
multiplicative-XOR hash, engram_demo_v1.py; the paper names it only):

    mix_{t,n} = (x'_t · m_0) XOR (x'_{t-1} · m_1) XOR ... XOR (x'_{t-n+1} · m_{n-1})
    z_{t,n,k} = mix_{t,n} mod p_{n,k}                 rows of layer l's table: z + offset_{n,k}

* Multipliers: m_j = 2 r_j + 1, r = numpy.random.default_rng(seed + 10007 · (l - 1)).integers(0, B, N) with
  B = max(1, ⌊⌊(2^63 - 1) / V'⌋ / 2⌋), V' the canonical vocabulary size; so x' · m < 2^63: no product
  overflows int64. They depend on V', so set_compression recomputes them.
* Table sizes: p_{n,k} are the next primes above table_size / K - 1, distinct across every head, order and
  layer of the model (searched layer by layer, order by order, head by head, as the reference does).
  Each layer's (N-1)·K tables are one table of Σ p rows (offsets: prefix sums).
* Padding: a position before the window, or before the start of its token's document, takes the canonical id
  of <pad> (the reference pads the sequence start with its pad token; a new document is a new sequence here).
  A document starts at a <s> (our data: data/dictionary.py), or, for a tokenizer's data (a retrofit:
  data/tokenized.py), right after the end-of-text token that closes the one before. The window is the batch's
  T tokens, or in decoding the cache's last N-1 tokens and the new.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from xlm_pkm.model.memory.memory_settings import EngramConfig

BOS, PAD = 0, 2  # data/dictionary.py: <s> starts every document; <pad>
MULTIPLIER_LAYER_PRIME = 10007  # the reference's per-layer seed step


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (exact for n < 3.3e24)."""
    if n < 2:
        return False
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    if n in bases:
        return True
    if any(n % p == 0 for p in bases):
        return False
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in bases:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def table_primes(cfg: EngramConfig) -> list[list[list[int]]]:
    """[layer][order - 2][head] -> p, the table size of each hash head (module docstring)."""
    seen: set[int] = set()
    out = []
    for _ in cfg.layers:
        orders = []
        for _ in range(2, cfg.max_ngram + 1):
            heads, candidate = [], cfg.table_size // cfg.heads - 1
            for _ in range(cfg.heads):
                candidate += 1
                while not is_prime(candidate) or candidate in seen:
                    candidate += 1
                seen.add(candidate)
                heads.append(candidate)
            orders.append(heads)
        out.append(orders)
    return out


def hash_multipliers(cfg: EngramConfig, canonical_size: int) -> list[list[int]]:
    """[layer][j] -> m_j, the odd multiplier of the token j positions back (module docstring)."""
    bound = max(1, (np.iinfo(np.int64).max // canonical_size) // 2)
    return [(np.random.default_rng(cfg.seed + MULTIPLIER_LAYER_PRIME * (layer - 1))
             .integers(0, bound, size=cfg.max_ngram, dtype=np.int64) * 2 + 1).tolist() for layer in cfg.layers]


class NgramHash(nn.Module):
    """The rows every Engram layer reads, from the token ids (module docstring). Buffers, saved with the
    model: canonical (V,) the compression, multipliers (L, N), primes (L, N-1, K), offsets (L, (N-1)·K)."""

    def __init__(self, cfg: EngramConfig, vocab_size: int, document_start: int | None = BOS,
                 document_end: int | None = None, pad: int = PAD):
        """The documents of the token stream start at `document_start` and after `document_end` (either None:
        not that rule); a position outside its token's document reads as `pad`."""
        super().__init__()
        self.cfg = cfg
        self.document_start, self.document_end, self.pad = document_start, document_end, pad
        self.sizes = table_primes(cfg)  # as Python ints: known also on the meta device
        primes = torch.tensor(self.sizes, dtype=torch.int64)  # (L, N-1, K)
        flat = primes.flatten(1)  # (L, (N-1)·K): order-major, as the rows are concatenated
        self.register_buffer("canonical", torch.arange(vocab_size))  # identity until set_compression
        self.register_buffer("multipliers", torch.tensor(hash_multipliers(cfg, vocab_size), dtype=torch.int64))
        self.register_buffer("primes", primes)
        self.register_buffer("offsets", flat.cumsum(1) - flat)

    def layer_rows(self, index: int) -> int:
        """The rows of Engram layer `index` (0-based among cfg.layers): Σ of its primes."""
        return sum(map(sum, self.sizes[index]))

    def set_compression(self, canonical: list[int]) -> None:
        """The canonical id of each token (token_compression.compress_vocabulary), and the multipliers it implies."""
        if len(canonical) != self.canonical.numel():
            raise ValueError(f"the compression maps {len(canonical)} tokens, the model's vocabulary has "
                             f"{self.canonical.numel()}")
        self.canonical.copy_(torch.tensor(canonical))
        self.multipliers.copy_(torch.tensor(hash_multipliers(self.cfg, max(canonical) + 1)))

    def forward(self, tokens: torch.Tensor, cache=None) -> torch.Tensor:
        """tokens (B, T) int64 -> rows (B, T, L, (N-1)·K) int64 of each Engram layer's table; with a
        cache (attention.Windows: a KVCache, or a retrofit's windows), the window starts with the N-1 tokens fed
        before (padding at first)."""
        B, T = tokens.shape
        N = self.cfg.max_ngram
        past = tokens.new_full((B, N - 1), self.pad)
        window = torch.cat([past, tokens], 1) if cache is None else cache.window(self, tokens, past)  # (B, N-1+T)
        starts = torch.zeros_like(window, dtype=torch.bool) if self.document_start is None \
            else window == self.document_start  # (B, N-1+T): a document starts there
        if self.document_end is not None:
            starts[:, 1:] |= window[:, :-1] == self.document_end
        documents = starts.cumsum(1)  # (B, N-1+T): documents begun up to each position
        pad = self.canonical[self.pad]
        back = [torch.where(documents[:, N - 1 - j: N - 1 - j + T] == documents[:, N - 1:],
                            self.canonical[window[:, N - 1 - j: N - 1 - j + T]], pad)
                for j in range(N)]  # x'_{t-j}, (B, T) each: pad before the window or the document
        products = torch.stack(back)[None] * self.multipliers[:, :, None, None]  # (L, N, B, T)
        mix, rows = products[:, 0], []
        for n in range(2, N + 1):
            mix = mix ^ products[:, n - 1]  # (L, B, T): the order-n mix extends the order n-1 one
            rows.append(mix[..., None] % self.primes[:, n - 2, None, None, :])  # (L, B, T, K)
        return (torch.cat(rows, -1) + self.offsets[:, None, None, :]).permute(1, 2, 0, 3)  # (B, T, L, (N-1)·K)
