"""Score functions (memory.score) against the equations written out: every slot scored densely, the
top-knn by brute force, the weights by the paper's formula, outputs and every gradient in float64."""

import pytest
import torch

from xlm_pkm.model.memory.pkm import ProductKeyMemory
from xlm_pkm.model.memory.scores import SCORE_FUNCTIONS

# the weights of the knn selected scores s (descending), as each paper writes them
PAPER_WEIGHTS = {
    "softmax": lambda s, t: torch.exp(s / t) / torch.exp(s / t).sum(-1, keepdim=True),  # Lample et al. 2019, eq. (2)
    "relu": lambda s, t: torch.where(s > 0, s, torch.zeros_like(s)),  # Csordás et al. 2023, §4: max(0, s)
    "identity": lambda s, t: s,  # UltraMem: the scores themselves
}


def test_every_score_function_has_its_equation_here():
    assert sorted(PAPER_WEIGHTS) == sorted(SCORE_FUNCTIONS)


def naive_memory(memory, x):
    """The layer's output written from the paper: queries, all n_keys² product keys scored, top-knn."""
    cfg, n = memory.cfg, memory.cfg.n_keys
    W, b = memory.query_net[0].weight, memory.query_net[0].bias
    keys, values = memory.keys.weight, memory.values.weight  # (H, 2, n, k_dim/2), (n², out)
    out = torch.zeros(x.shape[0], memory.output_dim, dtype=x.dtype)
    for t in range(x.shape[0]):
        q = W @ x[t] + b  # (H * k_dim,)
        for h in range(cfg.heads):
            qh = q[h * cfg.k_dim:(h + 1) * cfg.k_dim]
            half = cfg.k_dim // 2
            s = torch.stack([qh[:half] @ keys[h, 0, i] + qh[half:] @ keys[h, 1, j]
                             for i in range(n) for j in range(n)])  # (n²,) slot i·n + j
            best = sorted(range(n * n), key=lambda slot: -s[slot].item())[:cfg.knn]
            w = PAPER_WEIGHTS[cfg.score](s[best], cfg.temperature)
            out[t] = out[t] + sum(w[r] * values[slot] for r, slot in enumerate(best))
    return out


@pytest.mark.parametrize("score", sorted(SCORE_FUNCTIONS))
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_layer_equals_the_equations_with_every_gradient(score, temperature):
    torch.manual_seed(0)
    memory = ProductKeyMemory(6, 5, n_keys=4, k_dim=4, heads=2, knn=3, query_norm="none", score=score,
                              temperature=temperature).double()
    x = torch.randn(7, 6, dtype=torch.float64, requires_grad=True)
    ours = memory(x)
    ref = naive_memory(memory, x)
    assert (ours - ref).abs().max() <= 1e-10
    grad_out = torch.randn_like(ours)
    params = [x, *memory.parameters()]
    for g, r in zip(torch.autograd.grad(ours, params, grad_out), torch.autograd.grad(ref, params, grad_out)):
        assert (g - r).abs().max() <= 1e-10


def test_relu_reads_of_weight_zero_are_not_counted_as_usage():
    torch.manual_seed(0)
    memory = ProductKeyMemory(6, 5, n_keys=8, k_dim=4, heads=2, knn=8, query_norm="none", score="relu").eval()
    with torch.no_grad():  # every second half-query is b and every second-half sub-key -b/|b|²: scores s1_i - 1
        memory.query_net[0].weight[2:4].zero_()
        memory.query_net[0].weight[6:8].zero_()
        b = memory.query_net[0].bias
        b[2:4], b[6:8] = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0])
        memory.keys.weight[:, 1] = -torch.tensor([1.0, 2.0]) / 5.0
    memory.track_stats = True
    x = torch.randn(50, 6)
    weights, indices = memory.lookup(x)
    memory(x)
    assert (weights == 0).any() and (weights > 0).any()
    read = torch.zeros(64).index_add_(0, indices[weights > 0], torch.ones(int((weights > 0).sum())))
    assert memory.slot_stats.counts.tolist() == read.double().tolist()
    assert memory.stats()["usage_count"] == pytest.approx(100.0 * float((read > 0).double().mean()))
