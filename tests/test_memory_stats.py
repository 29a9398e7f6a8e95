"""Memory usage statistics against hand-computed numbers, and how a memory accumulates them."""

import json
import math

import pytest
import torch

from xlm_pkm.model.memory.pkm import ProductKeyMemory
from xlm_pkm.model.memory.stats import SlotStats


def test_hand_computed_example():
    stats = SlotStats(4)
    stats.add(torch.tensor([[0, 1], [0, 2]]), torch.tensor([[0.75, 0.25], [0.5, -0.5]]))  # by magnitude
    stats.add(torch.tensor([[2]]), torch.tensor([[0.0]]))  # a selection of weight 0 (ReLU): not a read
    # summed |weights| z' = [1.25, 0.25, 0.5, 0] -> z = [0.625, 0.125, 0.25, 0];
    # counts [2, 1, 1, 0] -> [.5, .25, .25, 0]
    assert stats.weights.tolist() == [1.25, 0.25, 0.5, 0.0]
    assert stats.counts.tolist() == [2.0, 1.0, 1.0, 0.0]
    s = stats.summary()
    assert s["usage"] == 75.0 and s["usage_count"] == 75.0
    # log 4 + .625 ln .625 + .125 ln .125 + .25 ln .25 = 1.3862944 - 0.2937525 - 0.2599302 - 0.3465736
    assert s["kl"] == pytest.approx(0.4860381, abs=1e-6)
    # log 4 + .5 ln .5 + 2 * .25 ln .25
    assert s["kl_count"] == pytest.approx(math.log(4) + 0.5 * math.log(0.5) + 0.5 * math.log(0.25), abs=1e-9)
    # sorted z: .625 (>= 50%), .625 + .25 = .875 (< 90%), + .125 = 1
    assert (s["slots_50"], s["slots_90"], s["slots_99"]) == (1, 3, 3)


def test_uniform_reads_have_zero_kl_and_full_usage():
    stats = SlotStats(6)
    stats.add(torch.arange(6).view(3, 2), torch.full((3, 2), 0.5))
    s = stats.summary()
    assert s["usage"] == 100.0 and s["kl"] == pytest.approx(0.0, abs=1e-12)
    assert (s["slots_50"], s["slots_90"], s["slots_99"]) == (3, 6, 6)


def test_memory_accumulates_only_in_eval_with_track_stats():
    torch.manual_seed(0)
    memory = ProductKeyMemory(8, 4, n_keys=6, k_dim=4, heads=3, knn=5)
    x = torch.randn(2, 5, 8)
    memory(x)  # off by default
    memory.track_stats = True
    memory(x)  # training mode: not accumulated
    assert not memory.slot_weights().any()
    memory.eval()
    memory(x)
    memory(x[1:])
    # every token gives weight 1 per head: (10 + 5 tokens) * 3 heads
    assert memory.slot_weights().sum().item() == pytest.approx(15 * 3)
    assert memory.slot_stats.counts.sum().item() == 15 * 3 * 5
    weights, indices = memory.lookup(torch.cat([x, x[1:]]))  # the reads, recomputed
    expected = torch.zeros(36, dtype=torch.float64).index_add_(0, indices.flatten(), weights.double().flatten())
    torch.testing.assert_close(memory.slot_weights(), expected)
    assert set(memory.stats()) == {"usage", "kl", "usage_count", "kl_count", "slots_50", "slots_90", "slots_99"}
    assert not any("stat" in key for key in memory.state_dict())
    memory.reset_stats()
    assert not memory.slot_weights().any()


ULTRAMEM = ["model.memory.key_type=tucker", "model.memory.tucker.cores=2", "model.memory.values=expanded",
            "model.memory.expanded.expansion=2", "model.memory.expanded.init=released", "model.memory.score=identity",
            "model.memory.qk_layernorm=true"]


@pytest.mark.parametrize("extra", [[], ["model.memory.values=peer", "model.memory.share_keys=true"], ULTRAMEM],
                         ids=["pkm", "peer", "ultramem"])
def test_logged_weight_and_output_norms_equal_a_recomputation(tiny_run, tmp_path, extra):
    """The last valid event of a tiny run (at its last step, nothing trains after it) against the trained model:
    the mean |w| of the value tables (PEER's two) and of UltraMem's projections from its weights, and the mean
    L2 norm of the memory's outputs from the valid batches run through the model again, caught by a hook."""
    trainer = tiny_run(tmp_path, "train.exp_id=norms", "train.max_steps=3", *extra)
    events = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    valid = [e for e in events if e["event"] == "valid"]
    assert valid[-1]["step"] == 3
    (logged,) = valid[-1]["memories"]
    ((layer, memory),) = trainer.model.memories()
    assert logged["layer"] == layer
    tables = [p.detach().double() for name, p in memory.values.named_parameters() if name != "proj"]
    assert len(tables) == (2 if "model.memory.values=peer" in extra else 1)
    assert logged["value_abs_mean"] == pytest.approx(
        sum(t.abs().sum().item() for t in tables) / sum(t.numel() for t in tables), rel=1e-12)
    if extra == ULTRAMEM:
        assert logged["proj_abs_mean"] == pytest.approx(memory.values.proj.detach().double().abs().mean().item(),
                                                        rel=1e-12)
    else:
        assert "proj_abs_mean" not in logged

    outputs = []
    hook = memory.register_forward_hook(lambda module, args, out: outputs.append(out.detach().double()))
    model, stream = trainer.model.eval(), trainer.valid_stream
    model.reset_stream_state(training=False)
    stream.rewind()
    with torch.no_grad():
        for (x, y), _ in zip(stream, range(trainer.cfg.train.eval_max_batches)):
            model(x, targets=y)
    hook.remove()
    norms = torch.cat([o.reshape(-1, o.shape[-1]) for o in outputs]).norm(dim=-1)  # one per position evaluated
    assert norms.numel() == valid[-1]["tokens"]
    assert logged["out_norm"] == pytest.approx(norms.mean().item(), rel=1e-12)
