"""The memory estimate per rank (train/memory_estimate.py) and train.py --dry-run: its parameters, gradients and
optimizer state against those of a built model after a real step; its activations against the tensors a real
forward saves for the backward (counted by autograd's saved-tensor hooks); its sharding arithmetic against
the model's own sizes; and (slow) its total against the peak resident memory of training on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import TINY

from xlm_pkm.config import load_config
from xlm_pkm.data.dictionary import Dictionary
from xlm_pkm.errors import ConfigError
from xlm_pkm.finetune import lora
from xlm_pkm.finetune.trainable import freeze
from xlm_pkm.launch.cli import train_main
from xlm_pkm.model.attention import SelfAttention
from xlm_pkm.model.blocks import FeedForward
from xlm_pkm.model.memory.engram import Engram
from xlm_pkm.model.memory.pkm import ProductKeyMemory
from xlm_pkm.model.memory.value_stores import is_memory_value
from xlm_pkm.optim.optimizers import value_optimizer
from xlm_pkm.runtime.precision import autocast, grad_scaler
from xlm_pkm.train.build import build_model, build_optimizers
from xlm_pkm.train.memory_estimate import estimate
from xlm_pkm.train.step import loss_backward, optimizer_update

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
# TINY's model without its corpus: a vocabulary of 64 (every first dimension then divides 2 and 4)
MODEL = [o for o in TINY if o.startswith(("model.", "data.", "optim."))] + ["model.vocab_size=64", "train.device=cpu"]
ENGRAM = ["model.engram.layers=[1]", "model.engram.ngram_dim=16", "model.engram.table_size=64"]


def tiny_config(*extra: str):
    return load_config(None, [*MODEL, *extra])


def tensor_bytes(t: torch.Tensor) -> int:
    if t.is_sparse:
        return tensor_bytes(t._values()) + tensor_bytes(t._indices())
    return t.numel() * t.element_size()


def one_step(cfg):
    """A built model and its optimizers after one step of random tokens; the gradients' bytes before the update."""
    torch.manual_seed(0)
    model = build_model(cfg, CPU)
    if lora.uses_lora(cfg.optim):  # as the trainer does
        lora.add_adapters(model, cfg.optim)
    else:
        freeze(model, cfg.optim.trainable, cfg.optim.freeze_norm_stats)
    optimizers, scaler = build_optimizers(model, cfg), grad_scaler(cfg.train.precision, CPU)
    x, y = (torch.randint(0, cfg.model.vocab_size, (cfg.data.batch_size, cfg.data.bptt)) for _ in range(2))
    loss = loss_backward(model, x, y, cfg.train.precision, CPU, scaler)
    grads = sum(tensor_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    optimizer_update(optimizers, scaler, loss)
    return model, optimizers, grads


@pytest.mark.parametrize("extra", [
    [],  # product keys, Adam on dense value gradients
    [*ENGRAM, "optim.optimizer=adagrad"],
    ["optim.trainable=memory_values"],  # only the value table has gradients and optimizer state
    ["model.memory.values=peer", "optim.values_optimizer=sgd", "optim.values_lr=0.1", "optim.trainable=memory"],
    ["optim.lora.rank=2"],  # the adapters alone train
    ["optim.values_optimizer=rowwise_adagrad"],  # one float32 per value row
    ["model.memory.value_dtype=bfloat16", "optim.values_optimizer=lazy_adam"],  # 2 bytes a value, float32 moments
], ids=["pkm", "engram_adagrad", "values_only", "peer_frozen_dense", "lora", "rowwise_adagrad", "bfloat16_values"])
@pytest.mark.slow
def test_parameters_gradients_and_optimizer_state_are_those_of_the_built_model(extra):
    cfg = tiny_config(*extra)
    model, optimizers, grads = one_step(cfg)
    est = estimate(cfg, 1)
    weights = sum(tensor_bytes(t) for t in [*model.parameters(), *model.buffers()])
    state = sum(tensor_bytes(v) for g in optimizers.groups for s in g.optimizer.state.values()
                for key, v in s.items() if key != "step" and torch.is_tensor(v))
    assert (est.parameters, est.optimizer) == (weights, state)
    if value_optimizer(cfg.optim).sparse:  # rows read: at most min(lookups, rows) of them, each with its index
        lookups = cfg.data.batch_size * cfg.data.bptt * cfg.model.memory.heads * cfg.model.memory.knn
        rows = sum(min(lookups, p.shape[0]) * (4 * p.shape[1] + 8) for p in model.memory_value_parameters())
        dense = sum(tensor_bytes(p) for p in model.parameters() if p.requires_grad and not is_memory_value(p))
        assert est.gradients == dense + rows and grads <= est.gradients
    else:
        assert est.gradients == grads
    assert est.communication == 0  # one process: no DDP
    assert sum(est.elements.values()) == sum(p.numel() for p in model.parameters())


def test_sharding_divides_what_each_rank_holds():
    """shard_values: each rank holds 1/W of the value table, its gradient and its Adam moments; fsdp: 1/W of
    every dense parameter (padded rows: none here, every first dimension divides 4); DDP's buckets copy the
    gradients it all-reduces, FSDP gathers its largest unit whole."""
    four = ["model.memory.heads=4"]  # the keys' first dimension: heads
    cfg = tiny_config(*four)
    model = build_model(cfg, CPU)
    values = sum(p.numel() for p in model.memory_value_parameters())
    dense = sum(p.numel() for p in model.parameters()) - values
    buffers = sum(tensor_bytes(b) for b in model.buffers())
    assert all(p.shape[0] % 4 == 0 for p in model.parameters())

    sharded = estimate(tiny_config(*four, "model.memory.shard_values=true"), 4)
    assert sharded.parameters == 4 * (dense + values // 4) + buffers
    assert (sharded.gradients, sharded.optimizer) == (4 * (dense + values // 4), 8 * (dense + values // 4))
    assert sharded.communication == 4 * dense  # the sharded table is averaged outside DDP
    assert estimate(cfg, 4).communication == 4 * (dense + values)  # a replicated table with dense gradients: in DDP
    # sparse rows, outside DDP: each rank's 64 (of its 1,024 lookups, 64 slots) gathered from 4 ranks and concatenated,
    # then the merged 64 rows divided by W; a row holds 32 float32 and its int64 index
    lazy = estimate(tiny_config(*four, "optim.values_optimizer=lazy_adam"), 4)
    assert lazy.communication == 4 * dense + (4 * 32 + 8) * (2 * 4 * 64 + 64)
    with pytest.raises(ConfigError, match="value dimension 32 does not split into 3"):
        estimate(tiny_config(*four, "model.memory.shard_values=true"), 3)

    fsdp = estimate(cfg, 4, "fsdp")
    assert (fsdp.parameters, fsdp.optimizer) == (4 * (dense // 4 + values) + buffers, 8 * (dense // 4 + values))
    units = [sum(p.numel() for p in block.parameters() if not is_memory_value(p)) for block in model.blocks]
    units.append(sum(p.numel() for name, p in model.named_parameters() if not name.startswith("blocks.")))
    assert fsdp.communication == 8 * max(units)
    largest = max(p.numel() for p in model.parameters())  # torch's AdamW: sqrt(v) and its quotient
    assert estimate(cfg, 1, device_type="cpu").step_temporaries == 8 * largest
    assert estimate(cfg, 1, device_type="cuda").step_temporaries == 4 * max(dense, values)  # foreach: a group
    assert fsdp.step_temporaries == 8 * max(largest // 4, max(p.numel() for p in model.memory_value_parameters()))
    odd = estimate(tiny_config(*four, "model.vocab_size=65"), 4, "fsdp")  # the embedding's 65 rows: 17 per rank
    assert odd.parameters - fsdp.parameters == 4 * 32 * (17 - 16)


def saved_for_backward(cfg) -> Counter:
    """Bytes of the distinct tensors a training forward of a built model saves for its backward (the parameters
    themselves apart), by the sublayer that saved them; "outside": embeddings, the blocks' norms, output, loss."""
    torch.manual_seed(0)
    model = build_model(cfg, CPU).train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kinds = {SelfAttention: "attention", FeedForward: "ffn", ProductKeyMemory: "memory", Engram: "engram"}
    inside = ["outside"]
    for block in model.blocks:
        for f in block.sublayers:
            f.register_forward_pre_hook(lambda module, args: inside.append(kinds[type(module)]))
            f.register_forward_hook(lambda module, args, out: inside.pop() and None)
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages.setdefault(storage.data_ptr(), (inside[-1], storage.nbytes()))
        return t

    x, y = (torch.randint(0, cfg.model.vocab_size, (cfg.data.batch_size, cfg.data.bptt)) for _ in range(2))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(cfg.train.precision, CPU):
        model(x, targets=y)
    saved = Counter()
    for part, size in storages.values():
        saved[part] += size
    return saved


@pytest.mark.parametrize("extra", [
    [], ["model.memory.key_type=flat"], ["model.memory.values=peer", "model.memory.share_keys=true"],
    ["model.memory.gated=true", "model.pre_norm=true"], ENGRAM,
    ["model.memory.key_type=tucker", "model.memory.values=expanded", "model.memory.expanded.expansion=4",
     "model.memory.tucker.cores=2", "model.memory.score=identity"],
    ["model.dropout=0.1", "model.attention_dropout=0.1", "model.memory.query_hidden=[16]",
     "model.memory.input_dropout=0.1", "model.memory.query_norm=batchnorm"],
], ids=["pkm", "flat", "peer_shared_keys", "memory_plus_pre_norm", "engram", "ultramem", "dropouts"])
def test_activations_are_what_the_forward_saves(extra):
    """Each sublayer kind's formula against the bytes its forward saved, within 7% (the formulas leave out
    copies of the size of a weight, such as qk_norm's normalised keys, and scalars per token)."""
    cfg = tiny_config(*extra)
    saved = saved_for_backward(cfg)
    parts = estimate(cfg, 1, device_type="cpu").activations
    counted = Counter({"outside": parts.pop("embeddings and norms") + parts.pop("output and loss")})
    counted.update({part: size for part, size in parts.items() if part != "transient (largest)"})
    assert set(saved) == {part for part, size in counted.items() if size}
    for part, size in saved.items():
        assert counted[part] == pytest.approx(size, rel=0.07), part


@pytest.mark.parametrize("extra", [[], ENGRAM, ["model.memory.values=peer", "model.memory.gated=true"]])
def test_activations_under_bf16_autocast_with_their_weight_copies(extra):
    cfg = tiny_config("train.precision=bf16", *extra)
    est = estimate(cfg, 1, device_type="cpu")
    assert est.activations["autocast weight copies"] > 0
    saved = est.activation_bytes - est.activations["transient (largest)"]
    assert saved == pytest.approx(sum(saved_for_backward(cfg).values()), rel=0.03)


def test_a_sublayer_without_a_formula_is_named_not_counted():
    cfg = load_config(REPO / "configs" / "all_attention" / "sample_bpe.yaml", ["model.vocab_size=64"])
    est = estimate(cfg, 1)
    assert est.omitted == ("the activations of sublayer all_attention (no formula)",)
    assert est.lines()[-1] == "  not counted: the activations of sublayer all_attention (no formula)"


def test_dry_run_prints_the_estimate_and_trains_nothing(tiny_data_dir, tmp_path, capsys, monkeypatch):
    overrides = [f"data.path={tiny_data_dir}", f"train.dump_path={tmp_path}", *TINY]
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    assert train_main(["--dry-run", "--world-size", "2", *overrides]) == 0
    out = capsys.readouterr().out
    vocab = len(Dictionary.load(tiny_data_dir / "vocab"))
    expected = estimate(load_config(None, [*overrides, f"model.vocab_size={vocab}"]), 2)
    assert out.splitlines() == expected.lines() and "world size 2" in out
    assert not any(tmp_path.iterdir())  # no run directory
    assert train_main(["--dry-run", "--world-size", "2", *overrides, "train.parallel=fsdp"]) == 0  # the run's mode
    fsdp = estimate(load_config(None, [*overrides, f"model.vocab_size={vocab}", "model.memory.shard_values=true"]), 2,
                    "fsdp")  # shard_values=auto resolved for fsdp on 2 processes
    assert capsys.readouterr().out.splitlines() == fsdp.lines() != expected.lines()

    monkeypatch.setenv("WORLD_SIZE", "4")  # under torchrun: its world size; only rank 0 prints
    monkeypatch.setenv("RANK", "1")
    assert train_main(["--dry-run", *overrides]) == 0 and capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")
    assert train_main(["--dry-run", *overrides]) == 0 and "world size 4" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stopped:
        train_main(["--world-size", "2", *overrides])
    assert stopped.value.code == 2 and "--world-size takes W >= 1, with --dry-run" in capsys.readouterr().err


def test_a_run_logs_its_memory_estimate(tiny_trainer, tmp_path):
    """train.log gives the estimate per rank in one line (--dry-run's table, summed up), also without --dry-run."""
    trainer = tiny_trainer(tmp_path, test=False)
    trainer.close()
    line = estimate(trainer.cfg, 1, "ddp", "cpu").summary()
    assert line.startswith("memory per rank, estimated: ") and "the build's peak" in line
    assert line in (trainer.run_dir / "train.log").read_text()


@pytest.mark.slow
def test_under_fsdp_on_2_processes_the_estimate_is_each_ranks_peak_within_25_percent(tiny_data_dir, tmp_path):
    """benchmarks/memory_estimate.py trains a model of 26M dense parameters (8 layers of width 512, batches of 4 x 64
    tokens) under fsdp on 2 processes (torchrun), in float32 and in bf16 (FSDP's mixed precision), and measures each
    rank's peak resident memory over its own before the model, malloc giving back what is freed (--live-memory: what
    the tensors hold, as CUDA's max_memory_allocated): the estimate is within 25% of each. glibc's default heap keeps
    freed blocks for reuse, which FSDP's buffers of many sizes fragment: without --live-memory the fp32 run's peak
    measured 1.4x the estimate on the bundled corpus (docs/training.md)."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("the peak resident memory is reset through /proc/self/clear_refs (Linux)")
    out = tmp_path / "memory.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "memory_estimate.py"), "--only", "wide_fsdp_2",
                    "wide_fsdp_bf16_2", "--steps", "2", "--data", str(tiny_data_dir), "--live-memory", "--out",
                    str(out)], check=True, capture_output=True, text=True, timeout=600)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["name"], r["world_size"], r["parallel"]) for r in rows] == [("wide_fsdp_2", 2, "fsdp"),
                                                                           ("wide_fsdp_bf16_2", 2, "fsdp")]
    for row in rows:
        assert len(row["ranks"]) == 2
        for rank in row["ranks"]:
            assert rank["measured_peak_bytes"] > 100 * 2**20  # the model's own memory, well above the noise
            assert 0.75 <= row["estimate"]["total"] / rank["measured_peak_bytes"] <= 1.25, (row["name"], rank)


@pytest.mark.slow
def test_the_estimate_is_within_a_factor_of_the_measured_peak_on_cpu(tiny_data_dir, tmp_path):
    """benchmarks/memory_estimate.py trains the default config and its Engram variant (on the tiny corpus's
    vocabulary) in fresh processes and measures their peak resident memory: the estimate is within 0.5x-2x
    of it. Not TINY's model: estimated at 1.4 MiB on this corpus, it measured 0.65-0.81 MiB over three runs,
    a size at which the figure is the allocator's (memory freed by the warm-up reused), not the model's."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("the peak resident memory is reset through /proc/self/clear_refs (Linux)")
    out = tmp_path / "memory.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "memory_estimate.py"), "--only", "default", "engram",
                    "--steps", "2", "--data", str(tiny_data_dir), "--out", str(out)],
                   check=True, capture_output=True, text=True, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [r["name"] for r in rows] == ["default", "engram"]
    for row in rows:
        assert row["measured_peak_bytes"] > 50 * 2**20  # the model's own memory, well above the noise
        assert 0.5 <= row["estimate"]["total"] / row["measured_peak_bytes"] <= 2.0, row["name"]
