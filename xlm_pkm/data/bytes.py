"""Character-level (byte) data: one token per byte, no Moses, no BPE; the enwik8 and text8 splits.

    python -m xlm_pkm.data.bytes --input FILE --output DIR [--split enwik8|text8|fractions]
        [--held-out-bytes N] [--held-out-fraction F]

FILE is read as raw bytes (enwik8 is not all valid UTF-8), except a JSONL corpus (`*.jsonl`, maybe
compressed, e.g. the bundled data/sample/python-docs.jsonl.xz): its documents' UTF-8 text, joined
by blank lines.

Splits (H = --held-out-bytes, 5,000,000 by default, as the authors' prep_enwik8.py / prep_text8.py):
  enwik8     train = bytes[:-2H], valid = bytes[-2H:-H], test = bytes[-H:]  (100M -> 90M / 5M / 5M)
  text8      the same cut, then each part stripped of leading/trailing whitespace (text8 starts
             with a space), as prep_text8.py does (text8 is ASCII: characters are bytes)
  fractions  any file: the last 2F of it held out, F each for valid and test (F = --held-out-fraction)

Tokens, as the authors' loader sees the space-separated files their scripts write:
  * each split is ONE document: `<s>`, then its bytes, a newline byte becoming `</s>` (the
    authors' `<eos>` after every line), and a final `</s>` when the split does not end in a newline;
  * DIR/vocab: the 4 specials (dictionary.py), then one token per byte value present in TRAIN
    other than the newline, in byte order, each written as its decimal value ("101 5723046", as
    prep_enwik8.py writes bytes); valid/test bytes absent from train become `<unk>` (counted).
    enwik8 holds 205 distinct byte values (newline included; a third-party count, not verified
    here). The authors' vocabulary is train's symbols + `<eos>`, and their loader fails on a valid/
    test symbol absent from train, so all 205 occur in train: theirs is 204 + `<eos>` = 205 symbols,
    ours 4 + 204 = 208 tokens.
  * DIR/{train,valid,test}.000.bin (shard.py) and DIR/meta.json with "unit": "byte", which tells
    evaluation to report bits per character: every token but the leading `<s>` is one byte.
Every file is written under a temporary name and renamed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Literal

import numpy as np

from xlm_pkm.errors import USER_ERRORS, fail
from xlm_pkm.utils.program import program_name

from .corpus import CorpusError, Reader, input_format
from .dictionary import Dictionary
from .meta import write_single_document_splits
from .shard import token_dtype

NEWLINE = 10
HELD_OUT_BYTES = 5_000_000
SplitMode = Literal["enwik8", "text8", "fractions"]


class ByteDataError(ValueError):
    """The input cannot be split or written as asked."""


def split_bytes(data: bytes, mode: SplitMode, held_out_bytes: int = HELD_OUT_BYTES,
                held_out_fraction: float = 0.05) -> dict[str, bytes]:
    """{train, valid, test} parts of `data` as the authors' scripts cut them (see the module doc)."""
    if mode == "fractions":
        if not 0 < held_out_fraction < 0.5:
            raise ByteDataError(f"--held-out-fraction must be in (0, 0.5), got {held_out_fraction}")
        held_out_bytes = int(len(data) * held_out_fraction)
    elif mode not in ("enwik8", "text8"):
        raise ByteDataError(f"unknown split {mode!r} (known: enwik8, text8, fractions)")
    if held_out_bytes < 1 or len(data) <= 2 * held_out_bytes:
        raise ByteDataError(f"{len(data)} bytes cannot hold a train split and 2 x {held_out_bytes} held-out bytes")
    parts = {"train": data[: -2 * held_out_bytes], "valid": data[-2 * held_out_bytes: -held_out_bytes],
             "test": data[-held_out_bytes:]}
    if mode == "text8":
        parts = {name: part.strip() for name, part in parts.items()}
    return parts


def byte_dictionary(counts: np.ndarray) -> Dictionary:
    """The specials, then each byte value present in train (`counts`: (256,) occurrences of each byte
    value) but the newline, as decimal strings."""
    return Dictionary([str(b) for b in np.flatnonzero(counts) if b != NEWLINE])


def byte_ids(part: bytes, dictionary: Dictionary) -> np.ndarray:
    """`<s>`, the part's ids (newline -> `</s>`, unseen bytes -> `<unk>`), a closing `</s>` if needed."""
    table = np.full(256, dictionary.unk, np.int64)
    for b in range(256):
        table[b] = dictionary.eos if b == NEWLINE else dictionary.index(str(b))
    ids = table[np.frombuffer(part, np.uint8)]
    closing = [] if part.endswith(b"\n") else [dictionary.eos]
    return np.concatenate([[dictionary.bos], ids, closing]).astype(token_dtype(len(dictionary)))


def preprocess_bytes(input_path: str | Path, output: str | Path, mode: SplitMode = "enwik8",
                     held_out_bytes: int = HELD_OUT_BYTES, held_out_fraction: float = 0.05) -> dict:
    """Split, write DIR/vocab, the three shards and DIR/meta.json; returns the meta dict."""
    input_path, out = Path(input_path), Path(output)
    try:
        if input_format(input_path) == "jsonl":
            data = "\n\n".join(Reader(input_path)).encode("utf-8")
        else:
            data = input_path.read_bytes()
        parts = split_bytes(data, mode, held_out_bytes, held_out_fraction)
    except OSError as e:
        raise ByteDataError(f"cannot read {input_path}: {e.strerror}") from None
    except CorpusError as e:  # names the file
        raise ByteDataError(str(e)) from None
    except ByteDataError as e:
        raise ByteDataError(f"{input_path}: {e}") from None
    counts = np.bincount(np.frombuffer(parts["train"], np.uint8), minlength=256)  # (256,)
    dictionary = byte_dictionary(counts)

    def encode(name: str) -> tuple[np.ndarray, dict]:
        ids = byte_ids(parts[name], dictionary)
        return ids, {"bytes": len(parts[name]), "unknown_bytes": int((ids == dictionary.unk).sum())}

    vocab = "".join(f"{w} {counts[int(w)]}\n" for w in dictionary.words[4:])
    meta = {"input": str(input_path), "unit": "byte", "split": mode}
    return write_single_document_splits(out, dictionary, vocab, meta, encode)


def main(argv: list[str] | None = None) -> int:
    prog = program_name("python -m xlm_pkm.data.bytes")
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True, help="the raw file (e.g. the unzipped enwik8 or text8)")
    parser.add_argument("--output", required=True, help="output directory")
    parser.add_argument("--split", default="enwik8", choices=["enwik8", "text8", "fractions"],
                        help="how train/valid/test are cut (default enwik8: the last 2 x 5M bytes held out)")
    parser.add_argument("--held-out-bytes", type=int, default=HELD_OUT_BYTES,
                        help=f"bytes each of valid and test (enwik8, text8; default {HELD_OUT_BYTES})")
    parser.add_argument("--held-out-fraction", type=float, default=0.05,
                        help="fraction of the file each of valid and test (fractions; default 0.05)")
    args = parser.parse_args(argv)
    try:
        meta = preprocess_bytes(args.input, args.output, args.split, args.held_out_bytes, args.held_out_fraction)
    except USER_ERRORS as e:
        return fail(prog, e)
    print(json.dumps(meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
