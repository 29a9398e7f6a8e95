"""The SLURM logic that needs no cluster: which signal requeues, a requeue SLURM refuses, job-id reuse,
impossible requests, checkpoint intervals, resuming with another config, and the import graph.
(tests/cluster/ runs the same paths against a real SLURM: `make test-cluster`.)"""

import os
import shlex
import signal
from pathlib import Path

import pytest
import yaml
from conftest import read_events

from xlm_pkm.checkpoint import files as checkpoint
from xlm_pkm.launch import slurm
from xlm_pkm.launch.cli import train_main
from xlm_pkm.launch.resume import launcher
from xlm_pkm.runtime.distributed import DistEnv
from xlm_pkm.train.run_dir import run_directory
from xlm_pkm.train.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent


def fake_command(tmp_path, monkeypatch, name: str, script: str) -> Path:
    """`name` on PATH runs `script` (sh) and appends its arguments to tmp_path/<name>.calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / f"{name}.calls"
    (bin_dir / name).write_text(f'#!/bin/sh\necho "$@" >> {calls}\n{script}\n')
    (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return calls


@pytest.mark.parametrize("signum, scontrol, requeued", [
    (signal.SIGUSR2, "exit 0", "requeued"),  # the time-limit warning
    (signal.SIGUSR2, 'echo "scontrol: error: Requested operation is presently disabled for job 123" >&2; exit 1',
     "not requeued: scontrol requeue 123 failed: scontrol: error: Requested operation is presently disabled"),
    (signal.SIGTERM, "exit 0", None),  # scancel, or SLURM pre-empting/requeueing the job itself
])
def test_only_the_time_limit_warning_requeues_and_a_refused_requeue_is_one_line(
        tiny_overrides, tmp_path, monkeypatch, signal_at_step, signum, scontrol, requeued):
    calls = fake_command(tmp_path, monkeypatch, "scontrol", scontrol)
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    signal_at_step(3, signum)
    argv = ["--no-test", *tiny_overrides(tmp_path)]
    assert train_main(argv) == 75
    run_dir = tmp_path / "tiny" / "123"  # named by the job id
    assert checkpoint.load(run_dir / "checkpoint.pt")["step"] == 3
    log = (run_dir / "train.log").read_text()
    assert f"stopping at step 3 ({signal.Signals(signum).name})" in log
    if requeued:
        assert calls.read_text() == "requeue 123\n" and f"SLURM job 123 {requeued}" in log
    else:
        assert not calls.exists() and "SLURM job 123" not in log
    resume = log.splitlines()[-1].split("to resume (with the same launcher and number of processes): ")[1]
    assert resume.startswith(f"{shlex.join(launcher())} --no-test ") and resume.endswith(" train.exp_id=123")


def test_a_reused_slurm_job_id_does_not_resume_an_unrelated_run(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    assert run_directory(str(tmp_path), "x", "", DistEnv()) == (tmp_path / "x" / "7", "7")  # new: its job id
    (tmp_path / "x" / "7").mkdir(parents=True)  # an earlier job with the same id
    with pytest.raises(FileExistsError, match=r"x/7 exists, but SLURM job 7 starts for the first time.*"
                                              r"train.exp_id=7 to resume that run"):
        run_directory(str(tmp_path), "x", "", DistEnv())
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # this job, requeued: resumes its own directory
    assert run_directory(str(tmp_path), "x", "", DistEnv()) == (tmp_path / "x" / "7", "7")


@pytest.mark.parametrize("args, error", [
    (("debug", 1, 8, 10, 8), "--gpus-per-node 8: partition 'debug' has no GPUs; use --gpus-per-node 0"),
    (("", 1, 1, 10, 0), "1 task(s) per node x --cpus-per-task 10: the nodes of the default partition 'debug' "
                        "have at most 2 CPUs"),
    (("gpu", 3, 8, 10, 8), "--nodes 3: partition 'gpu' has 2 node(s)"),
    (("gpu", 1, 8, 10, 16), "--gpus-per-node 16: partition 'gpu' has at most 8 GPUs per node"),
    (("learn", 1, 1, 1, 0), "partition 'learn' not found (sinfo lists: debug*, gpu)"),
    (("gpu", 2, 8, 10, 8), None),
    (("", 2, 1, 2, 0), None),
])
def test_impossible_requests_are_refused_before_submitting(tmp_path, monkeypatch, args, error):
    nodes = "debug*|2|(null)\ndebug*|2|(null)\ngpu|80|gpu:a100:8(S:0-1)\ngpu|80|gpu:8"
    fake_command(tmp_path, monkeypatch, "sinfo", f"printf '{nodes}\\n'")
    partition, nodes, tasks, cpus, gpus = args
    if error is None:
        slurm.check_request(partition, nodes, tasks, cpus, gpus)
    else:
        with pytest.raises(slurm.LaunchError) as refused:
            slurm.check_request(partition, nodes, tasks, cpus, gpus)
        assert str(refused.value).startswith(error)


@pytest.mark.parametrize("extra, saved", [
    (("train.save_every_steps=3",), [3, 6, 7]),  # and at the evaluation of the last step
    (("train.save_every_minutes=1e-9",), [1, 2, 3, 4, 5, 6, 7]),
    ((), [7]),
])
@pytest.mark.slow
def test_checkpoint_interval_independent_of_evaluations(tiny_run, tmp_path, monkeypatch, extra, saved):
    steps, save = [], Trainer.save_checkpoint
    monkeypatch.setattr(Trainer, "save_checkpoint", lambda self: (steps.append(self.step), save(self))[1])
    tiny_run(tmp_path, "train.exp_id=interval", "train.max_steps=7", *extra)
    assert steps == saved


@pytest.mark.slow
def test_resume_with_another_config_names_the_changes_and_keeps_the_old_one(tiny_run, tiny_trainer, tmp_path):
    first = tiny_run(tmp_path, "train.exp_id=changed", "train.max_steps=2")
    trainer = tiny_trainer(tmp_path, "train.exp_id=changed", "train.max_steps=4", "optim.lr=1e-3")
    trainer.close()
    log = (first.run_dir / "train.log").read_text()
    assert ("resumed with another config than the run's (previous one kept as config.until-step2.yaml): "
            "optim.lr: 0.003 -> 0.001; train.max_steps: 2 -> 4") in log
    assert yaml.safe_load((first.run_dir / "config.until-step2.yaml").read_text())["optim"]["lr"] == 3e-3
    assert yaml.safe_load((first.run_dir / "config.yaml").read_text())["optim"]["lr"] == 1e-3
    with pytest.raises(ValueError, match="another architecture"):  # refused, nothing rewritten
        tiny_trainer(tmp_path, "train.exp_id=changed", "model.dim=48")
    assert yaml.safe_load((first.run_dir / "config.yaml").read_text())["model"]["dim"] == 32
    assert [e["step"] for e in read_events(first.run_dir)] == [1, 2]


@pytest.mark.parametrize("train_status, result", [(75, "stopped"), (0, "done"), (2, None)])
def test_reproduce_job_stopped_by_a_signal_is_not_a_failure(tmp_path, monkeypatch, train_status, result):
    """RunJob: exit 75 (checkpointed, requeued) ends the job as "stopped", without evaluating; an error fails it."""
    from xlm_pkm.experiments import reproduce
    from xlm_pkm.launch import cli

    run = reproduce.Run("r", "configs/default.yaml", [], tmp_path / "r" / "tiny")
    evaluated = []
    monkeypatch.setattr(cli, "train_main", lambda argv: train_status)
    monkeypatch.setattr(cli, "evaluate_main", lambda argv: evaluated.append(argv) or 0)
    if result is None:
        with pytest.raises(RuntimeError, match="r: exited with status 2"):
            reproduce.RunJob(run, "tiny")()
    else:
        assert reproduce.RunJob(run, "tiny")() == result
    assert len(evaluated) == (result == "done")
