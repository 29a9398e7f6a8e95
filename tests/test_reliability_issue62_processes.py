"""Accidents of issue 62 around several processes and a live run, each reproduced (docs/reliability.md): an
unreadable checkpoint.pt on resume, a rank killed under torchrun, a checkpoint saved while another command loads it."""

import errno
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from xlm_pkm.launch.cli import train_main
from xlm_pkm.runtime.distributed import free_port

ROOT = Path(__file__).resolve().parent.parent


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def torchrun(tmp_path: Path, args: list[str], logs: str, **popen) -> subprocess.Popen:
    """torchrun --nproc_per_node=2 train.py ARGS, each rank's stdout and stderr in tmp_path/logs/.../R/."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", f"--log-dir={tmp_path / logs}", "--redirects=3", str(ROOT / "train.py"),
           *args]
    return subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}, **popen)


def rank_errors(logs: Path) -> dict[int, list[str]]:
    """{rank: the lines of its stderr} of a torchrun run whose logs are in `logs`."""
    return {int(p.parent.name): p.read_text().strip().splitlines() for p in logs.rglob("stderr.log")}


# ---- 62.13: an unreadable checkpoint.pt on resume ---------------------------------------------------------
DAMAGES = {"empty": lambda p: p.write_bytes(b""), "not a torch file": lambda p: p.write_text("notes\n"),
           "a folder": lambda p: p.mkdir()}


@pytest.mark.slow
def test_an_unreadable_latest_checkpoint_is_one_line_naming_it(tiny_overrides, tmp_path, capsys, monkeypatch):
    """train.exp_id=last on a run whose checkpoint.pt cannot be read: an OSError traceback (Errno 22) or a
    RuntimeError from torch.load's mmap, raised on rank 0 outside the one-line handler. One line naming the file
    and what to do; a given exp_id likewise."""
    assert train_main(["--no-test", *tiny_overrides(tmp_path, "train.exp_id=r", "train.max_steps=2")]) == 0
    path = tmp_path / "tiny" / "r" / "checkpoint.pt"
    last = ["--no-test", *tiny_overrides(tmp_path, "train.exp_id=last", "train.max_steps=4")]
    capsys.readouterr()

    def invalid_argument(*args, **kwargs):  # what the issue saw: mmap refused (a file it cannot map)
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(torch, "load", invalid_argument)
    assert train_main(last) == 2
    assert one_line(capsys) == (
        f"train.py: error: train.exp_id=last: {path}, the checkpoint a run of tiny saved last, cannot be read "
        f"(Invalid argument): restore it from a copy, or give the train.exp_id of the run to resume (or move "
        f"{path.parent} away: train.exp_id=last then finds the run that saved before it)")
    monkeypatch.undo()
    path.unlink()
    for damage, why in [("empty", "RuntimeError: mmap can only be used with files saved with"),
                        ("not a torch file", "RuntimeError: mmap can only be used with files saved with"),
                        ("a folder", "(Is a directory)")]:
        DAMAGES[damage](path)
        assert train_main(last) == 2, damage
        line = one_line(capsys)
        assert line.startswith(f"train.py: error: train.exp_id=last: {path}, the checkpoint a run of tiny saved "
                               f"last, cannot be read (") and why in line, line
        assert train_main(["--no-test", *tiny_overrides(tmp_path, "train.exp_id=r", "train.max_steps=4")]) == 2
        line = one_line(capsys)
        assert line.startswith(f"train.py: error: {path}: ") and line.endswith(
            f"; restore it from a copy to resume the run, or start a new run from its weights (another "
            f"train.exp_id, with train.init_from={path.parent / 'best.pt'})"), line
        path.rmdir() if path.is_dir() else path.unlink()


@pytest.mark.slow
def test_an_unreadable_checkpoint_under_torchrun_ends_every_rank_with_one_line(tiny_overrides, tmp_path):
    """torchrun --nproc_per_node 2 ... train.exp_id=last hung: rank 0 raised outside the one-line handler, rank 1
    waited for it in a broadcast. Every rank ends with the same line, at once (a given exp_id ended so already:
    each rank reads the file, and they agree before going on)."""
    assert train_main(["--no-test", *tiny_overrides(tmp_path, "train.exp_id=r", "train.max_steps=2")]) == 0
    path = tmp_path / "tiny" / "r" / "checkpoint.pt"
    path.write_bytes(b"")
    run = torchrun(tmp_path, ["--no-test", *tiny_overrides(tmp_path, "train.exp_id=last", "train.max_steps=4",
                                                            "train.collective_timeout_minutes=1")], "logs")
    out, err = run.communicate(timeout=150)
    assert run.returncode == 1, err[-3000:]  # torchrun's status when a rank fails
    errors = rank_errors(tmp_path / "logs")
    assert sorted(errors) == [0, 1] and all(len(lines) == 1 for lines in errors.values()), errors
    assert errors[0] == errors[1] and errors[0][0].startswith(f"train.py: error: train.exp_id=last: {path}, the "
                                                              f"checkpoint a run of tiny saved last, cannot be read ")


# ---- 62.14: a rank killed under torchrun ------------------------------------------------------------------
def rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of the worker of `rank` among torchrun's children (their environment has RANK)."""
    for child in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split():
        try:
            if f"RANK={rank}".encode() in (Path("/proc") / child / "environ").read_bytes().split(b"\0"):
                return int(child)
        except OSError:
            pass
    return None


def test_the_dead_ranks_are_those_whose_process_is_gone_and_did_not_end_on_their_own():
    """Heartbeat.dead_ranks from the processes recorded in the store: rank 1 killed (a zombie until reaped), rank 2
    alive, rank 3 gone after ending on the failure it saw itself (torchrun ends the survivors too), rank 4 killed on
    another host (not judged from here: its heartbeat tells), rank 5's pid reused by another process."""
    import socket

    import torch.distributed as dist

    from xlm_pkm.runtime.distributed import DistEnv, Heartbeat, _started

    store, host = dist.HashStore(), socket.gethostname()
    processes = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    started = [_started(p.pid) for p in processes]
    for p in processes:
        p.kill()
    os.waitid(os.P_PID, processes[0].pid, os.WEXITED | os.WNOWAIT)  # dead, not reaped: a zombie (kill() only sends)
    processes[1].wait()  # reaped: gone
    recorded = {1: f"{host} {processes[0].pid} {started[0]}", 2: f"{host} {os.getpid()} {_started(os.getpid())}",
                3: f"{host} {processes[1].pid} {started[1]}", 4: f"elsewhere {processes[2].pid} {started[2]}",
                5: f"{host} {os.getpid()} 1"}
    for rank, process in recorded.items():
        if rank != 5:
            store.set(f"xlm_pkm/process/{rank}", process)
    Heartbeat(store, DistEnv(3, 3, 6), 1.0).ending()
    heartbeat = Heartbeat(store, DistEnv(0, 0, 6), 1.0)
    assert heartbeat.dead_ranks() is None  # a rank not recorded (not started yet): left to the heartbeat
    store.set("xlm_pkm/process/5", recorded[5])
    assert heartbeat.dead_ranks() == [1, 5]
    for p in processes:
        p.wait()


def test_a_stop_signal_while_a_failed_collective_is_handled_leaves_the_failure_to_report(monkeypatch):
    """torchrun's SIGTERM to a survivor lands while it closes the run after the failed collective: the failure is
    the one reported (train_main walks the stop's context)."""
    import torch.distributed as dist

    from xlm_pkm.launch.cli import _failed_collective
    from xlm_pkm.utils.stop_signals import StoppedBySignal

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:59545: "
                        "Connection reset by peer.")
    with pytest.raises(StoppedBySignal) as raised:
        try:
            raise gloo
        finally:
            raise StoppedBySignal(signal.SIGTERM)  # noqa: B012 - as the signal handler does, wherever it lands
    assert _failed_collective(raised.value) is gloo
    assert _failed_collective(StoppedBySignal(signal.SIGTERM)) is None


@pytest.mark.slow
def test_a_rank_killed_under_torchrun_is_named_by_the_survivor_with_the_checkpoint_to_resume(tiny_overrides,
                                                                                            tmp_path):
    """kill -9 of rank 1: rank 0 said "stopped by SIGTERM after training, during the test evaluation ... run the same
    command again for its test figures" (torchrun's SIGTERM, landing while it closed the run after the failed
    collective, replaced the failure), then a gloo traceback from the barrier of its shutdown. It names the dead
    rank (its process gone), the step, the checkpoint that is intact and the command that resumes from it."""
    from xlm_pkm.checkpoint import files
    from xlm_pkm.checkpoint.trained import load_trained

    args = ["--no-test", *tiny_overrides(tmp_path, "train.exp_id=k", "train.max_steps=100000",
                                         "train.save_every_steps=5")]
    run = torchrun(tmp_path, args, "logs")
    metrics = tmp_path / "tiny" / "k" / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and '"step": 7,' in metrics.read_text()) and time.time() < deadline:
        time.sleep(0.05)
    os.kill(rank_pid(run.pid, 1), signal.SIGKILL)
    killed = time.monotonic()
    run.communicate(timeout=60)
    assert time.monotonic() - killed < 30  # torchrun's SIGTERM, then its SIGKILL 30 s later: not waited for
    errors = rank_errors(tmp_path / "logs")
    assert errors[1] == [] and len(errors[0]) == 1, errors
    path = tmp_path / "tiny" / "k" / "checkpoint.pt"
    saved = files.load(path)["step"]
    prefix = ("train.py: error: rank 0: a collective operation failed: rank(s) 1 died (process gone: killed, out of "
              "memory or crashed; see its log); this run stopped after step ")
    assert errors[0][0].startswith(prefix), errors
    stopped = int(errors[0][0][len(prefix):].split(":")[0])
    # the last save every 5 steps, or the one before when rank 1 died during the save of the step it stopped after
    # (seen under load: stopped after step 10, checkpoint of step 5)
    assert 7 <= stopped and saved in {stopped - stopped % 5, stopped - 5 if stopped % 5 == 0 else -1}, errors
    same = shlex.join(a for a in args if a != "train.exp_id=k")
    assert errors[0][0].endswith(f": its last checkpoint, {path} (step {saved}), is intact; to resume: torchrun "
                                 f"--nproc_per_node=2 {ROOT / 'train.py'} {same} train.exp_id=k"), errors
    assert load_trained(path).step == saved  # whole


# ---- 62.17: a checkpoint saved while a command loads it ---------------------------------------------------
def save_lands(run: Path, load) -> int:
    """What a live run's next save does to `run` (RunCheckpoints.save_last): its tensors in a folder of the new step,
    checkpoint.pt replaced to name it, the folder the previous one named removed (`load`: files.load). Returns the
    new step."""
    from xlm_pkm.checkpoint import dcp_tensors, files

    path = run / "checkpoint.pt"
    state = load(path)
    step = state["step"] + 1
    shutil.copytree(run / state[dcp_tensors.KEY], run / "checkpoint.dcp" / f"step{step}")
    record = {**state, "step": step, dcp_tensors.KEY: f"checkpoint.dcp/step{step}"}
    files.save_atomic(record, path)
    dcp_tensors.remove_stale(path, record)
    return step


def saving_while_read(monkeypatch, run: Path, times: int) -> None:
    """Every command's read of run/checkpoint.pt is followed by a save of the live run, the first `times` times."""
    from xlm_pkm.checkpoint import files

    load, saves = files.load, []

    def load_then_a_save_lands(path, **options):
        state = load(path, **options)
        if len(saves) < times:
            saves.append(save_lands(run, load))
        return state

    monkeypatch.setattr(files, "load", load_then_a_save_lands)


@pytest.mark.parametrize("command", ["evaluate", "generate", "export"])
def test_a_save_landing_during_a_load_reads_the_new_checkpoint(command, reference_run, tmp_path, capsys, monkeypatch):
    """evaluate.py, generate.py and export failed on a live run's checkpoint.pt when a save landed during the load
    (6 of 6 with train.save_every_steps=2), saying its tensors' folder was damaged: the save had removed the folder
    that the checkpoint.pt just read named. The load reads checkpoint.pt again when it was replaced meanwhile."""
    from xlm_pkm.checkpoint.trained import load_trained
    from xlm_pkm.inference.export import main as export_main
    from xlm_pkm.launch.cli import evaluate_main, generate_main

    run = tmp_path / "run"
    shutil.copytree(reference_run().run_dir, run)
    path = run / "checkpoint.pt"
    saving_while_read(monkeypatch, run, times=1)
    capsys.readouterr()
    if command == "evaluate":
        assert evaluate_main(["--checkpoint", str(path), "--split", "valid", "--max-batches", "1"]) == 0
    elif command == "generate":
        assert generate_main(["the", "--checkpoint", str(path), "--max-tokens", "2", "--greedy"]) == 0
    else:
        assert export_main([str(path), str(tmp_path / "exported")]) == 0
        assert load_trained(tmp_path / "exported").step == 9  # the step the save wrote
    assert capsys.readouterr().err == ""


def test_a_checkpoint_replaced_at_every_read_is_one_line_saying_so(reference_run, tmp_path, monkeypatch):
    from xlm_pkm.checkpoint.trained import load_trained

    run = tmp_path / "run"
    shutil.copytree(reference_run().run_dir, run)
    saving_while_read(monkeypatch, run, times=100)
    with pytest.raises(ValueError) as raised:
        load_trained(run / "checkpoint.pt")
    assert str(raised.value) == (f"{run / 'checkpoint.pt'}: replaced by a newer checkpoint each of the 3 times it was "
                                 f"read (a live run saving it meanwhile): run the command again, or give a copy")
    monkeypatch.undo()
    assert load_trained(run / "checkpoint.pt").step == 11  # whole after those saves
