"""End-to-end training on a tiny model and corpus: learning, exact resume, DDP, evaluate.py, bad input."""

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_two_processes_equal_one

from xlm_pkm.checkpoint import files as checkpoint
from xlm_pkm.config import load_config
from xlm_pkm.errors import ConfigError
from xlm_pkm.launch.cli import evaluate_main, train_main
from xlm_pkm.train.build import build_model
from xlm_pkm.train.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_loss_falls_and_run_directory_is_complete(tiny_run, train_losses, tmp_path):
    trainer = tiny_run(tmp_path, "train.max_steps=100", "train.eval_every=50", "train.log_every=10",
                  "train.exp_id=learn", "optim.lr=1e-2", "optim.warmup_steps=20",
                  "optim.values_beta2=0.98")  # the tiny memory's values learn fast enough in 100 steps
    losses = train_losses(trainer.run_dir)
    uniform = math.log(trainer.model.cfg.vocab_size)
    assert losses[100] < min(losses[10], uniform) - 1.0, (uniform, losses)
    files = {p.name for p in trainer.run_dir.iterdir()}
    assert {"config.yaml", "train.log", "metrics.jsonl", "checkpoint.pt", "best.pt"} <= files
    assert any(name.startswith("events.out.tfevents") for name in files)
    valid = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()
             if '"valid"' in line]
    assert [v["step"] for v in valid] == [50, 100] and valid[1]["ppl"] < valid[0]["ppl"]
    assert 0 < valid[-1]["memories"][0]["usage"] <= 100
    resolved = load_config(trainer.run_dir / "config.yaml")
    assert resolved.model.vocab_size == trainer.model.cfg.vocab_size and resolved.train.exp_id == "learn"


@pytest.mark.parametrize("stop_at, extra", [(3, ()), (5, ("optim.accumulate=2",)),
                                            (4, ("optim.values_optimizer=lazy_adam", "optim.accumulate=2"))])
@pytest.mark.slow
def test_resume_equals_uninterrupted_run(tiny_run, reference_run, train_losses, tmp_path, stop_at, extra):
    full = reference_run(*extra)
    tiny_run(tmp_path, "train.exp_id=cut", f"train.max_steps={stop_at}", *extra)
    resumed = tiny_run(tmp_path, "train.exp_id=cut", *extra)
    assert train_losses(resumed.run_dir) == train_losses(full.run_dir)  # bit-identical, float32 CPU
    for name, p in full.model.state_dict().items():
        assert torch.equal(p, resumed.model.state_dict()[name]), name


@pytest.mark.slow
def test_a_resume_on_another_cpu_thread_count_says_its_losses_will_differ(tiny_run, tmp_path):
    tiny_run(tmp_path, "train.exp_id=threads", "train.max_steps=3")  # TINY: one thread
    tiny_run(tmp_path, "train.exp_id=threads", "train.max_steps=5")
    log = (tiny_run(tmp_path, "train.exp_id=threads", "train.num_threads=2").run_dir / "train.log").read_text()
    assert log.count("CPU thread(s), saved on") == 1 and "resumed on 2 CPU thread(s), saved on 1: " in log, log


@pytest.mark.slow
def test_stop_signal_saves_exits_75_and_resumes_exactly(tiny_overrides, tiny_run, reference_run, train_losses,
                                                        tmp_path, monkeypatch, signal_at_step):
    signal_at_step(4)
    assert train_main(["--no-test", *tiny_overrides(tmp_path, "train.exp_id=sig", "train.log_every=3")]) == 75
    assert checkpoint.load(tmp_path / "tiny" / "sig" / "checkpoint.pt")["step"] == 4
    monkeypatch.undo()
    resumed = tiny_run(tmp_path, "train.exp_id=sig", "train.log_every=3")
    # the first line after the resume (step 6) averages steps 4-6, as the uninterrupted run's does
    assert train_losses(resumed.run_dir) == train_losses(reference_run("train.log_every=3").run_dir)


@pytest.mark.slow
def test_torchrun_two_processes_equal_one_with_same_global_batch(tiny_overrides, reference_run, tmp_path):
    """train.py under torchrun, sparse values (LazyAdam, all-gathered rows) and DDP for the rest; dense values
    in DDP's all-reduce and sharded values are checked the same way in tests/test_value_shards.py."""
    extra = ("train.max_steps=4", "optim.values_optimizer=lazy_adam", "train.eval_every=2")
    single = reference_run(*extra, "data.batch_size=8")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train.py"), "--no-test", *tiny_overrides(tmp_path, *extra), "train.exp_id=two",
           "data.batch_size=4", "train.num_threads=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_two_processes_equal_one(tmp_path / "tiny" / "two", single)


def activation_dtypes(monkeypatch) -> set:
    """The dtypes of every nn.Linear output from now on."""
    dtypes, forward = set(), torch.nn.Linear.forward

    def recording_forward(self, x):
        out = forward(self, x)
        dtypes.add(out.dtype)
        return out

    monkeypatch.setattr(torch.nn.Linear, "forward", recording_forward)
    return dtypes


def test_bf16_autocast_training_on_cpu_tracks_float32(reference_run, tiny_run, train_losses, tmp_path, monkeypatch):
    fp32 = train_losses(reference_run().run_dir)
    dtypes = activation_dtypes(monkeypatch)
    bf16 = train_losses(tiny_run(tmp_path, "train.exp_id=bf16", "train.precision=bf16").run_dir)
    assert dtypes == {torch.bfloat16}  # the feature ran: every matmul in bfloat16
    assert sorted(bf16) == sorted(fp32)
    for step, loss in fp32.items():
        assert math.isclose(bf16[step], loss, rel_tol=0.02), (step, bf16[step], loss)


@pytest.mark.slow
def test_torch_compile_matches_eager(reference_run, tiny_run, train_losses, tmp_path):
    from torch._dynamo.utils import counters

    eager = train_losses(reference_run().run_dir)
    counters.clear()
    compiled = train_losses(tiny_run(tmp_path, "train.exp_id=compiled", "train.max_steps=2",
                                     "train.compile=true").run_dir)
    assert counters["stats"]["unique_graphs"] >= 1 and counters["frames"]["ok"] >= 1  # dynamo compiled the model
    for step, loss in compiled.items():
        assert math.isclose(eager[step], loss, rel_tol=1e-4), (step, eager[step], loss)


@pytest.mark.slow
def test_train_cli_then_evaluate_cli_json(tiny_overrides, tmp_path, capsys):
    overrides = tiny_overrides(tmp_path, "train.exp_id=cli", "train.max_steps=6")
    # options and overrides in any order
    assert train_main([*overrides[:3], "--config", str(ROOT / "configs" / "default.yaml"), *overrides[3:]]) == 0
    out = capsys.readouterr().out
    assert "test ppl" in out
    best = tmp_path / "tiny" / "cli" / "best.pt"
    report = tmp_path / "eval.json"
    assert evaluate_main(["--checkpoint", str(best), "--split", "valid", "--json", str(report),
                          "--device", "cpu", "--max-batches", "4"]) == 0
    result = json.loads(report.read_text())
    assert {"ppl", "tokens_per_sec", "words_per_sec", "memories"} <= set(result)
    assert result["split"] == "valid" and 1 < result["ppl"] < 1e6 and result["words_per_sec"] > 0
    (memory,) = result["memories"]
    assert memory["layer"] == 2 and {"usage", "kl", "usage_count", "kl_count"} <= set(memory)
    assert 0 < memory["usage"] <= 100 and memory["kl"] >= 0
    # The valid perplexity evaluate.py reports is the one the run logged for best.pt.
    events = [json.loads(line) for line in (best.parent / "metrics.jsonl").read_text().splitlines()]
    logged = [e for e in events if e["event"] == "valid"][-1]
    assert math.isclose(result["ppl"], logged["ppl"], rel_tol=1e-9)


@pytest.mark.slow
def test_bad_input_gets_one_line_errors(tiny_overrides, tmp_path, capsys):
    cases = [
        (["data.path=/nonexistent/dir"], "/nonexistent/dir"),
        (["optim.lrr=1"], "did you mean optim.lr"),
        (["model.dim=big"], "model.dim"),
        (["train.precision=fp16"], "fp16 needs a CUDA device"),
    ]
    for extra, expected in cases:
        assert train_main(tiny_overrides(tmp_path, "train.exp_id=bad", *extra)) == 2
        err = capsys.readouterr().err.strip()
        assert expected in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "tiny" / "bad").exists()  # nothing written for a run that cannot start
    assert train_main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_missing_vocabulary_is_named(tiny_data_dir, tiny_trainer, tmp_path):
    broken = tmp_path / "data"
    broken.mkdir()
    for f in Path(tiny_data_dir).iterdir():
        if f.name != "vocab" and f.is_file():
            (broken / f.name).symlink_to(f)
    with pytest.raises(ValueError, match=f"{broken}/vocab"):
        tiny_trainer(tmp_path, "train.exp_id=novocab", f"data.path={broken}")


def test_checkpoint_of_another_architecture_names_the_key(tiny_run, tiny_trainer, tmp_path):
    tiny_run(tmp_path, "train.exp_id=arch", "train.max_steps=2")
    with pytest.raises(ValueError, match=r"another architecture: saved with model.dim=32, resumed with model.dim=48"):
        tiny_trainer(tmp_path, "train.exp_id=arch", "model.dim=48")


def test_slurm_submission_with_submitit_debug_executor(tiny_overrides, tmp_path, monkeypatch):
    from xlm_pkm.launch import slurm

    monkeypatch.chdir(tmp_path)
    job = slurm.main(["--cluster", "debug", "--gpus-per-node", "0", "--folder", str(tmp_path / "submitit"),
                      "--config", str(ROOT / "configs" / "default.yaml"), "--no-test",
                      *tiny_overrides(tmp_path, "train.max_steps=2")])
    assert job.result() == 0
    [run_dir] = (tmp_path / "tiny").iterdir()  # a new exp_id: no SLURM job id outside SLURM
    assert checkpoint.load(run_dir / "checkpoint.pt")["step"] == 2


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="unknown config key model.memory.n_key .*did you mean model.memory.n_keys"):
        load_config(None, ["model.memory.n_key=3"])
    with pytest.raises(ConfigError, match="train.compile: expected true or false"):
        load_config(None, ["train.compile=yes please"])
    cfg = load_config(ROOT / "configs" / "paper" / "l16_d1024_m2.yaml", ["optim.lr=1e-4"])
    assert (cfg.model.n_layers, cfg.model.dim, cfg.model.n_memories, cfg.model.n_heads) == (16, 1024, 2, 16)
    assert cfg.optim.lr == 1e-4 and cfg.optim.values_lr == 1e-3 and cfg.model.memory.n_keys == 512


def test_the_trainer_resolves_a_copy_of_its_config_and_alone_seeds_the_global_random_stream(tiny_overrides, tmp_path):
    """The config given is left as it is (trainer.cfg: the resolved copy, config.yaml's); the initial weights
    come from their own stream (train.seed), so the global one is seeded once, by the trainer, for dropout."""
    cfg = load_config(None, tiny_overrides(tmp_path, "model.dropout=0.1"))
    given = copy.deepcopy(cfg)
    trainer = Trainer(cfg, test=False)
    try:
        assert cfg == given and cfg.model.vocab_size == 0 and not cfg.train.exp_id
        resolved = trainer.cfg
        assert resolved.model.vocab_size == len(trainer.dictionary) and trainer.run_dir.name == resolved.train.exp_id
        assert torch.equal(torch.get_rng_state(), torch.Generator().manual_seed(cfg.train.seed * 1000).get_state())
        state = torch.get_rng_state()
        rebuilt = build_model(trainer.cfg, torch.device("cpu")).state_dict()
        assert torch.equal(torch.get_rng_state(), state)
        assert all(torch.equal(rebuilt[k], v) for k, v in trainer.model.state_dict().items())
    finally:
        trainer.close()
