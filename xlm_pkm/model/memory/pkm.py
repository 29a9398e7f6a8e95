"""Product Key Memory (Lample et al. 2019, §3): a sparse layer with a very large hidden state.

    memory = ProductKeyMemory(512, 512, n_keys=512, k_dim=512, heads=4, knn=32)   # or (512, 512, cfg)
    y = memory(x)                          # (..., 512) -> (..., 512), like nn.Linear
    weights, indices = memory.lookup(x)    # (..., heads, knn) each: the slots x reads, their weights
    scores, indices = memory.search(q)     # q: (N, heads, k_dim) -> the knn best slots per head

The algorithm, per token x and per head h (heads are summed, and share one value store):
    q = norm(query_net(x))_h                           (k_dim,)    the head's query
    s1 = q[:k_dim/2] · C_h,  s2 = q[k_dim/2:] · C'_h    (n_keys,)   scores against both sub-key sets
    top-knn of s1 (i's) and of s2 (j's)                 (knn,)      each
    s1_i + s2_j for the knn×knn pairs, top-knn of them  (knn,)      = the exact top-knn of all
                                                                      n_keys² keys (c_i, c'_j)
    w = softmax(scores), slot = i·n_keys + j
    m_h(x) = Σ w · values[slot]                          (output_dim,) via EmbeddingBag or a fused
                                                                      Triton kernel (value_read.py), so no
                                                                      (tokens, heads·knn, output_dim) tensor
Three parts are chosen by name, so that the variants of the design are this same layer:
  - the key search (lines 2-4; memory.key_type, keys.py): product keys as above, flat keys (an
    exhaustive search, the paper's Table 4 baseline), UltraMem's Tucker-decomposed search;
  - the score function (memory.score, scores.py): softmax (the paper), relu (Csordás et al. 2023),
    identity (UltraMem);
  - the value store (memory.values, value_stores.py): one table (the paper), PEER's single-neuron
    experts (peer.py), UltraMem's expanded values.
Search, score function and value read run in float32, also under autocast. A key search may add a
training loss term (`aux_loss()`, UltraMem's on its core): the model sums them (TransformerLM.aux_loss).

Every setting is a field of MemoryConfig (memory_settings.py: model.memory in a run's config; the variants' own
in their sections there: PeerConfig, TuckerConfig, ExpandedConfig), checked by the layer (settings.check); keyword
arguments override the fields of `cfg` (default MemoryConfig()). This module imports every part and variant, so
that their registrations are made (into memory_settings.py's registries). Beyond it:
  - shared_values: an existing value store to share between memory layers (Berges et al. 2024 share one
    memory pool across layers).
  - sparse_values (attribute, default False): the value tables' gradients are sparse tensors with one
    row per distinct slot read in the step (value_read.py), for optimizers on row-sparse gradients
    (LazyAdam): the step cost does not grow with the table. TransformerLM.set_sparse_values sets it.
  - cfg.shard_values=true: the table holds this rank's columns of every row (value_shards.py), and forward
    exchanges lookups and output slices with the other ranks (sharded_read.py); every rank must call it
    together. Its default, auto, reads as false here until a run resolves it (train/build.py).
  - The value-read backend (cfg.value_read) is resolved for the table's device when the layer is
    built or moved (`_apply`), into `read_backend`; forward only reads it.
  - query_norm="batchnorm" in training mode computes its statistics over all positions of the
    batch, so in a causal LM a position's query depends (weakly) on other positions, future ones
    included; in eval mode it uses running statistics and is causal. "layernorm" is causal in both.

Evaluation statistics: set `memory.track_stats = True`; in eval mode every forward accumulates the
per-slot weight and hit count and the outputs' norms (see stats.py); `memory.stats()` summarises the reads,
`memory.norm_sums()` the scale of the values, projections and outputs.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from xlm_pkm.model.memory.dtypes import at_least_float32
from xlm_pkm.model.memory.keys import KEY_SEARCHES
from xlm_pkm.model.memory.memory_settings import MemoryConfig
from xlm_pkm.model.memory.peer import PeerExperts  # noqa: F401 (registers the value store peer)
from xlm_pkm.model.memory.scores import SCORE_FUNCTIONS
from xlm_pkm.model.memory.stats import OutputNorms, SlotStats, abs_sum
from xlm_pkm.model.memory.ultramem import TuckerKeys  # noqa: F401 (registers key_type tucker, values expanded)
from xlm_pkm.model.memory.value_read import choose_backend, resolve_backend
from xlm_pkm.model.memory.value_stores import VALUE_STORES, ValueStore
from xlm_pkm.settings import check


class ProductKeyMemory(nn.Module):
    """(..., input_dim) -> (..., output_dim) through the key search's slots; see the module docstring."""

    def __init__(self, input_dim: int, output_dim: int, cfg: MemoryConfig | None = None, *,
                 shared_values: ValueStore | None = None, **fields):
        super().__init__()
        self.cfg = cfg = check(dataclasses.replace(cfg or MemoryConfig(), **fields), "model.memory.")
        self.input_dim, self.output_dim, self.heads, self.knn = input_dim, output_dim, cfg.heads, cfg.knn
        self.register_module("keys", None)  # first in the parameter order as before; built after the query net

        # query network: input_dim -> query_hidden... -> heads * k_dim, then the query norm
        sizes = [input_dim, *cfg.query_hidden, cfg.heads * cfg.k_dim]
        layers = []
        for i, (d_in, d_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers += [nn.Linear(d_in, d_out)] + ([nn.ReLU()] if i < len(sizes) - 2 else [])
        self.query_net = nn.Sequential(*layers)
        if cfg.query_norm == "batchnorm":
            self.query_norm = nn.BatchNorm1d(cfg.heads * cfg.k_dim)  # over all heads' channels, as XLM
        else:
            self.query_norm = nn.LayerNorm(cfg.k_dim) if cfg.query_norm == "layernorm" else None  # per head

        self.keys = KEY_SEARCHES[cfg.key_type](cfg)
        self.n_slots = self.keys.n_slots
        self.score = SCORE_FUNCTIONS[cfg.score]
        values = shared_values or VALUE_STORES[cfg.values](cfg, input_dim, output_dim, self.n_slots)
        values.check(self.n_slots, output_dim)
        self.values = values
        if cfg.gated:
            self.gate = nn.Linear(input_dim, output_dim, bias=False)
            self.out_proj = nn.Linear(output_dim, output_dim, bias=False)
        self.input_dropout = nn.Dropout(cfg.input_dropout)
        self.query_dropout = nn.Dropout(cfg.query_dropout)
        self.value_dropout = nn.Dropout(cfg.value_dropout)

        self.sparse_values = False
        self.track_stats = False
        self.slot_stats = SlotStats(self.n_slots)  # evaluation's reads, while track_stats
        self.output_norms = OutputNorms()  # evaluation's output norms, while track_stats
        self.step_reads: SlotStats | None = None  # training's reads, when set (memory_finetune.py)
        self.read_backend = choose_backend(cfg.value_read, self.device, cfg.read_backward)

    @property
    def device(self) -> torch.device:
        return self.query_net[0].weight.device

    def _apply(self, fn, recurse=True):
        """.to(), .cuda(), .double()...: the value-read backend is chosen again for the new device."""
        super()._apply(fn, recurse)
        self.read_backend = choose_backend(self.cfg.value_read, self.device, self.cfg.read_backward)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., input_dim) -> (..., output_dim)."""
        lead = x.shape[:-1]
        x = self.input_dropout(x.reshape(-1, self.input_dim))  # (N, input_dim)
        weights, indices = self.lookup(x)  # (N, H, K[, cores]), (N, H, K); float32 at least
        backend = self.read_backend or resolve_backend(  # None: why
            self.cfg.value_read, self.device, self.cfg.read_backward)
        with torch.autocast(x.device.type, enabled=False):
            reads = self.step_reads if self.training else self.slot_stats if self.track_stats else None
            if reads is not None:
                reads.add(indices, weights if weights.dim() == 3 else weights.abs().sum(-1))
            out = self.values(x, indices, weights, self.sparse_values, backend)  # (N, output_dim), heads summed
        out = self.value_dropout(out)
        if self.cfg.gated:  # Memory+: out = W_o(silu(W_g x) ⊙ read)
            out = self.out_proj(F.silu(self.gate(x)) * out)
        if self.track_stats and not self.training:
            self.output_norms.add(out)
        return out.view(*lead, self.output_dim)

    def lookup(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (..., input_dim) -> (weights, indices), each (..., heads, knn): the slots x reads and their
        weights (the score function's, float32 at least; weights (..., heads, knn, cores) for a search
        that scores with several cores). forward reads through this (after its input dropout)."""
        lead = x.shape[:-1]
        q = self.query_net(x.reshape(-1, self.input_dim))  # (N, H * k_dim), in the autocast dtype if any
        with torch.autocast(x.device.type, enabled=False):
            q = self.query_dropout(self.normalize_queries(at_least_float32(q)))  # (N, H, k_dim)
            scores, indices = self.search(q)  # (N, H, K[, cores]), (N, H, K)
            weights = self.score(scores, self.cfg.temperature)  # like scores
        return weights.view(*lead, *weights.shape[1:]), indices.view(*lead, self.heads, self.knn)

    def normalize_queries(self, q: torch.Tensor) -> torch.Tensor:
        """q: (N, H * k_dim) -> (N, H, k_dim) after the query norm (BatchNorm over all heads' channels,
        LayerNorm per head)."""
        if isinstance(self.query_norm, nn.BatchNorm1d):
            q = self.query_norm(q)
        q = q.view(-1, self.heads, self.cfg.k_dim)  # (N, H, k_dim)
        return self.query_norm(q) if isinstance(self.query_norm, nn.LayerNorm) else q

    def search(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: (N, heads, k_dim) -> (scores, indices), each (N, heads, knn), scores descending: the knn
        best slots of each head (keys.py; product keys: slot = i * n_keys + j)."""
        return self.keys.search(q)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token: 6 per dense weight (the keys count as the
        search, one multiply-add per key weight), and the value store's (table: 6 per value element
        read, heads · knn · output_dim)."""
        store = {id(p) for p in self.values.parameters()}
        dense = sum(p.numel() for p in self.parameters() if id(p) not in store)
        return 6.0 * dense + self.values.flops_per_token(self.heads, self.knn)

    def aux_loss(self) -> torch.Tensor | None:
        """The key search's training loss term (UltraMem's on its core), or None."""
        aux = getattr(self.keys, "aux_loss", None)
        return aux() if aux is not None else None

    def reset_stats(self) -> None:
        self.slot_stats.reset()
        self.output_norms.reset()

    def stats(self) -> dict[str, float]:
        """usage (%), kl (nats), usage_count, kl_count, slots_50/90/99 of the reads since reset_stats()."""
        return self.slot_stats.summary()

    def norm_sums(self) -> dict[str, torch.Tensor]:
        """The scale of the memory's weights and outputs (stats.py), each a (2,) float64 (sum, count) whose ratio
        is the mean: value_abs_mean, |w| over the value store's tables; proj_abs_mean, over its projections
        (UltraMem's, when it has some); out_norm, ‖m(x)‖₂ over the outputs since reset_stats() (when any)."""
        sums = {"value_abs_mean": abs_sum(self.values.tables())}
        if self.values.projections():
            sums["proj_abs_mean"] = abs_sum(self.values.projections())
        if self.output_norms.sums is not None:
            sums["out_norm"] = self.output_norms.sums
        return sums

    def slot_weights(self) -> torch.Tensor:
        """(n_slots,) float64 summed weight of every slot since reset_stats() (zeros before any read)."""
        if self.slot_stats.weights is None:
            return torch.zeros(self.n_slots, dtype=torch.float64, device=self.device)
        return self.slot_stats.weights

    def extra_repr(self) -> str:
        c = self.cfg
        return (f"{self.input_dim} -> {self.output_dim}, slots={self.n_slots}, keys={c.key_type}, "
                f"k_dim={c.k_dim}, heads={c.heads}, knn={c.knn}, score={c.score}, values={c.values}")
