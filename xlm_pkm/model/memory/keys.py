"""Key searches of a Product Key Memory: which slots (value rows) a query reads.

A key search is an nn.Module holding every head's keys, built from a MemoryConfig:

    keys = KEY_SEARCHES[cfg.key_type](cfg)
    keys.n_slots                           how many slots the keys address (the value table's rows)
    scores, indices = keys.search(q)       q: (N, heads, k_dim) -> (N, heads, knn) each: the knn best
                                           slots by inner product, scores descending, float32 at least
    keys.full_keys()                       (heads, n_slots, k_dim): every slot's whole key, for the
                                           tests' brute-force reference (search never forms it)

share_keys: every head searches the same keys (one (1, ...) parameter broadcast over the heads; PEER's
"different heads share the same pool of experts with the same set of product keys", He 2024 §2); the
heads still differ by their queries.

qk_norm: queries and keys are L2-normalised before scoring (product keys: each half-query and each
sub-key), so every score is a sum of cosines; pair it with a softmax temperature < 1.

qk_layernorm: queries and keys go through a LayerNorm before scoring, each piece a search scores on its own
(product and tucker keys: each half-query and each sub-key; flat: the whole query and key), one learned gain
for every query piece and one for every key, init (width)^-0.33, no bias: UltraMem's query/key LayerNorm
(Huang et al. 2025, Table 2 "+query/key LN"; their released code's LayerNorms and gains, the bias left out as
in the OLMoE configuration it builds on). For a piece v of width d:

    LN(v) = g ⊙ (v - mean(v)) / sqrt(var(v) + 1e-5)            var: the biased variance over the d entries

pair_candidates (product keys): the pairs of the two halves' knn best sub-keys scored to find the knn best
slots: "all" knn² of them, or "winnable" only those that can be among the knn best (below): the same scores.

score_precision (product keys' half scores, flat keys' scores; tucker scores in float32): the products that
choose the keys in float32, TF32 (on CUDA) or bfloat16, the chosen keys' scores then computed again in float32
(selected_scores.py); selection_differences(keys, q) says how often the choice differs from float32's.

half_topk (product keys): each half's knn best sub-keys by torch.topk, or by a Triton selection kernel
(triton_topk.py): the same scores; auto, the default, takes the kernel for queries on CUDA where Triton is installed.

A new key structure is one class here, registered under its name (the value of model.memory.key_type),
and an entry in tests/test_memory.py's brute-force cases.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from xlm_pkm.model.memory.dtypes import at_least_float32
from xlm_pkm.model.memory.memory_settings import KEY_SEARCHES, MemoryConfig
from xlm_pkm.model.memory.selected_scores import register_row_topk, register_tf32_scores, top_scores
from xlm_pkm.model.memory.value_read import triton_installed


def uniform_keys(*shape: int) -> nn.Parameter:
    """Keys of `shape`, uniform in ±1/sqrt(last dimension) (XLM's init)."""
    keys = nn.Parameter(torch.empty(shape))
    bound = shape[-1] ** -0.5
    nn.init.uniform_(keys, -bound, bound)
    return keys


def _layer_norm(v: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """LN(v) over the last dimension with the gain `gain` (width,), no bias, in v's dtype."""
    return F.layer_norm(v, gain.shape, gain.to(v.dtype), eps=1e-5)


class KeySearch(nn.Module, ABC):
    """The interface; subclasses hold their keys and check their own constraints on cfg."""

    shares_keys = False  # whether the class implements cfg.share_keys
    pieces = 1  # the query's pieces scored each against its own keys (product and tucker keys: the two halves)

    def __init__(self, cfg: MemoryConfig):
        super().__init__()
        if cfg.share_keys and not self.shares_keys:
            raise ValueError(f"memory.share_keys is not available with key_type={cfg.key_type} (product, flat)")
        if cfg.qk_norm and cfg.qk_layernorm:
            raise ValueError("memory.qk_norm and memory.qk_layernorm both normalise the queries and keys: set one")
        self.heads, self.k_dim, self.knn, self.qk_norm = cfg.heads, cfg.k_dim, cfg.knn, cfg.qk_norm
        self.n_slots = self.slots(cfg)
        if not 1 <= cfg.knn <= self.max_knn(cfg):
            raise ValueError(f"memory.knn={cfg.knn} must be in [1, {self.max_knn(cfg)}] for "
                             f"key_type={cfg.key_type} with n_keys={cfg.n_keys}")
        self.score_precision = cfg.score_precision  # of the products that choose the keys (product, flat)
        if cfg.score_precision == "tf32":
            register_tf32_scores()
        self.qk_layernorm = cfg.qk_layernorm
        if cfg.qk_layernorm:  # the LayerNorms' gains, (width,) each
            width = cfg.k_dim // self.pieces
            self.query_gain = nn.Parameter(torch.full((width,), width**-0.33))
            self.key_gain = nn.Parameter(torch.full((width,), width**-0.33))

    def normalize(self, q: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Query and key pieces (..., width) as they are scored: L2-normalised (qk_norm), LayerNormed
        (qk_layernorm), or unchanged."""
        if self.qk_norm:
            return F.normalize(q, dim=-1), F.normalize(keys, dim=-1)
        if self.qk_layernorm:
            return _layer_norm(q, self.query_gain), _layer_norm(keys, self.key_gain)
        return q, keys

    def extra_repr(self) -> str:
        return (f"heads={self.heads}, slots={self.n_slots}, k_dim={self.k_dim}, knn={self.knn}, qk_norm={self.qk_norm}"
                + (", qk_layernorm=True" if self.qk_layernorm else ""))

    @classmethod
    @abstractmethod
    def slots(cls, cfg: MemoryConfig) -> int:
        """The number of slots `cfg` gives, without building the keys (sizes a shared value table)."""

    @classmethod
    def max_knn(cls, cfg: MemoryConfig) -> int:
        return cls.slots(cfg)

    @abstractmethod
    def search(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: (N, heads, k_dim) -> (scores, indices), each (N, heads, knn), scores descending."""

    @abstractmethod
    def full_keys(self) -> torch.Tensor:
        """(heads, n_slots, k_dim): slot s's key; without qk_norm and qk_layernorm its score is
        q · full_keys()[h, s]."""


@KEY_SEARCHES.register("product")
class ProductKeys(KeySearch):
    """Per head two sets of n_keys sub-keys of k_dim/2 (paper §3.2); slot i·n_keys + j has the key
    [c_i, c'_j]. The exact top-knn of the n_keys² keys from 2·n_keys + knn² scores:

        s1 = q[:k_dim/2] · C,  s2 = q[k_dim/2:] · C'      (n_keys,) each
        top-knn of s1 (i's) and of s2 (j's)               (knn,) each
        s1_i + s2_j for the knn × knn pairs, top-knn     (knn,): no better pair can be outside them

    pair_candidates=winnable scores only the pairs of ranks (a, b) (0-based, in the two descending lists) with
    (a+1)(b+1) <= knn (119 of 1,024 at knn = 32): the (a+1)(b+1) - 1 pairs of ranks (<= a, <= b) score at
    least as high, so a pair beyond that bound has knn better or equal ones among the winnable (each rectangle
    of ranks larger than knn holds knn winnable pairs) and the knn best scores are the same.
    """

    shares_keys = True
    pieces = 2

    def __init__(self, cfg: MemoryConfig):
        if cfg.k_dim % 2:
            raise ValueError(f"memory.k_dim={cfg.k_dim} must be even for key_type=product (two halves)")
        super().__init__(cfg)
        self.n_keys = cfg.n_keys
        # (H or 1, 2, n_keys, k_dim/2)
        self.weight = uniform_keys(1 if cfg.share_keys else cfg.heads, 2, cfg.n_keys, cfg.k_dim // 2)
        self.half_topk = cfg.half_topk  # what selects each half's knn best: torch | triton | auto (by device)
        if cfg.half_topk == "triton" or cfg.half_topk == "auto" and triton_installed():
            register_row_topk()  # before any compiled forward looks the op up
        # (2, P): the ranks (a, b) of the pairs scored, or None: every one of the knn² (pair_candidates=all)
        self.register_buffer("pair_ranks", winnable_pairs(cfg.knn) if cfg.pair_candidates == "winnable" else None,
                             persistent=False)

    @classmethod
    def slots(cls, cfg: MemoryConfig) -> int:
        return cfg.n_keys**2

    @classmethod
    def max_knn(cls, cfg: MemoryConfig) -> int:
        return cfg.n_keys  # knn best of each half

    def search(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, keys = at_least_float32(q), at_least_float32(self.weight)
        N, H, K = q.shape[0], self.heads, self.knn
        q, keys = self.normalize(q.view(N, H, 2, self.k_dim // 2), keys)  # (N, H, 2, k_dim/2): the two sub-queries
        keys = keys.expand(H, *keys.shape[1:]).reshape(2 * H, self.n_keys, -1)  # (H·2, n_keys, k_dim/2)
        select = self.half_topk
        if select == "auto":  # the kernel for CUDA queries (2.1x torch.topk's speed on an H200), torch.topk elsewhere
            select = "triton" if q.is_cuda and triton_installed() else "torch"
        half_scores, half_indices = top_scores(q.reshape(N, 2 * H, -1), keys, K, self.score_precision,
                                               select)  # (N, H·2, K) each
        half_scores, half_indices = half_scores.view(N, H, 2, K), half_indices.view(N, H, 2, K)  # each descending
        if self.pair_ranks is None:  # every pair (a, b), as a·K + b
            pair_scores = half_scores[:, :, 0, :, None] + half_scores[:, :, 1, None, :]  # (N, H, K, K)
            scores, best = pair_scores.view(N, H, K * K).topk(K, dim=-1)  # (N, H, K)
            a, b = best // K, best % K  # (N, H, K) each: the picks' ranks in the two halves
        else:  # the winnable pairs only
            first, second = self.pair_ranks  # (P,) each
            scores, best = (half_scores[:, :, 0, first] + half_scores[:, :, 1, second]).topk(K, dim=-1)  # (N, H, K)
            a, b = first[best], second[best]
        i = half_indices[:, :, 0].gather(-1, a)  # (N, H, K) first-half sub-key of each pick
        j = half_indices[:, :, 1].gather(-1, b)  # (N, H, K) second-half sub-key
        return scores, i * self.n_keys + j

    def full_keys(self) -> torch.Tensor:
        n, weight = self.n_keys, self.weight.expand(self.heads, *self.weight.shape[1:])
        first = weight[:, 0].repeat_interleave(n, dim=1)  # (H, n², k_dim/2): c_i of slot i·n + j
        second = weight[:, 1].repeat(1, n, 1)  # (H, n², k_dim/2): c'_j
        return torch.cat([first, second], dim=-1)


@KEY_SEARCHES.register("flat")
class FlatKeys(KeySearch):
    """Per head n_keys² full keys of k_dim, searched exhaustively (the paper's Table 4 baseline)."""

    shares_keys = True

    def __init__(self, cfg: MemoryConfig):
        super().__init__(cfg)
        # (H or 1, n_slots, k_dim)
        self.weight = uniform_keys(1 if cfg.share_keys else cfg.heads, self.n_slots, cfg.k_dim)

    @classmethod
    def slots(cls, cfg: MemoryConfig) -> int:
        return cfg.n_keys**2

    def search(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, keys = self.normalize(at_least_float32(q), at_least_float32(self.weight))
        keys = keys.expand(self.heads, *keys.shape[1:])  # (H, n_slots, k_dim)
        return top_scores(q, keys, self.knn, self.score_precision)

    def full_keys(self) -> torch.Tensor:
        return self.weight.expand(self.heads, *self.weight.shape[1:])


def winnable_pairs(knn: int) -> torch.Tensor:
    """(2, P): the ranks (a, b) of the pairs that can be among the knn best of two descending lists of knn,
    (a+1)(b+1) <= knn, in row-major order (P = Σ_r floor(knn / r))."""
    pairs = [(a, b) for a in range(knn) for b in range(knn // (a + 1))]  # no data-dependent op: meta devices too
    return torch.tensor(pairs).T.contiguous()


def selection_differences(search: KeySearch, q: torch.Tensor) -> float:
    """The share of the slots search.search(q) chooses that the same search scoring in float32 does not
    choose, over q's (N, heads) lookups: how often search.score_precision changes the choice."""
    precision = search.score_precision
    with torch.no_grad():
        _, chosen = search.search(q)  # (N, H, K)
        search.score_precision = "float32"
        try:
            _, exact = search.search(q)
        finally:
            search.score_precision = precision
    return 1 - (chosen[..., :, None] == exact[..., None, :]).any(-1).double().mean().item()
