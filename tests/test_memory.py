"""ProductKeyMemory against independent references: brute force over all keys, numerical gradients,
the profiler's allocation record, nn.BatchNorm1d."""

import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from xlm_pkm.config import MemoryConfig
from xlm_pkm.model.memory import MaskedBatchNorm1d, ProductKeyMemory, value_table


def small_memory(**kw):
    args = dict(input_dim=12, output_dim=10, n_keys=8, k_dim=8, heads=2, knn=4) | kw
    torch.manual_seed(0)
    return ProductKeyMemory(**args)


def brute_force_scores(memory, q):
    """(N, H, n_slots) float64 scores of every key; product key slot i*n_keys+j = [c_i, c'_j]."""
    keys = memory.keys.detach().double().numpy()
    if memory.key_type == "product":
        H, _, n, half = keys.shape
        first = np.repeat(keys[:, 0], n, axis=1)  # (H, n*n, half): c_i for slot i*n + j
        second = np.tile(keys[:, 1], (1, n, 1))  # (H, n*n, half): c'_j
        keys = np.concatenate([first, second], axis=-1)  # (H, n*n, k_dim)
    return np.einsum("nhd,hsd->nhs", q.double().numpy(), keys)


def assert_exact_topk(memory, q):
    with torch.no_grad():
        scores, indices = memory.search(q)
    N, H, K = q.shape[0], memory.heads, memory.knn
    assert scores.shape == indices.shape == (N, H, K)
    assert scores.dtype == torch.float32
    full = brute_force_scores(memory, q)  # (N, H, n_slots)
    best = -np.sort(-full, axis=-1)[..., :K]  # the knn best scores of all keys
    np.testing.assert_allclose(scores.numpy(), best, atol=1e-5, rtol=0)
    idx = indices.numpy()
    assert idx.min() >= 0 and idx.max() < memory.n_slots
    assert all(len(set(row)) == K for row in idx.reshape(-1, K))  # distinct slots
    # each returned index really is a key with the returned score (ties aside: equal scores, any order)
    np.testing.assert_allclose(np.take_along_axis(full, idx, axis=-1), scores.numpy(), atol=1e-5, rtol=0)
    assert (scores[..., 1:] <= scores[..., :-1]).all()


@pytest.mark.parametrize("n_keys,k_dim,heads,knn", [(4, 4, 1, 4), (8, 16, 2, 5), (16, 8, 4, 16), (32, 32, 3, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_product_search_equals_brute_force(n_keys, k_dim, heads, knn, dtype):
    memory = small_memory(n_keys=n_keys, k_dim=k_dim, heads=heads, knn=knn)
    q = torch.randn(64, heads, k_dim).to(dtype)
    assert_exact_topk(memory, q)


@pytest.mark.parametrize("n_keys,knn", [(4, 3), (8, 16)])
def test_flat_search_equals_brute_force(n_keys, knn):
    memory = small_memory(n_keys=n_keys, knn=knn, key_type="flat")
    assert memory.keys.shape == (2, n_keys**2, 8)
    assert_exact_topk(memory, torch.randn(32, 2, 8))


def test_product_indices_are_first_half_times_n_keys_plus_second_half():
    memory = small_memory(n_keys=4, k_dim=2, heads=1, knn=1)
    with torch.no_grad():
        memory.keys.zero_()
        memory.keys[0, 0, 2, 0] = 1.0  # first half: sub-key 2 matches the query
        memory.keys[0, 1, 3, 0] = 1.0  # second half: sub-key 3 matches
    scores, indices = memory.search(torch.ones(1, 1, 2))
    assert indices.item() == 2 * 4 + 3 and scores.item() == 2.0


def test_output_is_softmax_weighted_sum_of_selected_values_summed_over_heads():
    memory = small_memory(query_norm="none").eval()
    x = torch.randn(5, 12)
    q = memory.query_net(x).view(5, 2, 8)
    scores, indices = memory.search(q)
    w = scores.softmax(-1)  # (5, H, knn)
    expected = (w[..., None] * memory.values.weight[indices]).sum((1, 2))  # (5, output_dim)
    torch.testing.assert_close(memory(x), expected)


@pytest.fixture
def one_thread():
    """Hundreds of tiny float64 ops: extra threads only add barrier waits (seconds on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("options", [dict(), dict(key_type="flat"), dict(gated=True, qk_norm=True, temperature=0.5),
                                     dict(query_norm="layernorm", query_hidden=[6])])
def test_gradients_match_finite_differences_in_float64(options, one_thread):
    memory = small_memory(input_dim=5, output_dim=3, n_keys=4, k_dim=4, heads=2, knn=3, **options).double()
    names, params = zip(*memory.named_parameters())
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)

    def f(x, *params):
        return torch.func.functional_call(memory, dict(zip(names, params)), (x,))

    # full gradcheck for the paper's layer; fast mode (random projections of the Jacobian) for the options
    assert torch.autograd.gradcheck(f, (x, *params), eps=1e-6, atol=1e-5, fast_mode=bool(options))
    memory(x).square().sum().backward()
    for name in ("query_net.0.weight", "keys", "values.weight"):
        assert memory.get_parameter(name).grad.abs().sum() > 0, name


def test_no_tokens_by_heads_knn_by_output_dim_intermediate():
    N, H, K, D = 512, 4, 32, 256  # a (N, H*K, D) float32 tensor would be 64 MiB
    memory = small_memory(input_dim=64, output_dim=D, n_keys=64, k_dim=32, heads=H, knn=K)
    x = torch.randn(N, 64, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        memory(x).sum().backward()
    largest = max(e.cpu_memory_usage for e in prof.events())  # bytes allocated by an op (with children)
    value_grad = memory.values.weight.numel() * 4
    assert value_grad <= largest < N * H * K * D * 4 / 4, largest  # the profiler saw the 4 MiB value gradient


def test_masked_batchnorm_ignores_padding_and_matches_batchnorm_without_it():
    torch.manual_seed(0)
    real = torch.randn(20, 6) * 3 + 1
    results = []
    for n_pad, pad_value in [(0, 0.0), (5, 100.0), (11, -7.0)]:
        bn = MaskedBatchNorm1d(6)
        x = torch.cat([real, torch.full((n_pad, 6), pad_value)])
        keep = torch.arange(len(x)) < len(real)
        y = bn(x, keep)
        results.append((y[keep], bn.running_mean.clone(), bn.running_var.clone()))
    for y, mean, var in results[1:]:
        torch.testing.assert_close(y, results[0][0])
        torch.testing.assert_close(mean, results[0][1])
        torch.testing.assert_close(var, results[0][2])
    reference = torch.nn.BatchNorm1d(6)
    torch.testing.assert_close(reference(real), results[0][0])
    torch.testing.assert_close(reference.running_mean, results[0][1])
    torch.testing.assert_close(reference.running_var, results[0][2])


def test_padding_does_not_move_memory_batchnorm_statistics():
    memory = small_memory()
    x = torch.randn(2, 7, 12)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 4:] = True
    memory(x, pad)
    stats = memory.query_norm.running_mean.clone(), memory.query_norm.running_var.clone()
    x[1, 4:] = 1e3  # change only the padding
    memory2 = small_memory()
    memory2(x, pad)
    torch.testing.assert_close(memory2.query_norm.running_mean, stats[0])
    torch.testing.assert_close(memory2.query_norm.running_var, stats[1])


def test_autocast_bfloat16_matches_float32_and_searches_in_float32():
    memory = small_memory().eval()
    x = torch.randn(16, 12)
    seen = {}
    search = memory.search

    def spy(q):
        seen["dtype"] = q.dtype
        return search(q)

    memory.search = spy
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = memory(x)
    assert seen["dtype"] == torch.float32
    torch.testing.assert_close(y.float(), small_memory().eval()(x), atol=0.05, rtol=0.05)


def test_sparse_values_give_sparse_gradient_equal_to_dense():
    x = torch.randn(9, 12)
    grads = []
    for sparse in (False, True):
        memory = small_memory(sparse=sparse)
        memory(x).square().sum().backward()
        grads.append(memory.values.weight.grad)
    assert grads[1].is_sparse and not grads[0].is_sparse
    torch.testing.assert_close(grads[1].to_dense(), grads[0])


def test_forward_backward_is_bitwise_deterministic():
    def run():
        memory = small_memory(n_keys=16, k_dim=16, heads=4, knn=8, output_dim=32)
        memory(torch.randn(3, 50, 12, generator=torch.Generator().manual_seed(1))).sum().backward()
        return [p.grad for p in memory.parameters()]

    for a, b in zip(run(), run()):
        assert torch.equal(a, b)


def test_from_config_and_shared_values():
    cfg = MemoryConfig(n_keys=8, k_dim=8, heads=2, knn=4, key_type="flat", query_norm="layernorm", gated=True)
    memory = ProductKeyMemory.from_config(cfg, 12, 10)
    assert (memory.n_keys, memory.k_dim, memory.heads, memory.knn, memory.key_type) == (8, 8, 2, 4, "flat")
    assert isinstance(memory.query_norm, torch.nn.LayerNorm) and memory.gated
    shared = value_table(64, 10)
    a, b = (ProductKeyMemory.from_config(cfg, 12, 10, values=shared) for _ in range(2))
    assert a.values is b.values is shared
    with pytest.raises(ValueError, match="shared values"):
        ProductKeyMemory.from_config(cfg, 12, 11, values=shared)


def test_any_leading_shape_and_bad_arguments():
    memory = small_memory()
    assert memory(torch.randn(2, 3, 4, 12)).shape == (2, 3, 4, 10)
    with pytest.raises(ValueError, match="knn"):
        small_memory(knn=9)
    with pytest.raises(ValueError, match="key_type"):
        small_memory(key_type="tree")
