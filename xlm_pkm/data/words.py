"""Word-level data as the all-attention authors read WikiText-103: whitespace tokens, an end-of-line
token, a vocabulary from train sorted by frequency (for the adaptive input/softmax clusters).

    python -m xlm_pkm.data.words --train FILE --valid FILE --test FILE --output DIR

As adaptive-span's data.py: every line (blank ones included) is `line.split()` then `<eos>`, which
is our `</s>`; the vocabulary is train's words sorted by decreasing count (ties as the authors'
reversed stable sort leaves them: the later first seen first). Ours starts with the 4 specials
(dictionary.py): `</s>` takes the authors' `<eos>`, and a literal `<unk>` in the text (WikiText
has them) is our `<unk>`; valid/test words absent from train become `<unk>` too (counted).
Each split is ONE document (`<s>`, then its tokens): DIR/{train,valid,test}.000.bin, DIR/vocab
(`word count`, most frequent first) and DIR/meta.json with "unit": "word". Files are written
under a temporary name and renamed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from xlm_pkm.errors import USER_ERRORS, fail
from xlm_pkm.utils.program import program_name

from .dictionary import SPECIALS, Dictionary
from .meta import SPLITS, write_single_document_splits
from .shard import token_dtype

EOS = "<eos>"


class WordDataError(ValueError):
    """An input cannot be read."""


def _lines(path: Path):
    try:
        with open(path, encoding="utf-8", newline="\n") as f:
            yield from f
    except (OSError, UnicodeDecodeError) as e:
        raise WordDataError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None


def frequency_vocabulary(train: Path) -> list[tuple[str, int]]:
    """[(word, count)] of train, most frequent first, with `<eos>` counted once per line."""
    counts: Counter[str] = Counter()
    for line in _lines(train):
        counts.update(line.split())
        counts[EOS] += 1
    return sorted(counts.items(), key=lambda kv: kv[1])[::-1]  # the authors' order, ties included


def word_ids(path: Path, dictionary: Dictionary) -> tuple[np.ndarray, int]:
    """`<s>`, then every line's word ids and `</s>`; and how many words were not in the vocabulary."""
    ids, unknown = [dictionary.bos], 0
    known = dict(dictionary.ids, **{EOS: dictionary.eos})
    for line in _lines(path):
        for w in line.split():
            i = known.get(w)
            if i is None:
                i, unknown = dictionary.unk, unknown + 1
            ids.append(i)
        ids.append(dictionary.eos)
    return np.asarray(ids, dtype=token_dtype(len(dictionary))), unknown


def preprocess_words(paths: dict[str, str | Path], output: str | Path) -> dict:
    """paths: {train, valid, test} -> DIR/vocab, the three shards and DIR/meta.json; returns the meta dict."""
    out = Path(output)
    words = [(w, c) for w, c in frequency_vocabulary(Path(paths["train"])) if w not in (EOS, *SPECIALS)]
    dictionary = Dictionary([w for w, _ in words])

    def encode(split: str) -> tuple[np.ndarray, dict]:
        ids, unknown = word_ids(Path(paths[split]), dictionary)
        return ids, {"tokens": len(ids) - 1, "unknown_tokens": unknown}

    return write_single_document_splits(out, dictionary, "".join(f"{w} {c}\n" for w, c in words),
                                        {"inputs": {s: str(paths[s]) for s in SPLITS}, "unit": "word"}, encode)


def main(argv: list[str] | None = None) -> int:
    prog = program_name("python -m xlm_pkm.data.words")
    parser = argparse.ArgumentParser(prog=prog, description=" ".join(__doc__.split("\n\n")[0].split()))
    for split in SPLITS:
        parser.add_argument(f"--{split}", required=True, help=f"the {split} text (e.g. wiki.{split}.tokens)")
    parser.add_argument("--output", required=True, help="output directory")
    args = parser.parse_args(argv)
    try:
        meta = preprocess_words({s: getattr(args, s) for s in SPLITS}, args.output)
    except USER_ERRORS as e:
        return fail(prog, e)
    print(json.dumps(meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
