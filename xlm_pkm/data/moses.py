"""Moses punctuation normalization and tokenization (sacremoses, English, no escaping), as XLM's
`tokenize.sh`: replace-unicode-punctuation | normalize-punctuation | remove-non-printing-char |
tokenizer -no-escape. One input line gives one output line of space-separated tokens."""

from __future__ import annotations

from functools import lru_cache

from sacremoses import MosesPunctNormalizer, MosesTokenizer


@lru_cache(maxsize=None)
def _moses(lang: str) -> tuple[MosesPunctNormalizer, MosesTokenizer]:
    normalizer = MosesPunctNormalizer(lang=lang, pre_replace_unicode_punct=True, post_remove_control_chars=True)
    return normalizer, MosesTokenizer(lang=lang)


def tokenize_line(line: str, lang: str = "en") -> str:
    """Normalized, tokenized line: tokens separated by single spaces ('' when nothing is left)."""
    normalizer, tokenizer = _moses(lang)
    return tokenizer.tokenize(normalizer.normalize(line), escape=False, return_str=True)
