"""Byte-level preprocessing against the authors' pipeline emulated independently: their prep script's
space-separated text, their loader's `line.split() + ['<eos>']`, and the download scripts on a stand-in."""

import json
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest

from xlm_pkm.data.bytes import main, preprocess_bytes
from xlm_pkm.data.dictionary import Dictionary
from xlm_pkm.data.shard import read_shard
from xlm_pkm.data.stream import TokenStream

REPO = Path(__file__).resolve().parents[1]
HELD_OUT = 300


def authors_tokens(text: str) -> list[str]:
    """adaptive-span data.py: every line split on whitespace, then '<eos>'."""
    return [tok for line in text.splitlines(keepends=True) for tok in line.split() + ["<eos>"]]


def enwik8_prep(part: bytes) -> str:
    """prep_enwik8.py's text for one part: decimal bytes joined by spaces, a newline kept as a line break."""
    return " ".join(str(c) if c != 10 else "\n" for c in part)


def text8_prep(part: str) -> str:
    return " ".join("_" if c == " " else c for c in part.strip())


def ours_as_authors(out: Path, split: str) -> list[str]:
    """Our shard's tokens without the leading <s>, spelled as the authors' symbols."""
    words = Dictionary.load(out / "vocab").words
    ids = read_shard(out / f"{split}.000.bin").tokens
    assert ids[0] == 0  # <s>
    return ["<eos>" if i == 1 else words[i] for i in ids[1:]]


@pytest.fixture
def enwik8_like(tmp_path) -> Path:
    rng = np.random.default_rng(0)
    data = bytearray(rng.choice([10, 32, 60, 62, 97, 98, 99, 195, 169], size=2000).astype(np.uint8).tobytes())
    data[-150] = 7  # a byte only in test: <unk>
    path = tmp_path / "enwik8"
    path.write_bytes(bytes(data))
    return path


def test_enwik8_split_matches_the_authors_tokens(enwik8_like, tmp_path):
    out = tmp_path / "out"
    meta = preprocess_bytes(enwik8_like, out, "enwik8", held_out_bytes=HELD_OUT)
    data = enwik8_like.read_bytes()
    parts = {"train": data[: -2 * HELD_OUT], "valid": data[-2 * HELD_OUT: -HELD_OUT], "test": data[-HELD_OUT:]}
    for split, part in parts.items():
        expected = authors_tokens(enwik8_prep(part))
        if split == "test":
            expected = ["<unk>" if t == "7" else t for t in expected]
        assert ours_as_authors(out, split) == expected
    assert meta["vocab_size"] == 4 + 8  # 9 byte values in train, the newline is </s>
    assert meta["bytes"] == {"train": 1400, "valid": 300, "test": 300}
    assert meta["unknown_bytes"] == {"train": 0, "valid": 0, "test": 1} and meta["unit"] == "byte"


def test_text8_split_strips_each_part(tmp_path):
    text = " anarchism originated as a term of abuse first used against early working class radicals " * 20
    path = tmp_path / "text8"
    path.write_text(text, encoding="ascii")
    out = tmp_path / "out"
    preprocess_bytes(path, out, "text8", held_out_bytes=HELD_OUT)
    parts = {"train": text[: -2 * HELD_OUT], "valid": text[-2 * HELD_OUT: -HELD_OUT], "test": text[-HELD_OUT:]}
    for split, part in parts.items():
        expected = ["32" if t == "_" else str(ord(t)) if t != "<eos>" else t for t in authors_tokens(text8_prep(part))]
        assert ours_as_authors(out, split) == expected


def test_fractions_split_and_token_stream_reads_it(enwik8_like, tmp_path):
    out = tmp_path / "out"
    meta = preprocess_bytes(enwik8_like, out, "fractions", held_out_fraction=0.1)
    assert meta["bytes"] == {"train": 1600, "valid": 200, "test": 200}
    x, y = next(iter(TokenStream(out, "train", batch_size=2, bptt=16)))
    assert x.shape == y.shape == (2, 16)


def test_too_small_input_is_one_line_error(tmp_path, capsys):
    path = tmp_path / "tiny"
    path.write_bytes(b"abc")
    assert main(["--input", str(path), "--output", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (f"python -m xlm_pkm.data.bytes: error: {path}: 3 bytes cannot hold a train "
                                       "split and 2 x 5000000 held-out bytes\n")
    assert not (tmp_path / "out" / "vocab").exists()


@pytest.mark.parametrize("name", ["enwik8", "text8"])
def test_download_script_on_a_local_stand_in(name, enwik8_like, tmp_path):
    archive = tmp_path / f"{name}.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr(name, enwik8_like.read_bytes() if name == "enwik8" else "the quick brown fox " * 100)
    data = tmp_path / "data"
    env = {"PATH": "/usr/bin:/bin", f"{name.upper()}_URL": archive.as_uri()}
    subprocess.run([str(REPO / f"scripts/get-{name}.sh"), str(data), "--held-out-bytes", str(HELD_OUT)],
                   env=env, check=True, capture_output=True)
    meta = json.loads((data / "processed" / "meta.json").read_text())
    assert meta["split"] == name and (data / "processed" / "test.000.bin").is_file()


def test_jsonl_corpus_is_its_documents_text(tiny_corpus, tmp_path):
    from xlm_pkm.data.corpus import Reader

    out = tmp_path / "out"
    meta = preprocess_bytes(tiny_corpus, out, "fractions", held_out_fraction=0.01)
    text = "\n\n".join(Reader(tiny_corpus)).encode("utf-8")
    assert sum(meta["bytes"].values()) == len(text)
    words = Dictionary.load(out / "vocab").words
    test_ids = read_shard(out / "test.000.bin").tokens[1:]
    tail = text[-meta["bytes"]["test"]:]
    decoded = bytes(10 if i == 1 else int(words[i]) for i in test_ids[: len(tail)])
    assert decoded == tail
