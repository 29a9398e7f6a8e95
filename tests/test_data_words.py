"""Word-level preprocessing against the authors' loader (adaptive-span data.py, sort_dict=True) emulated
independently, and the WikiText-103 download script on a stand-in archive."""

import subprocess
import zipfile
from pathlib import Path

import pytest

from xlm_pkm.data.dictionary import Dictionary
from xlm_pkm.data.shard import read_shard
from xlm_pkm.data.words import main, preprocess_words

REPO = Path(__file__).resolve().parents[1]
TRAIN = " = Valkyria = \n\n the game was the first <unk> game .\n the the game , of Valkyria .\n"
VALID = " the game of chess .\n\n"
TEST = " <unk> was first .\n"


def authors(train: str, text: str) -> tuple[list[str], list[str]]:
    """Their vocabulary (counts of train, ascending stable sort, reversed) and a split's tokens."""
    counts: dict[str, int] = {}
    for line in train.splitlines(keepends=True):
        for w in line.split() + ["<eos>"]:
            counts[w] = counts.get(w, 0) + 1
    vocab = [w for w, _ in sorted(counts.items(), key=lambda kv: kv[1])[::-1]]
    return vocab, [w for line in text.splitlines(keepends=True) for w in line.split() + ["<eos>"]]


@pytest.fixture
def splits(tmp_path) -> dict[str, Path]:
    paths = {}
    for name, text in (("train", TRAIN), ("valid", VALID), ("test", TEST)):
        paths[name] = tmp_path / f"wiki.{name}.tokens"
        paths[name].write_text(text, encoding="utf-8")
    return paths


def test_tokens_and_frequency_order_match_the_authors(splits, tmp_path):
    out = tmp_path / "out"
    meta = preprocess_words(splits, out)
    words = Dictionary.load(out / "vocab").words
    their_vocab, _ = authors(TRAIN, TRAIN)
    assert words[4:] == [w for w in their_vocab if w not in ("<eos>", "<unk>")]
    for split, text in (("train", TRAIN), ("valid", VALID), ("test", TEST)):
        ids = read_shard(out / f"{split}.000.bin").tokens
        ours = ["<eos>" if i == 1 else words[i] for i in ids[1:]]
        _, expected = authors(TRAIN, text)
        assert ours == [w if w in their_vocab else "<unk>" for w in expected]
        assert ids[0] == 0
    assert meta["unknown_tokens"] == {"train": 0, "valid": 1, "test": 0}  # "chess"; a literal <unk> is known
    assert meta["unit"] == "word" and meta["tokens"]["valid"] == 7


def test_missing_input_is_one_line_error(splits, tmp_path, capsys):
    assert main(["--train", str(tmp_path / "nope"), "--valid", str(splits["valid"]), "--test", str(splits["test"]),
                 "--output", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == \
        f"python -m xlm_pkm.data.words: error: cannot read {tmp_path}/nope: No such file or directory\n"


def test_download_script_on_a_stand_in(splits, tmp_path):
    archive = tmp_path / "wikitext-103-v1.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for name, path in splits.items():
            z.write(path, f"wikitext-103/wiki.{name}.tokens")
    data = tmp_path / "data"
    subprocess.run([str(REPO / "scripts/get-wikitext103.sh"), str(data)], check=True, capture_output=True,
                   env={"PATH": "/usr/bin:/bin", "WT103_URL": archive.as_uri()})
    assert (data / "processed" / "test.000.bin").is_file()
