"""Ctrl-C of preprocessing with worker processes: SIGINT to the whole process group, as a terminal sends it, ends
the run with one line and exit status 130 (no traceback from the parent, its workers or the forkserver), no process
of the group left, and the same command again reuses the chunks it kept. Also the paths it is given that are a file,
a named pipe or a broken symbolic link where a folder or a file is expected: one line each."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import xlm_pkm.data.preprocess as preprocess_module
from xlm_pkm.data.plan import Plan
from xlm_pkm.data.preprocess import main, work_file

REPO = Path(__file__).resolve().parents[1]
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} xlm_pkm\.")  # logging's lines (preprocess.main)


def shown_lines(stderr: str) -> list[str]:
    """The lines a terminal shows of `stderr`, less logging's: tqdm's bars redraw a line after \\r (and clear it)."""
    lines = [line.rsplit("\r", 1)[-1].strip() for line in stderr.split("\n")]
    return [line for line in lines if line and not LOG_LINE.match(line)]


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and forkserver workers")
def test_ctrl_c_during_tokenize_is_one_line_and_the_same_command_resumes(tiny_corpus, tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(tiny_corpus.read_text(encoding="utf-8") * 4, encoding="utf-8")  # 1.6 MB: 7 chunks
    out = tmp_path / "out"
    args = ["--input", str(corpus), "--output", str(out), "--chunk-mb", "0.25", "--bpe-codes", "50",
            "--valid-docs", "2", "--test-docs", "2"]
    proc = subprocess.Popen([sys.executable, "-m", "xlm_pkm.data.preprocess", *args, "--workers", "2"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.time() + 120
        while not list((out / "work").glob("*.train.tok")) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.01)  # the workers have tokenized a chunk: the tokenize step is under way
        assert proc.poll() is None, "the run ended before it could be interrupted"
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        stderr = proc.communicate(timeout=60)[1].decode()  # bytes: tqdm's \r kept (text mode makes it \n)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    shown = shown_lines(stderr)
    assert len(shown) == 1, stderr
    assert shown[0].startswith("python -m xlm_pkm.data.preprocess: error: interrupted (Ctrl-C); "), shown[0]
    assert "run the same command again to resume" in shown[0]
    kept = int(re.search(r"(\d+) of \d+ chunks tokenized", shown[0]).group(1))
    deadline = time.time() + 10
    while group_alive(proc.pid) and time.time() < deadline:  # the workers and the forkserver are gone too
        time.sleep(0.05)
    assert not group_alive(proc.pid)
    assert not (out / "preprocess.lock").exists()
    assert not [p.name for p in (out / "work").iterdir() if ".tmp" in p.name]  # the workers' unfinished files

    # the same command again (in this process, one worker: --workers is not part of what must match) resumes:
    # the chunks whose text was kept are not tokenized again
    plan = Plan.load(out / "plan.json")
    done = [c.index for c in plan.chunks()
            if all(work_file(out / "work", c.index, split, "tok").is_file() for split in ("train", "valid", "test"))]
    assert len(done) == kept >= 1
    left = sum(c.doc_stop - c.doc_start for c in plan.chunks() if c.index not in done)
    assert left < plan.n_docs
    tokenized = []
    real = preprocess_module.tokenize_document
    monkeypatch.setattr(preprocess_module, "tokenize_document", lambda text: tokenized.append(1) or real(text))
    assert main([*args, "--workers", "1"]) == 0
    assert len(tokenized) == left
    assert (out / "meta.json").is_file()


SAID = {"file": "is a file, not a folder", "folder": "is a folder, not a regular file",
        "pipe": "is a named pipe (FIFO), not a", "link": "is a symbolic link to"}


@pytest.mark.parametrize(("option", "kind"), [("--output", "file"), ("--output", "pipe"), ("--output", "link"),
                                              *((option, kind) for option in ("--codes", "--vocab")
                                                for kind in ("folder", "pipe", "link"))])
def test_a_path_of_the_wrong_kind_is_one_line(tiny_data_dir, tiny_corpus, tmp_path, capsys, option, kind):
    path = tmp_path / kind
    {"file": path.write_text, "folder": lambda _: path.mkdir(), "pipe": lambda _: os.mkfifo(path),
     "link": lambda _: path.symlink_to(tmp_path / "gone")}[kind]("x")
    out, codes = str(tmp_path / "out"), str(tiny_data_dir / "codes")
    args = {"--output": ["--output", str(path), "--bpe-codes", "50"],
            "--codes": ["--output", out, "--codes", str(path)],
            "--vocab": ["--output", out, "--codes", codes, "--vocab", str(path)]}
    assert main(["--input", str(tiny_corpus), "--valid-docs", "2", "--test-docs", "2", *args[option]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err  # and not stuck reading the pipe, which would wait for a writer
    assert err[0].startswith(f"python -m xlm_pkm.data.preprocess: error: {option}: {path} {SAID[kind]}"), err
