"""Accidents of issue 51 that lost, overwrote or hung a run, each reproduced (docs/reliability.md)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from xlm_pkm.checkpoint.files import NonFiniteError
from xlm_pkm.launch.cli import evaluate_main, generate_main, train_main

ROOT = Path(__file__).resolve().parent.parent

TINY_VALUES = "blocks.1.sublayers.1.values.weight"  # the tiny model's value table


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


# ---- 1. evaluate.py --json never overwrites a file it did not write ------------------------------------
@pytest.mark.slow
def test_evaluate_json_on_a_checkpoint_is_refused_before_evaluating(reference_run, capsys, monkeypatch, tmp_path):
    import xlm_pkm.launch.cli

    run = reference_run()
    checkpoint = tmp_path / "checkpoint.pt"
    shutil.copy(run.ckpt_path, checkpoint)
    before = checkpoint.read_bytes()
    evaluate_checkpoint = xlm_pkm.launch.cli.evaluate_checkpoint
    monkeypatch.setattr(xlm_pkm.launch.cli, "evaluate_checkpoint", lambda *a, **k: pytest.fail("evaluated anyway"))
    assert evaluate_main(["--checkpoint", str(run.best_path), "--json", str(checkpoint)]) == 2
    assert f"--json {checkpoint}: exists and is not a result written by evaluate.py" in one_line(capsys)
    assert checkpoint.read_bytes() == before
    assert evaluate_main(["--checkpoint", str(run.best_path), "--json", str(tmp_path)]) == 2
    assert "is a directory" in one_line(capsys)
    monkeypatch.setattr(xlm_pkm.launch.cli, "evaluate_checkpoint", evaluate_checkpoint)
    result = tmp_path / "result.json"
    for _ in range(2):  # a result of its own is replaced
        assert evaluate_main(["--checkpoint", str(run.best_path), "--json", str(result), "--max-batches", "1"]) == 0
    assert json.loads(result.read_text())["split"] == "test"


# ---- 9. a non-finite weight in a checkpoint (bit rot) --------------------------------------------------
def rewrite_tensor(path: Path, name: str, change) -> None:
    """checkpoint.pt's tensor `name` (in its Distributed Checkpoint folder) changed in place by change(tensor),
    the folder written again whole, on this process."""
    from torch.distributed.checkpoint import FileSystemReader, load, save

    folder = path.parent / torch.load(path, weights_only=False)["dcp"]
    metadata = FileSystemReader(folder).read_metadata().state_dict_metadata
    tensors = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.items()}
    load(tensors, checkpoint_id=folder, no_dist=True)
    change(tensors[name])
    save(tensors, checkpoint_id=folder, no_dist=True)


@pytest.mark.slow
def test_a_nan_weight_is_refused_by_evaluate_generate_and_resume(reference_run, tiny_run, tiny_trainer, tmp_path,
                                                                 capsys):
    damaged = tmp_path / "damaged.pt"
    state = torch.load(reference_run().best_path, weights_only=False)
    state["model"][TINY_VALUES][3, 1] = float("nan")
    torch.save(state, damaged)
    assert evaluate_main(["--checkpoint", str(damaged), "--max-batches", "1"]) == 2
    assert f"{damaged}: weight {TINY_VALUES} holds nan or inf" in one_line(capsys)
    assert generate_main(["--checkpoint", str(damaged), "--max-tokens", "3"]) == 2
    assert f"{damaged}: weight {TINY_VALUES} holds nan or inf" in one_line(capsys)
    run_dir = tiny_run(tmp_path, "train.exp_id=rot", "train.max_steps=2").run_dir
    rewrite_tensor(run_dir / "checkpoint.pt", f"model.{TINY_VALUES}", lambda t: t[0].fill_(float("inf")))
    with pytest.raises(NonFiniteError, match=f"checkpoint.pt: weight {TINY_VALUES} holds nan or inf") as refused:
        tiny_trainer(tmp_path, "train.exp_id=rot", "train.max_steps=4")
    assert "Last good checkpoint" not in str(refused.value)


# ---- 2. SIGHUP (terminal closed), and stop signals outside the training loop ------------------------------
def start_training(tiny_overrides, tmp_path, exp_id: str, *extra) -> subprocess.Popen:
    args = ["--no-test", *tiny_overrides(tmp_path, "train.max_steps=100", f"train.exp_id={exp_id}", *extra)]
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler installed for `signum` (its SigCgt mask in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(mask, 16) >> (signum - 1) & 1)


def wait_for(condition, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not condition() and time.time() < deadline:
        time.sleep(0.01)


@pytest.mark.slow
def test_sighup_checkpoints_and_exits_75(tiny_overrides, tmp_path):
    run = start_training(tiny_overrides, tmp_path, "hup")
    metrics = tmp_path / "tiny" / "hup" / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and '"step": 2,' in metrics.read_text())
    run.send_signal(signal.SIGHUP)
    out, err = run.communicate(timeout=120)
    assert run.returncode == 75, err
    step = torch.load(tmp_path / "tiny" / "hup" / "checkpoint.pt", weights_only=False)["step"]
    assert 2 <= step < 100 and f"stopping at step {step} (SIGHUP)" in out


@pytest.mark.parametrize("signum, status, line", [
    (signal.SIGTERM, 75, "train.py: error: stopped by SIGTERM "),
    # the other signals take the same path (launch/commands._run's handlers): the slow tier
    pytest.param(signal.SIGUSR1, 75, "train.py: error: stopped by SIGUSR1 ", marks=pytest.mark.slow),
    pytest.param(signal.SIGINT, 130, "train.py: error: interrupted (Ctrl-C)", marks=pytest.mark.slow),
])
@pytest.mark.slow
def test_a_signal_during_start_up_is_one_line_and_the_same_command_runs_again(tiny_overrides, tmp_path, signum,
                                                                              status, line):
    """Sent while torch is imported or the trainer is built (before the training loop's handlers): it used to
    end the process silently (143, 138) or with a KeyboardInterrupt traceback."""
    run = start_training(tiny_overrides, tmp_path, "early", "train.max_steps=2")
    # train.py's first line catches the stop signals (SIGTERM among them: Python itself catches only SIGINT);
    # torch is imported after it, for a second or more: the signal lands there, however fast the machine
    wait_for(lambda: catches(run.pid, signal.SIGTERM) or run.poll() is not None, timeout=60)
    run.send_signal(signum)
    out, err = run.communicate(timeout=120)
    assert run.returncode == status and err.startswith(line) and len(err.splitlines()) == 1, err
    again = start_training(tiny_overrides, tmp_path, "early", "train.max_steps=2")
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err


SIGNAL_IN_A_WEAKREF_CALLBACK = """
import signal, sys, weakref
from xlm_pkm.utils.stop_signals import StoppedBySignal, install_startup_handlers, raise_held_signal
install_startup_handlers()
class Lock: pass
lock = Lock()
# as importlib's module locks: the handler runs inside the callback, where Python cannot raise its exception
ref = weakref.ref(lock, lambda r: signal.raise_signal(signal.{name}))
del lock
print("went on")
try:
    raise_held_signal()
except (KeyboardInterrupt, StoppedBySignal) as e:
    print(type(e).__name__, *e.args)
"""


@pytest.mark.parametrize("name, raised", [("SIGINT", "KeyboardInterrupt"), ("SIGTERM", "StoppedBySignal SIGTERM")])
def test_a_start_up_signal_python_swallows_is_raised_again_without_a_traceback(name, raised):
    """CI caught a Ctrl-C in torch's import landing in importlib's weakref callback: Python printed "Exception
    ignored in ..." and the run trained to its end with status 0."""
    script = SIGNAL_IN_A_WEAKREF_CALLBACK.format(name=name)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.stdout.splitlines() == ["went on", raised], done.stderr
    assert done.returncode == 0 and done.stderr == ""


@pytest.mark.slow
def test_a_stop_signal_in_the_last_step_ends_a_finished_run_with_0(tiny_overrides, tmp_path, signal_at_step):
    signal_at_step(8, signal.SIGTERM)  # the tiny run's max_steps
    assert train_main(["--no-test", *tiny_overrides(tmp_path, "train.exp_id=last_step")]) == 0


# ---- 3. a run that trained no step does not block its own re-run ------------------------------------------
def test_bptt_longer_than_max_len_is_refused_with_the_config(tiny_overrides, tmp_path, capsys):
    assert train_main(tiny_overrides(tmp_path, "train.exp_id=long", "data.bptt=32")) == 2
    assert "data.bptt=32 is longer than model.max_len=16" in one_line(capsys)
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_a_run_that_failed_at_its_first_step_is_taken_over_by_the_same_command(tiny_overrides, tmp_path, capsys,
                                                                               monkeypatch):
    from xlm_pkm.errors import UserError
    from xlm_pkm.train.trainer import Trainer

    step_once = Trainer.train_step

    def fail_first_step(self, batches):
        raise UserError("cannot read shard train.000.bin (a stand-in for an OOM or a corrupt shard)")

    monkeypatch.setattr(Trainer, "train_step", fail_first_step)
    command = ["--no-test", *tiny_overrides(tmp_path, "train.exp_id=failed", "train.max_steps=2")]
    assert train_main(command) == 2
    run_dir = tmp_path / "tiny" / "failed"
    assert (run_dir / "config.yaml").exists() and not (run_dir / "checkpoint.pt").exists()
    monkeypatch.setattr(Trainer, "train_step", step_once)
    capsys.readouterr()
    assert train_main(command) == 0
    assert "held a run that trained no step" in (run_dir / "train.log").read_text()
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2, 2]


# ---- 6. every architecture key is refused changed on resume ------------------------------------------------
@pytest.fixture(scope="module")
def architecture_run(tiny_run, tmp_path_factory):
    dump = tmp_path_factory.mktemp("architecture")
    tiny_run(dump, "train.exp_id=arch", "train.max_steps=2")
    return dump


@pytest.mark.parametrize("override, saved", [
    ("model.n_heads=4", "2"),  # the same shapes: it was accepted, the attention weights cut into other heads
    ("model.memory.knn=2", "4"), ("model.mem_layers=[1]", "[2]"), ("model.memory.query_norm=batchnorm", "layernorm"),
    ("model.memory.score=relu", "softmax"), ("model.pre_norm=true", "False"),
])
def test_a_changed_architecture_key_is_refused_on_resume_naming_both_values(architecture_run, tiny_trainer,
                                                                            override, saved):
    key = override.split("=")[0]
    with pytest.raises(ValueError, match=re.escape(f"another architecture: saved with {key}={saved}, resumed with "
                                                   f"{key}=")):
        tiny_trainer(architecture_run, "train.exp_id=arch", "train.max_steps=4", override)
    trainer = tiny_trainer(architecture_run, "train.exp_id=arch", "train.max_steps=4", "model.dropout=0.1")
    trainer.close()  # not an architecture key: resumes
    assert trainer.resumed


def test_the_architecture_keys_are_declared_on_the_settings_fields():
    from xlm_pkm.config import Config
    from xlm_pkm.settings import architecture_keys

    keys = architecture_keys(Config())
    assert {"model.n_heads", "model.mem_layers", "model.memory.n_keys", "model.memory.values",
            "model.memory.tucker.rank", "model.engram.layers", "model.span.max_span"} <= keys.keys()
    assert not {"model.dropout", "model.memory.value_read", "model.memory.shard_values"} & keys.keys()


# ---- 7. BPE codes are checked where the vocabulary is --------------------------------------------------------
def test_other_bpe_codes_beside_the_models_vocabulary_are_refused(reference_run, tiny_data_dir, tmp_path, capsys):
    from xlm_pkm.inference.export import main as export_main

    other = tmp_path / "other"
    other.mkdir()
    for name in ("vocab", "meta.json"):
        shutil.copy(tiny_data_dir / name, other / name)
    merges = (tiny_data_dir / "codes").read_text().splitlines(keepends=True)
    (other / "codes").write_text("".join([merges[1], merges[0], *merges[2:]]))  # another merge order
    best = reference_run().best_path
    assert generate_main(["--checkpoint", str(best), "--data", str(other), "--max-tokens", "2"]) == 2
    assert f"{other}/codes: other BPE codes than {best} was trained with" in one_line(capsys)
    assert export_main([str(best), str(tmp_path / "exported"), "--data", str(other)]) == 2
    assert "other BPE codes" in one_line(capsys) and not (tmp_path / "exported").exists()
    older = tmp_path / "older.pt"  # a checkpoint of an earlier version, without the digest: the run's data's codes
    state = torch.load(best, weights_only=False)
    del state["codes_digest"]
    torch.save(state, older)
    assert generate_main(["--checkpoint", str(older), "--data", str(other), "--max-tokens", "2"]) == 2
    assert f"in {tiny_data_dir}/codes): text would be split" in one_line(capsys)
    assert generate_main(["--checkpoint", str(best), "--data", str(tiny_data_dir), "--max-tokens", "2"]) == 0


# ---- 8. data unreadable at an evaluation: the in-memory state is saved first ---------------------------------
def test_data_moved_before_an_evaluation_saves_the_run_then_stops_in_one_line(tiny_data_dir, tiny_overrides, tmp_path,
                                                                              capsys, monkeypatch):
    from xlm_pkm.train.trainer import Trainer

    data = tmp_path / "data"
    shutil.copytree(tiny_data_dir, data)
    step_once = Trainer.train_step

    def step_then_move_the_data(self, batches):
        out = step_once(self, batches)
        if self.step == 3:
            data.rename(tmp_path / "moved")
        return out

    monkeypatch.setattr(Trainer, "train_step", step_then_move_the_data)
    command = ["--no-test", *tiny_overrides(tmp_path, "train.exp_id=moved", f"data.path={data}",
                                            "train.eval_every=4")]
    assert train_main(command) == 2
    line = one_line(capsys)
    run_dir = tmp_path / "tiny" / "moved"
    assert f"cannot read shard {data}/valid.000.bin" in line, line
    assert f"the run was saved first: {run_dir}/checkpoint.pt (step 4)" in line
    assert torch.load(run_dir / "checkpoint.pt", weights_only=False)["step"] == 4


# ---- 5. out of memory: the estimate reads the process's limit; an allocation failure is one line ------------
def train_under_address_space_limit(tiny_overrides, tmp_path, limit_bytes: int, *extra):
    import resource

    limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))  # noqa: E731 (ulimit -v)
    args = ["--no-test", *tiny_overrides(tmp_path, "train.max_steps=2", *extra)]
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, capture_output=True, text=True,
                          preexec_fn=limit, timeout=300)


@pytest.mark.slow
def test_the_memory_estimate_compares_with_rlimit_as(tiny_overrides, tmp_path):
    """1.5 GiB of address space, a value table needing 1.5 GiB more: refused before anything is allocated (it
    compared with the machine's MemAvailable, passed, and ended in an allocator traceback)."""
    done = train_under_address_space_limit(tiny_overrides, tmp_path, 1536 << 20, "train.exp_id=estimate",
                                           "model.memory.n_keys=2000")
    assert done.returncode == 2, done.stderr
    assert "of address space left under its RLIMIT_AS (ulimit -v): fewer slots" in done.stderr.splitlines()[-1]


@pytest.mark.slow
def test_an_allocation_failure_at_a_step_is_one_line_and_the_run_can_start_again(tiny_overrides, tmp_path):
    """A batch too large for its activations under a real RLIMIT_AS: one line, exit 2 (a raw DefaultCPUAllocator
    traceback, exit 1), and the directory does not block the same command with a smaller batch."""
    done = train_under_address_space_limit(tiny_overrides, tmp_path, 1536 << 20, "train.exp_id=oom",
                                           "data.batch_size=2048", "model.dim=256")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("train.py: error: out of memory at step 1 (an allocation of ")
    assert "lower data.batch_size" in done.stderr and "Traceback" not in done.stderr
    assert train_main(["--no-test", *tiny_overrides(tmp_path, "train.max_steps=2", "train.exp_id=oom",
                                                    "model.dim=256")]) == 0


# ---- 4. torchrun on a run directory that a live run holds --------------------------------------------------
@pytest.mark.slow
def test_torchrun_on_a_held_run_directory_ends_every_rank_at_once_with_the_line(tiny_overrides, tmp_path):
    """Rank 0 printed "in use by pid ...", rank 1 went on and waited for it in a collective until
    train.collective_timeout_minutes, then a gloo traceback: now every rank ends with the line, in seconds."""
    run_dir = tmp_path / "tiny" / "held"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from xlm_pkm.train.run_dir import lock_run_directory; "
                               "held = lock_run_directory(Path(sys.argv[1])); print('locked', flush=True); "
                               "time.sleep(120)", str(run_dir)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "locked"
        logs = tmp_path / "logs"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               f"--log-dir={logs}", "--redirects=3", str(ROOT / "train.py"), "--no-test",
               *tiny_overrides(tmp_path, "train.exp_id=held", "train.collective_timeout_minutes=1")]
        start = time.monotonic()
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        elapsed = time.monotonic() - start
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 1, proc.stderr[-3000:]  # torchrun's status when a rank fails
    err = {int(p.parent.name): p.read_text().strip().splitlines() for p in logs.rglob("stderr.log")}
    assert sorted(err) == [0, 1] and all(len(lines) == 1 for lines in err.values()), err
    assert all(lines[0].startswith(f"train.py: error: {run_dir} is in use by pid {holder.pid}")
               for lines in err.values()), err
    assert elapsed < 45, elapsed  # start-up included; a rank waiting out the 60 s timeout would not be


# ---- smaller ones -------------------------------------------------------------------------------------------
def test_a_key_given_twice_in_a_yaml_config_is_refused(tmp_path):
    from xlm_pkm.config import load_config
    from xlm_pkm.errors import ConfigError

    config = tmp_path / "twice.yaml"
    config.write_text("model:\n  dim: 32\n  n_heads: 2\n  dim: 64\n")
    with pytest.raises(ConfigError, match=f"{config}: not valid YAML: key 'dim' given twice .* line 4"):
        load_config(config)


@pytest.mark.parametrize("override, said", [
    ("data.batch_size=8", "saved with data.batch_size=4, resumed with data.batch_size=8"),
    ("data.bptt=8", "saved with data.bptt=16, resumed with data.bptt=8"),
    ("train.seed=3", "saved with train.seed=0, resumed with train.seed=3"),
])
def test_a_resume_with_another_data_setting_names_the_setting_not_the_data(architecture_run, tiny_trainer, override,
                                                                           said):
    with pytest.raises(ValueError, match=re.escape(said) + ": its data position does not carry over"):
        tiny_trainer(architecture_run, "train.exp_id=arch", "train.max_steps=4", override)


def processes_running(marker: str) -> list[int]:
    """Pids of the processes whose command line holds `marker` (a test's own temporary path)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(entry.name))
        except OSError:
            pass
    return pids


@pytest.mark.slow
def test_ranks_whose_torchrun_launcher_is_killed_checkpoint_and_release_the_run(tiny_overrides, tmp_path):
    """kill -9 of torchrun left its ranks training on as orphans holding the run's lock: each rank watches its
    parent, and stops as for a signal (checkpoint, lock released)."""
    from xlm_pkm.train.run_dir import lock_run_directory

    run_dir = tmp_path / "tiny" / "orphans"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           f"--log-dir={tmp_path / 'logs'}", "--redirects=3", str(ROOT / "train.py"), "--no-test",
           *tiny_overrides(tmp_path, "train.exp_id=orphans", "train.max_steps=100000")]
    launcher = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").exists() and '"step": 2,' in (run_dir / "metrics.jsonl")
                 .read_text())
        launcher.kill()
        launcher.wait()
        ranks = f"train.dump_path={tmp_path}"  # in the ranks' command lines
        assert processes_running(ranks)  # orphans now
        wait_for(lambda: not processes_running(ranks), timeout=60)
        assert not processes_running(ranks)
    finally:
        for pid in processes_running(f"train.dump_path={tmp_path}"):
            os.kill(pid, signal.SIGKILL)
    lock_run_directory(run_dir).release()  # free
    assert "(the torchrun launcher is gone)" in (run_dir / "train.log").read_text()
    assert torch.load(run_dir / "checkpoint.pt", weights_only=False)["step"] >= 2


def test_a_pipe_as_preprocessing_input_is_told_as_such(tmp_path):
    from xlm_pkm.data.corpus import CorpusError
    from xlm_pkm.data.preprocess import preprocess

    read, write = os.pipe()  # what `--input <(cat f)` gives: /dev/fd/63
    try:
        with pytest.raises(CorpusError, match=f"input /dev/fd/{read} is a pipe .* can be read only once"):
            preprocess([f"/dev/fd/{read}"], tmp_path / "out", n_codes=10)
    finally:
        os.close(read)
        os.close(write)


@pytest.mark.slow
def test_learnbpe_out_of_memory_is_told_as_such(tmp_path, monkeypatch, fastbpe_bin):
    """fastBPE's learnbpe under a real `ulimit -v` (std::bad_alloc): it was "failed writing .../codes"."""
    import random
    import string

    from xlm_pkm.data.fastbpe import FastBPEError, learn_codes

    limited = tmp_path / "fast"
    limited.write_text(f'#!/bin/sh\nulimit -v 20000\nexec {fastbpe_bin} "$@"\n')
    limited.chmod(0o755)
    monkeypatch.setenv("FASTBPE", str(limited))
    rng = random.Random(0)
    text = tmp_path / "train.tok"
    text.write_text("\n".join(" ".join("".join(rng.choices(string.ascii_letters, k=12)) for _ in range(10))
                              for _ in range(20000)))  # 200,000 distinct words
    with pytest.raises(FastBPEError, match=re.escape(f"fastBPE learnbpe ran out of memory making {tmp_path}/codes "
                                                     f"(std::bad_alloc)")):
        learn_codes(100, [text], tmp_path / "codes")
    assert not (tmp_path / "codes").exists()


def test_ngram_gain_json_on_a_checkpoint_is_refused_before_the_work(reference_run, tmp_path, capsys):
    from xlm_pkm.experiments.ngram_gain import main as ngram_gain_main

    checkpoint = tmp_path / "checkpoint.pt"
    shutil.copy(reference_run().ckpt_path, checkpoint)
    before = checkpoint.read_bytes()
    assert ngram_gain_main(["--run", f"a={checkpoint}", "--json", str(checkpoint)]) == 2
    assert f"--json {checkpoint}: exists and is not a result of python -m xlm_pkm.experiments.ngram_gain" in \
        one_line(capsys)
    assert checkpoint.read_bytes() == before


def test_harness_json_on_a_checkpoint_is_refused_before_the_work(reference_run, tmp_path, capsys):
    from xlm_pkm.experiments.harness import main as harness_main

    checkpoint = tmp_path / "checkpoint.pt"
    shutil.copy(reference_run().ckpt_path, checkpoint)
    before = checkpoint.read_bytes()
    assert harness_main(["run", str(checkpoint), "--tasks", "lambada", "--json", str(checkpoint)]) == 2
    assert f"--json {checkpoint}: exists and is not a result of the harness" in one_line(capsys)
    assert checkpoint.read_bytes() == before
