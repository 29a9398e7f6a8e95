"""Documents -> shards with a Hugging Face tokenizer (a pretrained model's own), in place of Moses and fastBPE:
the steps of `python -m xlm_pkm.data.preprocess --tokenizer FOLDER [--gguf-file FILE]` (preprocess.py runs them
on its plan: the same scan, held-out documents and chunks).

    tokenizer = load_tokenizer("models/smollm2")       # AutoTokenizer of the folder (a fast one), local files
    dictionary = tokenizer_dictionary(tokenizer)       # the tokenizer's ids: its tokens in id order, its specials
    ids = document_ids(tokenizer, ["Some text."])      # [[...the tokenizer's ids (its BOS if it adds one), EOS]]

The ids are the tokenizer's, so that the model it belongs to reads the shards as they are. A document is what
`tokenizer(text)` gives (with the special tokens the tokenizer adds itself, such as Llama's BOS), then its EOS,
which separates it from the next one in the token stream (a document empty once stripped is dropped). The data
dir holds the tokenizer's own files (tokenizer.json, tokenizer_config.json...: what save_pretrained writes, which
text_codec.TokenizerCodec and an export read back), DIR/vocab (dictionary.py's tokenizer form: a header line of
the specials' ids, then each token in id order, escaped by vocab_word, with its count in train), and meta.json
with "unit": "tokenizer". A role the tokenizer has no token for (a BOS, a pad, an unknown token) takes its EOS's id.
"""

from __future__ import annotations

import hashlib
import struct
from functools import lru_cache
from pathlib import Path

import numpy as np

from xlm_pkm.utils.atomic import write_text
from xlm_pkm.utils.path_kind import path_problem

from .dictionary import ROLES, Dictionary
from .shard import ShardWriter, is_complete, read_shard

UNIT = "tokenizer"  # meta.json's "unit" of such data
BATCH_DOCS = 256  # documents tokenized at once


def load_tokenizer(folder: str | Path, gguf_file: str | None = None, option: str | None = None):
    """The fast (Rust) tokenizer of a Hugging Face model folder (or of its GGUF file), local files only. `option`
    names the folder in error messages (preprocess's --tokenizer; else the folder alone: a retrofit's
    model.base.path, a data dir); a folder that is missing, a file, a pipe or a broken link is named as such."""
    from transformers import AutoTokenizer

    where = f"{option} {folder}" if option else f"{folder}"
    gguf_option = ("--gguf-file" if option.startswith("--") else "model.base.gguf_file") if option else None
    problem = path_problem("folder", Path(folder))
    if problem:
        raise FileNotFoundError(f"{option + ': ' if option else ''}{problem} (a Hugging Face model's folder, with its "
                                f"tokenizer: tokenizer.json, or a GGUF file)")
    if gguf_file:
        problem = path_problem("file", Path(folder) / gguf_file)
        if problem:
            raise FileNotFoundError(f"{gguf_option + ': ' if option else ''}{problem} (a GGUF model file in {folder})")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True,
                                                  **({"gguf_file": gguf_file} if gguf_file else {}))
    except ImportError as e:
        if gguf_file and "gguf" in str(e).lower():
            raise ValueError(f"{gguf_option or gguf_file}: reading a GGUF file needs gguf: pip install "
                             f"'xlm-pkm[retrofit]'") from None
        raise
    except struct.error as e:  # transformers' GGUF reader ran out of bytes in the file's header
        if not gguf_file:
            raise
        raise ValueError(f"{Path(folder) / gguf_file} is truncated or damaged: its header ends before what it "
                         f"declares ({e}); download or copy it again") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: no Hugging Face tokenizer {'in ' + gguf_file if gguf_file else 'there'} "
                         f"({' '.join(str(e).split())[:200]})") from None
    except Exception as e:
        if type(e) is not Exception:  # the tokenizers library's own errors (a damaged tokenizer.json) are plain
            raise
        raise ValueError(f"{where}: its tokenizer cannot be read ({' '.join(str(e).split())[:200]}): is "
                         f"tokenizer.json damaged?") from e
    if not getattr(tokenizer, "is_fast", False) or tokenizer.eos_token_id is None:
        raise ValueError(f"{where}: needs a fast tokenizer (tokenizer.json) with an end-of-text token")
    return tokenizer


def vocab_word(token: str) -> str:
    """A token as DIR/vocab writes it, on one line without spaces: a backslash doubled, a space as \\s, any other
    whitespace or unprintable character as \\xHH or \\uHHHH (one to one, so the words stay distinct)."""
    out = []
    for c in token:
        if c == "\\":
            out.append("\\\\")
        elif c == " ":
            out.append("\\s")
        elif c.isspace() or not c.isprintable():
            out.append(f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}")
        else:
            out.append(c)
    return "".join(out) or "\\e"  # an empty token (never seen in practice) keeps a field


def tokenizer_dictionary(tokenizer) -> Dictionary:
    """The tokenizer's vocabulary: its tokens in id order (an id it lacks as <missing:ID>), and the ids of the
    four roles (its EOS for a role it has no token for)."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    words = [vocab_word(t) if t is not None else f"<missing:{i}>" for i, t in enumerate(tokens)]
    eos = tokenizer.eos_token_id
    ids = {"bos": tokenizer.bos_token_id, "eos": eos, "pad": tokenizer.pad_token_id, "unk": tokenizer.unk_token_id}
    return Dictionary(words, {role: eos if ids[role] is None else ids[role] for role in ROLES})


def surface_forms(tokenizer, size: int) -> list[str]:
    """The text of each of `size` ids (a model's embedding rows) for Engram's tokenizer compression
    (model/memory/token_compression.py), as the Engram reference decodes its tokens: the decoded id, or a name of
    its own (<id:N>) where that is not text (a byte-level piece of a character decodes to U+FFFD) and for an id
    past the tokenizer's (an embedding row it never gives)."""
    texts = [tokenizer.decode([i]) for i in range(min(size, len(tokenizer)))]
    return [text if "\ufffd" not in text else f"<id:{i}>" for i, text in enumerate(texts)] + \
        [f"<id:{i}>" for i in range(len(texts), size)]


def tokenizer_digest(tokenizer) -> str:
    """sha256 of the tokenizer's whole definition (tokenizer.json's content) and its specials' ids: what a re-run
    of preprocessing must find unchanged."""
    definition = tokenizer.backend_tokenizer.to_str() + tokenizer_dictionary(tokenizer).header()
    return hashlib.sha256(definition.encode()).hexdigest()


def document_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each non-empty text's ids: tokenizer(text) (with the specials it adds), then its EOS (unless it ends so)."""
    texts = [t for t in texts if t.strip()]
    eos = tokenizer.eos_token_id
    encoded = tokenizer(texts, add_special_tokens=True)["input_ids"] if texts else []
    return [ids if ids and ids[-1] == eos else [*ids, eos] for ids in encoded]


def save_tokenizer(tokenizer, work: Path) -> list[Path]:
    """The tokenizer's files (save_pretrained) in work/tokenizer/, to be copied into the data dir."""
    folder = work / "tokenizer"
    return sorted(Path(p) for p in tokenizer.save_pretrained(folder) if Path(p).is_file())


@lru_cache(maxsize=2)
def _saved_tokenizer(folder: str):
    """The tokenizer saved in a data dir, loaded once per worker process."""
    return load_tokenizer(folder)


def binarize_documents(out: Path, documents, shards: dict[str, Path], split_of, fingerprint: str,
                       dtype: np.dtype) -> None:
    """Tokenizes `documents` ((global index, text) pairs) with the tokenizer saved in `out`, each into the shard of
    its split (shards[split_of(index)]); a complete shard (a re-run) is left as it is."""
    if all(is_complete(path, fingerprint) for path in shards.values()):
        return
    tokenizer = _saved_tokenizer(str(out))
    writers = {split: ShardWriter(path, dtype, fingerprint) for split, path in shards.items()}
    try:
        batch: list[tuple[int, str]] = []
        for item in [*documents, None]:
            if item is not None:
                batch.append(item)
            if batch and (item is None or len(batch) == BATCH_DOCS):
                for split in writers:
                    texts = [text for index, text in batch if split_of(index) == split]
                    for ids in document_ids(tokenizer, texts):
                        writers[split].add_document(ids)
                batch = []
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    for writer in writers.values():
        writer.close()


def merge_shards(paths: list[Path], target: Path, fingerprint: str, dtype: np.dtype) -> None:
    """One shard of the documents of `paths`, in order (the held-out ones of every chunk)."""
    if is_complete(target, fingerprint):
        return
    with ShardWriter(target, dtype, fingerprint) as writer:
        for path in paths:
            shard = read_shard(path, fingerprint)
            ends = [*shard.doc_starts[1:].tolist(), len(shard.tokens)]
            for start, end in zip(shard.doc_starts.tolist(), ends):
                writer.add_document(np.asarray(shard.tokens[start:end]))


def write_vocab(out: Path, dictionary: Dictionary, train: list[Path]) -> None:
    """DIR/vocab: the header of the specials' ids, then each token and its count in the train shards."""
    counts = np.zeros(len(dictionary), np.int64)
    for path in train:
        tokens = read_shard(path, dictionary.fingerprint()).tokens
        counts += np.bincount(tokens, minlength=len(dictionary))[: len(dictionary)]
    lines = [dictionary.header(), *(f"{w} {c}" for w, c in zip(dictionary.words, counts.tolist()))]
    write_text(out / "vocab", "\n".join(lines) + "\n")
