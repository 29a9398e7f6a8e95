"""PEER's single-neuron experts (He 2024, model/memory/peer.py) against the paper's equations written out
naively: every expert scored, top-k by sorting, softmax router scores, Σ_h Σ_i g_i σ(u_i·x) v_i in loops."""

import math
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from xlm_pkm.config import Config, load_config
from xlm_pkm.errors import ConfigError
from xlm_pkm.model.memory import peer
from xlm_pkm.model.memory.pkm import MemoryConfig, ProductKeyMemory
from xlm_pkm.model.memory.value_read import triton_usable
from xlm_pkm.model.transformer import ModelConfig, TransformerLM
from xlm_pkm.optim.lazy_adam import LazyAdam
from xlm_pkm.optim.optimizers import OptimConfig
from xlm_pkm.runtime.precision import grad_scaler
from xlm_pkm.train.build import build_model, build_optimizers
from xlm_pkm.train.step import loss_backward, optimizer_update

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def one_thread():
    """Many tiny ops: extra threads only add barrier waits (seconds on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def peer_memory(activation="gelu", query_norm="batchnorm", **kw):
    torch.manual_seed(0)
    cfg = MemoryConfig(values="peer", peer=peer.PeerConfig(activation=activation), query_norm=query_norm, n_keys=6,
                       k_dim=8, heads=2, knn=3)
    return ProductKeyMemory(kw.pop("input_dim", 12), kw.pop("output_dim", 12), cfg, **kw).double()


def naive_peer(memory, x, activation):
    """He 2024, §2, from the layer's parameters only: q(x) (linear + BatchNorm with the batch's statistics),
    Eq. 1 the top-k of q·k_i over all n_keys² keys k_i = [c_i; c'_j] (Eq. 4), Eq. 2 g = softmax of the k
    scores, Eq. 6-7 f(x) = Σ_h Σ_{i in I^h} g_i σ(u_i·x) v_i."""
    H, K, n, d = memory.heads, memory.knn, memory.cfg.n_keys, memory.cfg.k_dim
    linear = memory.query_net[0]
    q = x @ linear.weight.T + linear.bias  # (N, H·d)
    if memory.cfg.query_norm == "batchnorm":  # training mode: the batch's mean and biased variance
        bn = memory.query_norm
        mean, var = q.mean(0), ((q - q.mean(0)) ** 2).mean(0)
        q = (q - mean) / torch.sqrt(var + bn.eps) * bn.weight + bn.bias
    q = q.view(-1, H, d)
    sub = memory.keys.weight  # (H, 2, n, d/2)
    full = torch.stack([torch.stack([torch.cat([sub[h, 0, i], sub[h, 1, j]]) for i in range(n) for j in range(n)])
                        for h in range(H)])  # (H, n², d): slot i·n + j has the key [c_i; c'_j]
    sigma = {"gelu": lambda z: 0.5 * z * (1 + torch.erf(z / math.sqrt(2))), "relu": lambda z: z * (z > 0)}[activation]
    u, v = memory.values.down, memory.values.up
    out = []
    for t in range(x.shape[0]):
        f = torch.zeros(memory.output_dim, dtype=x.dtype)
        for h in range(H):
            scores = torch.stack([q[t, h] @ full[h, s] for s in range(n * n)])  # every expert's score
            top = sorted(range(n * n), key=lambda s: -float(scores[s].detach()))[:K]  # Eq. 1: I^h
            e = torch.exp(scores[top] - scores[top].max())
            g = e / e.sum()  # Eq. 2: softmax over the k selected
            for gi, i in zip(g, top):
                f = f + gi * sigma(u[i] @ x[t]) * v[i]  # Eq. 6-7
        out.append(f)
    return torch.stack(out)


@pytest.mark.parametrize("activation,query_norm", [("gelu", "batchnorm"), ("relu", "none")])
@pytest.mark.parametrize("sparse", [False, True])
def test_output_and_every_gradient_equal_the_naive_equations(activation, query_norm, sparse):
    memory = peer_memory(activation, query_norm)
    memory.sparse_values = sparse
    x = torch.randn(7, 12, dtype=torch.float64, requires_grad=True)
    probe = torch.randn(7, 12, dtype=torch.float64)
    out = memory(x)
    (out * probe).sum().backward()
    grads = {name: p.grad.to_dense() if p.grad.is_sparse else p.grad for name, p in memory.named_parameters()}
    grads["x"], x.grad = x.grad, None
    memory.zero_grad()
    expected = naive_peer(memory, x, activation)
    (expected * probe).sum().backward()
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)
    assert set(grads) == {name for name, _ in memory.named_parameters()} | {"x"}
    for name, p in [*memory.named_parameters(), ("x", x)]:
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=1e-10, msg=name)
        assert grads[name].abs().sum() > 0, name


def test_sparse_gradients_hold_one_row_per_expert_read_and_equal_dense():
    memory = peer_memory()
    x = torch.randn(9, 12, dtype=torch.float64)
    grads = {}
    for sparse in (False, True):
        memory.zero_grad(set_to_none=True)
        memory.sparse_values = sparse
        memory(x).square().sum().backward()
        grads[sparse] = memory.values.down.grad, memory.values.up.grad
    _, indices = memory.lookup(x)
    read = torch.unique(indices)
    for dense, sparse in zip(grads[False], grads[True]):
        assert sparse.is_sparse and not dense.is_sparse
        assert sparse._nnz() == read.numel()  # one row per distinct expert read
        assert torch.equal(sparse.coalesce().indices()[0], read)
        torch.testing.assert_close(sparse.to_dense(), dense, rtol=0, atol=1e-12)
        unread = torch.ones(memory.n_slots, dtype=torch.bool)
        unread[read] = False
        assert torch.count_nonzero(dense[unread]) == 0
    assert [p is q for p, q in zip(memory.values.tables(), (memory.values.down, memory.values.up))] == [True, True]


def test_lazy_adam_on_sparse_expert_gradients_equals_adam_on_the_rows_read():
    memory = peer_memory()
    memory.sparse_values = True
    tables = memory.values.tables()
    opt = LazyAdam(tables, lr=1e-2, betas=(0.9, 0.98), eps=1e-8)
    reference = [t.detach().clone() for t in tables]
    moments = [(torch.zeros_like(t), torch.zeros_like(t)) for t in tables]
    for step in range(1, 4):
        x = torch.randn(4, 12, dtype=torch.float64)
        memory(x).square().sum().backward()
        rows = [t.grad.coalesce().indices()[0] for t in tables]
        dense = [t.grad.to_dense() for t in tables]
        opt.step()
        opt.zero_grad(set_to_none=True)
        for ref, (m, v), r, g in zip(reference, moments, rows, dense):  # Adam's formulas on the rows read
            m[r] = 0.9 * m[r] + 0.1 * g[r]
            v[r] = 0.98 * v[r] + 0.02 * g[r] ** 2
            ref[r] -= 1e-2 * (m[r] / (1 - 0.9**step)) / ((v[r] / (1 - 0.98**step)).sqrt() + 1e-8)
        for t, ref in zip(tables, reference):
            torch.testing.assert_close(t.detach(), ref, rtol=0, atol=1e-12)


def tiny_config(values_optimizer: str) -> Config:
    memory = MemoryConfig(values="peer", n_keys=16, k_dim=16, heads=2, knn=4, query_norm="layernorm")
    return Config(model=ModelConfig(vocab_size=50, dim=16, n_layers=2, n_heads=2, max_len=8, mem_layers=[2],
                                    memory=memory),
                  optim=OptimConfig(lr=1e-3, warmup_steps=1, values_lr=1e-2, clip_grad_norm=1.0,
                                    values_optimizer=values_optimizer))


def train_steps(values_optimizer: str, tokens: torch.Tensor, targets: torch.Tensor, steps: int = 1):
    """`steps` training steps through the trainer's own builders and step functions; returns the model and
    the rows of each expert table's last sparse gradient."""
    cfg = tiny_config(values_optimizer)
    model = build_model(cfg, torch.device("cpu"))
    optimizers = build_optimizers(model, cfg)
    rows, losses = {}, []
    for p in model.memory_value_parameters():
        p.register_post_accumulate_grad_hook(lambda p: rows.__setitem__(id(p), p.grad.coalesce().indices()[0])
                                             if p.grad.is_sparse else None)
    scaler = grad_scaler("fp32", torch.device("cpu"))
    for step in range(1, steps + 1):
        optimizers.set_step(step)
        loss = loss_backward(model, tokens, targets, "fp32", torch.device("cpu"), scaler, 1)
        optimizer_update(optimizers, scaler, loss)
        losses.append(float(loss))
    return model, rows, losses


def test_sparse_and_dense_expert_updates_agree_and_only_experts_read_move():
    g = torch.Generator().manual_seed(1)
    tokens, targets = torch.randint(0, 50, (4, 8), generator=g), torch.randint(0, 50, (4, 8), generator=g)
    (dense, _, _), (sparse, rows, _) = train_steps("adam", tokens, targets), train_steps("lazy_adam", tokens, targets)
    for (name, p_dense), p_sparse in zip(dense.named_parameters(), sparse.parameters()):
        torch.testing.assert_close(p_sparse, p_dense, rtol=1e-5, atol=1e-6, msg=name)
    initial = build_model(tiny_config("lazy_adam"), torch.device("cpu"))
    tables = sparse.memory_value_parameters()
    assert len(tables) == 2 and len(rows) == 2  # down and up, both in the values group, both sparse
    for before, after in zip(initial.memory_value_parameters(), tables):
        moved = (after.detach() != before.detach()).any(dim=1)
        read = torch.zeros_like(moved)
        read[rows[id(after)]] = True
        assert 0 < moved.sum() < len(moved) and torch.equal(moved, read)


def test_tiny_lm_with_peer_experts_learns_with_lazy_adam():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 50, (4, 8), generator=g)
    targets = torch.randint(0, 50, (4, 8), generator=g)
    model, _, losses = train_steps("lazy_adam", tokens, targets, steps=30)
    assert all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0] - 1.0, losses  # memorises the batch
    names = [name for name, p in model.named_parameters() if getattr(p, "is_memory_value", False)]
    assert names == ["blocks.1.sublayers.1.values.down", "blocks.1.sublayers.1.values.up"], names


def test_no_tokens_by_heads_knn_by_dim_intermediate(monkeypatch):
    monkeypatch.setattr(peer, "CHUNK_ELEMENTS", 2**18)  # the forward's gather in 1 MiB chunks
    N, H, K, D = 256, 4, 16, 128  # a (N, H·K, D) float32 tensor would be 8 MiB
    memory = ProductKeyMemory(D, D, MemoryConfig(values="peer", n_keys=32, k_dim=16, heads=H, knn=K))
    memory.sparse_values = True
    x = torch.randn(N, D, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        memory(x).sum().backward()
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert largest < N * H * K * D * 4 / 4, largest


def test_one_line_refusals():
    with pytest.raises(ValueError, match=r"^memory.values=peer: PEER's expert tables are not sharded; set "
                                         r"memory.shard_values=false$"):
        ProductKeyMemory(12, 12, MemoryConfig(values="peer", shard_values=True, n_keys=4, k_dim=4, heads=1, knn=2))
    memory = peer_memory()
    x, indices = torch.randn(3, 12, dtype=torch.float64), torch.zeros(3, 2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="^memory.values=peer reads one router score per expert"):
        memory.values(x, indices, torch.ones(3, 2, 3, 4, dtype=torch.float64), False, "torch")  # a cores axis
    with pytest.raises(ValueError, match=r"^memory.values=peer: the experts' u_i have 12 inputs, this memory's "
                                         r"input has 10$"):
        memory.values(x[:, :10], indices, torch.ones(3, 2, 3, dtype=torch.float64), False, "torch")
    with pytest.raises(ConfigError, match="peer.activation"):
        load_config(None, ["model.memory.values=peer", "model.memory.peer.activation=tanh"])


def test_other_output_width_and_memory_plus_gating():
    memory = peer_memory(input_dim=12, output_dim=5, gated=True)  # §2's f: R^n -> R^m; Memory+'s output gate
    assert memory.values.down.shape == (36, 12) and memory.values.up.shape == (36, 5)
    out = memory(torch.randn(4, 12, dtype=torch.float64))
    assert out.shape == (4, 5) and torch.isfinite(out).all()


def test_flops_count_both_tables():
    memory = peer_memory()
    assert memory.values.flops_per_token(2, 3) == 6.0 * 2 * 3 * (12 + 12)


@pytest.mark.parametrize("path", ["configs/variants/peer.yaml", "configs/variants/paper/peer.yaml"])
def test_variant_configs_load_and_build(path):
    cfg = load_config(ROOT / path)
    mem = cfg.model.memory
    assert mem.values == "peer" and mem.query_norm == "batchnorm"
    if "paper" in path:  # He 2024, §3.1: 1024² experts, 8 heads, top 16 per head
        assert (mem.n_keys, mem.heads, mem.knn, cfg.model.n_layers, cfg.model.dim) == (1024, 8, 16, 6, 512)
    cfg.model.vocab_size = 100
    with torch.device("meta"):
        model = TransformerLM(cfg.model)
    (_, memory), = model.memories()
    assert isinstance(memory.values, peer.PeerExperts)
    assert memory.values.down.shape == (mem.n_keys**2, cfg.model.dim)


@pytest.mark.slow
def test_triton_backend_equals_torch_backend(monkeypatch):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not triton_usable(device):
        pytest.skip("Triton's kernels run on CUDA, or on CPU under TRITON_INTERPRET=1 (tests/conftest.py)")
    from xlm_pkm.model.memory import triton_value_read

    launched = []
    for name in ("fused_row_dots", "fused_slot_sums"):
        kernel = getattr(triton_value_read, name)
        monkeypatch.setattr(triton_value_read, name,
                            lambda *a, kernel=kernel, name=name: launched.append(name) or kernel(*a))
    results = {}
    for backend in ("torch", "triton"):
        torch.manual_seed(0)
        memory = ProductKeyMemory(24, 24, MemoryConfig(values="peer", value_read=backend, n_keys=8, k_dim=8,
                                                       heads=2, knn=4)).to(device)
        assert memory.read_backend == backend
        for sparse in (False, True):
            memory.zero_grad(set_to_none=True)
            memory.sparse_values = sparse
            x = torch.randn(10, 24, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_()
            memory(x).square().sum().backward()
            results[backend, sparse] = [x.grad] + [p.grad.to_dense() if p.grad.is_sparse else p.grad
                                                   for p in memory.parameters()]
    assert {"fused_row_dots", "fused_slot_sums"} <= set(launched)  # the down side ran the fused kernels too
    for sparse in (False, True):
        for a, b in zip(results["torch", sparse], results["triton", sparse]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
