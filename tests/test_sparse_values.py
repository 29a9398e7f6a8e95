"""Sparse memory-value updates: gradients, lazy Adam, and agreement with the dense path."""

import math

import pytest
import torch

from xlm_pkm.config import Config
from xlm_pkm.model.memory.pkm import MemoryConfig, ProductKeyMemory
from xlm_pkm.model.memory.value_read import read_values
from xlm_pkm.model.transformer import ModelConfig
from xlm_pkm.optim import lazy_adam
from xlm_pkm.optim.clipping import clip_grad_norm
from xlm_pkm.optim.lazy_adam import LazyAdam
from xlm_pkm.optim.optimizers import OptimConfig
from xlm_pkm.runtime.precision import grad_scaler
from xlm_pkm.train.build import build_model, build_optimizers
from xlm_pkm.train.step import loss_backward, optimizer_update
from xlm_pkm.utils.sparse_grads import coalesced


def lookups(n_slots=500, dim=6, tokens=40, per_token=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(n_slots, dim, generator=g, dtype=torch.float64)
    indices = torch.randint(0, n_slots, (tokens, per_token), generator=g)
    indices[:5, :4] = 17  # a hot slot read many times
    weights = torch.rand(tokens, per_token, generator=g, dtype=torch.float64)
    grad_out = torch.randn(tokens, dim, generator=g, dtype=torch.float64)
    return table, indices, weights, grad_out


def test_sparse_read_matches_dense_read_and_gradients():
    table, indices, weights, grad_out = lookups()
    results = {}
    for sparse in (False, True):
        t, w = table.clone().requires_grad_(), weights.clone().requires_grad_()
        out = read_values(t, indices, w, sparse)
        out.backward(grad_out)
        results[sparse] = out, t.grad, w.grad
    (out_d, gt_d, gw_d), (out_s, gt_s, gw_s) = results[False], results[True]
    torch.testing.assert_close(out_s, out_d)
    torch.testing.assert_close(gw_s, gw_d)
    assert gt_s.is_sparse and not gt_d.is_sparse
    touched = torch.unique(indices)
    assert torch.equal(gt_s.coalesce().indices()[0], touched)  # one row per distinct slot read
    torch.testing.assert_close(gt_s.to_dense(), gt_d)
    untouched = torch.ones(table.shape[0], dtype=torch.bool)
    untouched[touched] = False
    assert torch.count_nonzero(gt_d[untouched]) == 0


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("chunk_bytes", [2**20, 32])  # the 30 rows of a step in one chunk, or 2 rows a chunk
def test_lazy_adam_equals_dense_adamw_on_touched_rows(weight_decay, chunk_bytes, monkeypatch):
    monkeypatch.setattr(lazy_adam, "CHUNK_BYTES", chunk_bytes)
    torch.manual_seed(0)
    n_slots, dim = 200, 4
    param = torch.nn.Parameter(torch.randn(n_slots, dim))
    opt = LazyAdam([param], lr=1e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=weight_decay)
    m, v = torch.zeros(n_slots, dim), torch.zeros(n_slots, dim)
    expected = param.detach().clone()
    for step in range(1, 4):
        rows = torch.randperm(n_slots)[:30]
        grad = torch.randn(30, dim)
        param.grad = torch.sparse_coo_tensor(rows.unsqueeze(0), grad, (n_slots, dim), check_invariants=True)
        before = param.detach().clone()
        opt.step()
        # reference: AdamW's formulas computed densely on the touched rows, with the global step for
        # bias correction (the rule documented in xlm_pkm/optim/lazy_adam.py)
        m[rows] = 0.9 * m[rows] + 0.1 * grad
        v[rows] = 0.98 * v[rows] + 0.02 * grad**2
        m_hat, v_hat = m[rows] / (1 - 0.9**step), v[rows] / (1 - 0.98**step)
        expected[rows] -= 1e-2 * (m_hat / (v_hat.sqrt() + 1e-8) + weight_decay * expected[rows])
        untouched = torch.ones(n_slots, dtype=torch.bool)
        untouched[rows] = False
        assert torch.equal(param.detach()[untouched], before[untouched])
        torch.testing.assert_close(param.detach(), expected)
    assert opt.state[param]["exp_avg"].shape == (n_slots, dim)  # allocated once, as dense tables


def test_lazy_adam_chunks_give_the_same_bits(monkeypatch):
    def run(chunk_bytes):
        monkeypatch.setattr(lazy_adam, "CHUNK_BYTES", chunk_bytes)
        torch.manual_seed(0)
        param = torch.nn.Parameter(torch.randn(300, 8))
        opt = LazyAdam([param], lr=1e-2, weight_decay=0.1)
        for _ in range(3):
            rows = torch.randperm(300)[:100].sort().values
            param.grad = torch.sparse_coo_tensor(rows.unsqueeze(0), torch.randn(100, 8), (300, 8),
                                                 check_invariants=True)
            opt.step()
        return param.detach(), opt.state[param]["exp_avg"], opt.state[param]["exp_avg_sq"]

    for chunked, whole in zip(run(96), run(2**20)):  # 3 rows a chunk, or all 100
        assert torch.equal(chunked, whole)


@pytest.mark.parametrize("rows", [[0, 3, 7, 9], [7, 3, 9, 0], [3, 3, 7, 9]])  # in order; unsorted; a repeat
def test_coalesced_equals_coalesce_and_copies_nothing_when_rows_are_in_order(rows):
    values = torch.randn(4, 5)
    grad = torch.sparse_coo_tensor(torch.tensor([rows]), values, (10, 5), check_invariants=True)
    assert not grad.is_coalesced()  # as AccumulateGrad stores the memory's gradient
    ours = coalesced(grad)
    assert ours.is_coalesced() and torch.equal(ours.to_dense(), grad.to_dense())
    assert torch.equal(ours.indices(), grad.coalesce().indices())
    assert (ours.values().data_ptr() == values.data_ptr()) == (rows == sorted(set(rows)))


def test_the_memory_gradient_reaches_the_optimizer_in_order():
    memory = ProductKeyMemory(16, 16, n_keys=8, k_dim=8, heads=2, knn=4)
    memory.sparse_values = True
    memory(torch.randn(5, 16)).sum().backward()
    rows = memory.values.weight.grad._indices()[0]
    assert bool((rows[1:] > rows[:-1]).all())  # so coalesced() only sets the flag


def tiny_config(values_optimizer: str) -> Config:
    memory = MemoryConfig(n_keys=16, k_dim=16, heads=2, knn=4, query_norm="layernorm")
    return Config(model=ModelConfig(vocab_size=50, dim=16, n_layers=2, n_heads=2, max_len=8, mem_layers=[2],
                                    memory=memory),
                  optim=OptimConfig(lr=1e-3, warmup_steps=1, values_lr=1e-2, clip_grad_norm=1.0,
                                    values_optimizer=values_optimizer))


def one_step(values_optimizer: str, tokens: torch.Tensor, targets: torch.Tensor, accumulate: int = 1):
    """One training step through the trainer's own builders and step functions; returns the model and
    the value rows its gradient held."""
    cfg = tiny_config(values_optimizer)
    model = build_model(cfg, torch.device("cpu"))
    optimizers = build_optimizers(model, cfg)
    optimizers.set_step(1)
    (values,) = model.memory_value_parameters()
    rows = []
    values.register_post_accumulate_grad_hook(
        lambda p: rows.append(p.grad.coalesce().indices()[0]) if p.grad.is_sparse else None)
    scaler = grad_scaler("fp32", torch.device("cpu"))
    losses = [loss_backward(model, x, y, "fp32", torch.device("cpu"), scaler, accumulate)
              for x, y in zip(tokens.chunk(accumulate), targets.chunk(accumulate))]
    optimizer_update(optimizers, scaler, torch.stack(losses).mean())
    return model, torch.cat(rows) if rows else None


@pytest.mark.parametrize("accumulate", [1, 2])
def test_sparse_and_dense_training_agree_for_one_step(accumulate):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 50, (4, 8), generator=g)
    targets = torch.randint(0, 50, (4, 8), generator=g)
    (dense, _), (sparse, _) = one_step("adam", tokens, targets, accumulate), one_step("lazy_adam", tokens, targets,
                                                                                     accumulate)
    for (name, p_dense), p_sparse in zip(dense.named_parameters(), sparse.parameters()):
        torch.testing.assert_close(p_sparse, p_dense, rtol=1e-5, atol=1e-6, msg=name)


def test_untouched_rows_do_not_move_with_sparse_updates():
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 50, (2, 8), generator=g)
    (initial,) = build_model(tiny_config("lazy_adam"), torch.device("cpu")).memory_value_parameters()
    model, rows = one_step("lazy_adam", tokens, tokens)
    (_, memory), = model.memories()
    moved = (memory.values.weight.detach() != initial.detach()).any(dim=1)  # (n_slots,)
    read = torch.zeros(memory.n_slots, dtype=torch.bool)
    read[rows] = True  # the rows of the step's gradient
    assert 0 < moved.sum() < memory.n_slots and torch.equal(moved, read)


def test_clip_grad_norm_counts_sparse_and_dense_gradients():
    dense = torch.nn.Parameter(torch.zeros(3))
    dense.grad = torch.tensor([3.0, 0.0, 0.0])
    sparse = torch.nn.Parameter(torch.zeros(10, 2))
    sparse.grad = torch.sparse_coo_tensor(torch.tensor([[4, 4]]), torch.tensor([[2.0, 0.0], [2.0, 0.0]]), (10, 2),
                                          check_invariants=True)
    norm = clip_grad_norm([dense, sparse], max_norm=1.0)
    assert math.isclose(float(norm), 5.0, rel_tol=1e-6)  # sqrt(3² + (2 + 2)²)
    assert math.isclose(float(torch.cat([dense.grad, sparse.grad.to_dense().flatten()]).norm()), 1.0, rel_tol=1e-5)


def test_sparse_memory_under_bf16_autocast():
    memory = ProductKeyMemory(16, 16, n_keys=8, k_dim=8, heads=2, knn=4)
    memory.sparse_values = True
    x = torch.randn(2, 5, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = memory(x)
    out.float().sum().backward()
    assert memory.values.weight.grad.is_sparse and x.grad is not None and torch.isfinite(x.grad).all()
