"""Binary shards of token ids that keep document boundaries, e.g. `DIR/train.000.bin`.

Layout (little-endian), readable with numpy alone:

    offset  size  field
    0       8     magic b"PKMSHARD"
    8       4     version (uint32, = 1)
    12      4     bytes per token id (uint32: 2 -> uint16 ids, 4 -> uint32 ids)
    16      8     n_tokens (uint64)
    24      8     n_docs (uint64)
    32      16    vocab fingerprint: `Dictionary.fingerprint()`, 16 ASCII hex digits
    48      16    zero padding
    64            token ids: n_tokens * bytes per id, then zero padding to a multiple of 8 bytes
    ...           document start offsets: n_docs int64 (index into the token ids of each `<s>`)

    header = np.fromfile(path, np.uint64, 4, offset=8)   # version|width, n_tokens, n_docs
    tokens = np.memmap(path, np.uint16, "r", 64, (n_tokens,))

The file size is checked against the header, so a truncated shard is detected. Shards are written to
`NAME.tmp` and renamed when complete.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"PKMSHARD"
VERSION = 1
HEADER_SIZE = 64
_HEADER = struct.Struct("<8sIIQQ16s16x")


class ShardError(ValueError):
    """A shard is missing, truncated, corrupted or built with another vocabulary."""


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def _tokens_nbytes(n_tokens: int, itemsize: int) -> int:
    return (n_tokens * itemsize + 7) // 8 * 8


@dataclass
class Shard:
    path: Path
    tokens: np.ndarray  # memmap of n_tokens ids
    doc_starts: np.ndarray  # memmap of n_docs int64
    fingerprint: str

    def __len__(self) -> int:
        return len(self.tokens)


def read_header(path: Path, fingerprint: str | None = None) -> tuple[np.dtype, int, int, str]:
    """Validate a shard's header and size: (dtype, n_tokens, n_docs, fingerprint)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(HEADER_SIZE)
    except OSError as e:
        raise ShardError(f"cannot read shard {path}: {e.strerror}") from None
    if len(raw) < HEADER_SIZE or raw[:8] != MAGIC:
        raise ShardError(f"corrupt shard {path}: not a shard file (bad magic or header)")
    _, version, width, n_tokens, n_docs, fp = _HEADER.unpack(raw)
    if version != VERSION or width not in (2, 4):
        raise ShardError(f"corrupt shard {path}: unsupported version {version} / token width {width}")
    expected = HEADER_SIZE + _tokens_nbytes(n_tokens, width) + 8 * n_docs
    if size != expected:
        raise ShardError(f"corrupt or truncated shard {path}: {size} bytes, header says {expected}")
    fp = fp.decode("ascii", errors="replace")
    if fingerprint is not None and fp != fingerprint:
        raise ShardError(f"shard {path} was built with another vocabulary (fingerprint {fp}, vocab has {fingerprint})")
    return np.dtype(np.uint16 if width == 2 else np.uint32), n_tokens, n_docs, fp


def read_shard(path: Path, fingerprint: str | None = None) -> Shard:
    """Memory-map a shard after validating it (and its vocabulary fingerprint when given)."""
    dtype, n_tokens, n_docs, fp = read_header(path, fingerprint)
    tokens = np.memmap(path, dtype, "r", HEADER_SIZE, (n_tokens,)) if n_tokens else np.zeros(0, dtype)
    doc_offset = HEADER_SIZE + _tokens_nbytes(n_tokens, dtype.itemsize)
    doc_starts = np.memmap(path, np.int64, "r", doc_offset, (n_docs,)) if n_docs else np.zeros(0, np.int64)
    return Shard(Path(path), tokens, doc_starts, fp)


def is_complete(path: Path, fingerprint: str) -> bool:
    """True when `path` is a valid shard for this vocabulary (a re-run skips it)."""
    try:
        read_header(path, fingerprint)
        return True
    except ShardError:
        return False


class ShardWriter:
    """Stream documents into `path.tmp`; `close()` writes the header and renames to `path`.

        with ShardWriter(path, dtype, fingerprint) as w:
            w.add_document(ids)   # ids start with <s>
    """

    def __init__(self, path: Path, dtype: np.dtype, fingerprint: str):
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.dtype = np.dtype(dtype)
        self.fingerprint = fingerprint
        self.doc_starts: list[int] = []
        self.n_tokens = 0
        self.file = open(self.tmp, "wb")
        self.file.write(b"\0" * HEADER_SIZE)

    def add_document(self, ids) -> None:
        ids = np.asarray(ids)
        if len(ids) and int(ids.max()) > np.iinfo(self.dtype).max:
            raise ShardError(f"token id {int(ids.max())} does not fit {self.dtype} in {self.path}")
        self.doc_starts.append(self.n_tokens)
        self.file.write(ids.astype(self.dtype).tobytes())
        self.n_tokens += len(ids)

    def close(self) -> None:
        f = self.file
        f.write(b"\0" * (_tokens_nbytes(self.n_tokens, self.dtype.itemsize) - self.n_tokens * self.dtype.itemsize))
        f.write(np.asarray(self.doc_starts, dtype="<i8").tobytes())
        f.seek(0)
        fp = self.fingerprint.encode("ascii")
        f.write(_HEADER.pack(MAGIC, VERSION, self.dtype.itemsize, self.n_tokens, len(self.doc_starts), fp))
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, *_) -> None:
        self.abort() if exc_type else self.close()


def write_shard(path: Path, documents, dtype: np.dtype, fingerprint: str) -> Path:
    """Write an iterable of documents (arrays of ids, each starting with `<s>`) as one shard."""
    with ShardWriter(path, dtype, fingerprint) as writer:
        for ids in documents:
            writer.add_document(ids)
    return Path(path)


def shard_paths(data_dir: Path, split: str) -> list[Path]:
    """`DIR/{split}.NNN.bin` in shard order."""
    paths = [p for p in Path(data_dir).glob(f"{split}.*.bin") if p.name.split(".")[1].isdigit()]
    return sorted(paths, key=lambda p: int(p.name.split(".")[1]))
