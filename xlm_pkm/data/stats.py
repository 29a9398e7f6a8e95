"""Corpus statistics of a preprocessed directory: python -m xlm_pkm.data.stats DIR [--json]

Per split: shards, documents, lines, BPE tokens, words (Moses tokens, i.e. BPE tokens that end a
word, punctuation included), unknown-token rate;
plus vocabulary size, number of BPE codes, and what DIR/meta.json recorded (input MB, timings).
Shards are scanned in blocks, so memory stays small on a large corpus.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from xlm_pkm.errors import USER_ERRORS, fail
from xlm_pkm.utils.program import program_name

from .dictionary import Dictionary
from .meta import check_data_directory
from .shard import read_shard, shard_paths

SCAN_TOKENS = 1 << 24


def split_stats(data_dir: Path, split: str, dictionary: Dictionary) -> dict:
    counts = np.zeros(len(dictionary), dtype=np.int64)
    paths = shard_paths(data_dir, split)
    docs = 0
    for path in paths:
        shard = read_shard(path, dictionary.fingerprint())
        docs += len(shard.doc_starts)
        for i in range(0, len(shard.tokens), SCAN_TOKENS):
            counts += np.bincount(shard.tokens[i: i + SCAN_TOKENS], minlength=len(dictionary))
    tokens = int(counts.sum())
    return {"shards": len(paths), "docs": docs, "lines": int(counts[dictionary.eos]), "tokens": tokens,
            "words": int(counts[dictionary.word_end_mask()].sum()),
            "unk_rate": round(float(counts[dictionary.unk]) / max(tokens, 1), 6)}


def corpus_stats(data_dir: str | Path) -> dict:
    data_dir = Path(data_dir)
    check_data_directory(data_dir)
    dictionary = Dictionary.load(data_dir / "vocab")
    with open(data_dir / "codes", encoding="utf-8") as f:
        n_codes = sum(1 for _ in f)
    stats = {"dir": str(data_dir), "vocab_size": len(dictionary), "codes": n_codes,
             "splits": {s: split_stats(data_dir, s, dictionary) for s in ("train", "valid", "test")}}
    meta = data_dir / "meta.json"
    if meta.exists():
        stats["preprocess"] = json.loads(meta.read_text())
    return stats


def format_stats(stats: dict) -> str:
    lines = [f"{stats['dir']}: vocabulary {stats['vocab_size']} (4 specials), {stats['codes']} BPE codes"]
    meta = stats.get("preprocess")
    if meta:
        lines.append(f"input: {meta['documents']} documents, {meta['text_mb']} MB of text, "
                     f"{meta['replaced_utf8_sequences']} invalid UTF-8 sequences replaced, {meta['chunks']} chunks")
    lines.append(f"{'split':<6} {'shards':>6} {'docs':>8} {'lines':>10} {'words':>12} {'tokens':>12} "
                 f"{'tok/word':>8} {'unk %':>7}")
    for split, s in stats["splits"].items():
        ratio = s["tokens"] / max(s["words"], 1)
        lines.append(f"{split:<6} {s['shards']:>6} {s['docs']:>8} {s['lines']:>10} {s['words']:>12} {s['tokens']:>12} "
                     f"{ratio:>8.3f} {100 * s['unk_rate']:>7.3f}")
    if meta:
        lines.append("preprocessing seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in meta["seconds"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    prog = program_name("python -m xlm_pkm.data.stats")
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("data_dir", help="output directory of xlm_pkm.data.preprocess")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    try:
        stats = corpus_stats(args.data_dir)
    except USER_ERRORS as e:
        return fail(prog, e)
    print(json.dumps(stats, indent=1) if args.json else format_stats(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
