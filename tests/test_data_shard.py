"""Shard format and dictionary: numpy-only reading, integrity checks, vocab fingerprint."""

from __future__ import annotations

import numpy as np
import pytest

from xlm_pkm.data.dictionary import Dictionary, DictionaryError
from xlm_pkm.data.shard import ShardError, read_shard, token_dtype, write_shard
from xlm_pkm.data.stream import TokenStream

DOCS = [np.array([0, 5, 6, 1]), np.array([0, 7, 1, 8, 9, 1]), np.array([0, 70000, 1])]


def test_write_then_read_with_numpy_alone(tmp_path):
    path = write_shard(tmp_path / "train.000.bin", DOCS, np.uint32, "0123456789abcdef")
    assert not (tmp_path / "train.000.bin.tmp").exists()
    version_width, n_tokens, n_docs = np.fromfile(path, np.uint64, 3, offset=8)
    assert (int(version_width) >> 32, n_tokens, n_docs) == (4, 13, 3)
    tokens = np.fromfile(path, np.uint32, n_tokens, offset=64)
    starts = np.fromfile(path, np.int64, n_docs, offset=64 + (4 * 13 + 7) // 8 * 8)
    assert tokens.tolist() == np.concatenate(DOCS).tolist() and starts.tolist() == [0, 4, 10]
    shard = read_shard(path, "0123456789abcdef")
    assert shard.tokens.tolist() == tokens.tolist() and shard.doc_starts.tolist() == [0, 4, 10]


def test_dtype_follows_vocab_size(tmp_path):
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    with pytest.raises(ShardError, match="does not fit"):
        write_shard(tmp_path / "x.bin", DOCS, np.uint16, "0" * 16)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("damage", ["truncate", "magic", "extra"])
def test_damaged_shard_is_detected(tmp_path, damage):
    path = write_shard(tmp_path / "train.000.bin", DOCS[:2], np.uint16, "0" * 16)
    data = path.read_bytes()
    path.write_bytes({"truncate": data[:-3], "magic": b"X" + data[1:], "extra": data + b"\0"}[damage])
    with pytest.raises(ShardError, match=str(path)):
        read_shard(path)


def test_dictionary(tmp_path):
    (tmp_path / "vocab").write_text("the 10\nqu@@ 5\nick 4\n")
    d = Dictionary.load(tmp_path / "vocab")
    assert (len(d), d.bos, d.eos, d.pad, d.unk) == (7, 0, 1, 2, 3)
    assert (d.index("qu@@"), d.index("nope"), d[6]) == (5, 3, "ick")
    assert d.word_end_mask().tolist() == [False] * 4 + [True, False, True]
    assert d.fingerprint() == Dictionary.load(tmp_path / "vocab").fingerprint() != Dictionary(["x"]).fingerprint()
    (tmp_path / "bad").write_text("the 10\nno-count\n")
    with pytest.raises(DictionaryError, match="bad, line 2"):
        Dictionary.load(tmp_path / "bad")


def test_stream_refuses_shard_of_other_vocab(tiny_data_dir, tmp_path):
    for name in ("vocab", "valid.000.bin"):
        (tmp_path / name).write_bytes((tiny_data_dir / name).read_bytes())
    with open(tmp_path / "vocab", "a") as f:
        f.write("extra 1\n")
    with pytest.raises(ShardError, match="another vocabulary"):
        TokenStream(tmp_path, "valid", 2, 8)


def test_stream_errors_name_what_is_missing(tiny_data_dir, tmp_path):
    with pytest.raises(ShardError, match="data directory not found"):
        TokenStream(tmp_path / "none", "train", 2, 8)
    with pytest.raises(DictionaryError, match="vocab file not found"):
        TokenStream(tmp_path, "train", 2, 8)
    (tmp_path / "vocab").write_bytes((tiny_data_dir / "vocab").read_bytes())
    with pytest.raises(ShardError, match="no shards for split 'train'"):
        TokenStream(tmp_path, "train", 2, 8)
