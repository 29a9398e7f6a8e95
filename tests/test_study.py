"""The study harness (xlm_pkm/experiments/study*.py): the study file, the budget in tokens and the learning-rate
grid, the choice on validation only, a study cut anywhere and run again, the report."""

import dataclasses
import json
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import TINY
from xlm_pkm.config import Config, to_dict
from xlm_pkm.experiments import study as study_cli
from xlm_pkm.experiments.reproduce import MATCHED, REPO, SCALES, plan
from xlm_pkm.experiments.study import TEST, TRAIN, pending, run_study
from xlm_pkm.experiments.study_plan import LR_KEYS, LR_RATIOS, StudyError, load_study
from xlm_pkm.experiments.study_report import seed_values, write_report

TIMING = {"time", "tokens_per_sec", "words_per_sec", "eta_s"}  # what differs between two runs of the same run


def write_study(tmp_path, data_dir=None, **changes) -> Path:
    raw = {"name": "tiny", "tokens": 512, "eval_every_tokens": 128, "seeds": [0, 1], "lr_grid": [0.5, 2],
           "set": [*([f"data.path={data_dir}"] if data_dir else []), *TINY], "test_max_batches": 4,
           "dump": str(tmp_path / "dump"), "results": str(tmp_path / "results"),
           "report": str(tmp_path / "out" / "report.md"),
           "cells": {"pkm": {"config": "configs/default.yaml"},
                     "dense": {"config": "configs/default.yaml", "set": ["model.n_memories=0", "model.mem_layers=[]"]}},
           "comparisons": [{"a": "pkm", "b": "dense", "claim": "the memory lowers perplexity"}], **changes}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.mark.slow
def test_the_variants_study_file_reads(tmp_path):
    study = load_study(REPO / "results/variants/study.yaml")
    assert {"dense_params", "dense_flops", "pkm", "memory_plus", "peer", "ultramem_step5_value_lr_decay",
            "engram_share25", "engram_share50", "engram"} <= set(study.cells)
    assert len(study.lr_grid) == 3 and study.lr_extend >= 1  # a 3-point grid, grown where the best is at an end
    for cell in study.cells:
        run = study.run(cell, 1.0, 0)
        assert run.steps * run.tokens_per_step >= 1_600_000, cell  # at least 4x the 400-step runs
    assert study.scale == "tiny" and study.results == REPO / "results/variants/runs"
    # the matched sizes written there are reproduce's at the tiny scale
    matched = [c for c in MATCHED if c in study.cells]
    for run in plan("variants", SCALES["tiny"], tmp_path, only=matched)[0]:
        assert run.overrides[-1] in study.cells[run.name][1], run.name
    step5 = study.run("ultramem_step5_value_lr_decay", 1.0, 0)
    assert load(step5).optim.values_lr_decay_steps == step5.steps  # the decay spans the longer run


@pytest.mark.slow
def test_the_tiny_study_file_re_makes_the_committed_tiny_runs_with_tuned_learning_rates(tmp_path):
    """results/tiny/study.yaml (issue 61): every cell at ×1 is the committed 400-step run's model, data and optimizer
    (key by key of runs/<cell>/tiny-seed0/config.yaml), on ≥ 1.6M tokens, 3 seeds, the divergence rule and the
    robustness runs declared, its claims' cells among them; it writes beside the old report, not over it."""
    from xlm_pkm.config import load_config, to_dict
    from xlm_pkm.train.build import shard_values_choice

    def flat(d, prefix=""):
        return {k: v for key, value in d.items() for k, v in (flat(value, f"{prefix}{key}.").items()
                                                              if isinstance(value, dict) else [(prefix + key, value)])}

    study = load_study(REPO / "results/tiny/study.yaml")
    assert study.seeds == (0, 1, 2) and study.diverge_ratio > 1 and study.robustness and study.lr_refine == 1
    assert study.results == REPO / "results/tiny/study_runs" and study.report == REPO / "results/tiny/study/report.md"
    assert len(study.comparisons) == 12 and {"usage", "ppl"} == {c.metric for c in study.comparisons}
    for cell in study.cells:
        run = study.run(cell, 1.0, 0)
        assert run.steps * run.tokens_per_step >= 1_600_000, cell
        cfg = load_config(REPO / run.run.config, run.run.overrides)
        ours = flat(to_dict(cfg)) | {"model.memory.shard_values": shard_values_choice(cfg, 1)[0]}  # auto, resolved
        old = flat(yaml.safe_load((REPO / "results/tiny/runs" / cell / "tiny-seed0/config.yaml").read_text()))
        differ = {k for k, v in old.items() if k.split(".")[0] in ("model", "data", "optim") and k in ours
                  and ours[k] != v and k != "model.vocab_size"}  # the vocabulary is resolved when a run starts
        assert not differ, (cell, differ)


@pytest.mark.parametrize("change, message", [
    ({"colour": 1}, "unknown key(s) colour"),
    ({"tokens": -5}, "tokens: a positive number of tokens, not -5"),
    ({"seeds": [0, 0]}, "seeds: a list of distinct integers"),
    ({"lr_grid": []}, "lr_grid: a list of distinct positive factors"),
    ({"test_max_batches": "all"}, "test_max_batches: a number of batches"),
    ({"diverge_ratio": 0.5}, "diverge_ratio: a ratio above 1 (0: no divergence rule), not 0.5"),
    ({"robustness": "yes"}, "robustness: true or false, not 'yes'"),
    ({"cells": {"x": {"config": "configs/nope.yaml"}}}, "cells.x.config: no such file configs/nope.yaml"),
    ({"comparisons": [{"a": "pkm", "b": "peer"}]}, "comparisons[0]: {a: CELL, b: CELL, claim: TEXT, metric: ppl | "
                                                   "usage} with cells"),
    ({"comparisons": [{"a": "pkm", "b": "dense", "metric": "kl"}]}, "comparisons[0]: {a: CELL, b: CELL, claim: TEXT"),
])
def test_a_bad_study_file_is_one_line_naming_the_key(tmp_path, capsys, change, message):
    path = write_study(tmp_path, **change)
    with pytest.raises(StudyError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        load_study(path)
    assert study_cli.main(["plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"study: error: {path}: ") and err.count("\n") == 1


def test_a_study_with_no_run_has_no_report(tmp_path, capsys):
    path = write_study(tmp_path)
    assert study_cli.main(["report", str(path)]) == 2
    assert "no run of the study is trained yet" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # a report already there stays as it is


def test_the_budget_is_in_tokens_and_the_grid_scales_every_learning_rate_together(tmp_path):
    study = load_study(write_study(tmp_path, tokens=1000, eval_every_tokens=256, lr_grid=[0.25, 1],
                                   set=[*TINY, "optim.accumulate=2", "optim.engram_lr_scale=3"], world_size=2))
    low, one = study.run("pkm", 0.25, 1), study.run("pkm", 1.0, 1)
    assert low.tokens_per_step == 4 * 16 * 2 * 2 and low.steps == 4  # ⌈1000 / 256⌉
    cfg_low, cfg_one = load(low), load(one)
    assert cfg_low.train.max_steps == 4 and cfg_low.train.eval_every == 1 and cfg_low.train.seed == 1
    for key in LR_KEYS:
        assert getattr(cfg_low.optim, key) == pytest.approx(0.25 * getattr(cfg_one.optim, key))
    assert cfg_one.optim.lr == 3e-3 and cfg_one.optim.values_lr == 1e-2
    assert cfg_low.optim.engram_lr_scale == cfg_one.optim.engram_lr_scale == 3  # a ratio to optim.lr: follows it
    assert low.run.run_dir == tmp_path / "dump" / "pkm" / "lr0.25-seed1" and low.train_command()[:3] == [
        "torchrun", "--nproc_per_node=2", "train.py"]
    # every learning rate of the optimizer settings is scaled or follows optim.lr: a new one must join a list
    lr_fields = {f.name for f in dataclasses.fields(Config().optim) if "lr" in f.name and f.type == "float"}
    assert lr_fields == set(LR_KEYS) | set(LR_RATIOS)


def load(run):
    from xlm_pkm.config import load_config

    return load_config(REPO / run.run.config, run.run.overrides)


def fake_trained(run, valid: list[float], test: float | None = None, vocab_size: int = 0) -> None:
    """A run's small files as the harness leaves them, without training it (its data's vocabulary: vocab_size)."""
    run.results.mkdir(parents=True, exist_ok=True)
    step = run.steps // len(valid)
    lines = [{"event": "train", "step": 1, "loss": 9.0, "tokens_per_sec": 1000.0}]
    lines += [{"event": "valid", "step": step * (i + 1), "ppl": p} for i, p in enumerate(valid)]
    (run.results / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    cfg = load(run)  # the plan's: the run is current
    cfg.model.vocab_size = vocab_size
    (run.results / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
    (run.results / "run.json").write_text(json.dumps({"lr": {"lr": run.factor, "values_lr": run.factor}}))
    if test is not None:
        (run.results / "test.json").write_text(json.dumps({"ppl": test}))


def fake_dump(run, step: int | None = None, best: bytes = b"kept") -> None:
    """The run's best.pt and checkpoint.pt in the dump, as train.py leaves them at `step` (its last by default)."""
    run.run.run_dir.mkdir(parents=True, exist_ok=True)
    run.checkpoint.write_bytes(best)
    torch.save({"step": run.steps if step is None else step}, run.run.run_dir / "checkpoint.pt")


def test_the_learning_rate_is_chosen_on_validation_only_and_flagged_at_the_grids_edge(tmp_path):
    study = load_study(write_study(tmp_path, lr_grid=[0.5, 1, 2], seeds=[3, 4]))
    assert [(j.kind, j.run.cell, j.run.id) for j in pending(study)][:3] == [
        (TRAIN, "pkm", "lr0.5-seed3"), (TRAIN, "pkm", "lr1-seed3"), (TRAIN, "pkm", "lr2-seed3")]
    assert [j.run.cell for j in pending(study.only(["dense"]))] == ["dense"] * 3  # a part of the study: its grid
    with pytest.raises(StudyError, match="no cell peer"):
        study.only(["peer"])
    # pkm: best valid at x1 (the lowest of each run counts: best.pt); dense: best at x2, the grid's end
    for factor, valid in {0.5: [50.0, 30.0], 1: [40.0, 20.0, 21.0], 2: [45.0, 25.0]}.items():
        fake_trained(study.run("pkm", factor, 3), valid)
    for factor, valid in {0.5: [50.0], 1: [40.0], 2: [39.0]}.items():
        fake_trained(study.run("dense", factor, 3), valid)
    pkm, dense = study.choice("pkm"), study.choice("dense")
    assert (pkm.factor, pkm.edge, pkm.valid) == (1, "", {0.5: 30.0, 1: 20.0, 2: 25.0})
    assert (dense.factor, dense.edge) == (2, "highest")
    # a test result planted (wrong) in runs at other factors changes neither the choice nor what is left to do
    fake_trained(study.run("pkm", 0.5, 4), [10.0], test=1.0)
    (study.run("pkm", 2, 3).results / "test.json").write_text(json.dumps({"ppl": 1.0}))
    assert study.choice("pkm") == pkm
    todo = [(j.kind, j.run.cell, j.run.id) for j in pending(study)]  # no test before every seed is trained
    assert todo == [(TRAIN, "pkm", "lr1-seed4"), (TRAIN, "dense", "lr2-seed4")]
    # the report reads test perplexity at the chosen factor only, and flags the edge
    fake_trained(study.run("pkm", 1, 4), [22.0, 21.0, 20.5], test=120.0)
    fake_trained(study.run("dense", 2, 4), [50.0, 45.0, 40.0, 38.0], test=131.0)  # at steps 2, 4, 6, 8 of 8
    memories = [{"layer": 1, "usage": 90.0, "kl": 1.0}, {"layer": 0, "usage": 50.0, "kl": 3.0}]
    (study.run("pkm", 1, 3).results / "test.json").write_text(json.dumps({"ppl": 110.0, "memories": memories}))
    (study.run("dense", 2, 3).results / "test.json").write_text(json.dumps({"ppl": 130.0}))
    # a benchmark row that timed one run for two configs (pkm's resolves to "alias"'s) counts for both names
    bench = {"rows": [{"cell": "dense", "tokens_per_s": 12345.6},
                      {"cell": "alias", "cells": ["alias", "pkm"], "tokens_per_s": 999.0}]}
    report = write_report(study, [bench]).read_text()
    choices, cells = report.split("## Cells")
    rows = {line.split(" | ")[0]: line for line in cells.splitlines() if line.startswith("| `")}
    # test usage/KL per memory layer, means over the seeds that have them (seed 4's test.json has none)
    assert "| 115.0 ± 7.1 | 2/2 | L0 50.0/3.00; L1 90.0/1.00 |" in rows["| `pkm`"]
    assert "| 130.5 ± 0.7 | 2/2 | · |" in rows["| `dense`"]
    assert "| · | 12,346 | 512 |" in rows["| `dense`"] and "| · | 999 | 512 |" in rows["| `pkm`"]  # logged, benchmark
    # the last quarter: (p(6) − p(8)) / p(6) = (40 − 38) / 40 on seed 4; seed 3 has no evaluation by step 6
    assert rows["| `dense`"].endswith("| 512 | 5.0 | 2 |") and rows["| `pkm`"].endswith("| 512 | · | 2 |")
    assert "| `pkm` | 30.0 | 20.0 | 25.0 | ×1 | lr 1, values_lr 1 |  |" in choices
    # values_lr only for a cell with memory values (issue 63)
    assert "| `dense` | 50.0 | 40.0 | 39.0 | ×2 | lr 2 | **at the highest end of the grid** |" in choices
    assert "| 3: -20.00, 4: -11.00 | −− | -15.50 |" in report  # pkm − dense per seed
    # sd 6.364: 3 seeds 4.303 · 6.364 / √3 = 15.8 > 15.5, 4 seeds 3.182 · 6.364 / 2 = 10.1 < 15.5 (one claim: m = 1)
    assert "| **inconclusive** | 4 / 4 |" in report
    assert not pending(study)


def test_a_choice_at_an_end_grows_the_grid_past_it_up_to_lr_extend_steps(tmp_path):
    study = load_study(write_study(tmp_path, lr_grid=[0.5, 1, 2], seeds=[3, 4], lr_extend=2))
    assert study.grid("pkm") == (0.5, 1, 2)  # nothing trained: the grid as written
    for factor, valid in {0.5: [50.0], 1: [40.0], 2: [39.0]}.items():  # best at the top: ×4 is asked for
        fake_trained(study.run("pkm", factor, 3), valid)
    for factor, valid in {0.5: [30.0], 1: [40.0], 2: [45.0]}.items():  # best at the bottom: ×0.25
        fake_trained(study.run("dense", factor, 3), valid)
    assert (study.grid("pkm"), study.grid("dense")) == ((0.5, 1, 2, 4), (0.25, 0.5, 1, 2))
    assert study.choice("pkm") is None and [(j.kind, j.run.cell, j.run.id) for j in pending(study)] == [
        (TRAIN, "pkm", "lr4-seed3"), (TRAIN, "dense", "lr0.25-seed3")]
    fake_trained(study.run("pkm", 4, 3), [38.0])  # still at the top: ×8, the last step lr_extend allows
    fake_trained(study.run("pkm", 8, 3), [37.0])
    # pkm is chosen, dense's grid is not trained: pkm's other seed comes first; no test while dense is open
    assert [(j.kind, j.run.cell, j.run.id) for j in pending(study)] == [
        (TRAIN, "pkm", "lr8-seed4"), (TRAIN, "dense", "lr0.25-seed3")]
    fake_trained(study.run("dense", 0.25, 3), [35.0])  # inside now: no further step
    assert study.grid("pkm") == (0.5, 1, 2, 4, 8) and study.grid("dense") == (0.25, 0.5, 1, 2)
    pkm, dense = study.choice("pkm"), study.choice("dense")
    assert (pkm.factor, pkm.edge, dense.factor, dense.edge) == (8, "highest", 0.5, "")
    assert [(j.kind, j.run.cell, j.run.id) for j in pending(study)] == [  # the tests once these are trained
        (TRAIN, "pkm", "lr8-seed4"), (TRAIN, "dense", "lr0.5-seed4")]
    choices = write_report(study).read_text().split("## Cells")[0]
    assert "| cell | valid ppl ×0.25 | valid ppl ×0.5 | valid ppl ×1 | valid ppl ×2 | valid ppl ×4 | valid ppl ×8 |" \
        in choices
    assert "| `dense` | 35.0 | 30.0 | 40.0 | 45.0 | · | · | ×0.5 |" in choices
    assert "| `pkm` | · | 50.0 | 40.0 | 39.0 | 38.0 | 37.0 | ×8 |" in choices and "**at the highest end" in choices
    assert load_study(write_study(tmp_path, lr_grid=[0.5, 1, 2])).grid("pkm") == (0.5, 1, 2)  # lr_extend 0


def test_lr_refine_trains_the_midpoints_around_the_best_and_chooses_over_all(tmp_path):
    """lr_refine: once the grid (grown or not) is trained, the geometric midpoints between the best factor and
    each trained neighbour are trained for the first seed, then the best of all is chosen; twice: again around
    the new best, with the closer neighbours. A best at an end has one neighbour, so one midpoint."""
    study = load_study(write_study(tmp_path, lr_grid=[1, 2, 4], seeds=[3, 4], lr_extend=1, lr_refine=2))
    for factor, valid in {1: [60.0], 2: [50.0], 4: [55.0]}.items():  # pkm: best inside, at ×2
        fake_trained(study.run("pkm", factor, 3), valid)
    for factor, valid in {1: [40.0], 2: [45.0], 4: [47.0]}.items():  # dense: best at the low end
        fake_trained(study.run("dense", factor, 3), valid)
    fake_trained(study.run("dense", 0.5, 3), [42.0])  # the grown step: ×1 is inside now
    r2, h = 1.41421, 0.707107  # √2 and 1/√2 as the run ids write them (6 digits)
    assert study.grid("pkm") == (1, r2, 2, 2.82843, 4) and study.grid("dense") == (0.5, h, 1, r2, 2, 4)
    assert study.choice("pkm") is None and [(j.run.cell, j.run.factor) for j in pending(study)] == [
        ("pkm", r2), ("pkm", 2.82843), ("dense", h), ("dense", r2)]
    fake_trained(study.run("pkm", r2, 3), [52.0])
    fake_trained(study.run("pkm", 2.82843, 3), [48.0])  # better than ×2: the second round is around ×2√2
    assert study.grid("pkm") == (1, r2, 2, 2.37842, 2.82843, 3.36359, 4)  # about 2^1.25, 2^1.75
    for factor in study.grid("pkm")[3], study.grid("pkm")[5]:
        fake_trained(study.run("pkm", factor, 3), [49.0])
    pkm = study.choice("pkm")
    assert (pkm.factor, pkm.edge, len(pkm.valid)) == (2.82843, "", 7)
    assert [r.id for r in study.chosen_runs("pkm")] == ["lr2.82843-seed3", "lr2.82843-seed4"]
    choices = write_report(study).read_text().split("## Cells")[0]  # factors shown to 3 digits
    assert "| valid ppl ×2.38 | valid ppl ×2.83 | valid ppl ×3.36 |" in choices
    assert "| 60.0 | 52.0 | 50.0 | 49.0 | 48.0 | 49.0 | 55.0 | ×2.83 | lr 2.83, values_lr 2.83 |" in choices
    for factor, valid in {h: [41.0], r2: [44.0]}.items():
        fake_trained(study.run("dense", factor, 3), valid)
    dense = study.choice("dense")  # ×1 stays best; its neighbours now ×1/√2 and ×√2: the second round
    assert dense is None and study.grid("dense") == (0.5, h, 0.840897, 1, 1.18921, r2, 2, 4)  # about 2^∓0.25


def test_no_test_read_before_every_cells_settings_are_final(tmp_path, capsys):
    """issue 61: dense_params' test split was read at ×4 before the grid's refinement moved its choice. The harness
    withholds every test while a cell is open (its factor not chosen, or a chosen seed not trained), even for a part
    of the study (--only) that is finished, refuses a test in one line naming the open cells, and `plan` says so."""
    path = write_study(tmp_path, lr_grid=[0.5, 1], seeds=[3, 4])
    study = load_study(path)
    for factor, valid in {0.5: [30.0], 1: [20.0]}.items():
        fake_trained(study.run("pkm", factor, 3), valid)
    fake_trained(study.run("pkm", 1, 4), [21.0])
    fake_trained(study.run("dense", 0.5, 3), [40.0])  # dense: 1 of 2 grid runs
    assert study.open_cells() == {"dense": "lr not chosen, 1 of 2 grid runs trained"}
    assert [(j.kind, j.run.cell, j.run.id) for j in pending(study)] == [(TRAIN, "dense", "lr1-seed3")]
    assert [j.kind for j in pending(study.only(["pkm"]))] == [TEST, TEST]  # the part alone would test...
    assert pending(study.only(["pkm"]), study) == []  # ...the whole study's open cell withholds it
    message = ("study tiny: no test read before every cell's settings are final; still open: dense (lr not chosen, "
               "1 of 2 grid runs trained)")
    with pytest.raises(StudyError, match=re.escape(message)):
        study.test_guard()
    assert study_cli.main(["run", str(path), "--only", "pkm"]) == 0  # nothing it may do now: one line why
    assert capsys.readouterr().err == f"{message} (2 test evaluation(s) wait)\n"
    for only in ([], ["--only", "pkm"]):  # a part of the study: the whole study's open cells
        assert study_cli.main(["plan", str(path), *only]) == 0
        assert capsys.readouterr().out.splitlines()[-1] == (
            "test split: not before every cell's settings are final; still open: dense (lr not chosen, 1 of 2 grid "
            "runs trained)")
    fake_trained(study.run("dense", 1, 3), [35.0])
    assert study.open_cells() == {"dense": "lr1-seed4 not trained"}  # chosen, a seed still to train
    fake_trained(study.run("dense", 1, 4), [36.0])
    assert not study.open_cells() and [(j.kind, j.run.cell, j.run.id) for j in pending(study)] == [
        (TEST, "pkm", "lr1-seed3"), (TEST, "pkm", "lr1-seed4"), (TEST, "dense", "lr1-seed3"),
        (TEST, "dense", "lr1-seed4")]
    study.test_guard()  # final: no refusal


def test_a_diverged_seed_is_run_again_one_factor_lower_and_the_report_shows_both(tmp_path):
    """diverge_ratio 1.2: seed 4's run at the chosen ×1 has a best valid perplexity 1.5× seed 3's there, so it
    runs again at ×0.5; a run whose curve ends above 1.2× its best, or is not finite, diverged too; the re-run
    is tested and compared, the diverged one named beside it; without the key nothing changes."""
    study = load_study(write_study(tmp_path, lr_grid=[0.5, 1], seeds=[3, 4], diverge_ratio=1.2))
    for cell in ("pkm", "dense"):
        fake_trained(study.run(cell, 0.5, 3), [40.0, 30.0])
        fake_trained(study.run(cell, 1, 3), [30.0, 20.0])
    fake_trained(study.run("pkm", 1, 4), [45.0, 30.0], test=150.0)  # 30 > 1.2 × 20: diverged (tested before)
    fake_trained(study.run("dense", 1, 4), [30.0, 23.0])  # 23 < 1.2 × 20: kept
    assert study.diverged(study.run("pkm", 1, 4)) == "best valid 30.0 > 1.2 × seed 3's 20.0"
    assert study.diverged(study.run("dense", 1, 4)) == ""
    assert [r.id for r in study.chosen_runs("pkm")] == ["lr1-seed3", "lr0.5-seed4"]
    assert study.open_cells() == {"pkm": "lr0.5-seed4 not trained"}
    assert [(j.kind, j.run.cell, j.run.id) for j in pending(study)] == [(TRAIN, "pkm", "lr0.5-seed4")]
    plan = "\n".join(study_cli.describe(study))
    assert "  lr1-seed4 [tested; diverged (best valid 30.0 > 1.2 × seed 3's 20.0): re-run at ×0.5]" in plan
    fake_trained(study.run("pkm", 0.5, 4), [35.0, 31.0], test=125.0)  # 31 < 1.2 × seed 3's 30 at ×0.5: kept
    for cell, seed, test in (("pkm", 3, 110.0), ("dense", 3, 130.0), ("dense", 4, 131.0)):
        (study.run(cell, 1, seed).results / "test.json").write_text(json.dumps({"ppl": test}))
    report = write_report(study).read_text()
    assert "**Divergence rule** (declared: ratio 1.2)" in report
    assert ("| seed 4 ×1 (test 150.0; best valid 30.0 > 1.2 × seed 3's 20.0) -> ×0.5 (test 125.0) |") in report
    assert "| 3: -20.00, 4: -6.00 (`pkm` ×0.5) | −− |" in report  # 125 − 131 from the re-run
    # the curve itself: not finite, or ending above 1.2 × its best
    fake_trained(study.run("dense", 0.5, 4), [30.0, float("nan")])
    assert study.diverged(study.run("dense", 0.5, 4)) == "a valid perplexity not finite"
    fake_trained(study.run("dense", 0.5, 4), [20.0, 30.0])
    assert study.diverged(study.run("dense", 0.5, 4)) == "last valid 30.0 > 1.2 × its best 20.0"
    off = load_study(write_study(tmp_path, lr_grid=[0.5, 1], seeds=[3, 4]))  # no rule: the run at ×1 counts
    assert [r.id for r in off.chosen_runs("pkm")] == ["lr1-seed3", "lr1-seed4"] and off.diverged(
        off.run("pkm", 1, 4)) == ""


def test_robustness_recomputes_each_claim_at_the_next_lower_factor(tmp_path):
    """robustness: true adds every seed at each cell's next lower factor (tested once the settings are final); the
    report judges the claim again with a, then b, moved there, at the claim's Holm level; "not run" where the
    tests are missing."""
    study = load_study(write_study(tmp_path, lr_grid=[0.5, 1, 2], seeds=[3, 4], robustness=True))
    for cell in ("pkm", "dense"):
        for factor, valid in {0.5: [40.0], 1: [20.0], 2: [30.0]}.items():
            fake_trained(study.run(cell, factor, 3), valid)
    assert study.neighbour("pkm") == 0.5 and [r.id for r in study.robustness_runs("pkm")] == [
        "lr0.5-seed3", "lr0.5-seed4"]
    assert [(j.kind, j.run.cell, j.run.id) for j in pending(study)] == [
        (TRAIN, "pkm", "lr1-seed4"), (TRAIN, "dense", "lr1-seed4"), (TRAIN, "pkm", "lr0.5-seed4"),
        (TRAIN, "dense", "lr0.5-seed4")]
    for cell, tests in (("pkm", (100.0, 110.0)), ("dense", (120.0, 131.0))):
        for seed, test in zip((3, 4), tests):
            fake_trained(study.run(cell, 1, seed), [20.0], test=test)
    fake_trained(study.run("pkm", 0.5, 4), [41.0])
    (study.run("pkm", 0.5, 3).results / "test.json").write_text(json.dumps({"ppl": 128.0}))
    (study.run("pkm", 0.5, 4).results / "test.json").write_text(json.dumps({"ppl": 139.0}))
    assert [(j.kind, j.run.cell, j.run.id) for j in pending(study)] == [
        (TRAIN, "dense", "lr0.5-seed4"), (TEST, "dense", "lr0.5-seed3")]  # settings final: the neighbours test
    at_hand = study.run("dense", 0.5, 3)
    fake_dump(at_hand)
    assert [(j.kind, j.run.cell, j.run.id) for j in pending(study)] == [
        (TEST, "dense", "lr0.5-seed3"), (TRAIN, "dense", "lr0.5-seed4")]  # its best.pt in the dump: read first
    fake_dump(at_hand, step=at_hand.steps - 1)  # a re-train cut before its last step: its best.pt is not the run's
    assert [(j.kind, j.run.cell, j.run.id) for j in pending(study)] == [
        (TRAIN, "dense", "lr0.5-seed4"), (TEST, "dense", "lr0.5-seed3")]
    shutil.rmtree(at_hand.run.run_dir)
    report = write_report(study).read_text()
    # pkm at ×0.5 − dense at ×1: 128 − 120, 139 − 131 = +8, +8 (no spread: the point interval, reversed)
    assert "| `pkm` ×0.5: +8.00, **reversed**; `dense` ×0.5: not run (0 of 2 seeds tested) |" in report
    assert "(the study runs them)" in report


def test_a_comparison_of_usage_pairs_the_first_memory_layers_test_usage(tmp_path):
    """metric: usage compares the first memory layer's test usage % seed by seed (Table 2's "BatchNorm raises
    usage"); a cell without a memory has no usage: fewer than 2 paired seeds."""
    study = load_study(write_study(tmp_path, lr_grid=[1], seeds=[3, 4], comparisons=[
        {"a": "dense", "b": "pkm", "metric": "usage", "claim": "the first uses less"},
        {"a": "pkm", "b": "pkm", "metric": "usage", "claim": "itself"}]))
    for seed, (low, high) in {3: (40.0, 90.0), 4: (50.0, 95.0)}.items():
        fake_trained(study.run("pkm", 1, seed), [20.0])
        memories = [{"layer": 5, "usage": high, "kl": 1.0}, {"layer": 2, "usage": low, "kl": 2.0}]
        (study.run("pkm", 1, seed).results / "test.json").write_text(json.dumps({"ppl": 100.0, "memories": memories}))
        fake_trained(study.run("dense", 1, seed), [30.0], test=120.0)
    assert seed_values(study, "pkm", metric="usage") == {3: 40.0, 4: 50.0}  # layer 2: the first
    report = write_report(study).read_text()
    assert "| the first uses less | `dense` − `pkm` (usage %) | · | · | · |" in report  # dense has no memory
    assert "| itself | `pkm` − `pkm` (usage %) | 3: +0.00, 4: +0.00 | 00 |" in report


def test_a_run_trained_before_the_study_file_changed_is_stale_not_reused(tmp_path, capsys):
    """Issue 62: after `tokens: 512 -> 1024` (or a key of `set:`) the plan showed every run done and the report
    printed the new token count beside runs of the old. A trained run counts only while its config is the plan's:
    `plan` shows it stale with what differs, `run` and `report` refuse in one line saying how to train it again."""
    study = load_study(write_study(tmp_path, lr_grid=[1], seeds=[0]))
    for cell in study.cells:
        fake_trained(study.run(cell, 1, 0), [30.0], test=100.0)
    assert not pending(study) and not study.stale_runs()
    assert study_cli.main(["plan", str(study.path)]) == 0
    assert "[stale]" not in capsys.readouterr().out

    for change, differs in (({"tokens": 1024}, "train.max_steps: 8 -> 16"),
                            ({"set": [*TINY, "model.dim=48"]}, "model.dim: 32 -> 48")):
        path = write_study(tmp_path, lr_grid=[1], seeds=[0], **change)
        assert [(r.id, c) for r, c in load_study(path).stale_runs()][0][0] == "lr1-seed0"
        assert study_cli.main(["plan", str(path)]) == 0
        out = capsys.readouterr().out
        assert "  lr1-seed0 [stale] " in out and f"trained with another config than the study's now: {differs}" in out
        assert "2 stale run(s): move away their results and run directories" in out
        for command in ("run", "report"):
            assert study_cli.main([command, str(path)]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and f"{path}: 2 trained run(s) are not the runs this study file asks for now" in err[0]
            assert differs in err[0] and "move away their results and run directories" in err[0]
    assert not (tmp_path / "out").exists()  # no report written


def test_how_a_run_computed_does_not_make_it_stale(tmp_path):
    """A setting of how a run computes, not what (settings.execution: read_op, half_topk, fused_values...), whose
    default changed after the runs (issue 59: read_op eager -> custom_op) leaves them the study's; the same edit of
    an architecture key (knn) makes them stale."""
    study = load_study(write_study(tmp_path, lr_grid=[1], seeds=[0]))
    for cell in study.cells:
        fake_trained(study.run(cell, 1, 0), [30.0], test=100.0)
    config = study.run("pkm", 1, 0).results / "config.yaml"
    saved = yaml.safe_load(config.read_text())
    for key, value in (("read_op", "eager"), ("half_topk", "torch"), ("shard_values", False)):
        saved["model"]["memory"][key] = value
    saved["optim"]["fused_values"] = True
    config.write_text(yaml.safe_dump(saved))
    assert not study.stale_runs()
    knn = saved["model"]["memory"]["knn"]
    saved["model"]["memory"]["knn"] = knn + 1
    config.write_text(yaml.safe_dump(saved))
    assert [(r.cell, c) for r, c in study.stale_runs()] == [("pkm", [f"model.memory.knn: {knn + 1} -> {knn}"])]


def test_the_report_counts_the_model_as_trained(tmp_path):
    """Issue 62/63: the report counted parameters and FLOPs with a 1,000-word vocabulary (217k shown, train.log
    said 2,345,344): it counts the model of the run's resolved config, its data's vocabulary size."""
    from xlm_pkm.model.transformer import TransformerLM
    from xlm_pkm.runs.sizes import count_text

    study = load_study(write_study(tmp_path, lr_grid=[1], seeds=[0]))
    for cell in study.cells:
        fake_trained(study.run(cell, 1, 0), [30.0], test=100.0, vocab_size=2345)
    cells = write_report(study).read_text().split("## Cells")[1]
    for cell in study.cells:
        model = TransformerLM(dataclasses.replace(load(study.run(cell, 1, 0)).model, vocab_size=2345))
        total = sum(p.numel() for p in model.parameters())
        assert f"| {count_text(total)} |" in next(line for line in cells.splitlines() if line.startswith(f"| `{cell}`"))


@pytest.mark.parametrize("streams", ["0", "-3"])
def test_no_stream_is_one_line_not_every_run_done(tmp_path, capsys, streams):
    path = write_study(tmp_path)
    assert study_cli.main(["run", str(path), "--streams", streams]) == 2
    err = capsys.readouterr().err
    assert err == f"study: error: --streams {streams}: the number of runs side by side, at least 1\n"


def test_a_truncated_metrics_file_is_one_line_naming_it(tmp_path, capsys):
    """The plan read a truncated metrics.jsonl as 'Expecting value: line 1 column 505', naming no file."""
    study = load_study(write_study(tmp_path, lr_grid=[1], seeds=[0]))
    fake_trained(study.run("pkm", 1, 0), [30.0, 20.0])
    metrics = study.run("pkm", 1, 0).results / "metrics.jsonl"
    metrics.write_text(metrics.read_text()[:-20])
    assert study_cli.main(["plan", str(study.path)]) == 2
    assert capsys.readouterr().err == f"study: error: {metrics}:3: not a JSON line (Unterminated string starting " \
                                      f"at, column 20): truncated or damaged\n"


def trained_in_process(job) -> int:
    """Runs a job here (the tests' way: no new interpreter per run)."""
    from xlm_pkm.launch.cli import evaluate_main, train_main

    run = job.run.run
    return train_main(run.train_argv(absolute=True)) if job.kind == TRAIN else \
        evaluate_main(run.evaluate_argv(absolute=True))


def snapshot(root) -> dict:
    """Every file under root, JSON and JSON lines without their timings."""
    files = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        text = path.read_text()
        if path.suffix in (".json", ".jsonl"):
            rows = [json.loads(line) for line in text.splitlines()] if path.suffix == ".jsonl" else [json.loads(text)]
            text = [{k: v for k, v in row.items() if k not in TIMING} for row in rows]
        files[str(path.relative_to(root))] = text
    return files


def untimed(report: str) -> str:
    """The report without its logged tokens/s (the column after the FLOPs per token, in millions)."""
    return re.sub(r"(M \| )[\d,]+( \| )", r"\1\2", report)


@pytest.mark.slow
def test_a_study_cut_anywhere_and_run_again_gives_the_files_of_an_uninterrupted_one(tmp_path, tiny_data_dir,
                                                                                    signal_at_step, capsys):
    path = write_study(tmp_path, tiny_data_dir)
    study = load_study(path)
    assert run_study(study, 1, trained_in_process) == 0
    reference = snapshot(study.results)
    chosen = {(c, r.id) for c in study.cells for r in study.chosen_runs(c)}
    assert len(reference) == 6 * 3 + 4  # 6 runs trained (config, metrics, run.json), 4 tested
    tested = {(p.parent.parent.name, p.parent.name) for p in study.dump.rglob("test.json")}
    assert tested == chosen == {(p.parent.parent.name, p.parent.name) for p in study.results.rglob("test.json")}
    report = untimed(write_report(study).read_text())
    shutil.rmtree(study.dump), shutil.rmtree(study.results)

    signal_at_step(3, signal.SIGTERM)  # the first run is stopped at step 3, with its checkpoint
    assert run_study(study, 1, trained_in_process) == 75
    first = study.run("pkm", 0.5, 0)
    assert (first.run.run_dir / "checkpoint.pt").is_file() and not first.results.exists()
    signal_at_step(10 ** 6)
    launched = []

    def killed_after_three(job):  # then the command is killed: the fourth job never runs
        launched.append(job)
        return trained_in_process(job) if len(launched) <= 3 else 130

    assert run_study(study, 1, killed_after_three) == 75 and len(launched) == 4
    assert "resumed at step 3" in (first.run.run_dir / "train.log").read_text()
    assert run_study(study, 1, trained_in_process) == 0
    assert snapshot(study.results) == reference
    assert untimed(write_report(study).read_text()) == report
    assert run_study(study, 1, lambda job: pytest.fail(f"{job.name} ran again")) == 0  # all done: nothing runs
    assert "every run is done" in capsys.readouterr().out


@pytest.mark.slow
def test_the_command_runs_streams_of_processes_then_plans_and_reports(tmp_path, tiny_data_dir, capsys):
    path = write_study(tmp_path, tiny_data_dir, lr_grid=[1], seeds=[0], comparisons=[])
    assert study_cli.main(["run", str(path), "--streams", "2"]) == 0
    study = load_study(path)
    for cell in study.cells:
        (run,) = study.chosen_runs(cell)
        info = json.loads((run.results / "run.json").read_text())
        assert info["commands"]["train"].startswith("python train.py --config configs/default.yaml data.path=")
        assert info["tokens"] == 512 and info["steps"] == 8
        assert json.loads((run.results / "test.json").read_text())["step"] == 8
        assert (study.dump / cell / "lr1-seed0.log").is_file()
    capsys.readouterr()
    assert study_cli.main(["plan", str(path)]) == 0
    assert "pkm: lr ×1 chosen\n  lr1-seed0 [tested] 8 steps × 64 tokens: python train.py" in capsys.readouterr().out
    assert study_cli.main(["report", str(path)]) == 0
    assert (tmp_path / "out" / "learning_curves.png").stat().st_size > 1000


def test_a_run_whose_checkpoint_is_gone_is_trained_again_before_its_test_its_first_files_kept(tmp_path, capsys):
    """A study moved to another machine without its dump: a test job finds no best.pt. The harness trains the run
    again by its own command, keeps the first run's files in the results (the lr choice read them), puts the second's
    in retrained/, reads the test from the second's checkpoint, and the report sets the two runs side by side. A
    re-train that fails is reported and its test not read."""
    study = load_study(write_study(tmp_path, lr_grid=[1], seeds=[0]))
    pkm, dense = study.run("pkm", 1, 0), study.run("dense", 1, 0)
    for run in (pkm, dense):
        fake_trained(run, [40.0, 20.0])
    fake_dump(dense)  # dense's checkpoint is there; pkm's is gone
    first = (pkm.results / "metrics.jsonl").read_text()
    second = "".join(json.dumps({"event": "valid", "step": s, "ppl": p}) + "\n" for s, p in ((4, 42.0), (8, 21.0)))
    launched = []

    def launch(job):
        launched.append((job.kind, job.run.cell))
        out = job.run.run.run_dir
        if job.kind == TRAIN:
            fake_dump(job.run, best=b"again")
            (out / "metrics.jsonl").write_text(second)
            (out / "config.yaml").write_text((job.run.results / "config.yaml").read_text())
        else:
            assert (out / "best.pt").is_file()  # the test reads a checkpoint that exists
            (out / "test.json").write_text(json.dumps({"ppl": 100.0 if job.run.cell == "pkm" else 110.0}))
        return 0

    assert run_study(study, 1, launch) == 0
    assert launched == [(TEST, "dense"), (TRAIN, "pkm"), (TEST, "pkm")]  # the checkpoint at hand is read first
    assert (pkm.results / "metrics.jsonl").read_text() == first  # the first run's, which the choice read
    assert (pkm.retrained / "metrics.jsonl").read_text() == second and not dense.retrained.exists()
    assert json.loads((pkm.results / "test.json").read_text())["ppl"] == 100.0
    assert "pkm/lr1-seed0: trained again, best valid perplexity 21.00 against the first run's 20.00 (+5.00%)" in \
        capsys.readouterr().out
    report = write_report(study).read_text()
    assert "## Runs trained again" in report and "| `pkm` | lr1-seed0 | 20.00 | 21.00 | +5.00% |" in report
    assert "  lr1-seed0 [tested, trained again] 8 steps" in "\n".join(study_cli.describe(study))

    (pkm.results / "test.json").unlink(), shutil.rmtree(pkm.retrained)
    fake_dump(pkm, step=4)  # a re-train cut at step 4 of 8: trained again (resumed) before its test
    launched.clear()
    assert run_study(study, 1, launch) == 0 and launched == [(TRAIN, "pkm"), (TEST, "pkm")]
    assert "pkm/lr1-seed0: " + str(pkm.checkpoint) + " is from a re-train cut before its last step" in \
        capsys.readouterr().out

    (pkm.results / "test.json").unlink(), shutil.rmtree(pkm.run.run_dir), shutil.rmtree(pkm.retrained)
    launched.clear()
    assert run_study(study, 1, lambda job: launched.append(job.kind) or 1) == 1  # the re-train fails: no test
    assert launched == [TRAIN] and not pkm.tested and not pkm.retrained.exists()


@pytest.mark.slow
def test_a_run_trained_again_for_its_lost_checkpoint_repeats_the_first_on_one_machine(tmp_path, tiny_data_dir,
                                                                                      signal_at_step):
    """Really trained: a run whose dump is gone is trained again by its own command; on the same machine the second
    run's metrics and test perplexity are the first's (the same seed and data order, deterministic on the CPU)."""
    study = load_study(write_study(tmp_path, tiny_data_dir, lr_grid=[1], seeds=[0], comparisons=[]))
    assert run_study(study, 1, trained_in_process) == 0
    run = study.run("pkm", 1, 0)
    first = snapshot(run.results)
    shutil.rmtree(run.run.run_dir), (run.results / "test.json").unlink()
    assert run_study(study, 1, trained_in_process) == 0
    assert snapshot(run.retrained) == {k: first[k] for k in ("config.yaml", "metrics.jsonl")}
    assert snapshot(run.results)["test.json"] == first["test.json"]
    shutil.rmtree(run.run.run_dir), shutil.rmtree(run.retrained), (run.results / "test.json").unlink()
    signal_at_step(5, signal.SIGTERM)  # the re-train is cut at step 5 of 8, after a best.pt (valid every 2 steps)
    assert run_study(study, 1, trained_in_process) == 75 and run.checkpoint.is_file() and not run.tested
    signal_at_step(10 ** 6)
    assert run_study(study, 1, trained_in_process) == 0  # its test waits for the resumed re-train's last step
    assert snapshot(run.retrained) == {k: first[k] for k in ("config.yaml", "metrics.jsonl")}
    assert snapshot(run.results)["test.json"] == first["test.json"]
    run.checkpoint.unlink()  # best.pt alone gone: the finished checkpoint.pt resumes to nothing, a one-line failure
    (run.results / "test.json").unlink()
    assert run_study(study, 1, trained_in_process) == 1 and not run.tested
