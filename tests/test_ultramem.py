"""UltraMem (model/memory/ultramem.py) against its paper's equations written out naively here (float64): every
one of the n_keys² slots scored densely (S_grid = S_rowᵀ C S_col per head and core), a brute-force top-k over
the whole grid, IVE's virtual values built densely as projections of the physical ones, outputs summed by
einsum; the core's aux loss, the value lr decay, the refusals, and a tiny LM trained with LazyAdam."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from xlm_pkm.model.memory.keys import KEY_SEARCHES
from xlm_pkm.model.memory.pkm import MemoryConfig, ProductKeyMemory
from xlm_pkm.model.memory.ultramem import ExpandedConfig, ExpandedValues, TuckerConfig
from xlm_pkm.model.transformer import ModelConfig, TransformerLM
from xlm_pkm.optim.optimizers import OptimConfig, Optimizers
from xlm_pkm.optim.schedule import values_lr

FULL = MemoryConfig(n_keys=6, k_dim=8, heads=2, knn=5, key_type="tucker", tucker=TuckerConfig(rank=3, cores=2, topm=6),
                    values="expanded", expanded=ExpandedConfig(expansion=4, value_dim=6), score="identity",
                    query_norm="none")


def replace(cfg: MemoryConfig, tucker: dict | None = None, expanded: dict | None = None, **fields) -> MemoryConfig:
    """cfg with `fields`, and the fields of its tucker and expanded sections, replaced."""
    return dataclasses.replace(cfg, **fields, tucker=dataclasses.replace(cfg.tucker, **(tucker or {})),
                               expanded=dataclasses.replace(cfg.expanded, **(expanded or {})))


def layer_norm_rows(v, gain):
    """LayerNorm of each row of v (..., d), written out: gain ⊙ (v - mean) / sqrt(biased variance + 1e-5)."""
    centred = v - v.mean(-1, keepdim=True)
    return gain * centred / torch.sqrt(centred.square().mean(-1, keepdim=True) + 1e-5)


def naive_grid(q, weight, core, qk_norm=False, gains=None):
    """Every slot's score per core, from the equations: S_row = K_row q_row, S_col = K_col q_col (r, n) each,
    S_grid^(c) = S_rowᵀ C^(c) S_col (n, n). q (N, H, k_dim), weight (H, 2, n, r, k_dim/2), core (H, C, r, r)
    -> (N, H, C, n²), slot i·n + j. qk_norm: each half-query and each key component divided by its norm;
    gains (query gain, key gain): each LayerNormed with them (query/key LN)."""
    N, H, d = q.shape
    n, C = weight.shape[2], core.shape[1]
    if gains is not None:
        qn, kn = (lambda v: layer_norm_rows(v, gains[0])), (lambda v: layer_norm_rows(v, gains[1]))
    else:
        qn = kn = (lambda v: v / v.norm(dim=-1, keepdim=True)) if qk_norm else (lambda v: v)
    out = torch.zeros(N, H, C, n * n, dtype=q.dtype)
    for t in range(N):
        for h in range(H):
            S_row = kn(weight[h, 0]).permute(1, 0, 2) @ qn(q[t, h, : d // 2])  # (r, n)
            S_col = kn(weight[h, 1]).permute(1, 0, 2) @ qn(q[t, h, d // 2 :])  # (r, n)
            for c in range(C):
                out[t, h, c] = (S_row.T @ core[h, c] @ S_col).reshape(-1)
    return out


def naive_output(memory, x):
    """The layer's output from the equations, with the exact top-knn of the dense grid (score = identity):
    virtual value of slot v for core c: V[π(v) mod P, piece c] @ W_{π(v) div P}[piece c rows];
    out = Σ_heads Σ_knn Σ_cores s^(c) · that."""
    lin = memory.query_net[0]
    q = (x @ lin.weight.T + lin.bias).view(x.shape[0], memory.heads, -1)
    gains = (memory.keys.query_gain, memory.keys.key_gain) if memory.cfg.qk_layernorm else None
    grid = naive_grid(q, memory.keys.weight, memory.keys.core, gains=gains)  # (N, H, C, n²)
    best = grid.sum(2).topk(memory.knn, dim=-1).indices  # (N, H, K): brute force over all slots
    scores = grid.gather(3, best[:, :, None].expand(-1, -1, grid.shape[2], -1))  # (N, H, C, K)
    store = memory.values
    V, W, P, C = store.weight, store.proj, store.n_physical, store.cores
    if W is None:  # E = 1 and D_v = output_dim: no projection, W_1 = identity
        W = torch.eye(V.shape[1], dtype=V.dtype)[None]
    shuffle = store.shuffle if store.shuffle is not None else torch.arange(memory.n_slots)  # E = 1: π = identity
    width = V.shape[1] // C
    virtual = torch.zeros(memory.n_slots, C, W.shape[2], dtype=V.dtype)  # (n_slots, C, output_dim)
    for v in range(memory.n_slots):
        target = int(shuffle[v])
        row, block = target % P, target // P
        for c in range(C):
            piece = slice(c * width, (c + 1) * width)
            virtual[v, c] = V[row, piece] @ W[block, piece]
    return torch.einsum("nhck,nhkco->no", scores, virtual[best]), best


def full_memory(**fields):
    torch.manual_seed(0)
    return ProductKeyMemory(7, 6, replace(FULL, **fields)).double()


def random_gains(keys):
    """Gains of their own for a search's query/key LayerNorms (not the init's constant); their values."""
    with torch.no_grad():
        keys.query_gain.uniform_(0.5, 1.5), keys.key_gain.uniform_(-1.5, -0.5)
    return keys.query_gain, keys.key_gain


@pytest.mark.parametrize("fields", [{}, dict(tucker=dict(cores=1, rank=1)), dict(qk_norm=True, heads=1, knn=6),
                                    dict(tucker=dict(both_signs=True)), dict(qk_layernorm=True)])
def test_search_with_m_equal_n_keys_is_brute_force(fields):
    torch.manual_seed(1)
    cfg = replace(FULL, **fields)
    keys = KEY_SEARCHES["tucker"](cfg).double()
    gains = random_gains(keys) if cfg.qk_layernorm else None
    q = torch.randn(20, cfg.heads, cfg.k_dim, dtype=torch.float64)
    with torch.no_grad():
        scores, indices = keys.search(q)
        grid = naive_grid(q, keys.weight, keys.core, cfg.qk_norm, gains)  # (N, H, C, n²)
    total = grid.sum(2)
    expected_scores, expected = total.topk(cfg.knn, dim=-1)
    assert torch.equal(indices, expected)
    if cfg.tucker.cores == 1:
        assert scores.shape == (20, cfg.heads, cfg.knn)
        torch.testing.assert_close(scores, expected_scores, rtol=0, atol=1e-12)
    else:
        per_core = grid.gather(3, expected[:, :, None].expand(-1, -1, cfg.tucker.cores, -1)).transpose(2, 3)
        torch.testing.assert_close(scores, per_core, rtol=0, atol=1e-12)
        assert (scores.sum(-1)[..., 1:] <= scores.sum(-1)[..., :-1]).all()


@pytest.mark.parametrize("positive,both_signs,topm,exact", [(True, False, 0, True), (False, True, 0, True),
                                                             (False, True, 12, True), (False, False, 0, False)])
def test_approximate_top_m_with_a_rank_one_core(positive, both_signs, topm, exact):
    """Σ_c C^(c) = σ u tᵀ: S_grid[i, j] = σ a_i b_j, a = uᵀS_row, b = tᵀS_col. With positive a and b, a slot of
    the top-knn has its row among the top-m of a and its column among the top-m of b (m >= knn): the
    paper's search with m = knn < n_keys equals brute force. With scores of both signs, pairs of two negatives
    score high too: the paper's search misses them, both_signs (top-m and bottom-m) finds them all, also when
    the two groups overlap (2m > n_keys: their common pairs counted once)."""
    torch.manual_seed(2)
    cfg = replace(FULL, n_keys=16, knn=4, tucker=dict(topm=topm, rank=2, both_signs=both_signs))
    keys = KEY_SEARCHES["tucker"](cfg).double()
    u, t = torch.randn(cfg.heads, 2, dtype=torch.float64), torch.randn(cfg.heads, 2, dtype=torch.float64)
    alphas = torch.tensor([0.3, 0.7], dtype=torch.float64)
    q = torch.randn(50, cfg.heads, cfg.k_dim, dtype=torch.float64)
    with torch.no_grad():
        if positive:
            keys.weight.abs_()
            u, t, q = u.abs() + 0.1, t.abs() + 0.1, q.abs()
        keys.core.copy_(alphas[None, :, None, None] * u[:, None, :, None] * t[:, None, None, :])
        scores, indices = keys.search(q)
        grid = naive_grid(q, keys.weight, keys.core).sum(2)
    assert keys.topm == (topm or 4) < keys.n_keys
    assert all(len(set(row)) == 4 for row in indices.reshape(-1, 4).tolist())  # distinct slots
    found = torch.equal(indices, grid.topk(cfg.knn, dim=-1).indices)
    assert found == exact
    if exact:
        torch.testing.assert_close(scores.sum(-1), grid.topk(cfg.knn, dim=-1).values, rtol=0, atol=1e-12)


def test_all_scores_is_the_dense_grid():
    torch.manual_seed(3)
    keys = KEY_SEARCHES["tucker"](FULL).double()
    q = torch.randn(4, FULL.heads, FULL.k_dim, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(keys.all_scores(q), naive_grid(q, keys.weight, keys.core).sum(2), rtol=0, atol=1e-12)
    with pytest.raises(NotImplementedError, match="bilinear in the query"):
        keys.full_keys()


@pytest.mark.parametrize("fields", [{}, dict(expanded=dict(expansion=1, value_dim=0)),
                                    dict(expanded=dict(expansion=2), tucker=dict(cores=3)),
                                    dict(qk_layernorm=True, expanded=dict(init="released"))])
def test_layer_output_and_gradients_equal_the_naive_equations(fields):
    memory = full_memory(**fields)
    if memory.cfg.qk_layernorm:
        random_gains(memory.keys)
    assert (memory.values.proj is None) == (fields.get("expanded", {}).get("expansion") == 1)
    x = torch.randn(9, 7, dtype=torch.float64, requires_grad=True)
    out = memory(x)
    expected, best = naive_output(memory, x)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)
    params = [x] + [p for p in memory.parameters() if p.requires_grad]
    probe = torch.randn_like(out)
    grads = torch.autograd.grad((out * probe).sum(), params)
    expected_grads = torch.autograd.grad((expected * probe).sum(), params)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-10)
    assert best.unique().numel() > memory.knn  # the tokens read different slots


def test_released_init_statistics_and_the_default_kept():
    """expanded.init=released: physical values N(0, 0.02²), projections N(0, 1/(E·D_v)) (UltraMem's released code,
    olmo/ultramem_layer.py reset_parameters), within sampling tolerance (the standard error of a sample std is
    about std / sqrt(2n): under 0.2% for the 262,144 values, 0.6% for the 16,384 projection entries); the query/key
    LayerNorms' gains (k_dim/2)^-0.33. The default (fan_in) is the earlier init draw for draw: N(0, 1/D_v) both."""
    E, D_v, out = 4, 64, 64
    cfg = replace(FULL, n_keys=128, k_dim=16, qk_layernorm=True, tucker=dict(cores=1, topm=0),
                  expanded=dict(expansion=E, value_dim=D_v, init="released"))
    torch.manual_seed(5)
    store = ExpandedValues(cfg, 7, out, 128**2)
    values, proj = store.weight.detach().double(), store.proj.detach().double()
    assert values.shape == (128**2 // E, D_v) and proj.shape == (E, D_v, out)
    for tensor, std in ((values, 0.02), (proj, (E * D_v) ** -0.5)):
        n = tensor.numel()
        assert abs(tensor.std().item() / std - 1) < 5 / math.sqrt(2 * n), (tensor.std().item(), std)
        assert abs(tensor.mean().item()) < 5 * std / math.sqrt(n)
    keys = KEY_SEARCHES["tucker"](cfg)
    assert torch.equal(keys.query_gain, torch.full((8,), 8**-0.33)) and torch.equal(keys.key_gain, keys.query_gain)

    torch.manual_seed(6)
    store = ExpandedValues(replace(cfg, expanded=dict(init="fan_in")), 7, out, 128**2)
    torch.manual_seed(6)
    assert torch.equal(store.weight, torch.randn(128**2 // E, D_v) * D_v**-0.5)
    assert torch.equal(store.proj, torch.randn(E, D_v, out) * D_v**-0.5)
    assert ExpandedConfig().init == "fan_in" and not MemoryConfig().qk_layernorm  # earlier configs: as before


def test_sparse_table_gradient_equals_dense_with_one_row_per_physical_value_read():
    memory = full_memory(n_keys=12, tucker=dict(topm=12))
    x = torch.randn(3, 7, dtype=torch.float64)
    probe = torch.randn(3, 6, dtype=torch.float64)
    grads = {}
    for sparse in (False, True):
        memory.zero_grad(set_to_none=True)
        memory.sparse_values = sparse
        (memory(x) * probe).sum().backward()
        grads[sparse] = memory.values.weight.grad
    assert grads[True].is_sparse and not grads[False].is_sparse
    torch.testing.assert_close(grads[True].to_dense(), grads[False], rtol=0, atol=1e-12)
    _, indices = memory.lookup(x)
    rows, _ = memory.values.physical_rows(indices)
    assert grads[True]._nnz() == rows.unique().numel() < memory.values.n_physical


def test_aux_loss_is_its_formula():
    """L_aux = α/(r-1) Σ_{i=2..r} max(0, λ_i - τ)², λ the singular values of each head's summed core, mean
    over heads; its gradient lowers the non-leading singular values above τ."""
    torch.manual_seed(4)
    keys = KEY_SEARCHES["tucker"](replace(FULL, tucker=dict(aux_coeff=0.5, aux_margin=0.2))).double()
    lam = [np.linalg.svd(c, compute_uv=False) for c in keys.core.detach().sum(1).numpy()]  # descending
    expected = 0.5 * np.mean([sum(max(0.0, lam_h[i] - 0.2) ** 2 for i in range(1, 3)) / 2 for lam_h in lam])
    loss = keys.aux_loss()
    assert expected > 0 and loss.item() == pytest.approx(expected, rel=1e-12)
    loss.backward()
    with torch.no_grad():
        keys.core -= 0.5 * keys.core.grad
    assert keys.aux_loss().item() < expected
    assert KEY_SEARCHES["tucker"](replace(FULL, tucker=dict(rank=1))).aux_loss().item() == 0.0


def test_values_lr_decay_is_its_formula_and_the_default_is_constant():
    cfg = OptimConfig(lr=2e-3, warmup_steps=10, warmup_init_lr=1e-7, values_lr_decay_steps=100,
                      values_lr_start_factor=10.0)
    for step in (1, 5, 10, 11, 50, 99, 100, 101, 400):
        dense = 1e-7 + (2e-3 - 1e-7) * step / 10 if step < 10 else 2e-3 * math.sqrt(10 / step)  # inverse_sqrt
        expected = dense * (1 + 9 * max(0.0, 1 - step / 100))
        assert values_lr(step, cfg) == pytest.approx(expected, rel=1e-12)
    default = OptimConfig()
    assert all(values_lr(step, default) == default.values_lr for step in (1, 7, 10**6))  # bit for bit
    own = dataclasses.replace(cfg, values_lr=4e-3, values_lr_decay_base="values_lr")  # no warm-up, as values_lr
    for step in (0, 1, 10, 50, 100, 101, 400):
        assert values_lr(step, own) == pytest.approx(4e-3 * (1 + 9 * max(0.0, 1 - step / 100)), rel=1e-12)


def test_refusals():
    def build(**fields):
        return ProductKeyMemory(7, 5, replace(FULL, **fields))

    cases = [
        (dict(tucker=dict(rank=7)), r"^memory.tucker.rank=7 must be in \[1, n_keys=6\]"),
        (dict(tucker=dict(topm=4)), r"^memory.tucker.topm=4 must be in \[knn=5, n_keys=6\] \(0: knn\)$"),
        (dict(tucker=dict(topm=7)), r"^memory.tucker.topm=7 must be in \[knn=5, n_keys=6\]"),
        (dict(k_dim=7), r"^memory.k_dim=7 must be even for key_type=tucker"),
        (dict(values="table"), r"^memory.tucker.cores=2 gives one score per core: it needs memory.values=expanded"),
        (dict(expanded=dict(expansion=5)), r"^memory.expanded.expansion=5 must be >= 1 and divide the 36 slots"),
        (dict(expanded=dict(value_dim=7)), r"^memory.tucker.cores=2 must divide the physical value width 7"),
        (dict(shard_values=True), r"^memory.values=expanded is not sharded: .* set memory.shard_values=false$"),
        (dict(key_type="product"), r"^memory.tucker.cores=2 needs key_type=tucker"),
        (dict(qk_norm=True, qk_layernorm=True),
         r"^memory.qk_norm and memory.qk_layernorm both normalise the queries and keys: set one$"),
        (dict(tucker=dict(aux_coeff=-1.0)),
         r"^memory.tucker.aux_coeff=-1.0 and memory.tucker.aux_margin=0.15 must be >= 0$"),
    ]
    for fields, message in cases:
        with pytest.raises(ValueError, match=message):
            build(**fields)
    weights = torch.ones(2, 2, 5, 3)
    with pytest.raises(ValueError, match=r"splits values in tucker.cores=2 pieces, the scores have 3 core\(s\)"):
        build().values(torch.zeros(2, 7), torch.zeros(2, 2, 5, dtype=torch.long), weights, False, "torch")


def test_tiny_lm_with_full_ultramem_trains_with_lazy_adam():
    memory = MemoryConfig(n_keys=8, k_dim=16, heads=2, knn=4, key_type="tucker", tucker=TuckerConfig(cores=2),
                          values="expanded", expanded=ExpandedConfig(expansion=4, value_dim=16), score="identity",
                          query_norm="layernorm")
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, max_len=16, n_memories=1,
                                      memory=memory))
    model.set_sparse_values(True)
    optimizers = Optimizers(model, OptimConfig(lr=1e-2, warmup_steps=2, values_optimizer="lazy_adam",
                                               values_lr_decay_steps=20))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    tokens = torch.randint(0, 50, (4, 13))
    losses = []
    for step in range(1, 16):
        lrs = optimizers.set_step(step)
        loss = model(tokens[:, :-1], targets=tokens[:, 1:]).mean()
        (loss + model.aux_loss()).backward()
        (values,) = model.memory_value_parameters()
        assert values.grad.is_sparse and values.shape == (16, 16)
        optimizers.unscale_and_clip(scaler)
        optimizers.step(scaler)
        optimizers.zero_grad()
        losses.append(loss.item())
    assert lrs["values"] == pytest.approx(lrs["dense"] * (1 + 9 * (1 - 15 / 20)))
    assert model.aux_loss().item() >= 0 and losses[-1] < losses[0] - 1.0, losses
