"""The reproduction report on synthetic run directories: tables hold the runs' numbers (mean ± sd over
seeds) beside the paper's, the directions are judged from per-seed differences (t interval, Holm),
speeds come from benchmark JSON only, every figure is written; introspection against the memory's own
slot statistics."""

import json
import math
import re

import pytest
import torch
import yaml

from xlm_pkm.checkpoint import files as checkpoint
from xlm_pkm.config import Config, to_dict
from xlm_pkm.data.moses import detokenize_pieces
from xlm_pkm.data.stream import TokenStream
from xlm_pkm.experiments.introspect import slot_contexts
from xlm_pkm.experiments.report import Measure, bench_speeds, directions, find_runs, load_run, main, write_report
from xlm_pkm.model.transformer import TransformerLM


def make_run(root, name, cells, ppl, usage=None, kl=None, words_per_sec=1000.0, n_keys=8, heads=4, knn=2,
             layers=6, dim=16, valid=((10, 900.0), (20, 500.0)), seed=0, key_type="product"):
    """A run directory as the trainer, evaluate.py --json and the harness (reproduce --seeds) leave it
    (no checkpoint). words_per_sec is the run's own, which the report must not use."""
    path = root / name / f"tiny-seed{seed}"
    path.mkdir(parents=True)
    cfg = Config()
    cfg.train.seed = seed
    cfg.model.n_layers, cfg.model.dim = layers, dim
    cfg.model.mem_layers = [] if usage is None else [layers - 1]
    cfg.model.memory.n_keys, cfg.model.memory.heads, cfg.model.memory.knn = n_keys, heads, knn
    cfg.model.memory.key_type = key_type
    (path / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
    events = [{"event": "train", "step": 5, "loss": 7.0, "time": 100.0}]
    events += [{"event": "valid", "step": s, "ppl": p, "time": 100.0 + 6 * s} for s, p in valid]
    (path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    memories = [] if usage is None else [{"layer": layers - 1, "usage": usage, "kl": kl}]
    (path / "test.json").write_text(json.dumps({"split": "test", "ppl": ppl, "words_per_sec": words_per_sec,
                                                "memories": memories}))
    (path / "reproduce.json").write_text(json.dumps({"scale": "tiny", "cells": [
        {"table": t, "cell": f"{t}_{i}", "key": key} for i, (t, key) in enumerate(cells)]}))
    return path


@pytest.fixture
def runs_dir(tmp_path):
    root = tmp_path / "runs"
    make_run(root, "no_memory", [("baseline", {})], 300.0)
    make_run(root, "base", [("table2", {"n_keys": 512, "batchnorm": True}), ("table3", {"position": 5}),
                            ("table4", {"n_keys": 512, "key_type": "product"}), ("figure6", {"heads": 4, "knn": 32})],
             250.0, usage=99.0, kl=0.5, n_keys=64, knn=8)
    make_run(root, "k128_none", [("table2", {"n_keys": 128, "batchnorm": False})], 270.0, 97.5, 0.25, n_keys=16)
    make_run(root, "k128_bn", [("table2", {"n_keys": 128, "batchnorm": True}),
                               ("table4", {"n_keys": 128, "key_type": "product"})], 268.0, 99.5, 0.21, 4200.0,
             n_keys=16)
    make_run(root, "k1024_none", [("table2", {"n_keys": 1024, "batchnorm": False})], 240.0, 40.0, 1.5, n_keys=128)
    make_run(root, "k1024_bn", [("table2", {"n_keys": 1024, "batchnorm": True})], 235.0, 70.0, 0.9, n_keys=128)
    make_run(root, "flat128", [("table4", {"n_keys": 128, "key_type": "flat"})], 280.0, 30.0, 2.0, 1500.0, n_keys=16,
             key_type="flat")
    make_run(root, "pos1", [("table3", {"position": 1})], 260.0, 100.0, 2.1)
    make_run(root, "h1k8", [("figure6", {"heads": 1, "knn": 8})], 262.0, 60.0, 1.0, heads=1, knn=2, n_keys=64)
    make_run(root, "h4k8", [("figure6", {"heads": 4, "knn": 8})], 255.0, 90.0, 0.7, knn=2, n_keys=64)
    make_run(root, "h1k32", [("figure6", {"heads": 1, "knn": 32})], 258.0, 85.0, 0.8, heads=1, knn=8, n_keys=64)
    make_run(root, "l12m1", [("table1", {"layers": 12, "dim": 1024, "memories": 1})], 200.0, 98.0, 0.6, 3000.0,
             layers=3, dim=128)
    make_run(root, "l24m0", [("table1", {"layers": 24, "dim": 1024, "memories": 0})], 210.0, None, None, 1800.0,
             layers=6, dim=128)
    return root


def row(report: str, heading: str, label: str) -> list[str]:
    """The cells of the row starting with `label` in the table under `heading`."""
    section = report.split(f"## {heading}")[1].split("\n## ")[0]
    line = next(li for li in section.splitlines() if li.startswith(f"| {label} |"))
    return [c.strip() for c in line.strip("|").split("|")][1:]


@pytest.mark.slow
def test_report_tables_directions_and_figures(runs_dir, tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"settings": {"dtype": "fp32"}, "table4": {"rows": [
        {"n_keys": 128, "slots": 16384, "key_type": "product", "words_per_s": 1524},
        {"n_keys": 128, "slots": 16384, "key_type": "flat", "words_per_s": 604},
        {"n_keys": 256, "slots": 65536, "key_type": "product", "words_per_s": 1960}]}, "figure4": {"rows": [
        {"layers": 12, "dim": 1024, "memories": 1, "words_per_s": 256},
        {"layers": 24, "dim": 1024, "memories": 0, "words_per_s": 132}]}}))
    out = tmp_path / "out"
    assert main([str(runs_dir), "--out", str(out), "--bench", str(bench)]) == 0
    report = (out / "report.md").read_text()

    t2 = "Table 2: memory size, with and without query BatchNorm"
    assert row(report, t2, "Perplexity")[:2] == ["270.0 (22.8)", "268.0 (23.0)"]
    assert row(report, t2, "Usage (%)")[10:] == ["40.0 (25.8)", "70.0 (80.3)"]
    assert row(report, t2, "KL")[6:8] == ["· (1.20)", "0.50 (0.68)"]  # 512² without BN: not run
    assert "Without memory (§4.5): 300.0 (23.0)" in report
    assert row(report, "Table 3: memory position", "Perplexity")[0] == "260.0 (21.5)"
    assert row(report, "Table 3: memory position", "Perplexity")[4] == "250.0 (19.8)"
    t4 = "Table 4: product keys vs flat keys"
    assert row(report, t4, "Usage (%)")[:2] == ["30.0 (19.6)", "99.5 (100.0)"]
    # the benchmark's speeds, not the runs' (1,500 and 4,200)
    assert row(report, t4, "Speed (words/s, benchmark at the paper's size)")[:4] == [
        "604 (35,000)", "1,524 (35,800)", "· (28,500)", "1,960 (36,700)"]
    t1 = "Table 1: test perplexity"
    assert row(report, t1, "12 (ours 3) layers")[1] == "200.0 (15.6)"
    assert row(report, t1, "24 (ours 6) layers")[0] == "210.0 (16.0)"
    assert row(report, t1, "16 layers")[3] == "-"  # a cell the paper does not have
    assert "| dim 1024 (ours 128), N=0 |" in report
    assert row(report, "Figure 6", "1 heads")[:3] == ["262.0", "·", "258.0"]
    assert "| k=8 (ours 2) | k=16 | k=32 (ours 8) | k=64 |" in report
    assert re.search(r"\| 16k \(ours 256\) no BN \|", report)  # the column says our size

    speeds = bench_speeds([json.loads(bench.read_text())])
    verdicts = {d.claim.split(" (")[0]: d.verdict() for d in directions(find_runs([runs_dir]), speeds)}
    assert verdicts == {  # one seed per cell: no interval, so every paired comparison is inconclusive
        "A memory beats the same model without it at equal steps": "inconclusive",
        "A shallower model with a memory beats a deeper one without, and is faster":
            "perplexity: inconclusive; speed: faster",  # the benchmark's 256 vs 132 words/s, not the runs'
        "BatchNorm raises usage, the more so as the memory grows": "inconclusive",
        "Product keys give a lower perplexity than flat keys, use more of the memory, and run faster":
            "perplexity: inconclusive; usage: inconclusive; speed: faster",
        "A memory in an upper-middle layer": "inconclusive",
        "The best position is layer 4 or 5 of 6": "inconclusive",
        "More memory heads and a larger k raise usage": "inconclusive",
    }
    assert "per seed 0: -50.0 (−); fewer than 2 paired seeds, no interval: **inconclusive**" in report
    assert "collapse of flat-key usage does not appear" not in report  # flat keys' 30% against 99.5%
    for name in ("learning_curves.png", "figure4.png", "table2.png", "figure6.png", "figure7.png"):
        assert (out / name).stat().st_size > 1000 and f"]({name})" in report


def t_quantile_df2(level: float) -> float:
    """Student t with 2 degrees of freedom: P(|T| ≤ t) = t / √(2 + t²), so t = level · √(2 / (1 − level²))."""
    return level * math.sqrt(2 / (1 - level**2))


@pytest.mark.slow
def test_directions_are_paired_by_seed_with_t_intervals_and_holm(tmp_path):
    """3 seeds whose cells spread widely across seeds but differ consistently within each: the memory is 2.0
    better (holds), product keys 4.0 worse than flat keys (reversed), usage equal (inconclusive); mean and
    t interval by hand, Holm over the three comparisons by hand (p: memory < product ppl < usage = 1)."""
    root = tmp_path / "runs"
    for seed, (base, mem_gap, flat, key_gap) in enumerate([(230.0, -2.0, 225.0, 4.0), (220.0, -2.1, 215.0, 4.4),
                                                           (240.0, -1.9, 235.0, 3.6)]):
        make_run(root, "no_memory", [("baseline", {})], base, seed=seed)
        make_run(root, "pos5", [("table3", {"position": 5})], base + mem_gap, 99.0, 0.5, seed=seed)
        make_run(root, "flat", [("table4", {"n_keys": 128, "key_type": "flat"})], flat, 100.0, 0.9, n_keys=16,
                 seed=seed, key_type="flat")
        make_run(root, "product", [("table4", {"n_keys": 128, "key_type": "product"})], flat + key_gap, 100.0, 0.6,
                 n_keys=16, seed=seed)
    runs = find_runs([root])
    memory, _, _, keys, *_ = directions(runs)
    # the seeds' spread (10) dwarfs the gap (2.0), but the pairs agree to 0.1
    (j,) = memory.judged  # with − without memory: -2.0, -2.1, -1.9
    se = 0.1 / math.sqrt(3)  # sd of the differences 0.1
    assert j.pair.seeds == (0, 1, 2) and j.pair.signs() == "−−−" and j.pair.mean == pytest.approx(-2.0)
    assert j.pair.interval() == pytest.approx((-2.0 - t_quantile_df2(0.95) * se, -2.0 + t_quantile_df2(0.95) * se))
    t_holm = t_quantile_df2(1 - 0.05 / 3)  # the smallest p of 3: level 1 − α/3
    assert j.holm.interval == pytest.approx((-2.0 - t_holm * se, -2.0 + t_holm * se)) and j.verdict() == "holds"
    ppl, usage = keys.judged  # product − flat: +4.0, +4.4, +3.6; flat − product usage: 0, 0, 0
    se = 0.4 / math.sqrt(3)
    t_holm = t_quantile_df2(1 - 0.05 / 2)  # the second smallest p of 3, rejected: level 1 − α/2
    assert ppl.pair.mean == pytest.approx(4.0) and ppl.pair.signs() == "+++"
    assert ppl.holm.interval == pytest.approx((4.0 - t_holm * se, 4.0 + t_holm * se)) and ppl.verdict() == "reversed"
    assert usage.pair.diffs == (0.0, 0.0, 0.0) and usage.verdict() == "inconclusive"
    assert keys.verdict() == "perplexity: reversed; usage: inconclusive; speed: not measured"

    out = tmp_path / "out"
    write_report(runs, out)
    report = (out / "report.md").read_text()
    lo, hi = -2.0 - t_quantile_df2(0.95) * 0.1 / math.sqrt(3), -2.0 + t_quantile_df2(0.95) * 0.1 / math.sqrt(3)
    assert f"per seed 0: -2.0, 1: -2.1, 2: -1.9 (−−−); mean -2.0, 95% [{lo:+.1f}, {hi:+.1f}]" in report
    assert "Of the 3 paired comparisons (Holm over all of them): 1 holds, 1 reversed, 1 inconclusive." in report
    assert "**Reversed**: ppl product − flat keys, 256 slots (mean +4.0" in report
    assert "**inconclusive**" in report and "within noise" not in report
    # Table 4's note: flat keys use every slot, and their key parameters (heads × slots × k_dim) by hand
    k_dim = Config().model.memory.k_dim
    assert "the paper's collapse of flat-key usage does not appear" in report
    assert f"256 slots: flat keys {4 * 256 * k_dim:,}, product keys {4 * 2 * 16 * k_dim // 2:,}" in report
    assert "Flat keys have the lower perplexity here, against the paper" in report


def test_seeds_make_one_cell(tmp_path):
    root = tmp_path / "runs"
    for seed, (none, bn) in enumerate([(221.4, 217.0), (221.5, 218.1), (219.0, 214.4)]):
        make_run(root, "no_memory", [("baseline", {})], none, seed=seed)
        make_run(root, "pos5", [("table3", {"position": 5})], bn, 99.0, 0.5, seed=seed)
    runs = find_runs([root])
    assert len(runs) == 6
    out = tmp_path / "out"
    write_report(runs, out)
    report = (out / "report.md").read_text()
    assert row(report, "Table 3: memory position", "Perplexity")[4] == "216.5 ± 1.9 (19.8)"
    assert "Without memory (§4.5): 220.6 ± 1.4 (23.0)" in report and "seeds 0, 1, 2" in report
    assert not (out / "figure6.png").exists() and "figure6.png" not in report


def test_measure_by_hand():
    m = Measure((1.0, 2.0, 6.0))
    assert m.mean == 3.0 and m.sd == pytest.approx(((4 + 1 + 9) / 2) ** 0.5) and m.text() == "3.0 ± 2.6"
    assert Measure((5.0,)).sd == 0.0 and Measure((5.0,)).text() == "5.0"


def test_bad_run_directory_is_one_line(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("model: {}\n")
    with pytest.raises(ValueError, match=r"run: not a readable run directory"):
        load_run(tmp_path / "run")
    assert main([str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert "missing: not a run directory" in capsys.readouterr().err


def test_detokenize_merges_bpe_then_moses():
    assert detokenize_pieces(["the", "to@@", "ken@@", "izer", "'s", "output", "."]) \
        == "the tokenizer's output."


def test_slot_contexts_match_the_memory_statistics(tiny_data_dir, tmp_path):
    """The most used slots and their weights equal what the memory's own statistics count over the
    same batches; reads are per position, summed over heads (at most `heads`)."""
    cfg = Config()
    cfg.data.path, cfg.data.batch_size, cfg.data.bptt = str(tiny_data_dir), 4, 16
    m = cfg.model
    m.dim, m.n_layers, m.n_heads, m.max_len, m.mem_layers = 16, 2, 2, 16, [2]
    m.memory.n_keys, m.memory.k_dim, m.memory.heads, m.memory.knn, m.memory.query_norm = 8, 8, 2, 3, "batchnorm"
    stream = TokenStream(tiny_data_dir, "test", 4, 16, train=False)
    m.vocab_size = len(stream.dictionary)
    torch.manual_seed(0)
    model = TransformerLM(m)
    checkpoint.save_atomic({"config": to_dict(cfg), "model": model.state_dict(), "step": 0}, tmp_path / "best.pt")

    found = slot_contexts(tmp_path / "best.pt", top_slots=3, per_slot=2, max_batches=3)

    model.eval()
    model.set_memory_stats(True)
    with torch.no_grad():
        for _, (x, _) in zip(range(3), stream):
            model(x)
    (layer, memory), = model.memories()
    expected = memory.slot_weights()
    assert [f["layer"] for f in found] == [2] and found[0]["tokens"] == 3 * 4 * 16
    slots = found[0]["slots"]
    assert [s["slot"] for s in slots] == expected.topk(3).indices.tolist()
    assert [s["weight"] for s in slots] == pytest.approx(expected.topk(3).values.tolist(), abs=1e-3)
    for s in slots:
        assert 1 <= len(s["reads"]) <= 2
        assert all(0 < r["weight"] <= 2 + 1e-6 and "@@" not in r["context"] + r["token"] for r in s["reads"])
