"""Full disks, for real (issue 35): training, evaluate.py --json, preprocessing and export writing to a
small tmpfs (conftest.small_filesystem) end in one line naming the file, keep the previous file and
leave no temporary file. Skipped, with a one-line reason, where a tmpfs cannot be mounted."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

import pytest

from xlm_pkm.checkpoint import files as checkpoint
from xlm_pkm.launch.cli import evaluate_main, train_main

FULL = "No space left on device"
PAGE = 4096  # tmpfs allocates whole pages


def fill(fs: Path, leave: int = 0) -> Path:
    """Fills the filesystem at `fs` with one file, leaving `leave` bytes (rounded up to whole pages) free."""
    reserve = fs / "reserve"
    if leave:
        reserve.write_bytes(b"\0" * leave)
    filler, chunk = fs / "filler", 1 << 20
    buffer = memoryview(bytes(chunk))
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        while chunk:
            try:
                os.write(fd, buffer[:chunk])
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                chunk //= 2
    finally:
        os.close(fd)
    reserve.unlink(missing_ok=True)
    return filler


def temporary_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name.endswith(".tmp"))


def test_small_filesystem_fills_for_real(small_filesystem):
    fs = small_filesystem(64)
    fill(fs)
    with pytest.raises(OSError) as raised:
        (fs / "one-byte").write_bytes(b"x")
    assert raised.value.errno == errno.ENOSPC


# ---- training: checkpoint.pt does not fit ------------------------------------------------------------
def test_full_disk_during_training_is_one_line_and_keeps_the_previous_checkpoint(reference_run, tiny_overrides,
                                                                                  small_filesystem, capsys):
    reference = reference_run()
    tensors = sum(p.stat().st_size for p in (reference.run_dir / "checkpoint.dcp").rglob("*") if p.is_file())
    last, best = reference.ckpt_path.stat().st_size + tensors, reference.best_path.stat().st_size
    # room for the logs, checkpoint.pt (and its tensors) of step 4 and best.pt of step 8, not for a second
    # checkpoint beside the first
    fs = small_filesystem((last + best + last // 2) // 1024 + 64)
    status = train_main(tiny_overrides(fs, "train.exp_id=full", "train.save_every_steps=4"))
    run = fs / "tiny" / "full"
    assert status == 2
    assert capsys.readouterr().err == (f"train.py: error: cannot write {run}/checkpoint.dcp/step8.partial: {FULL}; "
                                       f"the previous checkpoint.pt is kept\n")
    assert checkpoint.load(run / "checkpoint.pt")["step"] == 4
    assert [p.name for p in (run / "checkpoint.dcp").iterdir()] == ["step4"]  # its tensors; no partial folder
    assert checkpoint.load(run / "best.pt")["step"] == 8  # written before the disk was full
    assert temporary_files(fs) == []


# ---- checkpoint.pt's tensors under several processes ------------------------------------------------------
def save_tensors_on_a_full_disk(rank: int, world: int, folder: str) -> None:
    """Writes 4 tensors of 64 KB through Distributed Checkpoint into folder/fs (a tmpfs with 16 KB left): each rank
    writes its share, and fails inside torch.save; this rank's one-line error goes to folder/rankR.txt."""
    import torch

    from xlm_pkm.checkpoint import dcp_tensors
    from xlm_pkm.runtime.distributed import DistEnv
    from xlm_pkm.utils.atomic import OutputError

    record = {"model": {f"w{i}": torch.full((128, 128), float(i)) for i in range(4)}, "optimizers": {}, "step": 3}
    try:
        dcp_tensors.save(record, Path(folder) / "fs" / "checkpoint.pt", torch.nn.Module(), {},
                         DistEnv(rank, rank, world), torch.device("cpu"))
        said = "saved"
    except OutputError as e:
        said = str(e)
    (Path(folder) / f"rank{rank}.txt").write_text(said)


def test_a_full_disk_is_told_as_such_though_the_error_crosses_processes(small_filesystem, monkeypatch):
    """Distributed Checkpoint sends each rank's error to the others pickled, which drops its cause: under 2 processes
    a full disk read `[enforce fail at inline_container.cc:672] unexpected pos 704 vs 598` (torch's zip writer's
    error, whose cause was the OSError). One process here, each failure pickled as between ranks."""
    import pickle

    from torch.distributed.checkpoint import CheckpointException

    from xlm_pkm.checkpoint import dcp_tensors

    summary = dcp_tensors._summary

    def as_sent_between_ranks(error, ranks=False):
        if isinstance(error, CheckpointException):
            error = pickle.loads(pickle.dumps(error))
        return summary(error, ranks)

    monkeypatch.setattr(dcp_tensors, "_summary", as_sent_between_ranks)
    fs = small_filesystem(128, "fs")
    fill(fs, leave=4 * PAGE)
    save_tensors_on_a_full_disk(0, 1, str(fs.parent))
    assert (fs.parent / "rank0.txt").read_text() == f"cannot write {fs}/checkpoint.dcp/step3.partial: {FULL}"
    assert sorted(p.name for p in fs.rglob("*")) == ["checkpoint.dcp", "filler"]  # no partial folder left


@pytest.mark.slow
def test_a_full_disk_under_two_processes_is_one_line_on_each(small_filesystem, tmp_path):
    """The same with 2 real processes (gloo): every rank's line says the disk is full."""
    from conftest import spawn

    fs = small_filesystem(128, "fs")
    fill(fs, leave=4 * PAGE)
    spawn(save_tensors_on_a_full_disk, 2, tmp_path)
    for rank in range(2):
        said = (tmp_path / f"rank{rank}.txt").read_text()
        assert re.fullmatch(re.escape(f"cannot write {fs}/checkpoint.dcp/step3.partial: ") + rf"rank \d: {FULL}",
                            said), said
    assert sorted(p.name for p in fs.rglob("*")) == ["checkpoint.dcp", "filler"]


# ---- evaluate.py --json --------------------------------------------------------------------------------
def test_evaluate_json_on_a_full_disk_fails_before_evaluating(reference_run, small_filesystem, capsys, monkeypatch):
    import xlm_pkm.launch.cli

    fs = small_filesystem(64)
    fill(fs)
    monkeypatch.setattr(xlm_pkm.launch.cli, "evaluate_checkpoint", lambda *a, **k: pytest.fail("evaluated anyway"))
    assert evaluate_main(["--checkpoint", str(reference_run().best_path), "--json", str(fs / "r.json")]) == 2
    assert capsys.readouterr().err == f"evaluate.py: error: cannot write {fs}/r.json: {FULL}\n"
    assert sorted(p.name for p in fs.iterdir()) == ["filler"]


def test_evaluate_json_on_a_disk_that_fills_while_evaluating_fails_after(reference_run, small_filesystem, capsys,
                                                                         monkeypatch):
    import xlm_pkm.launch.cli

    fs = small_filesystem(64)
    previous = '{"split": "test", "tokens": 0, "memories": []}\n'
    (fs / "r.json").write_text(previous)  # a previous result of evaluate.py: the only kind --json replaces
    evaluate = xlm_pkm.launch.cli.evaluate_checkpoint

    def evaluate_while_the_disk_fills(*args, **kwargs):
        result = evaluate(*args, **kwargs)
        fill(fs)  # another process fills the disk meanwhile
        return result

    monkeypatch.setattr(xlm_pkm.launch.cli, "evaluate_checkpoint", evaluate_while_the_disk_fills)
    assert evaluate_main(["--checkpoint", str(reference_run().best_path), "--json", str(fs / "r.json"),
                          "--max-batches", "4"]) == 2
    captured = capsys.readouterr()
    assert captured.out.startswith("test ppl ")  # evaluated, printed, then the JSON could not be written
    assert captured.err == f"evaluate.py: error: cannot write {fs}/r.json: {FULL}; the previous r.json is kept\n"
    assert (fs / "r.json").read_text() == previous and temporary_files(fs) == []


# ---- preprocessing ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("size_kb, workers, failing", [
    (64, 2, r"work/0000[01]\.(train|valid|test)\.tok"),  # tokenizing, in the workers
    (600, 2, r"work/0000[01]\.train\.bpe"),  # applying BPE, in the workers
    (1200, 1, r"train\.00[01]\.bin"),  # binarizing
])
@pytest.mark.slow
def test_preprocessing_on_a_full_disk_is_one_line(tiny_corpus, small_filesystem, capfd, size_kb, workers, failing):
    from xlm_pkm.data.preprocess import main

    fs = small_filesystem(size_kb)
    out = fs / "out"
    status = main(["--input", str(tiny_corpus), "--output", str(out), "--bpe-codes", "500", "--valid-docs", "4",
                   "--test-docs", "4", "--chunk-mb", "0.25", "--workers", str(workers)])
    err = capfd.readouterr().err  # the workers' output too
    assert status == 2 and "Traceback" not in err, err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and err.splitlines()[-1] == errors[0], err
    assert re.search(rf"python -m xlm_pkm\.data\.preprocess: error: cannot write {re.escape(str(out))}/{failing}: "
                     rf"{FULL}$", errors[0]), errors[0]
    assert temporary_files(fs) == [] and not (out / "meta.json").exists()


# ---- export ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("room", ["none", "for the weights only"])
def test_export_on_a_full_disk_is_one_line_and_keeps_the_previous_export(reference_run, small_filesystem, capsys,
                                                                         tmp_path, room):
    from xlm_pkm.inference.export import main

    reference = reference_run()
    fs = small_filesystem(1024)
    out = fs / "exported"
    assert main([str(reference.best_path), str(out)]) == 0
    previous = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main([str(reference.ckpt_path), str(tmp_path / "elsewhere")]) == 0  # what the new export holds
    weights = (tmp_path / "elsewhere" / "model.safetensors").stat().st_size
    assert (tmp_path / "elsewhere" / "model.safetensors").read_bytes() != previous["model.safetensors"]  # another
    capsys.readouterr()
    fill(fs, leave=0 if room == "none" else weights)
    assert main([str(reference.ckpt_path), str(out)]) == 2
    failed = "config.json" if room == "none" else r"[\w.]+"  # the first file written, or the one that no longer fits
    assert re.fullmatch(rf"python -m xlm_pkm\.inference\.export: error: cannot write {re.escape(str(out))}/{failed}: "
                        rf"{FULL}; the previous export in {re.escape(str(out))} is kept\n", capsys.readouterr().err)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == previous  # nothing else either: no temporary file
