"""Engram's tokenizer compression (DeepSeek-AI 2026, arXiv 2601.07372, §2.2 "Tokenizer Compression"): a
surjective map from the vocabulary to canonical ids, so that tokens that differ only in surface form
share their N-gram entries.

    canonical = compress_vocabulary(dictionary.words)   # [canonical id of token i], first-seen order

A token's canonical form, as the reference code's normaliser (NFKC, NFD, accents stripped, lower-case,
whitespace stripped) with one decision of ours for fastBPE: the continuation marker `@@` (a piece that
does not end its word) is dropped, so `the@@` and `the` are one canonical token. This is the role of the
reference's stripping of the word-boundary space (`Ġthe` and `the` for a byte-level BPE): both tokenizers
mark word boundaries on the token, and the paper compresses that distinction away. The special tokens
(<s>, </s>, <pad>, <unk>) keep an id each; a token whose canonical form would be empty keeps its own.
Canonical ids are numbered in the order of first appearance in the vocabulary, as the reference does.
The special tokens and the marker are the vocabulary's (data/dictionary.py: SPECIALS, BPE_CONTINUATION).
"""

from __future__ import annotations

import unicodedata

from xlm_pkm.data.dictionary import BPE_CONTINUATION, SPECIALS


def canonical_form(token: str) -> str:
    """The normalised surface form of one vocabulary token (the module docstring's rule)."""
    if token in SPECIALS:
        return token
    text = token.removesuffix(BPE_CONTINUATION)
    text = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    text = "".join(c for c in text if unicodedata.category(c) != "Mn").lower().strip()
    return text or token


def compress_vocabulary(words: list[str]) -> list[int]:
    """[canonical id of each token of `words`] (vocabulary order), ids numbered by first appearance."""
    ids: dict[str, int] = {}
    return [ids.setdefault(canonical_form(w), len(ids)) for w in words]
