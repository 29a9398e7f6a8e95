"""Accidents that used to lose, overwrite or silently corrupt a run (issue 10), each reproduced."""

import errno
import gc
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import whole_checkpoint

from xlm_pkm.checkpoint import files as checkpoint
from xlm_pkm.checkpoint.files import NonFiniteError
from xlm_pkm.config import load_config
from xlm_pkm.data.dictionary import Dictionary
from xlm_pkm.data.shard import read_shard, shard_paths, write_shard
from xlm_pkm.errors import ConfigError
from xlm_pkm.launch.cli import evaluate_main, train_main
from xlm_pkm.optim.lazy_adam import LazyAdam
from xlm_pkm.runtime.distributed import free_port
from xlm_pkm.train.run_dir import lock_run_directory
from xlm_pkm.train.trainer import NonFiniteLossError
from xlm_pkm.utils.atomic import OutputError
from xlm_pkm.utils.lock import DirectoryBusy

ROOT = Path(__file__).resolve().parent.parent


# ---- non-finite weights never overwrite the good checkpoint ----------------------------------------
@pytest.mark.parametrize("extra, error", [
    # an evaluation and its checkpoint are due while the weights are not finite: the perplexity stops the run (issue 62)
    (("train.eval_every=4",), NonFiniteLossError),
    (("train.eval_every=5", "train.save_every_steps=4"), NonFiniteError),  # a checkpoint is due before any evaluation
    (("train.max_nonfinite=2",), NonFiniteLossError),  # the run gives up first
])
@pytest.mark.slow
def test_non_finite_weights_never_overwrite_the_good_checkpoint(tiny_run, tiny_trainer, tmp_path, extra, error):
    tiny_run(tmp_path, "train.exp_id=nan", "train.max_steps=3")
    trainer = tiny_trainer(tmp_path, "train.exp_id=nan", "train.max_steps=20", *extra)
    good = trainer.ckpt_path.read_bytes()
    with torch.no_grad():  # whatever the cause (an lr too large, a bad eps), the weights are now NaN
        trainer.model.memory_value_parameters()[0][0, 0] = float("nan")
    with pytest.raises(error) as raised:
        trainer.train()
    trainer.close()
    assert trainer.ckpt_path.read_bytes() == good
    assert f"Last good checkpoint: {trainer.ckpt_path} (step 3)" in str(raised.value)
    if extra != ("train.max_nonfinite=2",):  # a check of the weights names the tensor at fault
        assert "blocks.1.sublayers.1.values.weight is not finite" in str(raised.value)
    assert checkpoint.first_non_finite(whole_checkpoint(trainer.ckpt_path)["model"]) is None


def test_first_non_finite_names_the_tensor():
    state = {"model": {"w": torch.ones(3)}, "opt": [{"m": torch.tensor([1.0, float("inf")])}]}
    assert checkpoint.first_non_finite(state) == "opt.0.m"
    assert checkpoint.first_non_finite({"w": torch.ones(2), "step": torch.tensor(3)}) is None


@pytest.mark.parametrize("override", ["optim.eps=0", "optim.warmup_init_lr=.nan", "optim.lr=.inf",
                                      "optim.values_lr=.nan", "optim.values_beta2=1.0", "optim.lr=-1"])
def test_non_finite_or_nonsensical_optimizer_settings_are_refused_at_start(override):
    with pytest.raises(ConfigError, match=override.split("=")[0]):
        load_config(None, ["optim.values_optimizer=lazy_adam", override])


@pytest.mark.parametrize("kwargs", [dict(eps=0.0), dict(lr=float("nan")), dict(betas=(0.9, 1.0)),
                                    dict(weight_decay=-1.0)])
def test_lazy_adam_refuses_bad_settings(kwargs):
    with pytest.raises(ValueError, match="LazyAdam: invalid"):
        LazyAdam([torch.nn.Parameter(torch.zeros(2, 2))], **kwargs)


# ---- inputs checked before the first step ----------------------------------------------------------
def copy_data(tiny_data_dir, tmp_path) -> Path:
    out = tmp_path / "data"
    shutil.copytree(tiny_data_dir, out)
    return out


@pytest.mark.parametrize("split", ["valid", "test"])
def test_broken_held_out_split_is_found_before_the_first_step(tiny_data_dir, tiny_trainer, tmp_path, split):
    data = copy_data(tiny_data_dir, tmp_path)
    shard = shard_paths(data, split)[0]
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    with pytest.raises(ValueError, match=str(shard)):
        tiny_trainer(tmp_path, "train.exp_id=broken", f"data.path={data}")
    assert not (tmp_path / "tiny" / "broken").exists()  # nothing started, nothing written
    if split == "test":  # a run that will not evaluate test does not need it
        tiny_trainer(tmp_path, "train.exp_id=notest", f"data.path={data}", test=False).close()


# ---- one run per run directory -----------------------------------------------------------------------
def test_second_run_in_the_same_directory_is_refused_naming_the_holder(tiny_trainer, tmp_path):
    first = tiny_trainer(tmp_path, "train.exp_id=busy")
    try:
        with pytest.raises(DirectoryBusy, match=f"in use by pid {os.getpid()} on"):
            tiny_trainer(tmp_path, "train.exp_id=busy")
    finally:
        first.close()
    again = tiny_trainer(tmp_path, "train.exp_id=busy")  # free again once the first has ended; it trained no
    again.close()  # step, so its outputs are taken over (issue 51)
    assert again.took_over


@pytest.mark.slow
def test_stale_lock_of_a_killed_process_does_not_block(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from xlm_pkm.train.run_dir import lock_run_directory; "
                               "held = lock_run_directory(Path(sys.argv[1])); "
                               "print('locked', flush=True); time.sleep(60)", str(tmp_path)],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(DirectoryBusy, match=f"pid {holder.pid}"):
        lock_run_directory(tmp_path)
    holder.kill()  # kill -9: the lock file stays, its holder is gone
    holder.wait()
    assert (tmp_path / ".lock").exists()
    lock_run_directory(tmp_path).release()


def test_a_refused_lock_closes_no_other_file(tmp_path):
    """The refused lock's descriptor number is free again once refused: the next file opened gets it, and
    collecting the refused object must not close that file (it closed it twice before)."""
    held = lock_run_directory(tmp_path)
    try:
        with pytest.raises(DirectoryBusy) as refused:
            lock_run_directory(tmp_path)
        with open(tmp_path / "other.txt", "w") as f:
            del refused  # the refused DirectoryLock, held by the traceback, is collected now
            gc.collect()
            f.write("still open")
        assert (tmp_path / "other.txt").read_text() == "still open"
    finally:
        held.release()


# ---- unwritable outputs: one line, the previous file kept, no temporary files ---------------------
def test_failed_checkpoint_write_keeps_the_previous_one(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    checkpoint.save_atomic({"config": {}, "model": {}, "step": 1}, path)

    def disk_full(obj, f):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OutputError, match=f"cannot write {path}: No space left on device; the previous checkpoint.pt"):
        checkpoint.save_atomic({"step": 2}, path)
    monkeypatch.undo()
    assert checkpoint.load(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


def test_disk_full_while_logging_metrics_leaves_whole_lines(tiny_trainer, tmp_path, monkeypatch):
    trainer = tiny_trainer(tmp_path, "train.exp_id=full")
    trainer.log.event("train", 1, loss=1.0)

    class FullDisk:
        def __init__(self, f):
            self.f = f

        def tell(self):
            return self.f.tell()

        def truncate(self, size):
            return self.f.truncate(size)

        def write(self, data):
            self.f.write(data[:7])  # part of the line reaches the disk, then it is full
            raise OSError(errno.ENOSPC, "No space left on device")

    trainer.log.metrics = FullDisk(trainer.log.metrics)
    with pytest.raises(OutputError, match="metrics.jsonl: No space left on device"):
        trainer.log.event("train", 2, loss=2.0)
    trainer.log.metrics = trainer.log.metrics.f
    trainer.close()
    lines = (trainer.run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1]


def test_evaluate_json_into_a_missing_folder_fails_before_evaluating(reference_run, tmp_path, capsys, monkeypatch):
    import xlm_pkm.launch.cli

    monkeypatch.setattr(xlm_pkm.launch.cli, "evaluate_checkpoint", lambda *a, **k: pytest.fail("evaluated anyway"))
    best = reference_run().best_path
    assert evaluate_main(["--checkpoint", str(best), "--json", str(tmp_path / "no" / "r.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot write {tmp_path}/no/r.json" in err[0]


# ---- silently wrong: another vocabulary of the same size -------------------------------------------
def same_size_other_vocabulary(tiny_data_dir, tmp_path) -> Path:
    """A copy of the data whose vocabulary swaps two words (same size), shards rewritten for it, as a
    re-preprocessing into the same folder would leave it."""
    data = copy_data(tiny_data_dir, tmp_path)
    lines = (data / "vocab").read_text().splitlines(keepends=True)
    lines[10], lines[11] = lines[11], lines[10]
    (data / "vocab").write_text("".join(lines))
    fingerprint = Dictionary.load(data / "vocab").fingerprint()
    for path in sorted(data.glob("*.bin")):
        shard = read_shard(path)
        bounds = [*map(int, shard.doc_starts), len(shard.tokens)]
        docs = [np.array(shard.tokens[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
        write_shard(path, docs, shard.tokens.dtype, fingerprint)
    return data


def test_other_vocabulary_is_refused_on_resume_and_in_evaluation(tiny_data_dir, tiny_run, tiny_trainer, tmp_path,
                                                                 capsys):
    run = tiny_run(tmp_path, "train.exp_id=vocab", "train.max_steps=2")
    other = same_size_other_vocabulary(tiny_data_dir, tmp_path)
    with pytest.raises(ValueError, match=f"trained with another vocabulary than {other}/vocab"):
        tiny_trainer(tmp_path, "train.exp_id=vocab", f"data.path={other}")
    assert evaluate_main(["--checkpoint", str(run.best_path), "--data", str(other)]) == 2
    assert "another vocabulary" in capsys.readouterr().err


# ---- one-line errors ----------------------------------------------------------------------------------
@pytest.mark.parametrize("override, expected", [
    ("train.log_every=0", "train.log_every: must be > 0"), ("train.eval_every=-5", "train.eval_every: must be > 0"),
    ("model.dim=0", "model.dim: must be > 0"), ("model.memory.heads=0", "model.memory.heads: must be > 0"),
    ("train.max_nonfinite=0", "train.max_nonfinite: must be > 0"),
    ("train.device=gpu", "train.device: expected auto, cpu, cuda or cuda:N"),
    ("optim.values_optimizer=adamw", "optim.values_optimizer: expected one of adam | lazy_adam"),
    ("model.memory.sparse=true", "replaced by optim.values_optimizer"),
    ("model.mem_layers=[1,", "override 'model.mem_layers=[1,': not a valid YAML value"),
    ("train.seed=-1", "train.seed: must be >= 0"),
    ("train.exp_id=.", "train.exp_id: must be one file or folder name"),
    ("train.exp_id=../../x", "train.exp_id: must be one file or folder name"),
    ("optim.trainable=[]", "optim.trainable=[]: nothing to train (it selects no parameter)"),
    ("model.memory.n_keys=100000", "the model needs at least 4,768.4 GiB for its weights, gradients and optimizer"),
])
def test_bad_values_get_one_line_errors(tiny_overrides, tmp_path, capsys, override, expected):
    assert train_main(tiny_overrides(tmp_path, "train.exp_id=bad", override)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_a_memory_only_run_of_a_model_without_memory_is_refused(tiny_overrides, tmp_path, capsys):
    assert train_main(tiny_overrides(tmp_path, "optim.trainable=memory", "model.mem_layers=[]",
                                     "model.n_memories=0")) == 2
    assert capsys.readouterr().err == ("train.py: error: optim.trainable=['memory']: nothing to train (the model has "
                                       "no memory); use all, memory, memory_values (with a memory) or glob patterns "
                                       "over parameter names\n")


@pytest.mark.slow
def test_a_run_directory_without_checkpoint_is_not_overwritten(tiny_run, tiny_overrides, tmp_path, capsys):
    """best.pt of step 8 and the metrics stay as they were when checkpoint.pt is gone (deleted, or the run
    stopped before its first one) and the same command runs again."""
    run_dir = tiny_run(tmp_path, "train.exp_id=kept", "train.eval_every=4").run_dir
    (run_dir / "checkpoint.pt").unlink()
    outputs = lambda: {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != ".lock"}  # noqa: E731
    before = outputs()
    assert train_main(tiny_overrides(tmp_path, "train.exp_id=kept", "train.eval_every=4")) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"train.py: error: {run_dir} holds a run (best.pt, checkpoint.dcp, config.yaml, ")
    assert outputs() == before


@pytest.mark.slow
def test_temporary_files_of_a_killed_writer_are_removed_at_the_next_start(tiny_run, tiny_trainer, tmp_path):
    run_dir = tiny_run(tmp_path, "train.exp_id=tmp", "train.max_steps=4").run_dir
    leftover = run_dir / "checkpoint.pt.999999.0badc0de.tmp"  # a kill -9 during a write leaves one
    leftover.write_bytes(b"half a checkpoint")
    trainer = tiny_trainer(tmp_path, "train.exp_id=tmp")
    trainer.close()
    assert not leftover.exists()
    assert "removed 1 temporary file(s) left by a process killed while writing" in (run_dir / "train.log").read_text()


def test_evaluating_a_folder_that_is_not_an_export_says_what_is_expected(tmp_path, capsys):
    assert evaluate_main(["--checkpoint", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"evaluate.py: error: {tmp_path / 'model.safetensors'} not found: not a folder "
                                       f"written by python -m xlm_pkm.inference.export (nor a run's checkpoint.pt or "
                                       f"best.pt)\n")


@pytest.mark.slow
def test_resuming_on_other_data_says_what_to_do(tiny_run, tiny_trainer, tiny_corpus, tiny_data_dir, tmp_path):
    from xlm_pkm.data.preprocess import preprocess

    tiny_run(tmp_path, "train.exp_id=moved", "train.max_steps=4")
    other = tmp_path / "other"  # fewer documents held out, the same codes and vocabulary: other train tokens
    preprocess([str(tiny_corpus)], other, codes=str(tiny_data_dir / "codes"), vocab=str(tiny_data_dir / "vocab"),
               valid_docs=3, test_docs=4, seed=1, chunk_mb=0.25)
    with pytest.raises(ValueError, match=rf"the checkpoint's data position does not match {other} \(train\): its "
                                         r"total_tokens is \d+, this data's \d+; resume on the data the run was "
                                         r"trained on \(data.path in its config.yaml\)"):
        tiny_trainer(tmp_path, "train.exp_id=moved", f"data.path={other}")


@pytest.mark.slow
def test_torch_file_that_is_not_a_run_checkpoint(tmp_path, capsys):
    torch.save(torch.zeros(3), tmp_path / "weights.pt")
    assert evaluate_main(["--checkpoint", str(tmp_path / "weights.pt"), "--device", "gpu"]) == 2
    assert "--device gpu: expected auto, cpu, cuda or cuda:N" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert evaluate_main(["--checkpoint", str(tmp_path / "weights.pt"), "--device", "cuda"]) == 2
        assert capsys.readouterr().err == "evaluate.py: error: --device cuda: CUDA is not available on this machine\n"
    assert evaluate_main(["--checkpoint", str(tmp_path / "weights.pt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a checkpoint of an xlm-pkm run" in err[0]


# ---- logs after a crash and resume ----------------------------------------------------------------------
@pytest.mark.slow
def test_metrics_after_a_crash_and_resume_read_like_the_uninterrupted_run(tiny_trainer, tiny_run, reference_run,
                                                                          train_losses, tmp_path, monkeypatch):
    trainer = tiny_trainer(tmp_path, "train.exp_id=crash", "train.eval_every=4")
    step_once = type(trainer).train_step

    def crash_at_6(self, batches):
        if self.step == 6:
            raise KeyboardInterrupt  # killed after logging steps 5 and 6, past the checkpoint of step 4
        return step_once(self, batches)

    monkeypatch.setattr(type(trainer), "train_step", crash_at_6)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    trainer.close()
    monkeypatch.undo()
    resumed = tiny_run(tmp_path, "train.exp_id=crash", "train.eval_every=4")
    reference = reference_run("train.eval_every=4")
    assert train_losses(resumed.run_dir) == train_losses(reference.run_dir)  # no step twice, same values


# ---- distributed: a frozen or killed rank ------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("signum, parallel", [("SIGSTOP", "ddp"), ("SIGKILL", "ddp"), ("SIGKILL", "fsdp")])
def test_frozen_or_killed_rank_ends_the_job_with_one_line_naming_it(tiny_overrides, tmp_path, signum, parallel):
    """Two ranks started by hand (as srun does, no torchrun); rank 1 freezes or dies mid-training."""
    import signal as signals

    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "OMP_NUM_THREADS": "1"}
    args = [sys.executable, str(ROOT / "train.py"), "--no-test",
            *tiny_overrides(tmp_path, "train.exp_id=lost", "train.max_steps=100000", "train.num_threads=1",
                            "train.collective_timeout_minutes=0.05", f"train.parallel={parallel}")]  # 3 s
    ranks = [subprocess.Popen(args, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        for line in ranks[0].stdout:
            if "train step 3/" in line:
                break
        os.kill(ranks[1].pid, getattr(signals, signum))
        assert ranks[0].wait(timeout=60) == 2
        err = ranks[0].stderr.read().strip().splitlines()
        said = "rank(s) 1 stopped answering" if signum == "SIGSTOP" else "rank(s) 1 died (process gone"  # its pid
        assert len(err) == 1 and said in err[0] and "this run stopped after step " in err[0], err
    finally:
        for p in ranks:
            p.kill()
            p.wait()


def test_collective_failures_are_told_by_torchs_types_and_by_gloos_transport_messages(monkeypatch):
    """What torch 2.13 raises when a peer dies or a collective times out: DistError's subclasses (NCCL, the store),
    and on gloo a plain RuntimeError from its transport (messages as seen in a 2-process experiment)."""
    import torch.distributed as dist

    from xlm_pkm.runtime import distributed

    failures = [dist.DistBackendError("NCCL watchdog timeout"), dist.DistNetworkError("Failed to recv, got 0 bytes"),
                dist.DistStoreError("wait timeout"),
                RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
                             "closed by peer [127.0.0.1]:39335. This is typically caused by a remote worker crashing."),
                RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms "
                             "for recv operation to complete")]
    others = [RuntimeError("mat1 and mat2 shapes cannot be multiplied"), ValueError("Connection closed by peer")]
    assert not any(distributed.is_collective_failure(e) for e in failures)  # no process group: nothing collective
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    assert all(distributed.is_collective_failure(e) for e in failures)
    assert not any(distributed.is_collective_failure(e) for e in others)


def test_every_one_line_error_derives_from_user_error():
    """Commands catch USER_ERRORS (xlm_pkm/errors.py); each error written for the user is a UserError, and
    keeps the built-in base that code catching it before the regroup relied on."""
    from xlm_pkm.data.fastbpe import FastBPEError
    from xlm_pkm.errors import USER_ERRORS, UserError
    from xlm_pkm.runtime.distributed import CollectiveError

    for error, base in [(ConfigError, ValueError), (OutputError, RuntimeError), (DirectoryBusy, RuntimeError),
                        (NonFiniteError, RuntimeError), (NonFiniteLossError, RuntimeError),
                        (CollectiveError, RuntimeError), (FastBPEError, RuntimeError)]:
        assert issubclass(error, UserError) and issubclass(error, base), error
        assert issubclass(error, USER_ERRORS)
