"""The corpus a model-level speed benchmark stands for: its vocabulary size and words per token.

    corpus = corpus_stats("data/processed/sample", "test")   # None when the directory has no vocab
    words_per_s = tokens_per_s * corpus["words_per_token"]

A word is a token that ends one (not special, not ending in '@@'), counted over every token of the
split, as xlm_pkm/evaluation.py counts the words of its words/s.
"""

from __future__ import annotations

from pathlib import Path

from xlm_pkm.data.dictionary import Dictionary
from xlm_pkm.data.shard import ShardError, read_shard, shard_paths


def corpus_stats(data_dir: str | Path, split: str) -> dict | None:
    """{data, split, vocab_size, tokens, words, words_per_token} of a preprocessed split, or None
    when `data_dir` has no vocab file (not preprocessed)."""
    data_dir = Path(data_dir)
    if not (data_dir / "vocab").is_file():
        return None
    dictionary = Dictionary.load(data_dir / "vocab")
    word_end = dictionary.word_end_mask()  # (vocab,) bool
    tokens = words = 0
    for path in shard_paths(data_dir, split):
        ids = read_shard(path, dictionary.fingerprint()).tokens  # (n_tokens,) memmap
        tokens += len(ids)
        words += int(word_end[ids].sum())
    if not tokens:
        raise ShardError(f"no tokens in split {split!r} of {data_dir} (expected {data_dir}/{split}.000.bin)")
    return {"data": str(data_dir), "split": split, "vocab_size": len(dictionary), "tokens": tokens,
            "words": words, "words_per_token": words / tokens}
