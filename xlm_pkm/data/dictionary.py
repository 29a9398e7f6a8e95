"""The vocabulary: four special tokens, then the words of a fastBPE vocab file in file order.

    <s>=0    document separator: every document in the token stream starts with it
    </s>=1   ends every line of a document (as in XLM)
    <pad>=2
    <unk>=3  any word not in the vocab file

Data made with a Hugging Face tokenizer (data/tokenized.py) keeps the tokenizer's ids: its vocab file starts
with a header line naming the ids of the four roles (TOKENIZER_HEADER bos=ID eos=ID pad=ID unk=ID), then every
token in id order (escaped: tokenized.vocab_word), the special ones among them; no SPECIALS are prepended.

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
ROLES = ("bos", "eos", "pad", "unk")  # what each of SPECIALS is, in order
BPE_CONTINUATION = "@@"  # `to@@ ken`: the piece `to@@` continues into the next
TOKENIZER_HEADER = "#tokenizer"  # the first line of a tokenizer's vocab file: its specials' ids
# how a tokenizer's token starting a word begins: byte-level BPE's Ġ, SentencePiece's ▁, an escaped space
WORD_START = ("\u0120", "\u2581", "\\s")


class DictionaryError(ValueError):
    """The vocab file is missing or malformed."""


class Dictionary:
    def __init__(self, words: list[str], specials: dict[str, int] | None = None):
        """SPECIALS, then `words` (fastBPE data); with `specials` ({role: id} for each of ROLES), a tokenizer's
        tokens in id order, the special ones among them."""
        self.words = list(words) if specials else list(SPECIALS) + list(words)
        self.ids = {w: i for i, w in enumerate(self.words)}
        if len(self.ids) != len(self.words):
            raise DictionaryError("duplicate word in vocabulary")
        self.specials = specials
        if specials and (set(specials) != set(ROLES) or not all(0 <= i < len(self.words) for i in specials.values())):
            raise DictionaryError(f"special token ids {specials}: expected {', '.join(ROLES)} among the "
                                  f"{len(self.words)} tokens")
        self.bos, self.eos, self.pad, self.unk = (specials[r] for r in ROLES) if specials else range(len(SPECIALS))

    @classmethod
    def load(cls, path: str | Path) -> "Dictionary":
        """Read a fastBPE vocab file (`word count` lines)."""
        path = Path(path)
        if not path.is_file():
            raise DictionaryError(f"vocab file not found: {path}")
        words, specials = [], None
        with open(path, encoding="utf-8", newline="\n") as f:
            for n, line in enumerate(f, 1):
                fields = line.rstrip("\n").split(" ")
                if n == 1 and fields[0] == TOKENIZER_HEADER:
                    specials = _specials(fields[1:], path)
                    continue
                if len(fields) != 2 or not fields[0] or not fields[1].isdigit():
                    raise DictionaryError(f"malformed vocab file {path}, line {n}: {line.strip()!r}")
                if fields[0] in SPECIALS and specials is None:
                    raise DictionaryError(f"vocab file {path}, line {n}: reserved word {fields[0]}")
                words.append(fields[0])
        try:
            return cls(words, specials)
        except DictionaryError as e:
            raise DictionaryError(f"malformed vocab file {path}: {e}") from None

    def __len__(self) -> int:
        return len(self.words)

    def __getitem__(self, i: int) -> str:
        return self.words[i]

    def index(self, word: str) -> int:
        return self.ids.get(word, self.unk)

    def word_end_mask(self) -> np.ndarray:
        """True for tokens that end a word: not special, not ending in `@@` (for words/s). A tokenizer's: True for
        the tokens that start one (WORD_START), which there are as many of."""
        if self.specials:
            mask = np.array([w.startswith(WORD_START) for w in self.words], dtype=bool)
            mask[list(self.specials.values())] = False
            return mask
        mask = np.array([not w.endswith(BPE_CONTINUATION) for w in self.words], dtype=bool)
        mask[: len(SPECIALS)] = False
        return mask

    def header(self) -> str:
        """A tokenizer's vocab file's first line (its specials' ids); "" for fastBPE data."""
        return " ".join([TOKENIZER_HEADER, *(f"{r}={self.specials[r]}" for r in ROLES)]) if self.specials else ""

    def fingerprint(self) -> str:
        """Hex digest (16 chars) of the token list (and a tokenizer's specials); shards record it to detect a vocab
        mismatch."""
        return hashlib.sha256("\n".join([self.header(), *self.words] if self.specials else self.words)
                              .encode()).hexdigest()[:16]


def _specials(fields: list[str], path: Path) -> dict[str, int]:
    """{role: id} of a tokenizer vocab file's header fields ("bos=1" ...)."""
    pairs = [field.partition("=") for field in fields]
    if sorted(role for role, _, _ in pairs) != sorted(ROLES) or not all(i.isdigit() for _, _, i in pairs):
        raise DictionaryError(f"malformed vocab file {path}, line 1: expected {TOKENIZER_HEADER} "
                              f"{' '.join(r + '=ID' for r in ROLES)}")
    return {role: int(i) for role, _, i in pairs}
