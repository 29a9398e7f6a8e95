"""A Hugging Face transformers tokenizer giving the ids of a run's own preprocessing, in pure Python (no fastBPE
binding): an exported folder carries it as tokenization_xlm_pkm.py, next to its `vocab` and `codes`.

    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    tokenizer(text)["input_ids"] == TextCodec(data_dir).encode(text)
    tokenizer.decode(ids) == TextCodec(data_dir).decode(ids)

A text is one document, as TextCodec reads it: its non-blank lines, each Moses-tokenized (moses.py) and split
by the run's BPE codes limited to its vocabulary (bpe_apply.py, as valid/test data and TextCodec are; train
words lose nothing to the limit: the vocabulary holds their pieces), the lines separated by </s> and the last
one left open. `add_special_tokens` (the default) puts <s> first, as every document of the token stream starts;
a pair of texts is two documents, each after its <s>. Text is never searched for special tokens
(split_special_tokens=True): a literal "</s>" is Moses-tokenized, as preprocessing does. Decoding is
TextCodec's: </s> ends a line, <s> (a new document) leaves a blank line, <pad> is dropped; skip_special_tokens
also drops <s> and <unk>, keeping the line breaks.
"""

from __future__ import annotations

import os
import shutil

from transformers import PreTrainedTokenizer

from xlm_pkm.data.bpe_apply import BPE
from xlm_pkm.data.dictionary import SPECIALS, Dictionary
from xlm_pkm.data.moses import detokenize_pieces, tokenize_document

BOS, EOS, PAD, UNK = SPECIALS


class XlmPkmTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "vocab", "codes_file": "codes"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, codes_file: str, lang: str = "en", **kwargs):
        self.dictionary = Dictionary.load(vocab_file)
        self.bpe = BPE(codes_file, vocab_file)
        self.vocab_file, self.codes_file, self.lang = vocab_file, codes_file, lang
        for name, value in (("bos_token", BOS), ("eos_token", EOS), ("pad_token", PAD), ("unk_token", UNK),
                            ("split_special_tokens", True), ("clean_up_tokenization_spaces", False)):
            kwargs.setdefault(name, value)
        super().__init__(lang=lang, **kwargs)

    @property
    def vocab_size(self) -> int:
        return len(self.dictionary)

    def get_vocab(self) -> dict[str, int]:
        return {**self.dictionary.ids, **self.added_tokens_encoder}

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        """The document's BPE pieces, lines separated by </s> (no <s>: add_special_tokens puts it)."""
        tokens: list[str] = []
        for n, line in enumerate(self.bpe.apply(tokenize_document(text, self.lang))):
            if n:
                tokens.append(EOS)
            tokens += [piece for piece in line.split(" ") if piece]
        return tokens

    def _convert_token_to_id(self, token: str) -> int:
        return self.dictionary.index(token)

    def _convert_id_to_token(self, index: int) -> str:
        return self.dictionary[index]

    def build_inputs_with_special_tokens(self, token_ids_0: list[int],
                                         token_ids_1: list[int] | None = None) -> list[int]:
        """<s> before each document."""
        bos = [self.dictionary.bos]
        return bos + token_ids_0 + (bos + token_ids_1 if token_ids_1 is not None else [])

    def get_special_tokens_mask(self, token_ids_0: list[int], token_ids_1: list[int] | None = None,
                                already_has_special_tokens: bool = False) -> list[int]:
        if already_has_special_tokens:
            return super().get_special_tokens_mask(token_ids_0, token_ids_1, already_has_special_tokens=True)
        return [1] + [0] * len(token_ids_0) + ([1] + [0] * len(token_ids_1) if token_ids_1 is not None else [])

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        """TextCodec.decode's layout: </s> ends a line, <s> starts a document after a blank line, <pad> is dropped;
        a line's pieces are joined ("@@ ") and Moses-detokenized."""
        lines: list[str] = []
        pieces: list[str] = []
        for token in tokens:
            if token in (BOS, EOS):
                if pieces or token == EOS:
                    lines.append(detokenize_pieces(pieces, self.lang))
                if token == BOS and lines:
                    lines.append("")
                pieces = []
            elif token != PAD:
                pieces.append(token)
        if pieces:
            lines.append(detokenize_pieces(pieces, self.lang))
        return "\n".join(lines)

    def _decode(self, token_ids: int | list[int], skip_special_tokens: bool = False, **kwargs) -> str:
        """The text of the ids, never cleaned up (Moses detokenization places the spaces); skip_special_tokens
        keeps </s>: it is the line break of the text."""
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        if skip_special_tokens:
            skipped = set(self.all_special_ids) - {self.dictionary.eos}
            ids = [i for i in ids if i not in skipped]
        return self.convert_tokens_to_string(self.convert_ids_to_tokens(ids))

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str, ...]:
        """Copies of the `vocab` and `codes` files this tokenizer was made from."""
        saved = []
        for name, source in (("vocab", self.vocab_file), ("codes", self.codes_file)):
            target = os.path.join(save_directory, f"{filename_prefix}-{name}" if filename_prefix else name)
            if not (os.path.exists(target) and os.path.samefile(source, target)):
                shutil.copyfile(source, target)
            saved.append(target)
        return tuple(saved)
