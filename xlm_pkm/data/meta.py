"""DIR/meta.json: the record of a finished preprocessing run, and the checks made against it.

meta.json is written last, so its presence means the run finished. Besides statistics it holds

    "plan":   {"inputs": [[path, size, blake2b], ...], "options": {...}}   what was processed
    "splits": {"train": [{"file": "train.000.bin", "tokens": N, "docs": D}, ...], "valid": [...], ...}
    "files":  {"codes": {"bytes": N, "blake2b": HEX}, "vocab": {...}, "train.000.bin": {...}, ...}

`verify_outputs` (a re-run's proof that DIR is complete) re-hashes every file listed; `check_split`
(TokenStream, and the trainer before its first step) checks one split's shards against it cheaply:
listed shards present, none unlisted, token counts, vocabulary, ids within the vocabulary.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from pathlib import Path
from typing import Callable

import numpy as np

from xlm_pkm.utils.atomic import write_text

from .corpus import folder_files
from .dictionary import Dictionary
from .shard import ShardError, hash_file, read_header, shard_paths, write_shard

SPLITS = ("train", "valid", "test")


def file_digest(path: Path) -> str:
    """blake2b (16-byte digest, hex) of a file's bytes."""
    return hash_file(path, hashlib.blake2b(digest_size=16)).hexdigest()


def file_record(path: Path) -> dict:
    return {"bytes": Path(path).stat().st_size, "blake2b": file_digest(path)}


def output_record(out: Path, shards: dict[str, list[str]], other_files: list[str], fingerprint: str) -> dict:
    """meta.json's "splits" (each split's shards with their token and document counts) and "files"
    (size and hash of every output) for a preprocessed directory; the preprocessors add the rest."""
    splits = {}
    for split, names in shards.items():
        headers = [read_header(out / name, fingerprint) for name in names]
        splits[split] = [{"file": name, "tokens": h.n_tokens, "docs": h.n_docs} for name, h in zip(names, headers)]
    names = other_files + sum(shards.values(), [])
    return {"splits": splits, "files": {name: file_record(out / name) for name in names}}


def write_single_document_splits(out: Path, dictionary: Dictionary, vocab: str, meta: dict,
                                 encode: Callable[[str], tuple[np.ndarray, dict]]) -> dict:
    """The output of a preprocessor whose every split is ONE document (bytes.py, words.py): DIR/vocab
    (text `vocab`), DIR/{split}.000.bin of the ids `encode(split)` gives for each split, then DIR/meta.json:
    `meta`, "vocab_size", "fingerprint", each statistic `encode` returns as {name: {split: value}},
    "splits" and "files". Returns the meta dict."""
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "vocab", vocab)
    fingerprint = dictionary.fingerprint()
    meta = {**meta, "vocab_size": len(dictionary), "fingerprint": fingerprint}
    for split in SPLITS:
        ids, stats = encode(split)
        write_shard(out / f"{split}.000.bin", [ids], ids.dtype, fingerprint)
        for name, value in stats.items():
            meta.setdefault(name, {})[split] = value
    meta.update(output_record(out, {s: [f"{s}.000.bin"] for s in SPLITS}, ["vocab"], fingerprint))
    write_text(out / "meta.json", json.dumps(meta, indent=1) + "\n")
    return meta


def load_meta(data_dir: Path) -> dict:
    path = Path(data_dir) / "meta.json"
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ShardError(f"no {path}: not a complete preprocessed directory "
                         "(run or finish python -m xlm_pkm.data.preprocess)") from None
    except (OSError, ValueError) as e:
        raise ShardError(f"cannot read {path}: {e}") from None
    if (not isinstance(meta, dict) or not isinstance(meta.get("splits"), dict)
            or not isinstance(meta.get("files"), dict)):
        raise ShardError(f"{path} does not list the splits and files (written by an older version? "
                         "re-run python -m xlm_pkm.data.preprocess)")
    return meta


def verify_outputs(data_dir: Path, plan: dict) -> tuple[str | None, list[Path]]:
    """(None, []) when meta.json records `plan` and every file it lists is intact; else (what is not,
    the listed files that are damaged)."""
    data_dir = Path(data_dir)
    try:
        meta = load_meta(data_dir)
    except ShardError as e:
        return str(e), []
    if meta.get("plan") != plan:
        return f"{data_dir}/meta.json records other inputs or options", []
    damaged = []
    for name, record in meta["files"].items():
        path = data_dir / name
        try:
            if file_record(path) != record:
                damaged.append(path)
        except OSError:
            damaged.append(path)
    if damaged:
        return f"{damaged[0]} is missing or differs from its record in {data_dir}/meta.json", damaged
    return None, []


def not_a_data_directory(folder: Path) -> str:
    """The error for an existing folder that no preprocessing run wrote (raw text, say), with the command
    that makes a data directory of its files."""
    files, kinds = folder_files(folder)
    kinds = sorted(kinds)
    quoted = shlex.quote(str(folder))
    if not files:
        inputs = "FILE [FILE ...]"
    elif len(kinds) > 4 or "*" in kinds:
        inputs = f"{quoted}/*"
    else:
        inputs = " ".join(f"{quoted}/{k}" for k in kinds)
    named = folder if folder.name not in ("", "..") else folder.resolve()  # "." and ".." by their names
    new = shlex.quote(str(named.with_name(named.name + "-processed"))) if named.name else "NEW_DIR"
    return (f"{folder} exists but is not a preprocessed data directory (no meta.json): run python -m "
            f"xlm_pkm.data.preprocess --input {inputs} --output {new}, then use data.path={new}")


def check_data_directory(data_dir: Path) -> None:
    """ShardError when `data_dir` is missing, or is a folder that no preprocessing run wrote into."""
    if not data_dir.is_dir():
        raise ShardError(f"data directory not found: {data_dir} (run python -m xlm_pkm.data.preprocess)")
    if not any((data_dir / name).exists() for name in ("meta.json", "plan.json", "vocab")):
        raise ShardError(not_a_data_directory(data_dir))


def check_split(data_dir: str | Path, split: str) -> list[tuple[Path, int]]:
    """Check a split before reading it: [(shard path, n_tokens)] in order, or ShardError naming the fault.

    The split must be listed in meta.json, its shards present (and no unlisted one), readable, of the
    recorded token counts, built with DIR/vocab, with ids below the vocabulary size, and not empty.
    A folder that no preprocessing run wrote (raw text, say) is told what to run. Checksums are
    verified when a shard is first read (TokenStream)."""
    data_dir = Path(data_dir)
    check_data_directory(data_dir)
    meta = load_meta(data_dir)  # or an unfinished (or damaged) preprocessing run: says so
    dictionary = Dictionary.load(data_dir / "vocab")
    meta_path = data_dir / "meta.json"
    if split not in meta["splits"]:
        raise ShardError(f"no split {split!r} in {meta_path} (splits: {', '.join(meta['splits'])})")
    entries = meta["splits"][split]
    listed = [data_dir / e["file"] for e in entries]
    for path in listed:
        if not path.exists():
            raise ShardError(f"shard {path} listed in {meta_path} is missing")
    unlisted = sorted(set(shard_paths(data_dir, split)) - set(listed))
    if unlisted:
        raise ShardError(f"shard {unlisted[0]} is not listed in {meta_path} "
                         "(left by another run? delete it or re-run preprocessing)")
    shards = []
    for path, entry in zip(listed, entries):
        header = read_header(path, dictionary.fingerprint())
        if header.n_tokens != entry["tokens"]:
            raise ShardError(f"shard {path} has {header.n_tokens} tokens, {meta_path} says {entry['tokens']}")
        if header.n_tokens and header.max_id >= len(dictionary):
            raise ShardError(f"shard {path} holds token id {header.max_id}, "
                             f"beyond the {len(dictionary)} words of {data_dir / 'vocab'}")
        shards.append((path, header.n_tokens))
    if sum(n for _, n in shards) == 0:
        raise ShardError(f"split {split!r} of {data_dir} is empty (no tokens)")
    return shards
