"""TransformerLM: memory placement, sublayers, causality, the key/value cache, the paper's configurations,
counts and FLOPs."""

import dataclasses

import pytest
import torch

from xlm_pkm.model.blocks import SUBLAYERS
from xlm_pkm.model.memory.keys import KEY_SEARCHES
from xlm_pkm.model.memory.pkm import MemoryConfig, ProductKeyMemory
from xlm_pkm.model.transformer import ModelConfig, TransformerLM, layer_sublayers, memory_layers, resolve_memory_layers

TINY_MEMORY = MemoryConfig(n_keys=8, k_dim=16, heads=2, knn=4)


def tiny(**kw):
    args = dict(vocab_size=50, dim=32, n_layers=4, n_heads=4, max_len=24, n_memories=1, memory=TINY_MEMORY) | kw
    torch.manual_seed(0)
    return TransformerLM(ModelConfig(**args))


@pytest.mark.parametrize("n_layers,n_memories,expected", [
    (16, 2, [6, 12]), (6, 1, [5]), (12, 1, [9]), (24, 3, [6, 12, 18]), (12, 2, [5, 9]), (12, 3, [3, 6, 9]),
    (16, 1, [12]), (24, 1, [18]), (6, 2, [3, 5]), (12, 0, [])])
def test_memory_layers_rule(n_layers, n_memories, expected):
    assert memory_layers(n_layers, n_memories) == expected


def test_explicit_layers_win_and_bad_placements_are_rejected():
    assert resolve_memory_layers(ModelConfig(n_layers=6, n_memories=1, mem_layers=[4, 2])) == [2, 4]
    for bad in (dict(mem_layers=[0]), dict(mem_layers=[7]), dict(mem_layers=[3, 3]), dict(n_memories=6)):
        with pytest.raises(ValueError, match="model.(n_memories|mem_layers)"):
            resolve_memory_layers(dataclasses.replace(ModelConfig(n_layers=6), **bad))


@pytest.mark.parametrize("pre_norm", [False, True])
@pytest.mark.parametrize("mem_mode", ["replace", "add"])
def test_causal_in_eval_mode(pre_norm, mem_mode):
    model = tiny(pre_norm=pre_norm, mem_mode=mem_mode, dropout=0.1, attention_dropout=0.1).eval()
    tokens = torch.randint(0, 50, (3, 20))
    logits = model(tokens)
    for t in (0, 7, 18):
        changed = tokens.clone()
        changed[:, t + 1] = (changed[:, t + 1] + 1) % 50
        torch.testing.assert_close(model(changed)[:, : t + 1], logits[:, : t + 1], atol=1e-5, rtol=0)
        assert not torch.allclose(model(changed)[:, t + 1], logits[:, t + 1])


def test_sublayers_per_mode_and_memories():
    replace, add = tiny(n_memories=2), tiny(n_memories=2, mem_mode="add")
    assert [layer for layer, _ in replace.memories()] == memory_layers(4, 2) == [2, 3]
    kinds = lambda model, i: [type(f).__name__ for f in model.blocks[i].sublayers]  # noqa: E731
    assert kinds(replace, 1) == ["SelfAttention", "ProductKeyMemory"]
    assert kinds(add, 1) == ["SelfAttention", "FeedForward", "ProductKeyMemory"]
    assert kinds(replace, 0) == ["SelfAttention", "FeedForward"]


def test_layer_sublayers_from_config():
    cfg = ModelConfig(n_layers=4, sublayers=["attention", "ffn", "attention"])
    assert layer_sublayers(cfg, [2], 1) == ["attention", "ffn", "attention"]
    assert layer_sublayers(cfg, [2], 2) == ["attention", "memory", "attention"]
    assert layer_sublayers(dataclasses.replace(cfg, mem_mode="add"), [2], 2) == ["attention", "ffn", "attention",
                                                                                 "memory"]
    assert layer_sublayers(dataclasses.replace(cfg, sublayers=["attention"]), [2], 2) == ["attention", "memory"]
    model = tiny(sublayers=["attention", "attention", "ffn"], mem_layers=[3])
    assert [type(f).__name__ for f in model.blocks[2].sublayers] == ["SelfAttention", "SelfAttention",
                                                                     "ProductKeyMemory"]
    assert {"all_attention", "attention", "ffn", "memory", "span_attention"} <= set(SUBLAYERS)  # and any plugin's
    with pytest.raises(KeyError, match="unknown block sublayer 'moe'"):
        tiny(sublayers=["attention", "moe"])


def test_param_counts_and_shared_values():
    model = tiny(n_memories=2)
    counts = model.param_counts()
    assert counts["memory_values"] == 2 * 64 * 32
    assert counts["total"] == sum(p.numel() for p in model.parameters()) == counts["dense"] + counts["memory_values"]
    attention, ffn = 32 * 96 + 96 + 32 * 32 + 32, 32 * 128 + 128 + 128 * 32 + 32
    memory = 32 * 32 + 32 + 2 * 32 + 2 * 2 * 8 * 8  # query net, BatchNorm, sub-keys (values not dense)
    norms_and_embeddings = 4 * 2 * 2 * 32 + 2 * 32 + 50 * 32 + 24 * 32
    assert (counts["attention"], counts["ffn"], counts["memory"]) == (4 * attention, 2 * ffn, 2 * memory)
    assert counts["dense"] == 4 * attention + 2 * ffn + 2 * memory + norms_and_embeddings
    assert [p.shape for p in model.memory_value_parameters()] == [(64, 32)] * 2
    shared = tiny(n_memories=2, memory=dataclasses.replace(TINY_MEMORY, share_values=True))
    (_, a), (_, b) = shared.memories()
    assert a.values is b.values
    assert shared.memory_value_parameters() == [a.values.weight]
    assert shared.param_counts()["memory_values"] == 64 * 32
    assert shared.param_counts()["dense"] == counts["dense"]


def test_dense_flops_per_token_formula():
    model = tiny(n_layers=2, n_memories=0, vocab_size=10, dim=8, n_heads=2, max_len=4)
    # per layer: qkv 8*24+24, out 8*8+8, ffn 8*32+32 + 32*8+8, 2 norms 2*16; token embedding 10*8; emb norm 16
    dense = 2 * (216 + 72 + 288 + 264 + 32) + 80 + 16
    assert model.param_counts()["dense"] == dense + 4 * 8  # + position embeddings
    assert model.dense_flops_per_token(4) == 6 * dense + 12 * 2 * 4 * 8
    with_memory = tiny()
    (_, memory), = with_memory.memories()
    without_reads = 6 * (with_memory.param_counts()["dense"] - 24 * 32) + 12 * 4 * 24 * 32
    assert with_memory.dense_flops_per_token(24) == without_reads + 6 * memory.heads * memory.knn * 32


@pytest.mark.parametrize("options", [
    dict(), dict(n_memories=2, mem_mode="add", pre_norm=True),
    dict(n_memories=2, memory=MemoryConfig(n_keys=8, k_dim=16, heads=3, knn=5, key_type="flat", gated=True,
                                           share_values=True, query_hidden=[7])),
    dict(mem_layers=[1, 4], ffn_dim=40, memory=dataclasses.replace(TINY_MEMORY, query_norm="layernorm"))])
def test_flops_summed_over_sublayers_equal_the_whole_model_formula(options):
    """The per-sublayer FLOPs add up to the formula of the whole model (as computed before sublayers
    reported their own): 6 · (dense params - position embeddings + value reads) + 12 · L · T · dim."""
    model = tiny(**options)
    reads = sum(m.heads * m.knn * m.output_dim for _, m in model.memories())
    dense = model.param_counts()["dense"] - model.pos_emb.weight.numel()
    for seq_len in (1, 24):
        assert model.dense_flops_per_token(seq_len) == 6.0 * (dense + reads) + 12.0 * 4 * seq_len * 32


def test_forward_shapes_errors_and_autocast():
    model = tiny()
    tokens = torch.randint(0, 50, (2, 24))
    assert model(tokens).shape == (2, 24, 50)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.isfinite(model(tokens)).all()
    with pytest.raises(ValueError, match="max_len"):
        model(torch.zeros(1, 25, dtype=torch.long))
    with pytest.raises(ValueError, match="vocab_size"):
        TransformerLM(ModelConfig(vocab_size=0))
    assert [p.shape for p in model.parameters()].count((50, 32)) == 1  # output projection tied to the embeddings


def test_memory_stats_toggle_and_state_dict():
    model = tiny().eval()
    keys = set(model.state_dict())
    model.set_memory_stats(True)
    model(torch.randint(0, 50, (2, 10)))
    (_, memory), = model.memories()
    assert memory.slot_weights().sum().item() == pytest.approx(2 * 10 * TINY_MEMORY.heads)
    assert set(model.state_dict()) == keys
    model.set_memory_stats(False)  # off: what was gathered stays readable
    assert not memory.track_stats and memory.slot_weights().sum().item() == pytest.approx(2 * 10 * TINY_MEMORY.heads)
    model.set_memory_stats(True)  # on again: from zero
    assert memory.track_stats and not memory.slot_weights().any()


def test_training_step_is_bitwise_deterministic():
    def step():
        model = tiny(dropout=0.1, attention_dropout=0.1, memory=dataclasses.replace(TINY_MEMORY, value_dropout=0.1))
        torch.manual_seed(1)
        tokens = torch.randint(0, 50, (4, 24))
        torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        return [p.grad for p in model.parameters()]

    for a, b in zip(step(), step()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("n_layers,dim,n_memories", [(L, d, n) for L in (12, 16, 24) for d in (1024, 1600)
                                                     for n in range(4)])
def test_paper_configurations_build(n_layers, dim, n_memories):
    cfg = ModelConfig(vocab_size=60000, dim=dim, n_layers=n_layers, n_heads=16, n_memories=n_memories)
    with torch.device("meta"):
        model = TransformerLM(cfg)
    assert len(model.memories()) == n_memories
    assert model.param_counts()["memory_values"] == n_memories * 512**2 * dim


@pytest.mark.parametrize("n_keys", [128, 256, 384, 512, 768, 1024])
@pytest.mark.parametrize("key_type", list(KEY_SEARCHES))
def test_ablation_model_builds(n_keys, key_type):
    cfg = ModelConfig(vocab_size=60000, dim=512, n_layers=6, n_heads=8, n_memories=1,
                      memory=MemoryConfig(n_keys=n_keys, key_type=key_type))
    with torch.device("meta"):
        model = TransformerLM(cfg)
    (layer, memory), = model.memories()
    assert layer == 5 and isinstance(memory, ProductKeyMemory)
    assert memory.n_slots == KEY_SEARCHES[key_type].slots(cfg.memory)


def test_set_sparse_values_reaches_every_memory():
    model = tiny(n_memories=2, memory=dataclasses.replace(TINY_MEMORY, share_values=True))
    assert [m.sparse_values for _, m in model.memories()] == [False, False]
    model.set_sparse_values(True)
    assert [m.sparse_values for _, m in model.memories()] == [True, True]
    tokens = torch.randint(0, 50, (2, 8))
    torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    (values,) = model.memory_value_parameters()
    assert values.grad.is_sparse


@pytest.mark.parametrize("pre_norm,mem_mode", [(False, "replace"), (True, "add")])
def test_cached_decoding_equals_the_full_forward(pre_norm, mem_mode):
    model = tiny(pre_norm=pre_norm, mem_mode=mem_mode, n_memories=2, dropout=0.1, attention_dropout=0.1).eval()
    tokens = torch.randint(0, 50, (3, 24))
    with torch.no_grad():
        full = model(tokens)  # (3, 24, vocab)
        cache = model.new_cache()
        pieces = [model(tokens[:, :5], cache)]  # a prompt, then one token at a time, then a chunk
        pieces += [model(tokens[:, t : t + 1], cache) for t in range(5, 20)]
        pieces.append(model(tokens[:, 20:], cache))
    assert cache.offset == 24
    assert all(k.shape == (3, 4, 24, 8) for k, _ in cache.layers.values()) and len(cache.layers) == 4
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="sequence length 25 exceeds model.max_len=24"):
        model(tokens[:, :1], cache)
