"""Engram (DeepSeek-AI 2026, *Conditional Memory via Scalable Lookup*, arXiv 2601.07372): token-addressed
memory. Where a product-key memory chooses its slots from the hidden state, an Engram layer reads rows
chosen by the last N tokens (ngram_hash.py), known before the forward pass.

    engram = Engram(cfg.engram, dim, rows)      # rows: NgramHash.layer_rows(i)
    y = engram(h, ngram_rows)                   # h (B, T, dim); ngram_rows (B, T, (N-1)·K) -> (B, T, dim)
    y = engram(h, ngram_rows, cache)            # incremental decoding: the convolution's past from the cache

§2.2-2.3, with e_t the concatenation of the (N-1)·K rows read (Eq. 2) and d = dim:

    k_t = W_K e_t,   v_t = W_V e_t                                                      (Eq. 3)
    α_t = σ(s'),  s' = sign(s) · sqrt(max(|s|, 1e-6)),  s = RMSNorm(h_t)ᵀ RMSNorm(k_t) / √d  (Eq. 4)
    ṽ_t = α_t · v_t
    Y = SiLU(Conv1D(RMSNorm(Ṽ))) + Ṽ                                                     (Eq. 5)

The signed square root before the sigmoid is the reference code's (engram_demo_v1.py), not written in
Eq. 4. Conv1D is causal and depthwise, kernel cfg.kernel_size, dilation N (the largest order), without
bias, zero-initialised so that Y = Ṽ at the start of training (§4.1). W_K and W_V have biases, as the
reference's. The block adds Y to the residual stream (blocks.Block), before the layer's attention, as the
reference places it. The paper's multi-branch integration with mHC (§2.4) is out of scope: this model
has one residual stream.

The table is read by row: marked is_memory_value (value_stores.py), so its gradient is row-sparse when
the values optimizer wants it (`sparse`), and it also carries `engram_table`: the optimizers give it its
own group (optim.engram_lr_scale, the paper's 5x lr and no weight decay, §4.1). Rows are N(0, 1), as
the reference's nn.Embedding. With table_dtype=bfloat16 the table is stored in bfloat16 (drawn in float32, rounded
to nearest), read in float32 with a float32 gradient (value_read.read_values: one lookup a bag), and its optimizer
rounds its row updates stochastically (optim/stochastic_rounding.py), as the memory's value tables do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xlm_pkm.model.memory.memory_settings import EngramConfig
from xlm_pkm.model.memory.stats import SlotStats
from xlm_pkm.model.memory.value_read import read_values
from xlm_pkm.model.memory.value_stores import mark_memory_value


class Engram(nn.Module):
    uses_cache = True  # Block passes the model's KVCache (the convolution's past inputs)
    uses_ngrams = True  # and this layer's table rows (NgramHash, computed once for every layer)

    def __init__(self, cfg: EngramConfig, dim: int, rows: int):
        super().__init__()
        orders = cfg.max_ngram - 1
        self.dim, self.dilation, self.kernel_size = dim, cfg.max_ngram, cfg.kernel_size
        table = torch.randn(rows, cfg.ngram_dim // cfg.heads).to(getattr(torch, cfg.table_dtype))
        self.table = mark_memory_value(nn.Parameter(table))
        self.table.engram_table = True
        if cfg.table_dtype != "float32":
            self.table.grad_dtype = torch.float32  # its gradient rows, summed in float32, stay float32
        self.key = nn.Linear(orders * cfg.ngram_dim, dim)
        self.value = nn.Linear(orders * cfg.ngram_dim, dim)
        self.norm_h, self.norm_k, self.norm_v = nn.RMSNorm(dim), nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.conv = nn.Parameter(torch.zeros(dim, 1, cfg.kernel_size))  # depthwise (dim, 1, kernel)
        self.sparse = False
        self.track_stats = False
        self.slot_stats = SlotStats(rows)  # rows read (evaluation usage)

    def forward(self, h: torch.Tensor, rows: torch.Tensor, cache=None) -> torch.Tensor:
        """h (B, T, dim), rows (B, T, (N-1)·K) -> Y (B, T, dim)."""
        B, T, D = h.shape
        if self.track_stats and not self.training:
            self.slot_stats.add(rows.reshape(-1, 1), torch.ones(rows.numel(), 1, device=rows.device))
        e = self.read(rows).flatten(2)  # (B, T, (N-1)·ngram_dim)
        s = (self.norm_h(h) * self.norm_k(self.key(e))).sum(-1, keepdim=True) / D**0.5  # (B, T, 1)
        alpha = torch.sigmoid(s.abs().clamp_min(1e-6).sqrt() * s.sign())
        v = alpha * self.value(e)  # (B, T, D): Ṽ
        reach = (self.kernel_size - 1) * self.dilation  # past positions the convolution sees
        past = v.new_zeros(B, reach, D)  # causal zero padding before the window
        normed = self.norm_v(v)
        window = torch.cat([past, normed], 1) if cache is None else cache.window(self, normed, past)  # (B, reach+T, D)
        conv = F.conv1d(window.transpose(1, 2), self.conv, groups=D, dilation=self.dilation)  # (B, D, T)
        return F.silu(conv.transpose(1, 2)) + v

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (B, T, R) -> their table rows (B, T, R, width), float32 (a bfloat16 table's read in float32, its
        gradient float32: value_read.read_values, each lookup a bag of weight 1)."""
        if self.table.dtype == torch.float32:
            return F.embedding(rows, self.table, sparse=self.sparse)
        lookups = rows.reshape(-1, 1)  # (B·T·R, 1)
        ones = torch.ones(lookups.shape, device=rows.device)
        return read_values(self.table, lookups, ones, self.sparse).view(*rows.shape, -1)

    def reset_stats(self) -> None:
        self.slot_stats.reset()

    def flops_per_token(self, seq_len: int) -> float:
        """6 per weight of the projections, norms and convolution; the table lookup is not counted."""
        return 6.0 * sum(p.numel() for p in self.parameters() if p is not self.table)
