"""The key search's options against independent references: the winnable pairs (memory.pair_candidates) and the
lower score precisions (memory.score_precision) against brute force over every slot and a float64 recomputation;
the Triton selection of the half scores (memory.half_topk) against torch.topk; the keys' gradient with fixed
shapes (selected_scores.selected_grads) bit for bit against the grouping by distinct keys it replaced; no graph
break from the search under torch.compile."""

import pytest
import torch
import torch.nn.functional as F
from test_memory import SEARCH_CASES, assert_exact_topk

from xlm_pkm.errors import ConfigError
from xlm_pkm.model.memory.keys import KEY_SEARCHES, selection_differences, winnable_pairs
from xlm_pkm.model.memory.pkm import MemoryConfig, ProductKeyMemory
from xlm_pkm.model.memory.selected_scores import selected_grads, top_scores


def product_keys(n_keys, k_dim, heads, knn, **options):
    torch.manual_seed(0)
    return KEY_SEARCHES["product"](MemoryConfig(n_keys=n_keys, k_dim=k_dim, heads=heads, knn=knn, **options))


@pytest.mark.parametrize("knn", [1, 2, 3, 7, 16, 32])
def test_winnable_pairs_are_the_pairs_of_ranks_within_knn(knn):
    pairs = {tuple(p) for p in winnable_pairs(knn).T.tolist()}
    assert pairs == {(a, b) for a in range(knn) for b in range(knn) if (a + 1) * (b + 1) <= knn}
    assert len(pairs) == winnable_pairs(knn).shape[1] == sum(knn // r for r in range(1, knn + 1))
    if knn == 32:
        assert len(pairs) == 119


@pytest.mark.parametrize("knn", [1, 2, 5, 12, 32])
def test_winnable_pairs_hold_the_knn_best_sums_of_two_descending_lists(knn):
    """Random lists and lists of few distinct values (many ties): the knn best sums of the winnable pairs are
    those of all knn² pairs."""
    gen = torch.Generator().manual_seed(knn)
    first, second = winnable_pairs(knn)
    for values in [torch.randn(500, 2, knn, generator=gen), torch.randint(-2, 3, (500, 2, knn), generator=gen).float()]:
        lists = values.sort(dim=-1, descending=True).values  # (500, 2, knn)
        every = (lists[:, 0, :, None] + lists[:, 1, None, :]).flatten(1).topk(knn).values  # (500, knn)
        winnable = (lists[:, 0, first] + lists[:, 1, second]).topk(knn).values
        assert torch.equal(winnable, every)


@pytest.mark.parametrize("n_keys,k_dim,heads,knn", SEARCH_CASES["product"] + [(64, 8, 2, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_winnable_search_equals_brute_force_and_all_pairs(n_keys, k_dim, heads, knn, dtype):
    winnable = product_keys(n_keys, k_dim, heads, knn, pair_candidates="winnable")
    every = product_keys(n_keys, k_dim, heads, knn)
    assert torch.equal(winnable.weight, every.weight) and "pair_ranks" not in winnable.state_dict()
    q = torch.randn(64, heads, k_dim).to(dtype)
    assert_exact_topk(winnable, q)
    with torch.no_grad():
        (scores, indices), (every_scores, every_indices) = winnable.search(q), every.search(q)
    assert torch.equal(scores, every_scores) and torch.equal(indices, every_indices)  # no ties: the same picks


@pytest.mark.parametrize("pair_candidates", ["all", "winnable"])
@pytest.mark.parametrize("n_keys,knn", [(8, 5), (16, 16), (32, 32)])
def test_search_with_tied_scores_keeps_the_brute_force_scores(pair_candidates, n_keys, knn):
    """Integer queries and sub-keys in {-1, 0, 1}: most scores tie (exact in float32). The chosen slots may differ
    from the brute force's among equal scores, but the knn scores are its knn best and each slot has its score."""
    keys = product_keys(n_keys, 8, 2, knn, pair_candidates=pair_candidates)
    gen = torch.Generator().manual_seed(n_keys)
    with torch.no_grad():
        keys.weight.copy_(torch.randint(-1, 2, keys.weight.shape, generator=gen))
    q = torch.randint(-1, 2, (64, 2, 8), generator=gen).float()
    assert_exact_topk(keys, q)  # scores: the brute force's knn best; each index has its returned score; distinct
    every = product_keys(n_keys, 8, 2, knn)
    every.load_state_dict(keys.state_dict())
    with torch.no_grad():
        assert torch.equal(keys.search(q)[0], every.search(q)[0])


def test_winnable_gradients_equal_all_pairs_gradients():
    """The same (scores, indices) reach the same backward: the gradients of q and the sub-keys agree (float64)."""
    grads = {}
    for pair_candidates in ["all", "winnable"]:
        keys = product_keys(16, 8, 2, 6, pair_candidates=pair_candidates).double()
        q = torch.randn(32, 2, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        scores, _ = keys.search(q)
        grads[pair_candidates] = torch.autograd.grad(scores.square().sum(), [q, keys.weight])
    for ours, ref in zip(grads["winnable"], grads["all"]):
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)


def test_bad_key_search_settings_give_one_line_errors_naming_the_key():
    for key, value in [("pair_candidates", "some"), ("score_precision", "float16")]:
        with pytest.raises(ConfigError, match=f"model.memory.{key}: expected one of"):
            ProductKeyMemory(8, 8, n_keys=4, k_dim=4, heads=1, knn=2, **{key: value})


def float64_scores(keys, q, indices):
    """(N, H, K): q · full_keys()[h, idx] in float64, the chosen slots' exact scores."""
    full = keys.full_keys().double()  # (H, S, d)
    return torch.einsum("nhd,nhkd->nhk", q.double(), full[torch.arange(keys.heads)[:, None], indices])


@pytest.mark.parametrize("key_type", ["product", "flat"])
@pytest.mark.parametrize("precision", ["bfloat16", "tf32"])
def test_lower_precision_choice_returns_the_float32_scores_of_the_slots_chosen(key_type, precision):
    torch.manual_seed(0)
    keys = KEY_SEARCHES[key_type](MemoryConfig(key_type=key_type, n_keys=16, k_dim=16, heads=2, knn=6,
                                               score_precision=precision))
    q = torch.randn(128, 2, 16)
    with torch.no_grad():
        scores, indices = keys.search(q)
    assert scores.dtype == torch.float32 and (scores[..., 1:] <= scores[..., :-1]).all()
    assert all(len(set(row)) == 6 for row in indices.view(-1, 6).tolist())
    # float32 rounding of a product key's two half sums of 8 terms each of magnitude < 1: far below 1e-5, while
    # bfloat16 products err by about 1e-2 here
    torch.testing.assert_close(scores.double(), float64_scores(keys, q, indices), rtol=0, atol=1e-5)
    if precision == "tf32":  # on the CPU TF32 computes float32: the choice is float32's
        assert selection_differences(keys, q) == 0


def margins_ok(q, keys, knn, bound):
    """q (N, G, d), keys (G, S, d) -> (N, G) bool: the gap between the knn-th and (knn+1)-th best float64 score
    exceeds twice `bound`, the most a score may move: the knn best are then the same in any precision within it."""
    best = torch.einsum("ngd,gsd->ngs", q.double(), keys.double()).topk(knn + 1).values
    return best[..., knn - 1] - best[..., knn] > 2 * bound


def test_bfloat16_choice_on_well_separated_scores_is_the_float32_choice():
    """Where the knn-th and (knn+1)-th scores lie further apart than bfloat16's error (inputs rounded to 8 bits,
    the sum rounded to 8 bits: below 2^-7 · Σ|q_i k_i|), the knn best are float32's."""
    torch.manual_seed(0)
    q, keys = torch.randn(256, 4, 8), torch.randn(4, 12, 8)  # (N, G, d), (G, S, d)
    bound = 2**-7 * torch.einsum("ngd,gsd->ngs", q.abs().double(), keys.abs().double()).amax(-1)  # (N, G)
    ok = margins_ok(q, keys, 3, bound)
    assert ok.float().mean() > 0.3  # enough rows tested
    _, low = top_scores(q, keys, 3, "bfloat16")
    _, exact = top_scores(q, keys, 3)
    assert torch.equal(low.sort(-1).values[ok], exact.sort(-1).values[ok])

    # the whole product-key search: where both halves are well separated, the slots are float32's
    search = product_keys(12, 16, 2, 3, score_precision="bfloat16")
    q = torch.randn(256, 2, 16)
    halves, sub_keys = q.view(256, 4, 8), search.weight.detach().view(4, 12, 8)  # groups (head, half)
    bound = 2**-7 * torch.einsum("ngd,gsd->ngs", halves.abs().double(), sub_keys.abs().double()).amax(-1)
    ok = margins_ok(halves, sub_keys, 3, bound).view(256, 2, 2).all(-1)  # (N, H)
    assert ok.float().mean() > 0.2
    with torch.no_grad():
        low = search.search(q)[1]
        search.score_precision = "float32"
        exact = search.search(q)[1]
    assert torch.equal(low.sort(-1).values[ok], exact.sort(-1).values[ok])


def test_selection_differences_counts_the_slots_float32_would_not_choose():
    torch.manual_seed(0)
    search = KEY_SEARCHES["flat"](MemoryConfig(key_type="flat", n_keys=32, k_dim=32, heads=2, knn=8,
                                               score_precision="bfloat16"))
    q = torch.randn(256, 2, 32)
    with torch.no_grad():
        low = search.search(q)[1]
        search.score_precision = "float32"
        exact = search.search(q)[1]
        search.score_precision = "bfloat16"
    missing = sum(len(set(a) - set(b)) for a, b in zip(low.view(-1, 8).tolist(), exact.view(-1, 8).tolist()))
    share = selection_differences(search, q)
    assert search.score_precision == "bfloat16"  # restored
    assert share == pytest.approx(missing / low.numel(), abs=1e-12) and 0 < share < 0.1


@pytest.mark.slow
def test_tf32_scores_op_has_a_faithful_fake():
    from xlm_pkm.model.memory.selected_scores import register_tf32_scores

    register_tf32_scores()
    torch.library.opcheck(torch.ops.xlm_pkm.tf32_scores.default, (torch.randn(5, 3, 4), torch.randn(3, 7, 4)))


def selected_grads_before(q, keys, indices, grad):
    """The keys' search backward before slot_runs: lookups grouped by the distinct keys read (a unique count),
    each key's lookups one bag, the rows copied into a zero gradient (the reference)."""
    N, G, K = indices.shape
    S, d = keys.shape[1:]
    flat = (indices + torch.arange(G)[:, None] * S).view(N * G, K)
    grad = grad.reshape(N * G, K)
    grad_q = F.embedding_bag(flat, keys.reshape(G * S, d), per_sample_weights=grad, mode="sum").view(N, G, d)
    keys_read, order = torch.sort(flat.reshape(-1), stable=True)
    distinct, counts = torch.unique_consecutive(keys_read, return_counts=True)
    starts = F.pad(torch.cumsum(counts, 0), (1, 0))
    rows = F.embedding_bag(order // K, q.reshape(N * G, d), starts[:-1], per_sample_weights=grad.reshape(-1)[order],
                           mode="sum")
    grad_keys = keys.new_zeros(G * S, d).index_copy_(0, distinct, rows.to(keys.dtype)).view(G, S, d)
    return grad_q, grad_keys


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_keys_gradient_with_fixed_shapes_is_bitwise_the_distinct_keys_grouping(dtype):
    gen = torch.Generator().manual_seed(0)
    for N, G, S, d, K in [(200, 4, 16, 8, 5), (0, 2, 8, 4, 3), (1, 1, 4, 2, 4), (300, 2, 3, 16, 2)]:
        q, keys = torch.randn(N, G, d, generator=gen, dtype=dtype), torch.randn(G, S, d, generator=gen, dtype=dtype)
        preference = torch.rand(N, G, S, generator=gen)
        preference[: N // 2, :, 0] = 2  # a hot key: half the rows read key 0
        indices = preference.argsort(-1, descending=True)[..., :K]  # distinct per row, repeated over rows
        grad = torch.randn(N, G, K, generator=gen, dtype=dtype)
        ours = selected_grads(q, keys, indices, grad, True, True)
        for got, ref in zip(ours, selected_grads_before(q, keys, indices, grad)):
            assert got.shape == ref.shape and torch.equal(got, ref)
        assert selected_grads(q, keys, indices, grad, False, True)[0] is None


# CPU tensors through the Triton kernel under the interpreter (conftest.py sets TRITON_INTERPRET=1 without a GPU);
# on a GPU, Triton is compiled for CUDA tensors, and test_cuda_searches_at_the_paper_shapes runs the kernel there
INTERPRETER_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton kernel on CPU tensors needs "
                                      "TRITON_INTERPRET=1; on a GPU, test_cuda_searches_at_the_paper_shapes runs it")


@pytest.mark.parametrize("options", [dict(), dict(pair_candidates="winnable", score_precision="tf32"),
                                     dict(key_type="flat", score_precision="bfloat16"),
                                     pytest.param(dict(half_topk="triton", score_precision="bfloat16"),
                                                  marks=INTERPRETER_ONLY)])
def test_search_and_its_backward_trace_as_one_graph(options):
    """No graph break from the key search (its backward included) under torch.compile."""
    keys = KEY_SEARCHES[options.get("key_type", "product")](MemoryConfig(n_keys=8, k_dim=8, heads=2, knn=4,
                                                                         **options))
    q = torch.randn(16, 2, 8, requires_grad=True)
    explained = torch._dynamo.explain(lambda q: keys.search(q)[0].square().sum())(q)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons


@INTERPRETER_ONLY
@pytest.mark.parametrize("S,knn,dtype", [(128, 32, torch.float32), (37, 5, torch.float32), (200, 16, torch.bfloat16),
                                         (64, 8, torch.float64), (1024, 4, torch.float32)])
def test_triton_row_topk_is_torch_topk(S, knn, dtype):
    """The Triton selection kernel (under TRITON_INTERPRET=1 without a GPU) against torch.topk: the same values,
    each index a distinct position holding its value; random rows and rows of few distinct values (ties)."""
    pytest.importorskip("triton")
    from xlm_pkm.model.memory.triton_topk import row_topk

    gen = torch.Generator().manual_seed(S)
    for scores in [torch.randn(3, 2, S, generator=gen), torch.randint(-2, 3, (3, 2, S), generator=gen).float()]:
        scores = scores.to(dtype)
        values, indices = row_topk(scores, knn)
        assert values.dtype == dtype and indices.dtype == torch.int64 and values.shape == (3, 2, knn)
        assert torch.equal(values, scores.topk(knn).values)
        assert torch.equal(scores.gather(-1, indices), values)
        assert all(len(set(row)) == knn for row in indices.view(-1, knn).tolist())


@INTERPRETER_ONLY
@pytest.mark.parametrize("options", [dict(), dict(pair_candidates="winnable", score_precision="tf32")])
def test_triton_half_topk_search_equals_brute_force_and_torch(options):
    pytest.importorskip("triton")
    triton = product_keys(16, 8, 2, 5, half_topk="triton", **options)
    assert_exact_topk(triton, torch.randn(24, 2, 8))
    q = torch.randn(24, 2, 8, requires_grad=True)
    scores, indices = triton.search(q)
    grads = torch.autograd.grad(scores.square().sum(), [q, triton.weight])
    torch_topk = product_keys(16, 8, 2, 5, **options)
    ref_scores, ref_indices = torch_topk.search(q)
    ref_grads = torch.autograd.grad(ref_scores.square().sum(), [q, torch_topk.weight])
    assert torch.equal(scores, ref_scores) and torch.equal(indices, ref_indices)  # no ties
    for g, r in zip(grads, ref_grads):
        assert torch.equal(g, r)


@INTERPRETER_ONLY
def test_triton_half_topk_op_has_a_faithful_fake_and_says_where_it_runs(monkeypatch):
    pytest.importorskip("triton")
    from xlm_pkm.model.memory.selected_scores import register_row_topk

    register_row_topk()
    torch.library.opcheck(torch.ops.xlm_pkm.row_topk.default, (torch.randn(3, 2, 20), 4))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="memory.half_topk=triton needs a CUDA device"):
        torch.ops.xlm_pkm.row_topk(torch.randn(2, 8), 3)


def float64_product_scores(keys, q):
    """q (N, H, k_dim) -> (N, H, n_keys²): every slot's score from the two halves' sub-keys, in float64."""
    halves = torch.einsum("nhpd,hpsd->nhps", q.double().view(*q.shape[:2], 2, -1), keys.weight.double())
    return (halves[:, :, 0, :, None] + halves[:, :, 1, None, :]).flatten(2)  # slot i·n_keys + j


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_searches_at_the_paper_shapes(compiled):
    """On a GPU, eager and compiled: every setting's search at 512² slots, knn 32 against float64 brute force
    (the scores float32's for the slots chosen; exact settings: the brute force's knn best; a lower precision:
    all but a few of float32's slots), TF32 left as it was, and the Triton selection equal to torch.topk on
    128- to 1,024-wide rows."""
    from xlm_pkm.model.memory.triton_topk import row_topk

    for S in [128, 512, 1024]:
        scores = torch.randn(4096, 8, S, device="cuda")
        values, indices = row_topk(scores, 32)
        assert torch.equal(values, scores.topk(32).values) and torch.equal(scores.gather(-1, indices), values)
    allowed = torch.backends.cuda.matmul.allow_tf32
    q = torch.randn(256, 4, 512, device="cuda")
    for options in [dict(pair_candidates="winnable"), dict(score_precision="tf32"), dict(score_precision="bfloat16"),
                    dict(half_topk="triton"), dict(pair_candidates="winnable", score_precision="tf32",
                                                   half_topk="triton")]:
        keys = product_keys(512, 512, 4, 32, **options).cuda()
        search = torch.compile(keys.search, fullgraph=True) if compiled else keys.search
        with torch.no_grad():
            scores, indices = search(q)
            full = float64_product_scores(keys, q)  # (N, H, 512²)
        assert torch.backends.cuda.matmul.allow_tf32 == allowed
        torch.testing.assert_close(scores.double(), full.gather(-1, indices), rtol=0, atol=1e-5)
        if "score_precision" not in options:  # exact: the brute force's knn best
            torch.testing.assert_close(scores.double(), full.topk(32).values, rtol=0, atol=1e-5)
        else:
            assert selection_differences(keys, q) < 0.01, options
