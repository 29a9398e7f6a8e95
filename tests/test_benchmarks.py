"""Smoke runs of the model-level speed benchmarks on tiny models: the JSON they write has a row per
requested entry, positive speeds, and ratios that match their rows (recomputed here)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from xlm_pkm.data.dictionary import Dictionary
from xlm_pkm.data.shard import read_shard

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL = ["model.dim=16", "model.n_heads=2", "model.memory.k_dim=8", "model.memory.knn=4"]
TIMING = ["--batch", "2", "--seq", "8", "--min-time", "0.01", "--rounds", "1"]


def run_benchmark(name: str, out, *args: str) -> dict:
    """One thread: tiny models run no faster on more, and far slower when the cores are shared."""
    subprocess.run([sys.executable, str(REPO / "benchmarks" / f"{name}.py"), *TIMING, "--out", str(out), *args],
                   check=True, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.read_text())


def words_per_token(data_dir) -> float:
    dictionary = Dictionary.load(data_dir / "vocab")
    ids = np.concatenate([read_shard(p).tokens for p in sorted(data_dir.glob("test.*.bin"))])
    return dictionary.word_end_mask()[ids].mean()


@pytest.mark.slow
def test_inference_speed(tiny_data_dir, tmp_path):
    result = run_benchmark("inference_speed", tmp_path / "inference.json", "--device", "cpu",
                           "--data", str(tiny_data_dir), "--keys", "16", "32", "--flat-max-keys", "16",
                           "--layers", "12", "24", "--dims", "1024", "--memories", "0", "1",
                           "--override", *TINY_MODEL)
    assert result["machine"]["device"] == "cpu" and result["machine"]["cpu"]
    assert result["corpus"]["words_per_token"] == pytest.approx(words_per_token(tiny_data_dir))
    table4, figure4 = result["table4"], result["figure4"]
    assert sorted((r["key_type"], r["n_keys"]) for r in table4["rows"]) == [("flat", 16), ("product", 16),
                                                                            ("product", 32)]
    assert sorted((r["layers"], r["memories"]) for r in figure4["rows"]) == [(12, 0), (12, 1), (24, 0), (24, 1)]
    for row in table4["rows"] + figure4["rows"]:
        assert row["tokens_per_s"] > 0
        assert row["words_per_s"] == round(row["tokens_per_s"] * result["corpus"]["words_per_token"])

    speed = {(r["key_type"], r["n_keys"]): r["tokens_per_s"] for r in table4["rows"]}
    assert table4["product_largest_over_smallest"]["ratio"] == round(speed["product", 32] / speed["product", 16], 3)
    (flat16,) = table4["product_over_flat"]
    assert flat16["n_keys"] == 16 and flat16["ratio"] == round(speed["product", 16] / speed["flat", 16], 3)
    speed = {(r["layers"], r["memories"]): r["tokens_per_s"] for r in figure4["rows"]}
    assert figure4["l12_m1_over_l24_m0"] == [{"dim": 16, "ratio": round(speed[12, 1] / speed[24, 0], 3),
                                              "target": ">= 1.8"}]


@pytest.mark.slow
def test_inference_speed_without_data(tmp_path):
    result = run_benchmark("inference_speed", tmp_path / "inference.json", "--device", "cpu",
                           "--data", str(tmp_path / "missing"), "--parts", "table4", "--keys", "16",
                           "--flat-max-keys", "0", "--override", *TINY_MODEL)
    assert result["corpus"]["words_per_token"] is None and result["corpus"]["vocab_source"] == "fallback"
    assert result["settings"]["vocab"] == 32000
    (row,) = result["table4"]["rows"]
    assert row["tokens_per_s"] > 0 and row["words_per_s"] is None
    assert result["table4"]["product_over_flat"] == []


@pytest.mark.slow
def test_training_speed(tiny_data_dir, tmp_path):
    # 9 layers: configs/paper/l12_d1024_m1.yaml lists its memory layer, 9
    result = run_benchmark("training_speed", tmp_path / "training.json", "--device", "cpu",
                           "--data", str(tiny_data_dir), "--precisions", "fp32", "bf16", "--warmup", "1",
                           "--override", "model.n_layers=9", "model.memory.n_keys=16", *TINY_MODEL)
    assert result["machine"]["device"] == "cpu"
    rows = result["rows"]
    assert sorted((r["precision"], r["memories"], str(r["values"])) for r in rows) == [
        (p, m, v) for p in ("bf16", "fp32") for m, v in ((0, "None"), (1, "dense"), (1, "sparse"))]
    for row in rows:
        assert row["tokens_per_s"] > 0 and row["flops_per_token"] > 0
        assert row["mfu"] is None and row["peak_memory_gib"] is None  # CPU
    without = {r["precision"]: r["tokens_per_s"] for r in rows if r["memories"] == 0}
    assert sorted((s["precision"], s["values"], s["share"]) for s in result["memory_step_share"]) == sorted(
        (r["precision"], r["values"], round(1 - r["tokens_per_s"] / without[r["precision"]], 3))
        for r in rows if r["memories"])


@pytest.mark.slow
def test_memory_layer_speed(tmp_path):
    """Every mode and layer at every size, the ratios recomputed from the rows, the traffic floor by hand."""
    result = run_benchmark("memory_layer_speed", tmp_path / "layer.json", "--train-keys", "32", "64", "--no-peer")
    speed = {(r["mode"], r["layer"], r["n_keys"]): r["tokens_per_s"] for r in result["rows"]}
    assert sorted(speed) == sorted((mode, layer, n) for n in (32, 64) for mode, layer in [
        ("train", "dense_ffn"), ("train", "pkm"), ("train", "pkm_sparse"), ("train_step", "dense_ffn"),
        ("train_step", "pkm_sparse"), ("inference", "dense_ffn"), ("inference", "pkm")])
    assert all(v > 0 for v in speed.values())
    small, large = result["ratios"]
    assert large["train_over_dense_ffn"] == round(speed["train", "pkm_sparse", 64] / speed["train", "dense_ffn", 64], 3)
    assert large["train_step_time_over_half_n_keys"] == round(
        speed["train_step", "pkm_sparse", 32] / speed["train_step", "pkm_sparse", 64], 3)
    assert "train_step_time_over_half_n_keys" not in small
    lookups, tokens = 16 * 4 * 32, 16  # 2 x 8 tokens, 4 heads x knn 32
    for floor in result["sparse_train_floor"]:
        assert floor["bytes"]["value_rows_read_twice"] == 2 * lookups * 512 * 4
        rows_read = floor["bytes"]["sparse_gradient_rows_written"] // (512 * 4)
        assert 32 <= rows_read <= min(lookups, floor["n_keys"] ** 2)  # each token-head reads knn distinct slots
        measured_ms = 1e3 * tokens / speed["train", "pkm_sparse", floor["n_keys"]]
        assert floor["measured_ms"] == pytest.approx(measured_ms, rel=1e-3)
        assert floor["fraction_of_floor"] == pytest.approx(floor["floor_ms"] / floor["measured_ms"], abs=2e-3)


def test_sharded_values_arithmetic():
    """benchmarks/sharded_values.py's fit and its bytes per token (the table of
    docs/sparse-and-sharded-values.md) by hand."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import sharded_values

    measured = [{"world": 2, "slots": s, "before_model_gib": 0.5, "peak_gib_max": 0.5 + 1e-5 * s}
                for s in (10_000, 40_000)]
    assert sharded_values.largest_n_keys(*measured, budget_gib=19.0) == 948  # (9.5 - 0.5) / 1e-5 = 900k slots
    assert sharded_values.safe_n_keys(measured[0], 2000, budget_gib=19.0) == 842  # 80%: (7.6 - 0.5) / 1e-5
    rows = {r["world"]: r for r in sharded_values.communication(worlds=(2, 32))[0]["rows"]}
    # W = 32, L = 128 lookups, d = 1024: 31·128·8 (lookups) + 2·(31/32)·1024·4 (outputs) + 31·128·4 (weights)
    assert rows[32]["by_dimension_bytes_per_token"] == 31 * 128 * 8 + 7936 + 31 * 128 * 4 == 55_552
    assert rows[2]["by_dimension_bytes_per_token"] == 128 * 8 + 4096 + 128 * 4
    owners = 32 * (1 - (31 / 32) ** 128)  # distinct ranks a token reads from when slots are split
    assert rows[32]["by_slot_bytes_per_token"] == round(128 * 12 * 31 / 32 + 2 * owners * 31 / 32 * 4096)
    assert rows[32]["replicated_dense_allreduce_bytes_per_token"] == round(2 * 31 / 32 * 2**20 * 4096 / 8192)


@pytest.mark.slow
def test_checkpoint_cost(tmp_path):
    """It reports the bytes of checkpoint.pt and its tensors' folder for each entry, and leaves neither behind:
    float32 rows with Adam, and bfloat16 rows with row-wise Adagrad, which write fewer bytes."""
    result = run_benchmark("checkpoint_cost", tmp_path / "ckpt.json", "--vocab", "100", "--repeats", "2",
                           "--dir", str(tmp_path), "--override", *TINY_MODEL, "model.memory.n_keys=16")
    today, two_bytes = result["rows"]
    assert today["parameters"] > 0 and len(today["write_s_each"]) == 2 and today["total_s_median"] > 0
    assert today["bytes"] > 4 * 3 * today["parameters"]  # weights and Adam's two moments, float32
    values = 16 * 16 * 16  # the table's parameters: 16² slots of TINY_MODEL's dim 16
    assert today["bytes"] - two_bytes["bytes"] > (12 - 2) * values * 0.9  # 12 bytes a value against 2 (+ 4/16)
    assert not list(tmp_path.glob("tmp*"))  # its directory removed


def test_results_go_beside_the_committed_ones_unless_asked(tmp_path, monkeypatch):
    """Without --out a benchmark writes dumped/bench/<name>_<device>.json, never benchmarks/results/."""
    from types import SimpleNamespace

    sys.path.insert(0, str(REPO / "benchmarks"))
    import machine

    monkeypatch.setattr(machine, "REPO", tmp_path)
    machine.write_result({"x": 1}, SimpleNamespace(out=None, device="cpu"), "some_bench")
    assert json.loads((tmp_path / "dumped" / "bench" / "some_bench_cpu.json").read_text()) == {"x": 1}
    machine.write_result({"x": 2}, SimpleNamespace(out=str(tmp_path / "asked.json")), "some_bench")
    assert json.loads((tmp_path / "asked.json").read_text()) == {"x": 2}
    assert not (tmp_path / "benchmarks").exists()


def test_step_breakdown_variants_set_each_setting_as_before_issue_59_or_on(monkeypatch):
    """"off" is the code before issue 59 also where a setting's default has moved since, "default" this
    checkout's defaults, "on" every setting on, and each setting's own variant "off" with that one on."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import step_breakdown

    from xlm_pkm.config import load_config

    def resolved(overrides):
        cfg = load_config(step_breakdown.CONFIGS[1], overrides)
        return {name: str(functools.reduce(getattr, key.split("."), cfg)).lower()
                for name, (key, _, _) in step_breakdown.SETTINGS.items()}

    settings = step_breakdown.SETTINGS
    before = {name: value for name, (_, value, _) in settings.items()}
    after = {name: value for name, (_, _, value) in settings.items()}
    variants = step_breakdown.VARIANTS
    assert resolved(variants["off"]) == before and resolved(variants["on"]) == after
    assert resolved(variants["default"]) == resolved([]) != before  # read_op, read_backward, half_topk moved
    for name in settings:
        assert resolved(variants[name]) == {**before, name: after[name]}


@pytest.mark.slow
def test_step_breakdown(tiny_data_dir, tmp_path):
    """Every variant a row after the memoryless one, with its phases (the probed runs) and share (recomputed)."""
    variants = ["off", "on"]  # on: the Triton kernels too, under the interpreter (conftest's TRITON_INTERPRET=1)
    result = run_benchmark("step_breakdown", tmp_path / "breakdown.json", "--device", "cpu", "--data",
                           str(tiny_data_dir), "--steps", "2", "--warmup", "1", "--variants", *variants,
                           "--override", "model.n_layers=9", "model.memory.n_keys=16", "model.memory.value_read=triton",
                           *TINY_MODEL)
    rows = result["rows"]
    assert not [r["error"] for r in rows if "error" in r]
    assert [r["variant"] for r in rows] == ["no memory", *variants] and [r["memories"] for r in rows] == [0, 1, 1]
    assert "model.memory.read_op=eager" in result["settings"]["variants"]["off"]  # as before issue 59
    assert "model.memory.read_op=custom_op" in result["settings"]["variants"]["on"]
    for row in rows[1:]:
        assert row["memory_step_share"] == round(1 - row["tokens_per_s"] / rows[0]["tokens_per_s"], 3)
        assert set(row["phases_ms"]) == {"memory_forward", "memory_backward", "norms_and_clip", "optimizer_dense",
                                         "optimizer_values", "rest"}
        assert all(v >= 0 for k, v in row["phases_ms"].items() if k != "rest")
        assert row["host_syncs"] is None and row["graph_breaks"] is None  # CPU, not compiled
