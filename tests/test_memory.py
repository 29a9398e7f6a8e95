"""ProductKeyMemory and its key searches against independent references: brute force over all keys
(every registered key type), numerical gradients, the profiler's allocation record."""

import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from xlm_pkm.errors import ConfigError
from xlm_pkm.model.memory.keys import KEY_SEARCHES
from xlm_pkm.model.memory.pkm import MemoryConfig, ProductKeyMemory
from xlm_pkm.model.memory.ultramem import TuckerConfig
from xlm_pkm.model.memory.value_stores import TableValues


def small_memory(**kw):
    args = dict(input_dim=12, output_dim=10, n_keys=8, k_dim=8, heads=2, knn=4) | kw
    torch.manual_seed(0)
    return ProductKeyMemory(**args)


def assert_exact_topk(keys, q):
    """keys.search(q) is the exact top-knn of the brute-force scores q · full_keys() (float64)."""
    with torch.no_grad():
        scores, indices = keys.search(q)
        if hasattr(keys, "all_scores"):  # a search whose scores are not inner products with whole keys (tucker)
            full = keys.all_scores(q.double()).numpy()  # (N, H, n_slots)
        else:
            full = torch.einsum("nhd,hsd->nhs", q.double(), keys.full_keys().double()).numpy()  # (N, H, n_slots)
    N, H, K = q.shape[0], keys.heads, keys.knn
    assert scores.shape == indices.shape == (N, H, K)
    assert scores.dtype == torch.float32
    best = -np.sort(-full, axis=-1)[..., :K]  # the knn best scores of all keys
    np.testing.assert_allclose(scores.numpy(), best, atol=1e-5, rtol=0)
    idx = indices.numpy()
    assert idx.min() >= 0 and idx.max() < keys.n_slots == full.shape[-1]
    assert all(len(set(row)) == K for row in idx.reshape(-1, K))  # distinct slots
    # each returned index really is a key with the returned score (ties aside: equal scores, any order)
    np.testing.assert_allclose(np.take_along_axis(full, idx, axis=-1), scores.numpy(), atol=1e-5, rtol=0)
    assert (scores[..., 1:] <= scores[..., :-1]).all()


# (n_keys, k_dim, heads, knn) per key type: a new key structure adds its entry here
SEARCH_CASES = {
    "product": [(4, 4, 1, 4), (8, 16, 2, 5), (16, 8, 4, 16), (32, 32, 3, 8)],
    "flat": [(4, 8, 2, 3), (8, 8, 2, 16), (16, 5, 3, 40)],
    "tucker": [(4, 4, 1, 4), (8, 16, 2, 5), (16, 8, 4, 16)],  # exact with every row and column kept (topm = n_keys)
}


def test_every_key_type_has_search_cases():
    assert sorted(SEARCH_CASES) == sorted(KEY_SEARCHES)


@pytest.mark.parametrize("key_type,n_keys,k_dim,heads,knn",
                         [(t, *case) for t in KEY_SEARCHES for case in SEARCH_CASES.get(t, [])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_search_equals_brute_force(key_type, n_keys, k_dim, heads, knn, dtype):
    torch.manual_seed(0)
    cfg = MemoryConfig(key_type=key_type, n_keys=n_keys, k_dim=k_dim, heads=heads, knn=knn,
                       tucker=TuckerConfig(topm=n_keys))
    keys = KEY_SEARCHES[key_type](cfg)
    assert keys.n_slots == KEY_SEARCHES[key_type].slots(cfg)  # what sizes a shared value table
    assert_exact_topk(keys, torch.randn(64, heads, k_dim).to(dtype))


@pytest.mark.parametrize("key_type", ["product", "flat"])
def test_shared_keys_are_one_set_searched_by_every_head(key_type):
    torch.manual_seed(0)
    keys = KEY_SEARCHES[key_type](MemoryConfig(key_type=key_type, n_keys=8, k_dim=8, heads=3, knn=4, share_keys=True))
    assert keys.weight.shape[0] == 1 and keys.full_keys().shape[0] == 3
    assert_exact_topk(keys, torch.randn(32, 3, 8))
    _, indices = keys.search(torch.randn(5, 1, 8).expand(5, 3, 8))  # one query on every head: the same slots
    assert (indices == indices[:, :1]).all()


def test_product_indices_are_first_half_times_n_keys_plus_second_half():
    memory = small_memory(n_keys=4, k_dim=2, heads=1, knn=1)
    with torch.no_grad():
        memory.keys.weight.zero_()
        memory.keys.weight[0, 0, 2, 0] = 1.0  # first half: sub-key 2 matches the query
        memory.keys.weight[0, 1, 3, 0] = 1.0  # second half: sub-key 3 matches
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


@pytest.mark.parametrize("options", [dict(), dict(key_type="flat", query_norm="layernorm", temperature=0.5)])
def test_lookup_gives_the_slots_and_weights_forward_reads(options):
    memory = small_memory(**options).eval()
    x = torch.randn(2, 3, 12)
    weights, indices = memory.lookup(x)
    assert weights.shape == indices.shape == (2, 3, 2, 4) and weights.dtype == torch.float32
    with torch.no_grad():
        scores, expected = memory.search(memory.normalize_queries(memory.query_net(x.view(6, 12))))  # (6, H, knn)
    assert torch.equal(indices.view(6, 2, 4), expected)
    torch.testing.assert_close(weights.view(6, 2, 4), (scores / memory.cfg.temperature).softmax(-1))
    read = (weights[..., None] * memory.values.weight[indices]).sum((2, 3))  # (2, 3, output_dim)
    torch.testing.assert_close(memory(x), read)


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
    for name in ("query_net.0.weight", "keys.weight", "values.weight"):
        assert memory.get_parameter(name).grad.abs().sum() > 0, name


def naive_layer_norm(v, gain):
    """LayerNorm of one vector, written out: gain ⊙ (v - mean) / sqrt(biased variance + 1e-5)."""
    centred = v - v.sum() / v.numel()
    return gain * centred / torch.sqrt((centred * centred).sum() / v.numel() + 1e-5)


def naive_output(memory, x):
    """The layer written out one token and one head at a time (float64): every slot's score from the
    keys as the paper defines them (product: [c_i, c'_j], each half-query against its half; qk_norm:
    each normalised first; qk_layernorm: each LayerNormed first), the top-knn by sorting, softmax, the
    weighted rows summed over heads."""
    cfg = memory.cfg
    q = memory.normalize_queries(memory.query_net(x))  # (N, H, k_dim)
    weight = memory.keys.weight.expand(cfg.heads, *memory.keys.weight.shape[1:])
    gq, gk = (memory.keys.query_gain, memory.keys.key_gain) if cfg.qk_layernorm else (None, None)

    def norm(v, gain):
        if cfg.qk_norm:
            return v / v.norm()
        return v if gain is None else naive_layer_norm(v, gain)

    out = []
    for t in range(x.shape[0]):
        total = torch.zeros(memory.output_dim, dtype=x.dtype)
        for h in range(cfg.heads):
            if cfg.key_type == "product":
                half, n = cfg.k_dim // 2, cfg.n_keys
                s = torch.stack([norm(q[t, h, :half], gq) @ norm(weight[h, 0, i], gk)
                                 + norm(q[t, h, half:], gq) @ norm(weight[h, 1, j], gk)
                                 for i in range(n) for j in range(n)])  # (n²,) slot i·n + j
            else:
                s = torch.stack([norm(q[t, h], gq) @ norm(weight[h, slot], gk) for slot in range(memory.n_slots)])
            best = sorted(range(memory.n_slots), key=lambda slot: -s[slot].item())[:cfg.knn]
            w = torch.softmax(s[best] / cfg.temperature, 0)
            total = total + sum(w[r] * memory.values.weight[slot] for r, slot in enumerate(best))
        out.append(total)
    return torch.stack(out)


@pytest.mark.parametrize("options", [dict(), dict(sparse=True), dict(key_type="flat"), dict(share_keys=True),
                                     dict(qk_norm=True, temperature=0.5, sparse=True),
                                     dict(key_type="flat", share_keys=True, qk_norm=True), dict(qk_layernorm=True),
                                     dict(key_type="flat", qk_layernorm=True, sparse=True)])
@pytest.mark.parametrize("dense_backward", [False, True], ids=["selected_rows", "dense_score_grad"])
def test_output_and_every_gradient_equal_the_naive_layer_in_float64(options, dense_backward, one_thread, monkeypatch):
    """The search's backward through the selected keys only (selected_scores.py; or through the dense score
    gradient, the GPU's way) and the sparse rows (value_read.slot_sums) against autograd through the dense,
    written-out computation."""
    from xlm_pkm.model.memory import selected_scores

    monkeypatch.setattr(selected_scores, "DENSE_BACKWARD_DEVICES", ("cpu",) if dense_backward else ())
    options = dict(options)
    sparse = options.pop("sparse", False)
    memory = small_memory(input_dim=6, output_dim=5, n_keys=4, k_dim=4, heads=2, knn=3, query_norm="layernorm",
                          **options).double()
    memory.sparse_values = sparse
    if memory.cfg.qk_layernorm:  # gains of their own, not the init's constant
        with torch.no_grad():
            memory.keys.query_gain.uniform_(0.5, 1.5), memory.keys.key_gain.uniform_(-1.5, -0.5)
    x = torch.randn(7, 6, dtype=torch.float64, requires_grad=True)
    ours, ref = memory(x), naive_output(memory, x)
    assert (ours - ref).abs().max() <= 1e-10
    grad_out = torch.randn_like(ours)
    params = [x, *memory.parameters()]
    ours_grads = torch.autograd.grad(ours, params, grad_out)
    ref_grads = torch.autograd.grad(ref, params, grad_out)
    for name, g, r in zip(["x", *dict(memory.named_parameters())], ours_grads, ref_grads):
        assert g.is_sparse == (sparse and name == "values.weight"), name
        assert (g.to_dense() - r).abs().max() <= 1e-10, name


def test_flat_search_scores_the_tokens_in_chunks_with_the_same_result(monkeypatch):
    """A flat search over many slots scores a few tokens at a time (all N·H·S scores at 1M slots do not fit a
    GPU): no allocation near the whole score tensor, and the same output and gradients as one search."""
    from xlm_pkm.model.memory import selected_scores

    N, H, S = 512, 2, 64**2  # the whole (N, H, S) float32 score tensor: 16 MiB
    memory = small_memory(input_dim=16, output_dim=8, key_type="flat", n_keys=64, k_dim=8, heads=H, knn=4)
    x = torch.randn(N, 16, requires_grad=True)
    out = memory(x)
    grads = torch.autograd.grad(out.square().sum(), [x, *memory.parameters()])
    monkeypatch.setattr(selected_scores, "SCORES_AT_ONCE", 16 * H * S)  # 16 tokens at a time: 512 KiB
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        chunked = memory(x)
    assert max(e.cpu_memory_usage for e in prof.events()) < N * H * S * 4 / 8
    assert torch.equal(chunked, out)
    for g, c in zip(grads, torch.autograd.grad(chunked.square().sum(), [x, *memory.parameters()])):
        assert torch.equal(g, c)


def test_no_tokens_by_heads_knn_by_output_dim_intermediate():
    N, H, K, D = 512, 4, 32, 256  # a (N, H*K, D) float32 tensor would be 64 MiB
    memory = small_memory(input_dim=64, output_dim=D, n_keys=64, k_dim=32, heads=H, knn=K)
    x = torch.randn(N, 64, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        memory(x).sum().backward()
    largest = max(e.cpu_memory_usage for e in prof.events())  # bytes allocated by an op (with children)
    value_grad = memory.values.weight.numel() * 4
    assert value_grad <= largest < N * H * K * D * 4 / 4, largest  # the profiler saw the 4 MiB value gradient


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
        memory = small_memory()
        memory.sparse_values = sparse
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


def test_config_with_field_overrides_and_shared_values():
    cfg = MemoryConfig(n_keys=8, k_dim=8, heads=2, knn=4, key_type="flat", query_norm="layernorm", gated=True)
    memory = ProductKeyMemory(12, 10, cfg, knn=3)
    assert memory.cfg == MemoryConfig(n_keys=8, k_dim=8, heads=2, knn=3, key_type="flat", query_norm="layernorm",
                                      gated=True) and cfg.knn == 4  # the caller's config is not changed
    assert memory.keys.knn == 3 and memory.n_slots == 64 and not memory.sparse_values
    assert isinstance(memory.keys, KEY_SEARCHES["flat"]) and isinstance(memory.query_norm, torch.nn.LayerNorm)
    assert [name for name, _ in memory.named_parameters()][:2] == ["keys.weight", "query_net.0.weight"]
    shared = TableValues(cfg, 12, 10, 64)
    a, b = (ProductKeyMemory(12, 10, cfg, shared_values=shared) for _ in range(2))
    assert a.values is b.values is shared
    with pytest.raises(ValueError, match=r"^shared values hold 64 slots of 10 outputs, this memory needs 64 of 11$"):
        ProductKeyMemory(12, 11, cfg, shared_values=shared)


def test_any_leading_shape_and_bad_arguments():
    memory = small_memory()
    assert memory(torch.randn(2, 3, 4, 12)).shape == (2, 3, 4, 10)
    with pytest.raises(ValueError, match=r"^memory.knn=9 must be in \[1, 8\] for key_type=product with n_keys=8$"):
        small_memory(knn=9)
    with pytest.raises(ValueError, match=r"^memory.knn=65 must be in \[1, 64\] for key_type=flat with n_keys=8$"):
        small_memory(knn=65, key_type="flat")
    with pytest.raises(ValueError, match=r"^memory.k_dim=7 must be even for key_type=product"):
        small_memory(k_dim=7)
    with pytest.raises(ConfigError, match=r"^model.memory.temperature: must be > 0, got 0"):
        small_memory(temperature=0)
    with pytest.raises(ConfigError,
                       match=rf"^model.memory.key_type: expected one of {' [|] '.join(KEY_SEARCHES)}, got 'tree'"):
        small_memory(key_type="tree")
    with pytest.raises(ConfigError, match=r"^model.memory.query_norm: expected one of batchnorm \| layernorm"):
        small_memory(query_norm="batchnrm")
