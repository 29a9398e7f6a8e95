"""The vocabulary: four special tokens, then the words of a fastBPE vocab file in file order.

    <s>=0    document separator: every document in the token stream starts with it
    </s>=1   ends every line of a document (as in XLM)
    <pad>=2
    <unk>=3  any word not in the vocab file

The one home of the special tokens (SPECIALS) and of fastBPE's continuation marker (BPE_CONTINUATION,
ending every piece that does not end its word): the rest of data/, and Engram's token compression in
model/memory/, read them here. This module imports no other of xlm_pkm's, nor torch, so that the model
may.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

SPECIALS = ("<s>", "</s>", "<pad>", "<unk>")
BPE_CONTINUATION = "@@"  # `to@@ ken`: the piece `to@@` continues into the next


class DictionaryError(ValueError):
    """The vocab file is missing or malformed."""


class Dictionary:
    def __init__(self, words: list[str]):
        self.words = list(SPECIALS) + list(words)
        self.ids = {w: i for i, w in enumerate(self.words)}
        if len(self.ids) != len(self.words):
            raise DictionaryError("duplicate word in vocabulary")
        self.bos, self.eos, self.pad, self.unk = range(len(SPECIALS))

    @classmethod
    def load(cls, path: str | Path) -> "Dictionary":
        """Read a fastBPE vocab file (`word count` lines)."""
        path = Path(path)
        if not path.is_file():
            raise DictionaryError(f"vocab file not found: {path}")
        words = []
        with open(path, encoding="utf-8", newline="\n") as f:
            for n, line in enumerate(f, 1):
                fields = line.rstrip("\n").split(" ")
                if len(fields) != 2 or not fields[0] or not fields[1].isdigit():
                    raise DictionaryError(f"malformed vocab file {path}, line {n}: {line.strip()!r}")
                if fields[0] in SPECIALS:
                    raise DictionaryError(f"vocab file {path}, line {n}: reserved word {fields[0]}")
                words.append(fields[0])
        try:
            return cls(words)
        except DictionaryError as e:
            raise DictionaryError(f"malformed vocab file {path}: {e}") from None

    def __len__(self) -> int:
        return len(self.words)

    def __getitem__(self, i: int) -> str:
        return self.words[i]

    def index(self, word: str) -> int:
        return self.ids.get(word, self.unk)

    def word_end_mask(self) -> np.ndarray:
        """True for tokens that end a word: not special, not ending in `@@` (for words/s)."""
        mask = np.array([not w.endswith(BPE_CONTINUATION) for w in self.words], dtype=bool)
        mask[: len(SPECIALS)] = False
        return mask

    def fingerprint(self) -> str:
        """Hex digest (16 chars) of the token list; shards record it to detect a vocab mismatch."""
        return hashlib.sha256("\n".join(self.words).encode()).hexdigest()[:16]
