"""fastBPE 0.1.0's `apply` in pure Python: same output as `fastBPE.fastBPE(codes, vocab).apply(lines)`
(the binding preprocessing uses, fastbpe.py), for a tokenizer that must run without the compiled binding.

    bpe = BPE("codes", "vocab")   # vocab None: no restriction, as the binding's vocab_path ""
    bpe.apply(["a tokenized line"]) == ["a token@@ ized line"]

The algorithm of fastBPE.hpp (BPEApplyer::apply, process_bpe, limitVocab, decompose):
  * a line's words are its non-empty pieces between single spaces, joined back by single spaces;
  * a word is split into its characters (a NUL ends the split: the rest stays with the last character),
    the last one suffixed with `</w>`; while some adjacent pair is a code, every non-overlapping
    occurrence, left to right, of the pair of lowest rank (line of the codes file) is merged;
  * with a vocabulary (a non-empty vocab file), a subword is kept when the vocabulary has it as it is
    written (`piece@@`, or the last one without `</w>`), else it is split back into the pair it was
    merged from, recursively, down to characters (kept even when absent: they become <unk>);
  * subwords are written joined by `@@ `, the last one without `</w>`.
When two codes merge into the same string, the later one is the one undone, as in the binding (the
`fast` command-line tool aborts on such a codes file instead).
"""

from __future__ import annotations

from pathlib import Path

from .dictionary import BPE_CONTINUATION

END_WORD = "</w>"


class BPEApplyError(ValueError):
    """A codes or vocab file is missing or malformed."""


def _read_lines(path: str | Path, what: str) -> list[str]:
    try:
        with open(path, encoding="utf-8", newline="\n") as f:
            return f.read().split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise BPEApplyError(f"cannot read the {what} file {path}: {e}") from None


def _fields(line: str) -> list[str]:
    """fastBPE's split(line, ' '): the non-empty pieces between spaces."""
    return [field for field in line.split(" ") if field]


class BPE:
    def __init__(self, codes_path: str | Path, vocab_path: str | Path | None = None):
        self.ranks: dict[tuple[str, str], int] = {}
        self.merged_from: dict[str, tuple[str, str]] = {}
        for n, line in enumerate(_read_lines(codes_path, "codes"), 1):
            fields = _fields(line)
            if not fields:
                continue
            if len(fields) != 3:
                raise BPEApplyError(f"malformed codes file {codes_path}, line {n}: expected `left right count`")
            pair = (fields[0], fields[1])
            self.ranks[pair] = len(self.ranks)
            self.merged_from[pair[0] + pair[1]] = pair
        self.vocab: set[str] = set()
        for n, line in enumerate(_read_lines(vocab_path, "vocab") if vocab_path else [], 1):
            fields = _fields(line)
            if fields and len(fields) != 2:
                raise BPEApplyError(f"malformed vocab file {vocab_path}, line {n}: expected `word count`")
            self.vocab.update(fields[:1])
        self._cache: dict[str, str] = {}

    def apply(self, lines: list[str]) -> list[str]:
        """Each line (space-separated words) with its words split into BPE subwords."""
        return [" ".join(self.word(w) for w in _fields(line)) for line in lines]

    def word(self, word: str) -> str:
        """One word's subwords, joined by `@@ ` (cached)."""
        if word not in self._cache:
            subwords = self._limit_vocab(self._merge(self._characters(word)))
            self._cache[word] = (BPE_CONTINUATION + " ").join(subwords)[: -len(END_WORD)]
        return self._cache[word]

    @staticmethod
    def _characters(word: str) -> list[str]:
        last = max(len(word.split("\0", 1)[0]) - 1, 0)
        return list(word[:last]) + [word[last:] + END_WORD]

    def _merge(self, subwords: list[str]) -> list[str]:
        while len(subwords) > 1:
            ranked = [(self.ranks[p], i) for i, p in enumerate(zip(subwords, subwords[1:])) if p in self.ranks]
            if not ranked:
                break
            best = min(ranked)[1]
            left, right = subwords[best], subwords[best + 1]
            merged, i = [], 0
            while i < len(subwords):
                if i + 1 < len(subwords) and subwords[i] == left and subwords[i + 1] == right:
                    merged.append(left + right)
                    i += 2
                else:
                    merged.append(subwords[i])
                    i += 1
            subwords = merged
        return subwords

    def _known(self, subword: str, final: bool) -> bool:
        """The vocabulary has the subword as it is written: the last one without `</w>`, the others with `@@`."""
        return (subword.removesuffix(END_WORD) if final else subword + BPE_CONTINUATION) in self.vocab

    def _limit_vocab(self, subwords: list[str]) -> list[str]:
        if not self.vocab:
            return subwords
        limited: list[str] = []
        for i, subword in enumerate(subwords):
            final = i == len(subwords) - 1
            if self._known(subword, final):
                limited.append(subword)
            else:
                self._decompose(subword, final, limited)
        return limited

    def _decompose(self, subword: str, final: bool, out: list[str]) -> None:
        """Undo the merge that made `subword` (a character is kept), keeping each half the vocabulary has."""
        if subword not in self.merged_from:
            out.append(subword)
            return
        left, right = self.merged_from[subword]
        for piece, piece_final in ((left, False), (right, final)):
            if self._known(piece, piece_final):
                out.append(piece)
            else:
                self._decompose(piece, piece_final, out)
