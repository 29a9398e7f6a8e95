"""Text <-> token ids with a run's own preprocessing, for each kind of data a run trains on:

    codec = text_codec(data_dir, unit)               # unit: meta.json's "unit" (data_unit(data_dir))
    ids = codec.encode("First line.\nThe second")   # [<s>, ...first line..., </s>, ...the second...]
    text = codec.decode(ids)

    TextCodec   BPE data (xlm_pkm.data.preprocess; the folder's `codes` and `vocab`): Moses
                tokenisation then the run's BPE codes; decoding merges "@@ " pieces and
                Moses-detokenises each line (sacremoses, without unescaping, as tokenisation does
                not escape). Blank lines are dropped, as preprocessing drops them.
    ByteCodec   character-level data (xlm_pkm.data.bytes, unit "byte"; `vocab` only): one token per
                UTF-8 byte; decoding joins the bytes (an <unk> or a cut character becomes U+FFFD).
    WordCodec   word-level data (xlm_pkm.data.words, unit "word"; `vocab` only): whitespace tokens,
                decoded joined by spaces (WikiText text is already tokenised).
    TokenizerCodec  a Hugging Face tokenizer's data (preprocess --tokenizer: tokenized.py, unit "tokenizer"; the
                tokenizer's files saved in the folder): the tokenizer's own encode and decode.

The first three are LineCodecs, and follow the preprocessing's document layout: the text is one document, so it
starts with <s>; every line ends with </s> except the last, which is left open for the model to continue.
Decoding reverses it: </s> ends a line, <s> (a new document) gives a blank line, <pad> is dropped. A tokenizer's
text is a document as tokenized.document_ids starts one (the special tokens the tokenizer adds), left open.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from functools import cached_property
from pathlib import Path

from xlm_pkm.data.dictionary import Dictionary
from xlm_pkm.data.tokenized import UNIT as TOKENIZER_UNIT
from xlm_pkm.data.tokenized import load_tokenizer

BPE_UNIT = "token"  # meta.json without "unit": BPE data (xlm_pkm.data.preprocess)


class Codec(ABC):
    """Text <-> the token ids of one kind of data, whose vocabulary is `dictionary` (data_dir's)."""

    def __init__(self, data_dir: str | Path, vocab: str | Path | None = None):
        self.vocab = Path(vocab or Path(data_dir) / "vocab")  # a vocab file elsewhere: data not made yet
        self.dictionary = Dictionary.load(self.vocab)

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """The ids of `text` as one document, left open for the model to continue."""

    @abstractmethod
    def decode(self, ids: list[int]) -> str:
        """The text of `ids`."""


class LineCodec(Codec):
    """The document layout shared by the codecs of our own preprocessing; subclasses encode lines and join a
    line's tokens."""

    @abstractmethod
    def encode_lines(self, text: str) -> list[list[int]]:
        """The ids of each line of `text` (no <s>, no </s>)."""

    @abstractmethod
    def join_line(self, tokens: list[str]) -> str:
        """One line's text from its tokens (vocabulary strings)."""

    def encode(self, text: str) -> list[int]:
        lines = self.encode_lines(text)
        ids = [self.dictionary.bos]
        for n, line in enumerate(lines):
            ids += line
            if n < len(lines) - 1:
                ids.append(self.dictionary.eos)
        return ids

    def decode(self, ids: list[int]) -> str:
        d, lines, words = self.dictionary, [], []
        for i in ids:
            if i in (d.eos, d.bos):
                if words or i == d.eos:
                    lines.append(self.join_line(words))
                if i == d.bos and lines:
                    lines.append("")  # a blank line between documents
                words = []
            elif i != d.pad:
                words.append(d[i])
        if words:
            lines.append(self.join_line(words))
        return "\n".join(lines)


class TextCodec(LineCodec):
    def __init__(self, data_dir: str | Path, lang: str = "en", codes: str | Path | None = None,
                 vocab: str | Path | None = None):
        super().__init__(data_dir, vocab)
        self.codes, self.lang = Path(codes or Path(data_dir) / "codes"), lang

    @cached_property
    def _bpe(self):
        from xlm_pkm.data.fastbpe import bpe_applier, check_codes

        check_codes(self.codes)  # fastBPE aborts the process on a malformed file
        return bpe_applier(self.codes, self.vocab)  # BPE limited to the vocabulary, as valid/test are

    def encode_lines(self, text: str) -> list[list[int]]:
        from xlm_pkm.data.moses import tokenize_document

        lines = tokenize_document(text, self.lang)
        if not lines:
            return []
        return [[self.dictionary.index(w) for w in line.split(" ") if w] for line in self._bpe.apply(lines)]

    def join_line(self, tokens: list[str]) -> str:
        from xlm_pkm.data.moses import detokenize_pieces

        return detokenize_pieces(tokens, self.lang)


class ByteCodec(LineCodec):
    def encode_lines(self, text: str) -> list[list[int]]:
        return [[self.dictionary.index(str(b)) for b in line] for line in text.encode("utf-8").split(b"\n")]

    def join_line(self, tokens: list[str]) -> str:
        return b"".join(bytes([int(t)]) if t.isdigit() else "\ufffd".encode()
                        for t in tokens).decode("utf-8", "replace")


class WordCodec(LineCodec):
    def encode_lines(self, text: str) -> list[list[int]]:
        return [[self.dictionary.index(w) for w in line.split()] for line in text.split("\n")]

    def join_line(self, tokens: list[str]) -> str:
        return " ".join(tokens)


class TokenizerCodec(Codec):
    def __init__(self, data_dir: str | Path):
        super().__init__(data_dir)
        self.folder = Path(data_dir)

    @cached_property
    def tokenizer(self):
        return load_tokenizer(self.folder)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=True)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


CODECS = {BPE_UNIT: TextCodec, "byte": ByteCodec, "word": WordCodec, TOKENIZER_UNIT: TokenizerCodec}


def text_codec(data_dir: str | Path, unit: str = BPE_UNIT) -> Codec:
    """The codec of data of this unit (meta.json's "unit") whose vocabulary (and BPE codes) are in data_dir."""
    if unit not in CODECS:
        raise ValueError(f"{data_dir}: no text codec for data of unit {unit!r} (known: {', '.join(CODECS)})")
    return CODECS[unit](data_dir)


def data_unit(data_dir: str | Path) -> str:
    """The unit of a processed data folder: meta.json's "unit", BPE_UNIT when it has none."""
    from xlm_pkm.data.meta import load_meta

    return load_meta(Path(data_dir)).get("unit", BPE_UNIT)
