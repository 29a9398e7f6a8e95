"""UltraMem (Huang et al., ICLR 2025, "Ultra-Sparse Memory Network", arXiv 2411.12364): a key search and a
value store for the memory layer of pkm.py.

    cfg = MemoryConfig(n_keys=1024, k_dim=256, heads=2, knn=32, key_type="tucker", tucker=TuckerConfig(cores=2),
                       values="expanded", expanded=ExpandedConfig(expansion=4, value_dim=256), score="identity")
    memory = ProductKeyMemory(512, 512, cfg)      # 1024² virtual values over 512² physical ones
    loss = lm_loss + memory.aux_loss()            # the core's loss (TransformerLM.aux_loss sums them)

Per token and memory head (heads share the values; their outputs are summed), with q_row, q_col the two
halves of the head's query, K_row, K_col its n_keys sub-keys of r components each, C^(1..h) its cores:

TDQKR, Tucker Decomposed Query-Key Retrieval (§3, Eq. 4-10):
    S_row = K_row q_row,  S_col = K_col q_col                        (r, n_keys) each: one score per component
    S_grid = S_rowᵀ C S_col                                          (n_keys, n_keys): slot i·n_keys + j
    C = Σ_c C^(c) ≈ σ₁ u tᵀ   (u, t: C's leading singular vectors)    the rank-1 approximation
    rows I = top-m of uᵀ S_row, columns J = top-m of tᵀ S_col         (m,) each
    S_grid[i, j] = S_row[:, i]ᵀ C S_col[:, j] for (i, j) ∈ I × J,    the exact scores of the m² candidates;
    its top-knn are the slots read                                    m = n_keys: the exact top-knn of all
    memory.tucker.both_signs (not the paper's): also the bottom-m of uᵀ S_row and tᵀ S_col and their m² pairs,
    as two negatives make a high σ₁ a_i b_j too; the paper's top-m never reaches those slots, about half of
    the exact top-knn for queries of symmetric distribution (benchmarks/ultramem_topm.py)
MCS, Multi-Core Scoring (Eq. 16-17): the slots are chosen by S_grid of the summed core, each core c keeps its
    own score s^(c) = S_rowᵀ C^(c) S_col, the scores are (N, heads, knn, cores)
score function (memory.score): UltraMem removes the softmax (Table 2 "+rm softmax"): the weights are the raw
    scores (identity; their code applies no activation)
IVE, Implicit Value Expansion (Eq. 13-15), the "expanded" store: n_slots virtual values over P = n_slots / E
    physical ones V (P, D_v); virtual slot v is physical row π(v) mod P of block p = π(v) div P (π a fixed
    random permutation, the paper's shuffle), Ṽ_p = V W_p with W_p (D_v, output_dim); with the cores, V's
    columns are split in h pieces V^(c) read with their own core's scores:
        o = Σ_p W_pᵀ [Σ_{v ∈ p} s^(1)_v V^(1)[π(v)]; ...; Σ_{v ∈ p} s^(h)_v V^(h)[π(v)]]   pool, then project
aux loss on the core (Eq. 11-12), per head, averaged over the heads:
    C = U Λ Tᵀ,   L_aux = α/(r-1) Σ_{i=2..r} max(0, λ_i - τ)²        α = 0.001, τ = 0.15 (Table 5)
query/key LayerNorm (Table 2 "+query/key LN"): memory.qk_layernorm, each half-query and each key component
    LayerNormed before scoring (keys.py)
value lr decay (Table 2 "+value lr decay": 10x, decaying to 1x): optim.values_lr_decay_steps, with
    optim.values_lr_decay_base the lr it multiplies (optim/schedule.py values_lr)

Where the paper is silent or ambiguous, chosen here (their released code, ZihaoHuang-notabot/
Ultra-Sparse-Memory-Network olmo/ultramem_layer.py, decides where it speaks):
  - the components: each sub-key has r vectors of k_dim/2 against the whole half-query (their code's keys
    (heads, 2, n_keys, k_dim, r)), not the half-query cut in r pieces.
  - the rank-1 approximation is of the summed core (their code), computed without gradient (it only chooses
    the candidates); u and t are defined up to one common sign, which decides which end of uᵀS_row and
    tᵀS_col is kept: the sign making u's and t's sums non-negative (their code keeps the previous step's sign;
    a core with positive entries, as initialised, has positive singular vectors).
  - the aux loss is on the summed core, its mean over heads (their code); multi-core selection is by the summed
    scores (Eq. 16), the returned per-core scores sum to them, descending.
  - m (memory.tucker.topm, 0: knn): their code keeps knn rows and columns; m must be in [knn, n_keys].
  - init of the expanded store (memory.expanded.init): "released", their code's (UltraMemLayerV1.reset_parameters):
    physical values N(0, 0.02²), projections N(0, 1/(E·D_v)) (theirs is one Linear from the E pooled blocks,
    E·D_v inputs); "fan_in" (the default, the init before this key): both N(0, 1/D_v), each virtual value
    V[i] W_p then N(0, ~1/D_v), close to the table store's N(0, 1/output_dim). Sub-keys uniform ±1/sqrt(k_dim/2)
    (keys.py's, XLM; theirs N(0, 1/(k_dim/2)), √3 times wider), cores uniform in [0, 1) (their code).
    The paper differs: its "improved init" (Table 2, a row after MCS; Appendix A) sets the values' variance from
    the model, E/(2·m·H·L) (m values read per head, H heads, L layers: the memory's output then has an FFN's
    variance at init), and the query and key LayerNorm gains so that the selected scores average about 1 (from
    a Monte Carlo estimate of the mean of the top-m of normal scores). It is not implemented: the released code
    uses neither (0.02, and gains (k_dim/2)^-0.33), and the appendix was read here only through summaries of it.
  - query/key LayerNorm: their code's query_norm and keys_norm, one gain per side shared by every head and half,
    init (k_dim/2)^-0.33, no bias (the OLMoE configuration their code builds on has no norm biases). Their query
    is one per token shared by the heads (Table 2's "+share query", not reproduced); ours is per head, after the
    cell's own query norm (memory.query_norm). qk_norm, L2-normalising instead, is not the paper's.
  - no projection when E = 1 and D_v = output_dim: "expanded" is then one table split by core (E = 1 and
    D_v < output_dim is Table 2's "+half vdim+proj": one projection).
Equation numbers follow arXiv 2411.12364 as cited by secondary sources (reviews and implementations of it).

The store reads its table with value_read.py's read: one bag per (token, block, core), weights zero outside
the block, so each step's sparse gradient has one row per distinct physical value read (the table's rows are
physical values, not slots: read `physical_rows(slots)`). The read costs E times a plain one (the masked
lookups); the projections are dense parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xlm_pkm.model.memory.dtypes import at_least_float32, compute_dtype
from xlm_pkm.model.memory.keys import KeySearch, uniform_keys
from xlm_pkm.model.memory.memory_settings import KEY_SEARCHES, VALUE_STORES, MemoryConfig
from xlm_pkm.model.memory.memory_settings import ExpandedConfig as ExpandedConfig  # its sections, here too
from xlm_pkm.model.memory.memory_settings import TuckerConfig as TuckerConfig
from xlm_pkm.model.memory.slot_groups import table_gradient
from xlm_pkm.model.memory.value_read import read_values
from xlm_pkm.model.memory.value_stores import ValueStore, mark_memory_value


def rank_one(core: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """core (H, r, r) -> u, t (H, r): the leading left and right singular vectors of each head's core, with
    the common sign that makes u.sum() + t.sum() >= 0 (core ≈ σ₁ u tᵀ)."""
    U, _, Vh = torch.linalg.svd(core)
    u, t = U[..., :, 0], Vh[..., 0, :]  # (H, r) each
    sign = torch.where(u.sum(-1) + t.sum(-1) < 0, -1.0, 1.0).to(core.dtype)[:, None]  # (H, 1)
    return u * sign, t * sign


@KEY_SEARCHES.register("tucker")
class TuckerKeys(KeySearch):
    """TDQKR with multi-core scoring (module docstring). weight (H, 2, n_keys, r, k_dim/2): row (0) and
    column (1) sub-keys of r components; core (H, cores, r, r). search(q) -> scores (N, H, knn), or
    (N, H, knn, cores) with several cores, and indices i·n_keys + j."""

    pieces = 2  # row and column halves

    def __init__(self, cfg: MemoryConfig):
        if cfg.k_dim % 2:
            raise ValueError(f"memory.k_dim={cfg.k_dim} must be even for key_type=tucker (row and column halves)")
        if not 1 <= cfg.tucker.rank <= cfg.n_keys:
            raise ValueError(f"memory.tucker.rank={cfg.tucker.rank} must be in [1, n_keys={cfg.n_keys}]: the "
                             f"{cfg.n_keys} row scores span at most {cfg.n_keys} components")
        if cfg.tucker.cores < 1:
            raise ValueError(f"memory.tucker.cores={cfg.tucker.cores} must be >= 1")
        if cfg.tucker.cores > 1 and cfg.values != "expanded":
            raise ValueError(f"memory.tucker.cores={cfg.tucker.cores} gives one score per core: it needs "
                             f"memory.values=expanded (values split by core), got memory.values={cfg.values}")
        if cfg.tucker.aux_coeff < 0 or cfg.tucker.aux_margin < 0:
            raise ValueError(f"memory.tucker.aux_coeff={cfg.tucker.aux_coeff} and memory.tucker.aux_margin="
                             f"{cfg.tucker.aux_margin} must be >= 0")
        super().__init__(cfg)  # checks 1 <= knn <= n_keys
        self.topm = cfg.tucker.topm or cfg.knn
        if not cfg.knn <= self.topm <= cfg.n_keys:
            raise ValueError(f"memory.tucker.topm={cfg.tucker.topm} must be in [knn={cfg.knn}, n_keys={cfg.n_keys}] "
                             f"(0: knn)")
        self.n_keys, self.rank, self.cores = cfg.n_keys, cfg.tucker.rank, cfg.tucker.cores
        self.both_signs = cfg.tucker.both_signs
        self.aux_coeff, self.aux_margin = cfg.tucker.aux_coeff, cfg.tucker.aux_margin
        self.weight = uniform_keys(cfg.heads, 2, cfg.n_keys, cfg.tucker.rank, cfg.k_dim // 2)
        self.core = nn.Parameter(torch.rand(cfg.heads, cfg.tucker.cores, cfg.tucker.rank, cfg.tucker.rank))

    @classmethod
    def slots(cls, cfg: MemoryConfig) -> int:
        return cfg.n_keys**2

    @classmethod
    def max_knn(cls, cfg: MemoryConfig) -> int:
        return cfg.n_keys  # knn <= m <= n_keys

    def component_scores(self, q: torch.Tensor) -> torch.Tensor:
        """q (N, H, k_dim) -> S (N, H, 2, n_keys, r): S[:, :, 0] = S_rowᵀ, S[:, :, 1] = S_colᵀ, in float32 at
        least (float64 if q or the keys are)."""
        dtype = torch.promote_types(compute_dtype(q), compute_dtype(self.weight))
        q, keys = q.to(dtype), self.weight.to(dtype)
        q = q.view(q.shape[0], self.heads, 2, self.k_dim // 2)  # (N, H, 2, k_dim/2): row and column queries
        q, keys = self.normalize(q, keys)  # each half-query and each key component
        return torch.einsum("nhpd,hpird->nhpir", q, keys)

    def search(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        N, H, K, r = q.shape[0], self.heads, self.knn, self.rank
        S = self.component_scores(q)  # (N, H, 2, n, r)
        cores = self.core.to(S.dtype)  # (H, C, r, r)
        with torch.no_grad():
            u, t = rank_one(cores.sum(1))  # (H, r) each: C ≈ σ₁ u tᵀ
            rows, cols, duplicate = self.candidates(torch.einsum("nhir,hr->nhi", S[:, :, 0], u),
                                                    torch.einsum("nhjr,hr->nhj", S[:, :, 1], t))
        G, M = rows.shape[2], rows.shape[3]  # candidate groups (2 with both signs), m
        # the kept rows' and columns' component scores, (N, H, G, m, r) each
        S_row = S[:, :, 0, None].expand(N, H, G, -1, r).gather(3, rows[..., None].expand(N, H, G, M, r))
        S_col = S[:, :, 1, None].expand(N, H, G, -1, r).gather(3, cols[..., None].expand(N, H, G, M, r))
        grid = torch.einsum("nhgir,hcrs,nhgjs->nhcgij", S_row, cores, S_col).reshape(N, H, self.cores, G * M * M)
        total = grid.sum(2)  # (N, H, G·m²): the exact scores of the candidates (summed cores, Eq. 16)
        if duplicate is not None:
            total = total.masked_fill(duplicate, float("-inf"))
        scores, best = total.topk(K, dim=-1)  # (N, H, K): the exact top-knn of the candidates
        group, pair = best // (M * M), best % (M * M)
        indices = (rows.flatten(2, 3).gather(2, group * M + pair // M) * self.n_keys
                   + cols.flatten(2, 3).gather(2, group * M + pair % M))  # (N, H, K)
        if self.cores == 1:
            return scores, indices
        per_core = grid.gather(3, best[:, :, None].expand(N, H, self.cores, K))  # (N, H, C, K)
        return per_core.transpose(2, 3), indices  # (N, H, K, C)

    def candidates(self, a: torch.Tensor, b: torch.Tensor):
        """The rank-1 scores a = uᵀS_row, b = tᵀS_col (N, H, n) -> rows, cols (N, H, G, m): the top-m of each
        (G = 1, the paper's I and J), with both_signs also their bottom-m (G = 2: the pairs of the m lowest,
        whose products are high too); duplicate (N, H, G·m²) marks the second group's pairs already in the
        first (when 2m > n_keys), or None."""
        m = self.topm
        rows, cols = a.topk(m, dim=-1).indices, b.topk(m, dim=-1).indices  # (N, H, m) each
        if not self.both_signs:
            return rows[:, :, None], cols[:, :, None], None
        low_rows, low_cols = (-a).topk(m, dim=-1).indices, (-b).topk(m, dim=-1).indices
        in_rows = (low_rows[..., :, None] == rows[..., None, :]).any(-1)  # (N, H, m): a low row also kept high
        in_cols = (low_cols[..., :, None] == cols[..., None, :]).any(-1)
        again = (in_rows[..., :, None] & in_cols[..., None, :]).flatten(2)  # (N, H, m²)
        duplicate = torch.cat([torch.zeros_like(again), again], dim=-1)  # (N, H, 2m²)
        return torch.stack([rows, low_rows], 2), torch.stack([cols, low_cols], 2), duplicate

    def all_scores(self, q: torch.Tensor) -> torch.Tensor:
        """q (N, H, k_dim) -> (N, H, n_slots): every slot's S_grid (summed cores), for brute-force references."""
        S = self.component_scores(q)
        grid = torch.einsum("nhir,hrs,nhjs->nhij", S[:, :, 0], self.core.to(S.dtype).sum(1), S[:, :, 1])
        return grid.reshape(q.shape[0], self.heads, self.n_slots)

    def full_keys(self) -> torch.Tensor:
        raise NotImplementedError("key_type=tucker: a slot's score S_rowᵀ C S_col is bilinear in the query, not "
                                  "q · key; all_scores(q) gives every slot's score")

    def aux_loss(self) -> torch.Tensor:
        """α/(r-1) Σ_{i=2..r} max(0, λ_i - τ)² of each head's summed core, averaged over heads (0 when r = 1)."""
        if self.rank == 1 or self.aux_coeff == 0:
            return self.core.new_zeros(())
        singular = torch.linalg.svdvals(at_least_float32(self.core).sum(1))  # (H, r) descending
        per_head = F.relu(singular[:, 1:] - self.aux_margin).square().sum(-1) / (self.rank - 1)  # (H,)
        return self.aux_coeff * per_head.mean()

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, rank={self.rank}, cores={self.cores}, topm={self.topm}"
                + (", both_signs=True" if self.both_signs else ""))


class _Pieces(torch.autograd.Function):
    """table (R, D) -> its (R·C, D/C) view, row r·C + c being the c-th piece of row r (MCS's V^(c)). Backward
    brings the view's gradient back to (R, D); a row-sparse one stays row-sparse, one row per table row read."""

    @staticmethod
    def forward(ctx, table, pieces):
        ctx.shape, ctx.pieces = table.shape, pieces
        return table.view(table.shape[0] * pieces, table.shape[1] // pieces)

    @staticmethod
    def backward(ctx, grad):
        (R, D), C = ctx.shape, ctx.pieces
        if not grad.is_sparse:
            return grad.reshape(R, D), None
        grad = grad.coalesce()
        piece_rows, values = grad.indices()[0], grad.values()  # (U,) ascending, (U, D/C)
        rows, which = torch.unique_consecutive(piece_rows // C, return_inverse=True)  # (U',) ascending
        full = values.new_zeros(rows.numel(), C, D // C)
        full[which, piece_rows % C] = values
        return table_gradient(rows, full.view(-1, D), ctx.shape, sparse=True), None


@VALUE_STORES.register("expanded")
class ExpandedValues(ValueStore):
    """IVE and MCS's values (module docstring): `weight` (n_slots / E, D_v) the physical values (row-sparse),
    `proj` (E, D_v, output_dim) the blocks' projections W_p (None when E = 1 and D_v = output_dim), `shuffle`
    (n_slots,) the virtual -> physical permutation π (a buffer, saved with the model; absent when E = 1)."""

    def __init__(self, cfg: MemoryConfig, input_dim: int, output_dim: int, n_slots: int):
        super().__init__(cfg, input_dim, output_dim, n_slots)
        E, C, D_v = cfg.expanded.expansion, cfg.tucker.cores, cfg.expanded.value_dim or output_dim
        if cfg.shard_values is True:
            raise ValueError("memory.values=expanded is not sharded: the sharded read exchanges column slices of "
                             "one plain table, while each block's projection needs its whole pooled value; "
                             "set memory.shard_values=false")
        if E < 1 or n_slots % E:
            raise ValueError(f"memory.expanded.expansion={E} must be >= 1 and divide the {n_slots} slots "
                             f"(n_keys²: virtual values over n_slots / E physical ones)")
        if cfg.expanded.value_dim < 0:
            raise ValueError(f"memory.expanded.value_dim={cfg.expanded.value_dim} must be >= 0 "
                             f"(0: the output dim {output_dim})")
        if C < 1 or D_v % C:
            raise ValueError(f"memory.tucker.cores={C} must divide the physical value width {D_v} "
                             f"(memory.expanded.value_dim, 0: the output dim): each core weights its piece of every "
                             f"value")
        if C > 1 and cfg.key_type != "tucker":
            raise ValueError(f"memory.tucker.cores={C} needs key_type=tucker (per-core scores), "
                             f"got key_type={cfg.key_type}")
        self.expansion, self.cores, self.value_dim, self.n_physical = E, C, D_v, n_slots // E
        # their code's projection is one Linear of the E pooled blocks, E·D_v inputs
        value_std, proj_std = (0.02, (E * D_v) ** -0.5) if cfg.expanded.init == "released" else (D_v**-0.5,) * 2
        self.weight = mark_memory_value(nn.Parameter(torch.randn(self.n_physical, D_v) * value_std))
        project = E > 1 or D_v != output_dim
        self.register_parameter("proj", nn.Parameter(torch.randn(E, D_v, output_dim) * proj_std) if project else None)
        self.register_buffer("shuffle", torch.randperm(n_slots) if E > 1 else None)

    def projections(self) -> list[nn.Parameter]:
        return [] if self.proj is None else [self.proj]

    def physical_rows(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Virtual slots -> (their rows of `weight`, their blocks p), each like `slots`."""
        if self.shuffle is None:
            return slots, torch.zeros_like(slots)
        target = self.shuffle[slots]
        return target % self.n_physical, target // self.n_physical

    def table_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """The distinct rows of `weight` that virtual `slots` read, ascending (for per-slot row selections such
        as sparse memory finetuning's: the table's rows are physical values, each read by E virtual slots)."""
        return self.physical_rows(slots)[0].unique()

    def forward(self, x, indices, weights, sparse, backend):
        N, (E, C) = indices.shape[0], (self.expansion, self.cores)
        if weights.dim() == 3:
            weights = weights.unsqueeze(-1)  # (N, H, K, 1): one core
        if weights.shape[-1] != C:
            raise ValueError(f"memory.values=expanded splits values in tucker.cores={C} pieces, the scores have "
                             f"{weights.shape[-1]} core(s)")
        L = indices.shape[1] * indices.shape[2]
        rows, blocks = self.physical_rows(indices.reshape(N, L))  # (N, L) each
        # one bag per (token n, block p, core c): piece c of the rows read, weighted by core c where in block p
        pieces = rows[:, None, None, :] * C + torch.arange(C, device=rows.device)[:, None]  # (N, 1, C, L)
        bag_weights = weights.reshape(N, L, C).transpose(1, 2)[:, None]  # (N, 1, C, L)
        if E > 1:
            in_block = blocks[:, None, :] == torch.arange(E, device=rows.device)[:, None]  # (N, E, L)
            bag_weights = bag_weights * in_block[:, :, None, :]  # (N, E, C, L)
            pieces = pieces.expand(N, E, C, L)
        table = _Pieces.apply(self.weight, C) if C > 1 else self.weight  # (P·C, D_v/C)
        pooled = read_values(table, pieces.reshape(-1, L), bag_weights.reshape(-1, L), sparse, backend)
        pooled = pooled.view(N, E, self.value_dim)  # per block: [Σ s^(1) V^(1); ...; Σ s^(C) V^(C)]
        if self.proj is None:
            return pooled[:, 0]
        return torch.einsum("ned,edo->no", pooled, self.proj.to(pooled.dtype))  # Σ_p W_pᵀ pooled_p

    def extra_repr(self) -> str:
        return (f"slots={self.n_slots}, physical={self.n_physical}, value_dim={self.value_dim}, "
                f"expansion={self.expansion}, cores={self.cores}")
