"""Tied adaptive input / adaptive softmax: normalised, equal to a dense softmax where the clusters are
trivial, the NLL path equal to the full log-probabilities, the input embedding as defined."""

import math

import pytest
import torch
import torch.nn.functional as F

from xlm_pkm.model.adaptive_io import AdaptiveEmbedding, AdaptiveLogSoftmax

DIM = 16


def make(vocab, cutoffs, seed=0):
    torch.manual_seed(seed)
    emb = AdaptiveEmbedding(vocab, DIM, cutoffs, factor=2)
    out = AdaptiveLogSoftmax(emb)
    with torch.no_grad():
        for b in out.biases:
            b.normal_()
    return emb, out


def test_log_probabilities_sum_to_one_and_nll_matches():
    """In float64, so that the check is of the factorisation, not of one CPU's float32 exp and log."""
    emb, out = make(50, [10, 20, 35])
    out.double()
    hidden = torch.randn(64, DIM, dtype=torch.float64)
    logp = out.log_prob(hidden)
    assert logp.shape == (64, 50) and logp.dtype == torch.float64
    torch.testing.assert_close(logp.logsumexp(-1), torch.zeros(64, dtype=torch.float64), atol=1e-12, rtol=0)
    target = torch.randint(0, 50, (64,))
    torch.testing.assert_close(out(hidden, target), -logp.gather(1, target[:, None]).squeeze(1), atol=1e-12, rtol=0)


def test_float32_and_half_logits_give_float32_log_probabilities():
    emb, out = make(50, [10, 20, 35])
    hidden = torch.randn(8, DIM)
    assert out.log_prob(hidden).dtype == torch.float32
    out.to(torch.bfloat16)
    assert out.log_prob(hidden.bfloat16()).dtype == torch.float32
    assert out(hidden.bfloat16(), torch.tensor([1, 12, 25, 45] * 2)).dtype == torch.float32


def test_trivial_clusters_equal_a_full_softmax():
    """Tail clusters of one token each: p(token) = p_head(its cluster), a dense softmax over the
    shortlist rows of E_0 and the cluster rows, all on h·P_0."""
    emb, out = make(12, [9, 10, 11])
    out.double()
    hidden = torch.randn(8, DIM, dtype=torch.float64)
    z = hidden @ emb.projections[0]
    weight = torch.cat([emb.tables[0], out.cluster.weight])  # (9 + 3, d_0)
    bias = torch.cat([out.biases[0], out.cluster.bias])
    torch.testing.assert_close(out.log_prob(hidden), F.log_softmax(z @ weight.t() + bias, -1), atol=1e-12, rtol=1e-12)


def test_embedding_is_the_scaled_projected_cluster_row_and_tied_to_the_output():
    emb, out = make(50, [10, 20, 35])
    tokens = torch.tensor([[3, 12, 40]])
    x = emb(tokens)
    for i, (c, row) in enumerate([(0, 3), (1, 2), (3, 5)]):
        torch.testing.assert_close(x[0, i], math.sqrt(DIM) * emb.projections[c] @ emb.tables[c][row])
    out(torch.randn(4, DIM), torch.tensor([1, 12, 25, 45])).sum().backward()
    assert all(t.grad is not None for t in emb.tables) and all(p.grad is not None for p in emb.projections)
    assert {id(p) for p in emb.parameters()} <= {id(p) for p in out.parameters()}


def test_bad_cutoffs_are_one_line_errors():
    with pytest.raises(ValueError,
                       match=r"adaptive cutoffs must increase strictly in \(0, vocab_size=30\), got \[10, 40\]"):
        AdaptiveEmbedding(30, DIM, [10, 40])
