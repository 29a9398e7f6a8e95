"""Text <-> token ids with a run's own preprocessing: Moses tokenisation, its BPE codes and vocabulary.

    codec = TextCodec(data_dir)                       # a folder with the run's `codes` and `vocab`
    ids = codec.encode("First line.\nThe second")   # [<s>, ...first line..., </s>, ...the second...]
    text = codec.decode(ids)                         # BPE merged, Moses-detokenised lines

Encoding follows the preprocessing (xlm_pkm/data/preprocess.py): the text is one document, so it
starts with <s>; blank lines are dropped; every line ends with </s> except the last, which is left
open for the model to continue. Decoding reverses it: </s> ends a line, <s> (a new document) gives a
blank line, <pad> is dropped, "@@ " joins BPE pieces, and each line is Moses-detokenised
(sacremoses, without unescaping, as tokenisation does not escape).
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from xlm_pkm.data.dictionary import Dictionary


class TextCodec:
    def __init__(self, data_dir: str | Path, lang: str = "en"):
        self.codes, self.vocab, self.lang = Path(data_dir) / "codes", Path(data_dir) / "vocab", lang
        self.dictionary = Dictionary.load(self.vocab)

    @cached_property
    def _bpe(self):
        from xlm_pkm.data.fastbpe import bpe_applier, check_codes

        check_codes(self.codes)  # fastBPE aborts the process on a malformed file
        return bpe_applier(self.codes, self.vocab)  # BPE limited to the vocabulary, as valid/test are

    def encode(self, text: str) -> list[int]:
        from xlm_pkm.data.moses import tokenize_document

        lines = tokenize_document(text, self.lang)
        ids = [self.dictionary.bos]
        for n, line in enumerate(self._bpe.apply(lines) if lines else []):
            ids += [self.dictionary.index(w) for w in line.split(" ") if w]
            if n < len(lines) - 1:
                ids.append(self.dictionary.eos)
        return ids

    def decode(self, ids: list[int]) -> str:
        from xlm_pkm.data.moses import detokenize_pieces

        d, lines, words = self.dictionary, [], []
        for i in ids:
            if i in (d.eos, d.bos):
                if words or i == d.eos:
                    lines.append(detokenize_pieces(words, self.lang))
                if i == d.bos and lines:
                    lines.append("")  # a blank line between documents
                words = []
            elif i != d.pad:
                words.append(d[i])
        if words:
            lines.append(detokenize_pieces(words, self.lang))
        return "\n".join(lines)
