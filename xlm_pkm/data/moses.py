"""Moses punctuation normalization and tokenization (sacremoses, English, no escaping), as XLM's
`tokenize.sh`: replace-unicode-punctuation | normalize-punctuation | remove-non-printing-char |
tokenizer -no-escape. One input line gives one output line of space-separated tokens
(`tokenize_document`: a document's lines, blank ones dropped, as preprocessing and TextCodec read it).
`detokenize_pieces` goes back: BPE pieces of a line -> text."""

from __future__ import annotations

from functools import lru_cache

from sacremoses import MosesDetokenizer, MosesPunctNormalizer, MosesTokenizer

from .corpus import document_lines
from .dictionary import BPE_CONTINUATION


@lru_cache(maxsize=None)
def _moses(lang: str) -> tuple[MosesPunctNormalizer, MosesTokenizer]:
    normalizer = MosesPunctNormalizer(lang=lang, pre_replace_unicode_punct=True, post_remove_control_chars=True)
    return normalizer, MosesTokenizer(lang=lang)


def tokenize_line(line: str, lang: str = "en") -> str:
    """Normalized, tokenized line: tokens separated by single spaces ('' when nothing is left)."""
    normalizer, tokenizer = _moses(lang)
    return tokenizer.tokenize(normalizer.normalize(line), escape=False, return_str=True)


def tokenize_document(text: str, lang: str = "en") -> list[str]:
    """The document's lines (corpus.document_lines), each normalized and tokenized, the empty ones dropped."""
    return [tok for tok in (tokenize_line(line, lang) for line in document_lines(text)) if tok]


@lru_cache(maxsize=None)
def _detokenizer(lang: str) -> MosesDetokenizer:
    return MosesDetokenizer(lang=lang)


def detokenize_pieces(pieces: list[str], lang: str = "en") -> str:
    """BPE pieces of one line -> text: 'to@@ ken' -> 'token' (an unfinished last word loses its '@@'),
    then Moses detokenisation, without unescaping (tokenisation does not escape)."""
    text = " ".join(pieces).replace(BPE_CONTINUATION + " ", "").removesuffix(BPE_CONTINUATION)
    return _detokenizer(lang).detokenize(text.split(), unescape=False)
