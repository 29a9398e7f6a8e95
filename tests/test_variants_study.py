"""The memory variants' study (results/variants): every config of configs/variants joins it and builds,
the dense cells are matched to the PKM cell at the run's own scale, and the report judges the
published orderings against the seeds' spread, and the PKM-Engram allocation's U shape."""

import dataclasses
import json

import pytest
import torch
import yaml

from tests.test_report import make_run
from xlm_pkm.config import load_config, to_dict
from xlm_pkm.experiments import variants_report
from xlm_pkm.experiments.reproduce import MATCHED, REPO, SCALES, TABLES, model_size, plan
from xlm_pkm.experiments.study_plan import load_study
from xlm_pkm.model.transformer import TransformerLM
from xlm_pkm.optim.schedule import values_lr


def test_every_variant_config_is_a_cell_and_builds():
    papers = sorted(p.stem for p in (REPO / "configs/variants/paper").glob("*.yaml"))
    assert [c.name for c in TABLES["variants"]] == papers and {"pkm", *MATCHED} <= set(papers)
    for path in sorted((REPO / "configs/variants").rglob("*.yaml")):
        cfg = load_config(path)
        assert model_size(cfg, cfg.data.bptt)["total"] > 0, path


@pytest.mark.parametrize("scale", ["tiny", "paper"])
def test_matched_cells_match_the_pkm_cell_at_the_runs_scale(tmp_path, scale):
    runs = {next(c.name for c in r.cells if c.table == "variants"): r
            for r in plan("variants", SCALES[scale], tmp_path, only=["pkm", *MATCHED])[0]}

    def size(cell, *extra):
        cfg = load_config(REPO / runs[cell].config, [*runs[cell].overrides, *extra])
        return model_size(cfg, cfg.data.bptt), cfg.model.ffn_dim

    target = size("pkm")[0]
    for cell, what in (("dense_params", "total"), ("dense_flops", "flops")):
        got, width = size(cell)
        assert width > 0 and not size(cell)[0] == target  # a real width, not the memory model
        # the chosen width is the closest: one unit more or less lands farther from the PKM cell
        for other in (width - 1, width + 1):
            assert abs(got[what] - target[what]) <= abs(size(cell, f"model.ffn_dim={other}")[0][what] - target[what])
        assert abs(got[what] - target[what]) / target[what] < 0.01
    # the Engram cells' tables take what the PKM cell's total leaves, to within the jumps of their prime sizes
    for cell in ("engram", "engram_share25", "engram_share50", "engram_share75"):
        cfg = load_config(REPO / runs[cell].config, runs[cell].overrides)
        assert cfg.model.engram.layers == [2]
        assert abs(model_size(cfg, cfg.data.bptt)["total"] - target["total"]) / target["total"] < 0.005


def test_the_values_lr_decay_spans_the_scaled_run(tmp_path):
    (run,), _ = plan("variants", SCALES["tiny"], tmp_path, only=["ultramem"])
    cfg = load_config(REPO / run.config, run.overrides)
    assert cfg.optim.values_lr_decay_steps == cfg.train.max_steps == 400  # 500,000 of 500,000 at the paper's


def test_ultramem_steps_add_table_2s_rows_in_its_order():
    """Query/key LayerNorm comes after "+rm softmax" and before "+IVE" in Table 2: step 1b, kept by every later
    step; IVE and the steps after it initialise its values as the released code; ultramem.yaml is step 5."""
    paper = REPO / "configs/variants/paper"
    steps = ["pkm", "ultramem_step1_no_softmax", "ultramem_step1b_qk_layernorm", "ultramem_step2_ive",
             "ultramem_step3_tdqkr", "ultramem_step4_mcs", "ultramem_step5_value_lr_decay"]
    memory = {step: load_config(paper / f"{step}.yaml").model.memory for step in steps}
    assert [memory[s].qk_layernorm for s in steps] == [False, False, True, True, True, True, True]
    assert [memory[s].score for s in steps] == ["softmax", *["identity"] * 6]
    assert [memory[s].values == "expanded" and memory[s].expanded.init == "released" for s in steps] == [
        False, False, False, True, True, True, True]
    whole, step5 = (to_dict(load_config(paper / f"{name}.yaml")) for name in ("ultramem", steps[-1]))
    assert whole["train"].pop("exp_name") == "variant_ultramem" and step5["train"].pop("exp_name")
    assert whole == step5


def test_step5_decays_the_values_lr_from_ten_times_step4s_to_step4s():
    """The study's steps 4 and 5 at the tiny scale (values_lr 1e-3 x 4 = 4e-3, 40 warm-up steps, 1,600 steps,
    the study's values_lr_decay_steps=1600), at the grid's factor 1: step 4's values lr is 4e-3 at every step;
    step 5's is 4e-3 · (1 + 9 · (1 - t / 1600)), by hand: 10 x step 4's at the start, 9.775 x at the warm-up's
    end, 5.5 x half-way, step 4's at the end."""
    study = load_study(REPO / "results/variants/study.yaml")
    step4, step5 = (load_study_run(study.run(cell, 1.0, 0)) for cell in (
        "ultramem_step4_mcs", "ultramem_step5_value_lr_decay"))
    assert step5.train.max_steps == step5.optim.values_lr_decay_steps == 1600 and step5.optim.warmup_steps == 40
    by_hand = {0: 0.04, 40: 0.0391, 800: 0.022, 1600: 0.004}
    for step, lr in by_hand.items():
        assert values_lr(step, step4.optim) == pytest.approx(0.004, rel=1e-12)
        assert values_lr(step, step5.optim) == pytest.approx(lr, rel=1e-12), step
    assert values_lr(0, step5.optim) == pytest.approx(10 * values_lr(0, step4.optim), rel=1e-12)
    assert all(values_lr(t, step5.optim) >= values_lr(t, step4.optim) for t in range(1, 1601))


def test_report_judges_the_orderings_against_the_spread(tmp_path):
    root = tmp_path / "runs"
    ppl = {"dense_params": (200.0, 201.0, 199.0), "pkm_relu": (210.0, 211.0, 209.0), "pkm": (215.0, 230.0, 200.0),
           "peer": (190.0, 191.0, 189.0), "dense_flops": (220.0, 221.0, 219.0),
           "ultramem_step1_tdqkr": (212.0, 212.5, 211.5), "ultramem_step2_mcs": (214.0, 214.5, 213.5)}
    for cell, values in ppl.items():
        for seed, value in enumerate(values):
            also = [("variants", {"variant": "ultramem"})] if cell == "ultramem_step2_mcs" else []  # one config
            make_run(root, cell, [("variants", {"variant": cell}), *also], value,
                     usage=None if "dense" in cell else 90.0, kl=0.5, seed=seed)
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"rows": [{"cell": "pkm", "tokens_per_s": 1234.0}]}))
    assert variants_report.main([str(root), "--out", str(tmp_path / "out"), "--bench", str(bench)]) == 0
    report = (tmp_path / "out" / "report.md").read_text()
    lines = {line.split(" | ")[0]: line for line in report.splitlines() if line.startswith("| ")}
    # dense < relu holds (10 apart, spread 2); relu < pkm is within pkm's spread of 15
    assert "partly: dense_params < pkm_relu holds, pkm_relu < pkm within noise" in lines[next(
        k for k in lines if "Csordás" in k)]
    assert "partly: peer < pkm holds, pkm < dense_flops within noise" in lines[next(k for k in lines if "PEER" in k)]
    ultra = lines[next(k for k in lines if "UltraMem" in k)]
    assert "pkm → ultramem_step1_tdqkr → ultramem_step2_mcs)" in ultra and "| `ultramem` |" in report
    assert "ultramem_step2_mcs < ultramem_step1_tdqkr does not hold" in ultra
    assert "| `pkm` |" in report and "1,234" in report and (tmp_path / "out" / "variants.png").stat().st_size > 1000


def load_study_run(run):
    """The resolved config of a study run."""
    return load_config(REPO / run.run.config, run.run.overrides)


def make_allocation_run(root, cell, ppl, seed, n_keys, table_size):
    """A run of make_run with n_keys² PKM slots of width 16 (no memory at 0) and Engram tables of about
    table_size rows per order at layer 2 (no Engram at 0), each of whose layers read 95% of its rows."""
    path = make_run(root, cell, [("variants", {"variant": cell})], ppl, usage=90.0 if n_keys else None, kl=0.5,
                    n_keys=n_keys or 8, seed=seed)
    cfg = yaml.safe_load((path / "config.yaml").read_text())
    cfg["model"]["engram"].update(layers=[2] if table_size else [], heads=2, ngram_dim=16, table_size=table_size or 16)
    (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    test = json.loads((path / "test.json").read_text())
    test["engrams"] = [{"layer": 2, "rows": 0, "usage": 95.0, "kl": 0.1}] if table_size else []
    (path / "test.json").write_text(json.dumps(test))
    return path


def engram_share(path, n_keys):
    """% of the memory parameters in the run's Engram tables: n_keys² value rows of 16 against the tables."""
    cfg = load_config(path / "config.yaml")
    with torch.device("meta"):
        model = TransformerLM(dataclasses.replace(cfg.model, vocab_size=1000))
    engram = sum(e.table.numel() for _, e in model.engrams())
    return 100 * engram / (engram + n_keys**2 * 16)


@pytest.mark.parametrize("u", [True, False])
def test_report_places_the_allocation_cells_at_their_engram_share(tmp_path, u):
    root = tmp_path / "runs"
    # (cell, n_keys, table_size, ppl over seeds): a U with its bottom at 25%, or falling to all-Engram
    cells = [("pkm", 8, 0, (215.0, 216.0, 214.0)), ("engram_share25", 7, 16, (200.0, 201.0, 199.0)),
             ("engram_share50", 6, 32, (205.0, 207.0, 203.0)), ("engram_share75", 4, 48, (209.0, 209.5, 208.5)),
             ("engram", 0, 64, (212.0, 213.0, 211.0) if u else (190.0, 190.5, 189.5))]
    share = {}
    for cell, n_keys, table_size, ppl in cells:
        paths = [make_allocation_run(root, cell, value, seed, n_keys, table_size) for seed, value in enumerate(ppl)]
        share[cell] = engram_share(paths[0], n_keys)
    assert share["pkm"] == 0 < share["engram_share25"] < share["engram_share50"] < share["engram_share75"] < 100
    assert share["engram"] == 100
    assert variants_report.main([str(root), "--out", str(tmp_path / "out")]) == 0
    report = (tmp_path / "out" / "report.md").read_text()
    assert report.startswith("# ") and "Engram" in report.splitlines()[0]
    cell_rows = {line.split(" | ")[1]: line.split(" | ") for line in report.splitlines() if line.count(" | ") > 10}
    assert cell_rows["`pkm`"][-2] == "-" and cell_rows["`engram`"][-2] == "95.0 ± 0.0"  # Engram rows read %
    assert cell_rows["`engram`"][-4:-2] == ["-", "-"] and cell_rows["`engram_share25`"][-4] == "90.0 ± 0.0"
    assert "PKM + Engram, 25%" in cell_rows["`engram_share25`"][0]
    section = report.split("## Allocation: a fixed memory budget split between PKM and Engram")[1]
    rows = {line.split(" | ")[0][2:]: line.strip("| ").split(" | ") for line in section.splitlines()
            if line.startswith("| `")}
    assert list(rows) == ["`pkm`", "`engram_share25`", "`engram_share50`", "`engram_share75`", "`engram`"]
    for cell, n_keys, _, ppl in cells:
        assert rows[f"`{cell}`"][1] == f"{share[cell]:.1f}" and rows[f"`{cell}`"][2] == f"{n_keys ** 2:,}"
        mean = sum(ppl) / 3
        assert rows[f"`{cell}`"][5] == f"{mean:.1f} ± {(sum((p - mean) ** 2 for p in ppl) / 2) ** .5:.1f}"
    assert rows["`pkm`"][3] == "0" and int(rows["`engram`"][3].replace(",", "")) > 2 * 64 - 10
    claim = next(line for line in report.splitlines() if line.startswith("| Engram paper"))
    if u:  # 25% is 14 below pkm and 12 below engram, each beyond the spreads summed (2 each)
        assert "A U shape appears: the best interior point, engram_share25" in section
        assert f"The lowest mean perplexity is at {share['engram_share25']:.0f}% to Engram (`engram_share25`), " \
               "below every other share beyond the spreads." in section
        assert f"| holds; lowest at {share['engram_share25']:.0f}% |" in claim
    else:  # the best interior point is 10 above all-Engram: no U, the best share is 100%
        assert "No U shape: the best interior point, engram_share25" in section and "against engram" in section
        assert "The lowest mean perplexity is at 100% to Engram (`engram`)" in section
        assert "| does not hold; lowest at 100% |" in claim
    assert (tmp_path / "out" / "allocation.png").stat().st_size > 1000
