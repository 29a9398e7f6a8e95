"""Preprocessing: fastBPE equality, round trip, held-out split, determinism, resume, bad input."""

from __future__ import annotations

import gzip
import json
import lzma
import os
import subprocess
import sys
from itertools import islice

import numpy as np
import pytest

from xlm_pkm.data.corpus import Reader
from xlm_pkm.data.dictionary import Dictionary
from xlm_pkm.data.executor import Executor
from xlm_pkm.data.fastbpe import FastBPEError
from xlm_pkm.data.plan import PlanError, default_held_out
from xlm_pkm.data.preprocess import main, preprocess
from xlm_pkm.data.shard import read_shard, shard_paths
from xlm_pkm.data.stats import corpus_stats

SPLITS = ("train", "valid", "test")


def write_jsonl(path, n_docs, lines_per_doc=3):
    """Documents whose words name their document: 'docN' appears in every line of document N."""
    with open(path, "w", encoding="utf-8") as f:
        for d in range(n_docs):
            text = "\n".join(f"doc{d} line {i}, the quick brown fox jumps over the lazy dog."
                             for i in range(lines_per_doc))
            f.write(json.dumps({"id": d, "text": text}) + "\n")
    return path


def docs_of(data_dir, split):
    """Document ids of a split, in order, from its tokenized text (kept with keep_intermediate)."""
    docs = (data_dir / f"{split}.tok").read_text(encoding="utf-8").split("\n\n")[:-1]
    return [int(doc.split()[0][3:]) for doc in docs]


def test_bpe_equals_fastbpe_cli(tiny_data_dir, fastbpe_bin, tmp_path):
    for split, vocab in (("train", []), ("valid", ["vocab"]), ("test", ["vocab"])):
        out = tmp_path / f"{split}.bpe"
        subprocess.run([fastbpe_bin, "applybpe", str(out), str(tiny_data_dir / f"{split}.tok"),
                        str(tiny_data_dir / "codes"), *[str(tiny_data_dir / v) for v in vocab]],
                       check=True, capture_output=True)
        assert out.read_bytes() == (tiny_data_dir / f"{split}.bpe").read_bytes()
    vocab = subprocess.run([fastbpe_bin, "getvocab", str(tiny_data_dir / "train.bpe")], check=True, capture_output=True)
    assert vocab.stdout == (tiny_data_dir / "vocab").read_bytes()
    assert len((tiny_data_dir / "codes").read_text().splitlines()) == 500


def test_shards_round_trip_to_bpe_text(tiny_data_dir):
    d = Dictionary.load(tiny_data_dir / "vocab")
    assert len(shard_paths(tiny_data_dir, "train")) == 2
    for split in SPLITS:
        lines, docs = [], 0
        for path in shard_paths(tiny_data_dir, split):
            shard = read_shard(path, d.fingerprint())
            assert shard.tokens.dtype == np.uint16
            tokens = shard.tokens.tolist()
            assert all(tokens[i] == d.bos for i in shard.doc_starts)
            docs += len(shard.doc_starts)
            words = []
            for t in tokens:
                if t == d.bos:
                    if lines:
                        lines.append("")
                elif t == d.eos:
                    lines.append(" ".join(words))
                    words = []
                else:
                    words.append(d[t])
        text = (tiny_data_dir / f"{split}.bpe").read_text(encoding="utf-8")
        assert docs == text.count("\n\n")
        if split != "train":  # held-out text may hold characters never seen in train
            text = "\n".join(" ".join(w if w in d.ids else "<unk>" for w in line.split(" ") if w)
                             for line in text.split("\n"))
        assert "\n".join(lines) + "\n\n" == text


def test_tokenization_is_moses(tiny_data_dir):
    first = (tiny_data_dir / "train.tok").read_text(encoding="utf-8").split("\n")[:50]
    assert all("  " not in line and line == line.strip() for line in first)
    assert any(" ," in line or " ." in line for line in first)


def test_held_out_split_is_disjoint_seeded_and_worker_independent(tmp_path):
    corpus = write_jsonl(tmp_path / "tiny.jsonl", 30)
    a = tmp_path / "a"
    preprocess([str(corpus)], a, n_codes=40, valid_docs=5, test_docs=4, seed=3, keep_intermediate=True)
    train, valid, test = (docs_of(a, s) for s in SPLITS)
    assert (len(valid), len(test)) == (5, 4)
    assert sorted(train + valid + test) == list(range(30))
    assert train == sorted(train) and valid == sorted(valid)  # documents stay in input order
    b = tmp_path / "b"
    preprocess([str(corpus)], b, n_codes=40, valid_docs=5, test_docs=4, seed=3, chunk_mb=0.25, keep_intermediate=True,
               executor=Executor(workers=2))
    assert [docs_of(b, s) for s in SPLITS] == [train, valid, test]
    c = tmp_path / "c"
    preprocess([str(corpus)], c, n_codes=40, valid_docs=5, test_docs=4, seed=4, keep_intermediate=True)
    assert docs_of(c, "valid") != valid


@pytest.mark.slow
def test_multiple_inputs_text_gz_and_more_workers_than_files(tmp_path):
    jsonl = write_jsonl(tmp_path / "a.jsonl", 10)
    text = tmp_path / "b.txt.gz"
    with gzip.open(text, "wt", encoding="utf-8") as f:
        f.write("".join(f"doc{d} first line .\n  doc{d} second line .\n\n \n" for d in range(10, 20)))
    out1, out4 = tmp_path / "w1", tmp_path / "w4"
    preprocess([str(jsonl), str(text)], out1, n_codes=30, valid_docs=2, test_docs=2, chunk_mb=0.25,
               keep_intermediate=True)
    preprocess([str(jsonl), str(text)], out4, n_codes=30, valid_docs=2, test_docs=2, chunk_mb=0.25,
               executor=Executor(workers=4))
    assert sorted(sum((docs_of(out1, s) for s in SPLITS), [])) == list(range(20))
    for name in ("codes", "vocab", "train.000.bin", "train.001.bin", "valid.000.bin", "test.000.bin"):
        assert (out1 / name).read_bytes() == (out4 / name).read_bytes()
    assert corpus_stats(out1)["splits"]["train"]["docs"] == 16


def test_rerun_skips_complete_work_and_refuses_other_options(tmp_path):
    corpus = write_jsonl(tmp_path / "tiny.jsonl", 12)
    out = tmp_path / "out"
    preprocess([str(corpus)], out, n_codes=30, valid_docs=2, test_docs=2)
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert "preprocess.lock" not in mtimes  # removed by its holder when done
    times = preprocess([str(corpus)], out, n_codes=30, valid_docs=2, test_docs=2)
    assert set(times) == {"scan"}
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == mtimes
    (out / "train.000.bin").unlink()
    preprocess([str(corpus)], out, n_codes=30, valid_docs=2, test_docs=2)
    assert read_shard(out / "train.000.bin").tokens.size > 0
    with pytest.raises(PlanError, match="other inputs or options"):
        preprocess([str(corpus)], out, n_codes=31, valid_docs=2, test_docs=2)
    assert not (out / "preprocess.lock").exists()  # also after a failure


def test_a_removed_lock_file_is_not_held_by_whoever_locked_it_as_it_went(tmp_path):
    from xlm_pkm.utils.lock import DirectoryBusy, DirectoryLock

    first = DirectoryLock(tmp_path, "x.lock", "wait", remove=True)
    with pytest.raises(DirectoryBusy):
        DirectoryLock(tmp_path, "x.lock", "wait", remove=True)
    stale = os.open(tmp_path / "x.lock", os.O_RDWR)  # opened just before its holder removes it
    first.release()
    assert not (tmp_path / "x.lock").exists()
    second = DirectoryLock(tmp_path, "x.lock", "wait", remove=True)
    assert not second._still_there(stale)  # what a process that locked `stale` checks, and then opens again
    os.close(stale)
    second.release()


def test_given_codes_are_used(tiny_data_dir, tmp_path):
    corpus = write_jsonl(tmp_path / "tiny.jsonl", 8)
    out = tmp_path / "out"
    preprocess([str(corpus)], out, codes=str(tiny_data_dir / "codes"), valid_docs=1, test_docs=1)
    assert (out / "codes").read_bytes() == (tiny_data_dir / "codes").read_bytes()


def test_given_vocab_is_reused_and_unknown_words_become_unk(tiny_data_dir, tmp_path):
    """--vocab: another corpus binarized with the pretraining vocabulary (a model trained on one reads the
    other); train BPE is limited to it, so only characters it lacks become <unk>."""
    corpus = tmp_path / "new.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"the fox {i} saw Ωmega."}) for i in range(6)) + "\n")
    out = tmp_path / "out"
    preprocess([str(corpus)], out, codes=str(tiny_data_dir / "codes"), valid_docs=1, test_docs=1,
               keep_intermediate=True, vocab=str(tiny_data_dir / "vocab"))
    assert (out / "vocab").read_bytes() == (tiny_data_dir / "vocab").read_bytes()
    d = Dictionary.load(tiny_data_dir / "vocab")
    assert json.loads((out / "meta.json").read_text())["fingerprint"] == d.fingerprint()
    tokens = np.concatenate([read_shard(p, d.fingerprint()).tokens for p in shard_paths(out, "train")])
    decoded = " ".join(d[t] for t in tokens if t not in (d.bos, d.eos)).replace("@@ ", "").split()
    tokenized = (out / "train.tok").read_text(encoding="utf-8").split()
    assert "Ωmega" in tokenized  # every word as it was, but Ω (a character the vocab lacks): <unk>
    assert decoded == " ".join(tokenized).replace("Ω", "<unk> ").split()


def test_vocab_without_codes_is_refused(tiny_data_dir, tmp_path):
    corpus = write_jsonl(tmp_path / "tiny.jsonl", 4)
    with pytest.raises(PlanError, match="--vocab needs --codes"):
        preprocess([str(corpus)], tmp_path / "out", valid_docs=1, test_docs=1, vocab=str(tiny_data_dir / "vocab"))


def test_non_utf8_bytes_are_replaced_and_counted(tmp_path, caplog):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"caf\xe9 au lait .\nsecond line\n\nok doc\n\n\xff\xfe third doc\n\nfourth\n\nfifth\n")
    assert [d.split()[0] for d in Reader(path)] == ["caf\ufffd", "ok", "\ufffd\ufffd", "fourth", "fifth"]
    out = tmp_path / "out"
    with caplog.at_level("WARNING"):
        preprocess([str(path)], out, n_codes=10, valid_docs=1, test_docs=1)
    assert f"{path}: replaced 3 invalid UTF-8 sequences" in caplog.text
    assert json.loads((out / "meta.json").read_text())["replaced_utf8_sequences"] == 3


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "xlm_pkm.data.preprocess", *map(str, args)], capture_output=True,
                          text=True)


@pytest.mark.parametrize("case", ["missing", "empty", "malformed_json", "too_many_held_out"])
def test_bad_input_gives_one_line_error(tmp_path, case):
    path = tmp_path / "in.jsonl"
    content = {"missing": None, "empty": "\n\n", "malformed_json": '{"text": "a"}\n{"txt": 1}\n',
               "too_many_held_out": '{"text": "a"}\n{"text": "b"}\n'}[case]
    if content is not None:
        path.write_text(content)
    expected = {"missing": "input file not found", "empty": "no documents", "malformed_json": "line 2",
                "too_many_held_out": "--valid-docs 1 + --test-docs 1"}[case]
    result = run_cli("--input", path, "--output", tmp_path / "out", "--bpe-codes", 10, "--valid-docs", 1,
                     "--test-docs", 1)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("python -m xlm_pkm.data.preprocess: error: ") and expected in last
    assert case == "too_many_held_out" or str(path) in last


@pytest.mark.parametrize("codes", ["a b\n", "a b 3\na b 4\n", "", None])
def test_bad_codes_file_is_refused(tmp_path, codes):
    corpus = write_jsonl(tmp_path / "tiny.jsonl", 5)
    path = tmp_path / "codes"
    if codes is not None:
        path.write_text(codes)
    with pytest.raises(FastBPEError, match=str(path)):
        preprocess([str(corpus)], tmp_path / "out", codes=str(path), valid_docs=1, test_docs=1)


def test_missing_fastbpe_is_explained(tmp_path, monkeypatch):
    import xlm_pkm.data.fastbpe as fastbpe

    monkeypatch.setenv("FASTBPE", str(tmp_path / "nowhere"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(fastbpe, "REPO_ROOT", tmp_path)
    with pytest.raises(FastBPEError, match="make install"):
        fastbpe.find_fastbpe()


@pytest.mark.slow
def test_slurm_path_through_submitit(tmp_path):
    """submitit's local executor runs the array jobs as local processes, whether SLURM is installed or not
    (tests/cluster/ runs them on a real SLURM)."""
    corpus = write_jsonl(tmp_path / "tiny.jsonl", 6)
    out = tmp_path / "out"
    preprocess([str(corpus)], out, n_codes=20, valid_docs=1, test_docs=1, keep_intermediate=True,
               executor=Executor(slurm_partition="any", slurm_cluster="local"))
    assert sorted(sum((docs_of(out, s) for s in SPLITS), [])) == list(range(6))


# ---- a newcomer's own corpus -----------------------------------------------------------------------
PROG = "python -m xlm_pkm.data.preprocess"


@pytest.fixture(scope="module")
def corpus_300(tmp_path_factory):
    """300 short documents (two lines each) from the first documents of the bundled corpus, as JSONL."""
    from conftest import SAMPLE

    with lzma.open(SAMPLE, "rt", encoding="utf-8") as f:
        lines = [line for doc in islice(f, 8) for line in json.loads(doc)["text"].splitlines() if line.strip()]
    assert len(lines) >= 600
    path = tmp_path_factory.mktemp("corpus_300") / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": "\n".join(lines[2 * d: 2 * d + 2])}) + "\n" for d in range(300)))
    return path


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ": error: " in line]


@pytest.mark.parametrize("n_docs, held_out", [(3, 1), (39, 1), (40, 2), (300, 15), (99_999, 4999), (100_000, 5000),
                                              (40_000_000, 5000)])
def test_default_held_out_is_the_papers_at_scale_else_5_percent(n_docs, held_out):
    assert default_held_out(n_docs) == held_out


def test_small_corpus_with_default_held_out_sizes(corpus_300, tmp_path, capsys):
    """No --valid-docs/--test-docs on 300 documents: 15 + 15 held out (5% each), said once on stderr and
    recorded, so that the same command (or one naming 15 + 15) finds the directory complete."""
    out = tmp_path / "out"
    command = ["--input", str(corpus_300), "--output", str(out), "--bpe-codes", "50", "--workers", "1"]
    assert main(command) == 0
    notice = (f"{PROG}: 300 documents: holding out 15 valid + 15 test (5% each; the paper's 5,000 need 100,000 "
              "documents or more; set --valid-docs/--test-docs to choose)")
    assert [line for line in capsys.readouterr().err.splitlines() if "holding out" in line] == [notice]
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["options"]["valid_docs"], meta["options"]["test_docs"]) == (15, 15) == \
        (meta["splits"]["valid"][0]["docs"], meta["splits"]["test"][0]["docs"])
    assert sum(s["docs"] for s in meta["splits"]["train"]) == 270
    mtime = (out / "meta.json").stat().st_mtime_ns
    assert main(command) == 0 and main(command + ["--valid-docs", "15", "--test-docs", "15"]) == 0
    assert (out / "meta.json").stat().st_mtime_ns == mtime  # complete: nothing redone
    assert not error_lines(capsys.readouterr().err)
    assert main(command + ["--valid-docs", "20"]) == 2  # other sizes than those recorded: refused
    assert error_lines(capsys.readouterr().err) == [
        f"{PROG}: error: {out} holds the output of other inputs or options (see {out}/plan.json): "
        "use another --output or delete it"]


def test_held_out_sizes_that_do_not_fit_name_sizes_that_do(corpus_300, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["--input", str(corpus_300), "--output", str(out), "--bpe-codes", "50", "--workers", "1",
                 "--valid-docs", "5000", "--test-docs", "5000"]) == 2
    assert error_lines(capsys.readouterr().err) == [
        f"{PROG}: error: --valid-docs 5000 + --test-docs 5000 must leave training documents: the input has 300 "
        "documents; --valid-docs 15 --test-docs 15 fit (5% each, as when both are left out)"]
    assert not (out / "meta.json").exists()


def test_raw_text_folder_as_data_path_says_what_to_run(tiny_overrides, corpus_300, tmp_path, capsys):
    """data.path naming a folder of raw text (no meta.json): one line saying so, and the command to run."""
    from xlm_pkm.launch.cli import train_main

    raw = tmp_path / "my_corpus"
    raw.mkdir()
    (raw / "part1.jsonl").write_bytes(corpus_300.read_bytes())
    (raw / "part2.jsonl").write_bytes(corpus_300.read_bytes())
    assert train_main(tiny_overrides(tmp_path / "dump", f"data.path={raw}")) == 2
    assert capsys.readouterr().err == (
        f"train.py: error: {raw} exists but is not a preprocessed data directory (no meta.json): run python -m "
        f"xlm_pkm.data.preprocess --input {raw}/*.jsonl --output {raw}-processed, then use data.path={raw}-processed\n")
    assert not (tmp_path / "dump").exists()
