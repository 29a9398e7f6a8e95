"""The all-attention family through TransformerLM: the paper's parameter counts (counted on the meta
device against the shape formulas), blocks with the stream cache equal the whole sequence, causality,
span loss and clamp, the stream state for resuming, a product-key memory inside, the configs."""

import copy
from pathlib import Path

import pytest
import torch

from xlm_pkm.config import load_config
from xlm_pkm.errors import ConfigError
from xlm_pkm.model.adaptive_span import SpanConfig
from xlm_pkm.model.memory.pkm import MemoryConfig
from xlm_pkm.model.transformer import ModelConfig, TransformerLM

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "all_attention"
ENWIK8_VOCAB = 205  # the authors': 204 non-newline bytes of enwik8's train split + <eos>
WT103_VOCAB = 267_735  # the authors': WikiText-103 train types + <eos>


def on_meta(cfg: ModelConfig) -> TransformerLM:
    with torch.device("meta"):
        return TransformerLM(cfg)


def layer_params(d, n_persistent, ffn=0):
    """Per layer: q, k, v, o without bias, the persistent keys and values, the span ratios (8 heads),
    one LayerNorm, and an FFN with its LayerNorm when kept."""
    ffn_params = 2 * d * ffn + ffn + d + 2 * d if ffn else 0
    return 4 * d * d + 2 * d * n_persistent + 8 + 2 * d + ffn_params


@pytest.mark.parametrize("config, vocab, millions, expected", [
    # layers + shared position table (64 x S) + input embedding + output Linear with bias
    ("enwik8_small.yaml", ENWIK8_VOCAB, 38.5, 18 * layer_params(512, 1024) + 64 * 8192 + 2 * 205 * 512 + 205),
    ("enwik8_large.yaml", ENWIK8_VOCAB, 114.0, 36 * layer_params(512, 2048) + 64 * 8192 + 2 * 205 * 512 + 205),
    ("adaptive_span_baseline.yaml", ENWIK8_VOCAB, 38.5,
     12 * layer_params(512, 0, ffn=2048) + 64 * 8192 + 2 * 205 * 512 + 205),
    # adaptive I/O: tables 20k x 512, 20k x 128, 160k x 32, 67,735 x 8; projections 512 x (512, 128, 32, 8);
    # output biases (one per word) and the 512 -> 3 cluster logits
    ("wikitext103.yaml", WT103_VOCAB, 132.5, 36 * layer_params(512, 2048) + 64 * 2048
     + 20000 * 512 + 20000 * 128 + 160000 * 32 + 67735 * 8 + 512 * (512 + 128 + 32 + 8) + WT103_VOCAB + 512 * 3 + 3),
])
@pytest.mark.slow
def test_paper_parameter_counts(config, vocab, millions, expected):
    cfg = load_config(CONFIGS / config, [f"model.vocab_size={vocab}"])
    total = on_meta(cfg.model).param_counts()["total"]
    assert total == expected
    assert round(total / 1e6, 1) == millions


def tiny(**kw):
    args = dict(vocab_size=40, dim=16, n_layers=3, n_heads=2, family="all_attention", sublayers=["all_attention"],
                persistent_vectors=4, span=SpanConfig(max_span=64, adaptive=True, ramp=8, loss_coeff=1e-3)) | kw
    torch.manual_seed(0)
    return TransformerLM(ModelConfig(**args))


def open_spans(model, z=1.0):
    with torch.no_grad():
        for span in model.spans():
            span.z.fill_(z)


@pytest.mark.parametrize("kw", [{}, dict(sublayers=["span_attention", "ffn"], persistent_vectors=0),
                                dict(persistent_mixing="head_split"),
                                dict(mem_layers=[2], memory=MemoryConfig(n_keys=8, k_dim=16, heads=2, knn=4,
                                                                         query_norm="layernorm"))])
def test_blocks_with_cache_equal_whole_sequence(kw):
    model = tiny(**kw).eval()
    open_spans(model)
    tokens = torch.randint(0, 40, (2, 80))  # longer than max_span (64): the cache carries the context
    with torch.no_grad():
        whole = model(tokens)
        model.reset_stream_state()
        blocks = torch.cat([model(tokens[:, s:s + 20]) for s in range(0, 80, 20)], 1)
    torch.testing.assert_close(blocks, whole, rtol=1e-4, atol=1e-5)


def test_causal():
    model = tiny().eval()
    open_spans(model, 0.3)
    tokens = torch.randint(0, 40, (2, 30))
    with torch.no_grad():
        logits = model(tokens)
        for t in (0, 11, 28):
            changed = tokens.clone()
            changed[:, t + 1] = (changed[:, t + 1] + 1) % 40
            model.reset_stream_state()
            out = model(changed)
            torch.testing.assert_close(out[:, : t + 1], logits[:, : t + 1], rtol=0, atol=1e-6)
            assert not torch.allclose(out[:, t + 1], logits[:, t + 1])
            model.reset_stream_state()


def test_stream_state_resumes_exactly():
    model = tiny().eval()
    open_spans(model, 0.5)
    tokens = torch.randint(0, 40, (2, 48))
    with torch.no_grad():
        model(tokens[:, :16])
        model(tokens[:, 16:32])
        saved = copy.deepcopy(model.stream_state())
        expected = model(tokens[:, 32:])
        model.reset_stream_state()
        model(tokens[:, :8])  # another stream in between
        model.load_stream_state(saved)
        torch.testing.assert_close(model(tokens[:, 32:]), expected, rtol=0, atol=0)
    assert all(t is None or not t.requires_grad for t in model.stream_state())


def test_span_loss_and_clamp():
    model = tiny()
    with torch.no_grad():
        for i, span in enumerate(model.spans()):
            span.z.copy_(torch.tensor([0.1 * i, 2.0 - i]))
    expected = sum(1e-3 * 64 * (0.1 * i + 2.0 - i) / 2 for i in range(3))
    torch.testing.assert_close(model.span_loss(), torch.tensor(expected))
    model.clamp_spans()
    assert all(0.0 <= v <= 1.0 for span in model.spans() for v in span.z.tolist())


def test_memory_layer_inside_an_all_attention_network():
    model = tiny(mem_layers=[2], memory=MemoryConfig(n_keys=8, k_dim=16, heads=2, knn=4))
    assert model.plan == [["all_attention"], ["all_attention", "memory"], ["all_attention"]]
    assert [layer for layer, _ in model.memories()] == [2]
    model.train()
    loss = torch.nn.functional.cross_entropy(model(torch.randint(0, 40, (4, 12))).flatten(0, 1),
                                             torch.randint(0, 40, (48,))) + model.span_loss()
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_flops_follow_the_span_in_use():
    """Spans 64 -> 256 tokens: per layer and token, 18 · ΔL · dim for the context and position scores and
    the mixing, and 12 · dim² · ΔL / M for the keys and values of the longer cache."""
    model = tiny(span=SpanConfig(max_span=256, ramp=8))
    open_spans(model, 0.0)
    short = model.dense_flops_per_token(16)
    open_spans(model, 1.0)
    assert model.dense_flops_per_token(16) - short == 3 * (18 * 192 * 16 + 12 * 16 * 16 * 192 / 16)


@pytest.mark.parametrize("override, message", [
    ("model.family=other", "model.family"),
    ("model.span.ramp=0", "model.span.ramp"),
    ("model.persistent_vectors=-1", "model.persistent_vectors"),
    ("model.persistent_mixing=both", "model.persistent_mixing"),
    ("model.family=transformer", "model.sublayers: all_attention needs model.family=all_attention"),
    ("model.adaptive_cutoffs=[20,10]", "model.adaptive_cutoffs: must increase strictly"),
])
def test_config_errors_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(CONFIGS / "enwik8_small.yaml", [override])


def test_evaluation_keeps_its_own_stream_state():
    """model.eval() starts evaluation streams from a zero cache (any batch size); model.train() returns to
    the training streams' cache as they were."""
    model = tiny()
    open_spans(model, 0.5)
    tokens = torch.randint(0, 40, (2, 32))
    with torch.no_grad():
        model.train()
        model(tokens[:, :16])
        training_state = [t.clone() for t in model.stream_state()]
        model.eval()
        assert all(t is None for t in model.stream_state())
        fresh = model(tokens[:1, 16:])  # another batch size: evaluation streams
        model.train()
        torch.testing.assert_close(model.stream_state(), training_state, rtol=0, atol=0)
        model.eval()
        torch.testing.assert_close(model(tokens[:1, 16:]), fresh, rtol=0, atol=0)  # a new pass, fresh again


def test_adaptive_softmax_lm_nll_matches_its_log_probabilities():
    """In float64: a check of the factorisation, not of one CPU's float32 exp and log (test_adaptive_io's float32
    check was 4.6e-5 off on CI's CPU)."""
    model = tiny(vocab_size=60, adaptive_cutoffs=[10, 30], adaptive_factor=2, dropout=0.1).double().eval()
    tokens, targets = torch.randint(0, 60, (2, 12)), torch.randint(0, 60, (2, 12))
    with torch.no_grad():
        nll = model(tokens, targets=targets)
        model.reset_stream_state()
        logp = model(tokens)
    assert logp.dtype == torch.float64
    torch.testing.assert_close(logp.logsumexp(-1), torch.zeros(2, 12, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(nll, -logp.gather(-1, targets[..., None]).squeeze(-1), atol=1e-12, rtol=0)
