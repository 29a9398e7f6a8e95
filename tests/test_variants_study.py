"""The memory variants' study (results/variants): every config of configs/variants joins it and builds,
the dense cells are matched to the PKM cell at the run's own scale, and UltraMem's ablation steps are
Table 2's (the report is the study's: tests/test_study.py)."""

import pytest

from xlm_pkm.config import load_config, to_dict
from xlm_pkm.experiments.reproduce import MATCHED, REPO, SCALES, TABLES, model_size, plan
from xlm_pkm.experiments.study_plan import load_study
from xlm_pkm.optim.schedule import values_lr


@pytest.mark.slow
def test_every_variant_config_is_a_cell_and_builds():
    papers = sorted(p.stem for p in (REPO / "configs/variants/paper").glob("*.yaml"))
    assert [c.name for c in TABLES["variants"]] == papers and {"pkm", *MATCHED} <= set(papers)
    for path in sorted((REPO / "configs/variants").rglob("*.yaml")):
        cfg = load_config(path)
        assert model_size(cfg, cfg.data.bptt)["total"] > 0, path


@pytest.mark.slow
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


@pytest.mark.slow
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


def test_step5_as_the_paper_gives_it_decays_the_values_lr_from_ten_times_the_dense_lr_to_it():
    """The study's step 5 in the paper's form (cell ultramem_step5_paper) at the grid's factor 1: the dense lr is
    1e-3 · √(40 / t) after its 40 warm-up steps (inverse_sqrt), and the values' lr is that times
    1 + 9 · (1 − t / 1600), by hand: 9.775e-3 at the warm-up's end, 5.5 × 1e-3 · √(40 / 800) half-way, the dense
    lr itself at the end. Everything else is step 5 as run here."""
    study = load_study(REPO / "results/variants/study.yaml")
    paper, as_run = (load_study_run(study.run(cell, 1.0, 0)) for cell in (
        "ultramem_step5_paper", "ultramem_step5_value_lr_decay"))
    assert paper.optim.schedule == "inverse_sqrt" and paper.optim.warmup_steps == 40 and paper.optim.lr == 1e-3
    by_hand = {40: 9.775e-3, 800: 5.5e-3 * (40 / 800) ** 0.5, 1600: 1e-3 * (40 / 1600) ** 0.5}
    for step, lr in by_hand.items():
        assert values_lr(step, paper.optim) == pytest.approx(lr, rel=1e-12), step
    paper_dict, as_run_dict = to_dict(paper), to_dict(as_run)
    assert paper_dict["optim"].pop("values_lr_decay_base") == "dense"
    assert as_run_dict["optim"].pop("values_lr_decay_base") == "values_lr"
    for d in (paper_dict, as_run_dict):
        d["train"].pop("exp_name")
    assert paper_dict == as_run_dict


def load_study_run(run):
    """The resolved config of a study run."""
    return load_config(REPO / run.run.config, run.run.overrides)
