"""Shard format and dictionary: numpy-only reading, integrity checks, vocab fingerprint."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

from xlm_pkm.data.dictionary import Dictionary, DictionaryError
from xlm_pkm.data.meta import check_split
from xlm_pkm.data.shard import ShardError, read_shard, token_dtype, write_shard
from xlm_pkm.data.stream import TokenStream

DOCS = [np.array([0, 5, 6, 1]), np.array([0, 7, 1, 8, 9, 1]), np.array([0, 70000, 1])]


def test_write_then_read_with_numpy_alone(tmp_path):
    path = write_shard(tmp_path / "train.000.bin", DOCS, np.uint32, "0123456789abcdef")
    assert not (tmp_path / "train.000.bin.tmp").exists()
    version_width, n_tokens, n_docs = np.fromfile(path, np.uint64, 3, offset=8)
    assert (int(version_width) & 0xFFFFFFFF, int(version_width) >> 32, n_tokens, n_docs) == (2, 4, 13, 3)
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
    for name in ("vocab", "meta.json", "valid.000.bin"):
        (tmp_path / name).write_bytes((tiny_data_dir / name).read_bytes())
    with open(tmp_path / "vocab", "a") as f:
        f.write("extra 1\n")
    with pytest.raises(ShardError, match="another vocabulary"):
        TokenStream(tmp_path, "valid", 2, 8)


def test_stream_errors_name_what_is_missing(tiny_data_dir, tmp_path):
    with pytest.raises(ShardError, match="data directory not found"):
        TokenStream(tmp_path / "none", "train", 2, 8)
    with pytest.raises(ShardError, match=re.escape(f"{tmp_path} exists but is not a preprocessed data directory "
                                                   "(no meta.json): run python -m xlm_pkm.data.preprocess "
                                                   "--input FILE")):
        TokenStream(tmp_path, "train", 2, 8)
    (tmp_path / "vocab").write_bytes((tiny_data_dir / "vocab").read_bytes())
    with pytest.raises(ShardError, match=f"no {tmp_path}/meta.json: not a complete preprocessed directory"):
        TokenStream(tmp_path, "train", 2, 8)


def copy_data(tiny_data_dir, tmp_path):
    """A copy of the shared data directory that a test may damage."""
    return shutil.copytree(tiny_data_dir, tmp_path / "data")


@pytest.mark.parametrize("damage", ["missing", "unlisted", "token_count", "unknown_split"])
def test_stream_checks_the_split_against_meta_json(tiny_data_dir, tmp_path, damage):
    data = copy_data(tiny_data_dir, tmp_path)
    meta = json.loads((data / "meta.json").read_text())
    assert [s["tokens"] for s in meta["splits"]["train"]] == [len(read_shard(data / f"train.00{i}.bin"))
                                                              for i in (0, 1)]
    split = "train"
    if damage == "missing":
        (data / "train.001.bin").unlink()
        expected = f"shard {data}/train.001.bin listed in {data}/meta.json is missing"
    elif damage == "unlisted":
        shutil.copy(data / "train.001.bin", data / "train.002.bin")
        expected = f"shard {data}/train.002.bin is not listed in {data}/meta.json"
    elif damage == "token_count":
        meta["splits"]["train"][0]["tokens"] += 1
        (data / "meta.json").write_text(json.dumps(meta))
        expected = (f"shard {data}/train.000.bin has {meta['splits']['train'][0]['tokens'] - 1} tokens, "
                    f"{data}/meta.json says")
    else:
        split, expected = "dev", f"no split 'dev' in {data}/meta.json \\(splits: train, valid, test\\)"
    with pytest.raises(ShardError, match=expected):
        TokenStream(data, split, 2, 8)
    with pytest.raises(ShardError, match=expected):
        check_split(data, split)


def test_check_split_lists_the_shards(tiny_data_dir):
    shards = check_split(tiny_data_dir, "train")
    assert [(p.name, n) for p, n in shards] == [(f"train.00{i}.bin", len(read_shard(p)))
                                                for i, (p, _) in enumerate(shards)]


def test_empty_split_is_refused(tiny_data_dir, tmp_path):
    data = copy_data(tiny_data_dir, tmp_path)
    write_shard(data / "valid.000.bin", [], np.uint16, Dictionary.load(data / "vocab").fingerprint())
    meta = json.loads((data / "meta.json").read_text())
    meta["splits"]["valid"] = [{"file": "valid.000.bin", "tokens": 0}]
    (data / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ShardError, match=f"split 'valid' of {data} is empty"):
        check_split(data, "valid")


def test_in_range_corruption_is_detected_when_the_shard_is_read(tiny_data_dir, tmp_path):
    data = copy_data(tiny_data_dir, tmp_path)
    path = data / "valid.000.bin"
    raw = bytearray(path.read_bytes())
    raw[64 + 2 * 100] ^= 1  # token 100: another id, still in the vocabulary
    path.write_bytes(bytes(raw))
    stream = TokenStream(data, "valid", 2, 8, train=False)
    with pytest.raises(ShardError, match=f"corrupt shard {path}: checksum"):
        next(iter(stream))


def test_token_ids_beyond_the_vocabulary_are_refused(tiny_data_dir, tmp_path):
    data = copy_data(tiny_data_dir, tmp_path)
    vocab = Dictionary.load(data / "vocab")
    shard = read_shard(data / "valid.000.bin")
    tokens = np.array(shard.tokens)
    tokens[5] = len(vocab)
    starts = list(shard.doc_starts) + [len(tokens)]
    write_shard(data / "valid.000.bin", [tokens[a:b] for a, b in zip(starts, starts[1:])], np.uint16,
                vocab.fingerprint())
    with pytest.raises(ShardError, match=f"shard {data}/valid.000.bin holds token id {len(vocab)}, "
                                         f"beyond the {len(vocab)} words of {data}/vocab"):
        TokenStream(data, "valid", 2, 8)


def test_version_1_shard_asks_for_a_rerun(tmp_path):
    path = write_shard(tmp_path / "train.000.bin", DOCS[:2], np.uint16, "0" * 16)
    raw = bytearray(path.read_bytes())
    raw[8:12] = (1).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(ShardError,
                       match=f"shard {path} has format version 1: re-run python -m xlm_pkm.data.preprocess"):
        read_shard(path)
