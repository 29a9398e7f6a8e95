"""Product Key Memory (Lample et al. 2019, §3): a sparse layer with a very large hidden state.

    memory = ProductKeyMemory(512, 512, n_keys=512, k_dim=512, heads=4, knn=32)
    y = memory(x)                         # (..., 512) -> (..., 512), like nn.Linear
    scores, indices = memory.search(q)    # the knn best of the n_keys² product keys, per head

The algorithm, per token x and per head h (heads are summed, and share one value table):
    q = norm(query_net(x))_h                           (k_dim,)    the head's query
    s1 = q[:k_dim/2] · C_h,  s2 = q[k_dim/2:] · C'_h    (n_keys,)   scores against both sub-key sets
    top-knn of s1 (i's) and of s2 (j's)                 (knn,)      each
    s1_i + s2_j for the knn×knn pairs, top-knn of them  (knn,)      = the exact top-knn of all
                                                                      n_keys² keys (c_i, c'_j)
    w = softmax(scores), slot = i·n_keys + j
    m_h(x) = Σ w · values[slot]                          (output_dim,) via EmbeddingBag or a fused
                                                                      Triton kernel (value_read.py), so no
                                                                      (tokens, heads·knn, output_dim) tensor
Search, softmax and value read run in float32, also under autocast.

Options beyond the paper, all off by default:
  - key_type="flat": |K| full keys searched exhaustively (the paper's Table 4 baseline).
  - query_norm: "batchnorm" (paper, §4.5) | "layernorm" | "none". BatchNorm in training mode
    computes its statistics over all positions of the batch, so in a causal LM a position's query
    depends (weakly) on other positions, future ones included; in eval mode it uses running
    statistics and is causal. "layernorm" (per head) is causal in both modes. Padding is excluded
    from the BatchNorm statistics when `pad_mask` is given.
  - gated: output gating out = W_o(silu(W_g x) ⊙ read), the Memory+ layer of Berges et al. 2024
    ("Memory Layers at Scale").
  - qk_norm: L2-normalise each half-query and each sub-key (flat: each query and key) before
    scoring (query-key normalisation, cf. Berges et al. 2024); pair with temperature < 1.
  - temperature: softmax(scores / temperature); 1 is the paper.
  - values: pass an existing value table to share it between memory layers (Berges et al. 2024
    share one memory pool across layers).
  - sparse: the value table's gradient is a sparse tensor with one row per distinct slot read in the
    step (value_read.py), for the lazy Adam of xlm_pkm/optim.py: the step cost does not grow with
    the table.
  - value_read: "auto" (fused Triton kernels on CUDA, EmbeddingBag on CPU) | "torch" | "triton".

Evaluation statistics: set `memory.track_stats = True`; in eval mode every forward accumulates the
per-slot weight and hit count (see memory_stats.py); `memory.stats()` summarises them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xlm_pkm.config import MemoryConfig
from xlm_pkm.model.memory_stats import SlotStats
from xlm_pkm.model.value_read import check_backend, read_values
from xlm_pkm.precision import at_least_float32


def value_table(n_slots: int, output_dim: int) -> nn.EmbeddingBag:
    """The (n_slots, output_dim) values, read as weighted sums; init N(0, 1/output_dim)."""
    values = nn.EmbeddingBag(n_slots, output_dim, mode="sum")
    nn.init.normal_(values.weight, mean=0.0, std=output_dim**-0.5)
    values.weight.is_memory_value = True  # lets an optimizer find the value parameters
    return values


class MaskedBatchNorm1d(nn.BatchNorm1d):
    """BatchNorm1d over (N, C) whose training statistics come only from the rows where `keep` is True."""

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        if keep is None or not self.training:
            return super().forward(x)
        w = keep.to(x.dtype).unsqueeze(1)  # (N, 1)
        n = w.sum().clamp(min=1)
        mean = (x * w).sum(0) / n  # (C,)
        var = ((x - mean) ** 2 * w).sum(0) / n  # (C,) biased, as BatchNorm normalises with
        with torch.no_grad():  # running statistics as nn.BatchNorm1d: momentum, unbiased variance
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * n / (n - 1).clamp(min=1), self.momentum)
            self.num_batches_tracked += 1
        return (x - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias


class ProductKeyMemory(nn.Module):
    """(..., input_dim) -> (..., output_dim) through n_keys² memory slots; see the module docstring."""

    def __init__(
        self,
        input_dim: int,
        output_dim: int,
        n_keys: int = 512,
        k_dim: int = 512,
        heads: int = 4,
        knn: int = 32,
        key_type: str = "product",
        query_norm: str = "batchnorm",
        query_hidden: list[int] = (),
        input_dropout: float = 0.0,
        query_dropout: float = 0.0,
        value_dropout: float = 0.0,
        gated: bool = False,
        qk_norm: bool = False,
        temperature: float = 1.0,
        sparse: bool = False,
        value_read: str = "auto",
        values: nn.EmbeddingBag | None = None,
    ):
        super().__init__()
        if key_type not in ("product", "flat"):
            raise ValueError(f"memory key_type must be product or flat, got {key_type!r}")
        if query_norm not in ("batchnorm", "layernorm", "none"):
            raise ValueError(f"memory query_norm must be batchnorm, layernorm or none, got {query_norm!r}")
        check_backend(value_read)
        if k_dim % 2 or knn > (n_keys if key_type == "product" else n_keys**2) or temperature <= 0:
            raise ValueError(f"memory needs an even k_dim, knn <= n_keys and temperature > 0 "
                             f"(k_dim={k_dim}, knn={knn}, n_keys={n_keys}, temperature={temperature})")
        self.input_dim, self.output_dim = input_dim, output_dim
        self.n_keys, self.n_slots, self.k_dim, self.heads, self.knn = n_keys, n_keys**2, k_dim, heads, knn
        self.key_type, self.qk_norm, self.temperature = key_type, qk_norm, temperature

        # query network: input_dim -> hidden... -> heads * k_dim, then the query norm
        sizes = [input_dim, *query_hidden, heads * k_dim]
        layers = []
        for i, (d_in, d_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers += [nn.Linear(d_in, d_out)] + ([nn.ReLU()] if i < len(sizes) - 2 else [])
        self.query_net = nn.Sequential(*layers)
        if query_norm == "batchnorm":
            self.query_norm = MaskedBatchNorm1d(heads * k_dim)  # over all heads' channels, as XLM
        else:
            self.query_norm = nn.LayerNorm(k_dim) if query_norm == "layernorm" else None  # per head

        # keys: per head, two sets of n_keys sub-keys of k_dim/2 (product) or n_keys² full keys (flat)
        shape = (heads, 2, n_keys, k_dim // 2) if key_type == "product" else (heads, n_keys**2, k_dim)
        self.keys = nn.Parameter(torch.empty(shape))
        bound = shape[-1] ** -0.5
        nn.init.uniform_(self.keys, -bound, bound)

        self.values = values if values is not None else value_table(self.n_slots, output_dim)
        self.sparse = sparse
        self.value_read = value_read
        if self.values.weight.shape != (self.n_slots, output_dim):
            raise ValueError(f"shared values have shape {tuple(self.values.weight.shape)}, "
                             f"this memory needs ({self.n_slots}, {output_dim})")
        if gated:
            self.gate = nn.Linear(input_dim, output_dim, bias=False)
            self.out_proj = nn.Linear(output_dim, output_dim, bias=False)
        self.gated = gated
        self.input_dropout = nn.Dropout(input_dropout)
        self.query_dropout = nn.Dropout(query_dropout)
        self.value_dropout = nn.Dropout(value_dropout)

        self.track_stats = False
        self.slot_stats = SlotStats(self.n_slots)

    @classmethod
    def from_config(cls, cfg: MemoryConfig, input_dim: int, output_dim: int, values=None) -> ProductKeyMemory:
        return cls(input_dim, output_dim, n_keys=cfg.n_keys, k_dim=cfg.k_dim, heads=cfg.heads, knn=cfg.knn,
                   key_type=cfg.key_type, query_norm=cfg.query_norm, query_hidden=cfg.query_hidden,
                   input_dropout=cfg.input_dropout, query_dropout=cfg.query_dropout,
                   value_dropout=cfg.value_dropout, gated=cfg.gated, qk_norm=cfg.qk_norm,
                   temperature=cfg.temperature, value_read=cfg.value_read,
                   values=values)

    def forward(self, x: torch.Tensor, pad_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x: (..., input_dim); pad_mask: (...) bool, True at padding (excluded from statistics)."""
        lead = x.shape[:-1]
        x = self.input_dropout(x.reshape(-1, self.input_dim))  # (N, input_dim)
        keep = None if pad_mask is None else ~pad_mask.reshape(-1)  # (N,)
        N, H, K = x.shape[0], self.heads, self.knn
        q = self.query_net(x)  # (N, H * k_dim), in the autocast dtype if any
        with torch.autocast(x.device.type, enabled=False):
            q = self.query_dropout(self.normalize_queries(at_least_float32(q), keep))  # (N, H, k_dim)
            scores, indices = self.search(q)  # (N, H, K) each
            weights = F.softmax(scores / self.temperature, dim=-1)  # (N, H, K), float32 at least
            if self.track_stats and not self.training:
                self.slot_stats.add(indices, weights, keep)
            table = self.values.weight
            out = read_values(table, indices.view(N, H * K), weights.view(N, H * K), self.sparse, self.value_read)
        out = self.value_dropout(out)  # (N, output_dim), heads summed by the bag
        if self.gated:
            out = self.out_proj(F.silu(self.gate(x)) * out)
        return out.view(*lead, self.output_dim)

    def normalize_queries(self, q: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """q: (N, H * k_dim) -> (N, H, k_dim) after the query norm (BatchNorm over all heads' channels,
        LayerNorm per head)."""
        if isinstance(self.query_norm, MaskedBatchNorm1d):
            q = self.query_norm(q, keep)
        q = q.view(-1, self.heads, self.k_dim)  # (N, H, k_dim)
        return self.query_norm(q) if isinstance(self.query_norm, nn.LayerNorm) else q

    def search(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: (N, heads, k_dim) -> (scores, indices), each (N, heads, knn), scores descending.

        The exact knn best of all n_keys² keys by inner product; slot = i * n_keys + j with i a
        sub-key of the first half and j of the second.
        """
        q, keys = at_least_float32(q), at_least_float32(self.keys)
        if self.key_type == "flat":
            if self.qk_norm:
                q, keys = F.normalize(q, dim=-1), F.normalize(keys, dim=-1)
            return torch.einsum("nhd,hsd->nhs", q, keys).topk(self.knn, dim=-1)  # from (N, H, n_slots)
        N, H, K = q.shape[0], self.heads, self.knn
        q = q.view(N, H, 2, self.k_dim // 2)  # (N, H, 2, k_dim/2): the two sub-queries
        if self.qk_norm:
            q, keys = F.normalize(q, dim=-1), F.normalize(keys, dim=-1)
        half_scores, half_indices = torch.einsum("nhpd,hpsd->nhps", q, keys).topk(K, dim=-1)  # (N, H, 2, K)
        pair_scores = half_scores[:, :, 0, :, None] + half_scores[:, :, 1, None, :]  # (N, H, K, K)
        scores, best = pair_scores.view(N, H, K * K).topk(K, dim=-1)  # (N, H, K)
        i = half_indices[:, :, 0].gather(-1, best // K)  # (N, H, K) first-half sub-key of each pick
        j = half_indices[:, :, 1].gather(-1, best % K)  # (N, H, K) second-half sub-key
        return scores, i * self.n_keys + j

    def reset_stats(self) -> None:
        self.slot_stats.reset()

    def stats(self) -> dict[str, float]:
        """usage (%), kl (nats), usage_count, kl_count, slots_50/90/99 of the reads since reset_stats()."""
        return self.slot_stats.summary()

    def slot_weights(self) -> torch.Tensor:
        """(n_slots,) float64 summed weight of every slot since reset_stats() (zeros before any read)."""
        if self.slot_stats.weights is None:
            return torch.zeros(self.n_slots, dtype=torch.float64, device=self.values.weight.device)
        return self.slot_stats.weights

    def extra_repr(self) -> str:
        return (f"{self.input_dim} -> {self.output_dim}, slots={self.n_keys}^2, keys={self.key_type}, "
                f"k_dim={self.k_dim}, heads={self.heads}, knn={self.knn}")
