"""Preprocessing accidents: killed runs, full disks, unproven completeness, touched inputs, binary
input, more BPE codes than the corpus allows, concurrent writers of one file."""

from __future__ import annotations

import builtins
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_data_preprocess import write_jsonl

from xlm_pkm.data.corpus import CorpusError, Reader
from xlm_pkm.data.plan import PlanError
from xlm_pkm.data.preprocess import main, preprocess
from xlm_pkm.data.shard import ShardWriter, read_shard

REPO = Path(__file__).resolve().parents[1]
SMALL = dict(n_codes=30, valid_docs=2, test_docs=2)


def descendants(pid: int) -> set[int]:
    """Live (non-zombie) descendants of a process, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_run_takes_its_workers_with_it(tiny_corpus, tmp_path, sig):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(tiny_corpus.read_text(encoding="utf-8") * 3, encoding="utf-8")
    proc = subprocess.Popen([sys.executable, "-m", "xlm_pkm.data.preprocess", "--input", str(corpus), "--output",
                             str(tmp_path / "out"), "--workers", "2", "--chunk-mb", "0.25", "--bpe-codes", "50",
                             "--valid-docs", "2", "--test-docs", "2"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    workers: set[int] = set()
    while len(workers) < 3 and time.time() < deadline and proc.poll() is None:  # forkserver + 2 workers
        workers = descendants(proc.pid)
        time.sleep(0.02)
    assert len(workers) >= 3, "the run ended before its workers could be seen"
    proc.send_signal(sig)
    proc.wait()
    deadline = time.time() + 10
    while any(map(alive, workers)) and time.time() < deadline:
        time.sleep(0.05)
    assert not [p for p in workers if alive(p)]


def test_second_run_into_a_busy_directory_is_refused_and_a_stale_lock_is_not(tmp_path):
    from xlm_pkm.utils.lock import DirectoryBusy, DirectoryLock

    corpus = write_jsonl(tmp_path / "in.jsonl", 12)
    out = tmp_path / "out"
    with DirectoryLock(out, "preprocess.lock", "wait"):
        with pytest.raises(DirectoryBusy, match=f"{out} is in use by pid {os.getpid()} on"):
            preprocess([str(corpus)], out, **SMALL)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (out / "preprocess.lock").write_text(dead.stdout)
    (out / f"plan.json.{dead.stdout.strip()}.0123abcd.tmp").write_text("left by a killed run")
    preprocess([str(corpus)], out, **SMALL)
    assert (out / "meta.json").exists() and leftovers(out) == []


def test_two_writers_of_one_shard_do_not_share_a_temporary_file(tmp_path):
    path = tmp_path / "train.000.bin"
    first, second = ShardWriter(path, np.uint16, "0" * 16), ShardWriter(path, np.uint16, "0" * 16)
    first.add_document(np.array([0, 5, 6, 1]))
    second.add_document(np.array([0, 7, 1]))
    first.close()
    second.close()
    assert read_shard(path).tokens.tolist() == [0, 7, 1]
    assert [p.name for p in tmp_path.iterdir()] == ["train.000.bin"]


class FullDisk:
    """A file whose writes fail with ENOSPC."""

    def __init__(self, f):
        self._f = f

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self._f.close()


def error_line(stderr: str) -> str:
    """The one-line error a command wrote on stderr: its last line, and the only one with ': error: '."""
    lines = stderr.splitlines()
    assert [line for line in lines if ": error: " in line] == lines[-1:], stderr
    return lines[-1]


def leftovers(out: Path) -> list[str]:
    return [p.name for p in out.rglob("*") if ".tmp" in p.name]


@pytest.mark.parametrize("target", ["plan.json", "00000.train.tok", "codes", "vocab", "train.000.bin", "test.000.bin",
                                    "meta.json"])
def test_full_disk_gives_one_line_error_and_no_temporary_files(tmp_path, monkeypatch, capsys, target):
    corpus = write_jsonl(tmp_path / "in.jsonl", 12)
    out = tmp_path / "out"
    real_open = builtins.open

    def open_on_full_disk(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        writing = any(c in mode for c in "wax+")
        return FullDisk(f) if writing and os.path.basename(str(file)).startswith(target) else f

    monkeypatch.setattr(builtins, "open", open_on_full_disk)
    assert main(["--input", str(corpus), "--output", str(out), "--bpe-codes", "30", "--valid-docs", "2",
                 "--test-docs", "2", "--workers", "1"]) == 2
    message = error_line(capsys.readouterr().err)
    assert message.startswith("python -m xlm_pkm.data.preprocess: error: cannot write ")
    assert str(out / target) in message or str(out / "work" / target) in message
    assert "No space left on device" in message and "\n" not in message
    assert not (out / target).exists() and leftovers(out) == []
    monkeypatch.setattr(builtins, "open", real_open)
    preprocess([str(corpus)], out, **SMALL)
    assert (out / "meta.json").exists() and leftovers(out) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_read_only_output_gives_one_line_error(tmp_path, capsys):
    corpus = write_jsonl(tmp_path / "in.jsonl", 12)
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o555)
    try:
        status = main(["--input", str(corpus), "--output", str(out), "--bpe-codes", "30", "--valid-docs", "2",
                       "--test-docs", "2"])
    finally:
        out.chmod(0o755)
    message = error_line(capsys.readouterr().err)
    assert status == 2 and message.startswith(f"python -m xlm_pkm.data.preprocess: error: cannot write {out}/")
    assert list(out.iterdir()) == []


def test_full_disk_while_rewriting_keeps_the_previous_good_file(tmp_path, monkeypatch):
    corpus = write_jsonl(tmp_path / "in.jsonl", 12)
    out = tmp_path / "out"
    preprocess([str(corpus)], out, **SMALL)
    good = (out / "meta.json").read_bytes()
    monkeypatch.setattr(builtins, "open", lambda f, mode="r", *a, open=builtins.open, **k:
                        FullDisk(open(f, mode, *a, **k)) if "w" in mode and ".tmp" in str(f)
                        else open(f, mode, *a, **k))
    from xlm_pkm.utils.atomic import OutputError, atomic_file

    with pytest.raises(OutputError, match="meta.json"):
        with atomic_file(out / "meta.json", "w") as f:
            f.write("{}")
    assert (out / "meta.json").read_bytes() == good and leftovers(out) == []


def test_directory_with_outputs_but_no_plan_is_not_taken_as_complete(tiny_data_dir, tmp_path):
    corpus = write_jsonl(tmp_path / "in.jsonl", 12)
    out = tmp_path / "out"
    out.mkdir()
    for name in ("codes", "vocab", "train.000.bin", "valid.000.bin", "test.000.bin"):
        shutil.copy(tiny_data_dir / name, out / name)
    with pytest.raises(PlanError, match=f"{out} holds .* but no plan.json"):
        preprocess([str(corpus)], out, **SMALL)


def test_rerun_proves_completeness_with_meta_json(tmp_path):
    corpus = write_jsonl(tmp_path / "in.jsonl", 12)
    out = tmp_path / "out"
    preprocess([str(corpus)], out, **SMALL)
    meta = json.loads((out / "meta.json").read_text())
    assert {"codes", "vocab", "train.000.bin", "valid.000.bin", "test.000.bin"} <= set(meta["files"])
    original = (out / "train.000.bin").read_bytes()
    (out / "meta.json").unlink()  # killed just before the last write
    assert set(preprocess([str(corpus)], out, **SMALL)) != {"scan"}
    assert json.loads((out / "meta.json").read_text())["files"] == meta["files"]
    damaged = bytearray(original)
    damaged[70] ^= 1  # an in-range change of a token id
    (out / "train.000.bin").write_bytes(bytes(damaged))
    assert set(preprocess([str(corpus)], out, **SMALL)) != {"scan"}
    assert (out / "train.000.bin").read_bytes() == original


def test_inputs_are_identified_by_content_not_mtime(tmp_path):
    corpus = write_jsonl(tmp_path / "in.jsonl", 12)
    out = tmp_path / "out"
    preprocess([str(corpus)], out, **SMALL)
    os.utime(corpus, ns=(1, 1))  # same bytes, as after a git checkout
    assert set(preprocess([str(corpus)], out, **SMALL)) == {"scan"}
    stat = corpus.stat()
    corpus.write_text(corpus.read_text().replace("doc1 ", "doc9 "))  # other bytes, same size and mtime
    os.utime(corpus, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert corpus.stat().st_size == stat.st_size
    with pytest.raises(PlanError, match="other inputs or options"):
        preprocess([str(corpus)], out, **SMALL)


@pytest.mark.parametrize("kind", ["elf.jsonl", "image.png", "nul.txt"])
def test_binary_input_is_refused(tmp_path, capsys, kind):
    rng = np.random.default_rng(0)
    head = {"elf.jsonl": b"\x7fELF\x02\x01\x01\x00", "image.png": b"\x89PNG\r\n\x1a\n", "nul.txt": b"text\x00"}[kind]
    path = tmp_path / kind
    path.write_bytes(head + rng.integers(0, 256, 20000, dtype=np.uint8).tobytes())
    with pytest.raises(CorpusError, match=f"{path} is not text"):
        list(Reader(path))
    assert main(["--input", str(path), "--output", str(tmp_path / "out"), "--bpe-codes", "10"]) == 2
    assert error_line(capsys.readouterr().err).startswith(
        f"python -m xlm_pkm.data.preprocess: error: {path} is not text")


@pytest.mark.parametrize("name", ["bom.jsonl", "bom.txt"])
def test_utf8_byte_order_mark_is_stripped(tmp_path, name):
    path = tmp_path / name
    body = '{"text": "first doc"}\n{"text": "second"}\n' if name.endswith("jsonl") else "first doc\n\nsecond\n"
    path.write_bytes(b"\xef\xbb\xbf" + body.encode())
    expected = ["first doc", "second"] if name.endswith("jsonl") else ["first doc\n", "second\n"]
    assert list(Reader(path)) == expected


def test_more_codes_than_the_corpus_allows_stop_at_the_last_merge(tmp_path, caplog):
    corpus = write_jsonl(tmp_path / "in.jsonl", 12)
    out = tmp_path / "out"
    with caplog.at_level("WARNING"):
        preprocess([str(corpus)], out, n_codes=60000, valid_docs=2, test_docs=2)
    codes = (out / "codes").read_text().splitlines()
    assert 0 < len(codes) < 60000 and all(int(line.split()[2]) > 0 for line in codes)
    assert len({tuple(line.split()[:2]) for line in codes}) == len(codes)
    assert f"the corpus allows only {len(codes)} BPE merges (60000 requested)" in caplog.text
    assert set(preprocess([str(corpus)], out, n_codes=60000, valid_docs=2, test_docs=2)) == {"scan"}


# ---- inputs: a directory, the same input twice (issue 35) ----------------------------------------------------
def test_directory_input_says_it_is_a_directory(tmp_path, capsys):
    folder = tmp_path / "corpus"
    folder.mkdir()
    args = ["--output", str(tmp_path / "out"), "--bpe-codes", "10"]
    assert main(["--input", str(folder), *args]) == 2
    assert error_line(capsys.readouterr().err) == (f"python -m xlm_pkm.data.preprocess: error: --input {folder} is a "
                                                   f"directory, with no files in it: give text or JSONL files")
    write_jsonl(folder / "a.jsonl", 3)
    write_jsonl(folder / "b.jsonl", 3)
    (folder / "c.txt.gz").write_bytes(b"")
    assert main(["--input", str(folder), *args]) == 2
    assert error_line(capsys.readouterr().err) == (
        f"python -m xlm_pkm.data.preprocess: error: --input {folder} is a directory, not a file: give its files, "
        f"e.g. --input {folder}/*.jsonl {folder}/*.txt.gz (3 files there)")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("second", ["same path", "symlink", "copy"])
def test_the_same_input_twice_is_refused(tmp_path, capsys, second):
    corpus = write_jsonl(tmp_path / "in.jsonl", 12)
    other = {"same path": corpus, "symlink": tmp_path / "link.jsonl", "copy": tmp_path / "copy.jsonl"}[second]
    if second == "symlink":
        other.symlink_to(corpus)
    elif second == "copy":
        shutil.copy(corpus, other)
    out = tmp_path / "out"
    assert main(["--input", str(corpus), str(other), "--output", str(out), "--bpe-codes", "30", "--valid-docs", "2",
                 "--test-docs", "2", "--workers", "1"]) == 2
    how = "two files with the same content" if second == "copy" else "the same file"
    assert error_line(capsys.readouterr().err) == (
        f"python -m xlm_pkm.data.preprocess: error: --input {corpus} and {other} are {how}: give each input once (its "
        f"documents would be counted twice, and valid/test documents would also be in train)")
    assert not (out / "plan.json").exists()
