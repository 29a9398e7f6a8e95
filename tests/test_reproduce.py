"""The reproduction harness: scaling rules, shared runs, dry run, and one tiny cell run through
submitit's debug executor, skipped once done and resumed when interrupted."""

import json

import pytest

from xlm_pkm.config import load_config
from xlm_pkm.experiments.reproduce import REPO, SCALES, TABLES, main, plan, scale_overrides
from xlm_pkm.model.transformer import resolve_memory_layers

TINY_RUN = ["model.dim=16", "model.n_heads=2", "model.max_len=16", "model.memory.n_keys=8", "model.memory.k_dim=16",
            "model.memory.heads=2", "model.memory.knn=4", "data.batch_size=4", "data.bptt=16", "train.max_steps=3",
            "train.eval_every=3", "train.eval_max_batches=2", "train.log_every=1", "train.device=cpu"]


def cell(table, name):
    return next(c for c in TABLES[table] if c.name == name)


def resolved(table, name, scale):
    c = cell(table, name)
    return load_config(REPO / c.config, scale_overrides(c, SCALES[scale]))


def test_tiny_scale_divides_every_size():
    cfg = resolved("table1", "l24_d1024_m1", "tiny")
    m = cfg.model
    assert (m.n_layers, m.dim, m.n_heads, resolve_memory_layers(m)) == (6, 128, 2, [5])  # layer 18 of 24 -> 5 of 6
    assert (m.memory.n_keys, m.memory.k_dim, m.memory.knn, m.memory.heads) == (64, 64, 8, 4)
    assert (cfg.data.batch_size, cfg.data.bptt, m.max_len, cfg.train.max_steps) == (16, 64, 64, 400)
    assert cfg.optim.lr == pytest.approx(1e-3) and cfg.optim.clip_grad_norm == 5.0
    ablation = resolved("table2", "table2_keys1024_none", "tiny").model  # the 6-layer model keeps its depth
    assert (ablation.n_layers, ablation.dim, ablation.n_heads, ablation.memory.n_keys) == (6, 64, 1, 128)
    assert resolved("figure6", "figure6_heads8_knn64", "small").model.memory.knn == 32


def test_paper_scale_is_the_config_itself():
    assert scale_overrides(cell("table1", "l16_d1024_m2"), SCALES["paper"]) == []
    m = resolved("table1", "l16_d1024_m2", "paper").model
    assert (m.n_layers, m.dim, resolve_memory_layers(m), m.memory.n_keys) == (16, 1024, [6, 12], 512)


@pytest.mark.slow
def test_cells_sharing_a_config_share_a_run(tmp_path):
    runs, skipped = plan("table3", SCALES["tiny"], tmp_path)
    assert skipped == []
    base = next(r for r in runs if r.name == "ablation_base")
    assert sorted(c.name for c in base.cells) == ["figure6_heads4_knn32", "pkm", "table2_keys512_batchnorm",
                                                  "table3_position5", "table4_keys512_product"]  # pkm: the variants
    assert base.run_dir == tmp_path.resolve() / "ablation_base" / "tiny"
    assert [r.name for r in runs] == ["ablation_no_memory", *(f"table3_position{p}" for p in range(1, 5)),
                                      "ablation_base", "table3_position6"]
    table2_runs, _ = plan("table2", SCALES["tiny"], tmp_path)
    assert base.run_dir in {r.run_dir for r in table2_runs}


@pytest.mark.slow
def test_cells_that_cannot_be_scaled_are_named(tmp_path):
    runs, skipped = plan("table1", SCALES["tiny"], tmp_path)
    assert len(runs) == 13
    assert skipped == ["configs/paper/l12_d1024_m3.yaml: memories at layers [3, 6, 9] of 12 collide at scale "
                       "tiny (3 layers)"]


@pytest.mark.slow
def test_dry_run_prints_the_commands(tmp_path, capsys):
    assert main(["table3", "--scale", "tiny", "--dump", str(tmp_path), "--only", "table3_position1",
                 "--set", "train.num_threads=1", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "table3_position1 [new] fills table3:table3_position1"
    assert out[1].startswith("  python train.py --config configs/ablations/table3_position1.yaml model.dim=64 ")
    assert "'model.mem_layers=[1]'" in out[1] and out[1].endswith(
        f"train.num_threads=1 train.dump_path={tmp_path.resolve()} train.exp_name=table3_position1 "
        "train.exp_id=tiny --no-test")
    assert out[2] == (f"  python evaluate.py --checkpoint {tmp_path.resolve()}/table3_position1/tiny/best.pt "
                      f"--split test --precision fp32 --json {tmp_path.resolve()}/table3_position1/tiny/test.json")
    assert not (tmp_path / "table3_position1").exists()


@pytest.mark.slow
def test_data_given_replaces_the_scales_data_path_in_the_commands(tmp_path, capsys):
    assert main(["table3", "--scale", "tiny", "--dump", str(tmp_path), "--only", "table3_position1",
                 "--data", str(tmp_path / "mine"), "--dry-run"]) == 0
    train = capsys.readouterr().out.splitlines()[1]
    assert train.count("data.path=") == 1 and f"data.path={tmp_path / 'mine'} " in train


@pytest.mark.slow
def test_seeds_make_one_run_per_seed_in_its_own_directory(tmp_path, capsys):
    assert main(["table3", "--scale", "tiny", "--dump", str(tmp_path), "--only", "table3_position1",
                 "--seeds", "0", "7", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 6  # per seed: the run's line and its two commands
    for seed, train in ((0, out[1]), (7, out[4])):
        assert f"train.seed={seed} " in train and train.endswith(f"train.exp_id=tiny-seed{seed} --no-test")
    runs, _ = plan("table3", SCALES["tiny"], tmp_path, only=["table3_position1"], seed=7)
    assert runs[0].run_dir == tmp_path.resolve() / "table3_position1" / "tiny-seed7"
    assert load_config(REPO / runs[0].config, runs[0].overrides).train.seed == 7

def test_bad_cell_is_one_line(tmp_path, capsys):
    assert main(["table3", "--only", "table2_keys128_none", "--dump", str(tmp_path), "--dry-run"]) == 2
    assert "--only table2_keys128_none: not a cell of table3" in capsys.readouterr().err


@pytest.mark.slow
def test_debug_array_runs_a_cell_skips_it_when_done_and_resumes_it(tiny_data_dir, tmp_path):
    argv = ["table3", "--scale", "tiny", "--dump", str(tmp_path / "runs"), "--data", str(tiny_data_dir),
            "--only", "table3_position1", "--test-max-batches", "4", "--set", *TINY_RUN, "--slurm",
            "--cluster", "debug", "--folder", str(tmp_path / "submitit")]
    assert main(argv) == 0
    run_dir = tmp_path / "runs" / "table3_position1" / "tiny"
    result = json.loads((run_dir / "test.json").read_text())
    assert result["step"] == 3 and result["split"] == "test" and result["memories"][0]["layer"] == 1
    info = json.loads((run_dir / "reproduce.json").read_text())
    assert info["cells"] == [{"table": "table3", "cell": "table3_position1", "key": {"position": 1}}]
    assert info["commands"][0].startswith("python train.py --config configs/ablations/table3_position1.yaml")

    mtime = (run_dir / "test.json").stat().st_mtime_ns
    assert main(argv) == 0  # done: skipped
    assert (run_dir / "test.json").stat().st_mtime_ns == mtime

    (run_dir / "test.json").unlink()  # as if the job died after training: resumes, then evaluates
    assert main(argv) == 0
    assert json.loads((run_dir / "test.json").read_text())["ppl"] == pytest.approx(result["ppl"], rel=1e-6)
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["event"] == "train"]
    assert steps == [1, 2, 3]
    assert "resumed at step 3" in (run_dir / "train.log").read_text()
