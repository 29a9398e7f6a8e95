"""Binary shards of token ids that keep document boundaries, e.g. `DIR/train.000.bin`.

Layout (little-endian), readable with numpy alone:

    offset  size  field
    0       8     magic b"PKMSHARD"
    8       4     version (uint32, = 2)
    12      4     bytes per token id (uint32: 2 -> uint16 ids, 4 -> uint32 ids)
    16      8     n_tokens (uint64)
    24      8     n_docs (uint64)
    32      16    vocab fingerprint: `Dictionary.fingerprint()`, 16 ASCII hex digits
    48      8     checksum: blake2b (8-byte digest) of every byte after the header
    56      4     max token id (uint32; 0 for an empty shard)
    60      4     zero padding
    64            token ids: n_tokens * bytes per id, then zero padding to a multiple of 8 bytes
    ...           document start offsets: n_docs int64 (index into the token ids of each `<s>`)

    header = np.fromfile(path, np.uint64, 4, offset=8)   # version|width, n_tokens, n_docs
    tokens = np.memmap(path, np.uint16, "r", 64, (n_tokens,))

Opening a shard checks its header and size (a truncated shard is detected) and the vocabulary
fingerprint; `verify` also recomputes the checksum (corruption inside the id range). Version-1 shards
(no checksum) are refused with a request to re-run preprocessing. Shards are written to a temporary
name (xlm_pkm/utils/atomic.py) and renamed when complete.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from xlm_pkm.utils.atomic import temporary_name, write_error

MAGIC = b"PKMSHARD"
VERSION = 2
HEADER_SIZE = 64
_HEADER = struct.Struct("<8sIIQQ16s8sI4x")
HASH_BLOCK = 1 << 24


class ShardError(ValueError):
    """A shard is missing, truncated, corrupted or built with another vocabulary."""


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def _tokens_nbytes(n_tokens: int, itemsize: int) -> int:
    return (n_tokens * itemsize + 7) // 8 * 8


def _checksum():
    return hashlib.blake2b(digest_size=8)


@dataclass
class Header:
    dtype: np.dtype
    n_tokens: int
    n_docs: int
    fingerprint: str
    checksum: bytes
    max_id: int


@dataclass
class Shard:
    path: Path
    tokens: np.ndarray  # memmap of n_tokens ids
    doc_starts: np.ndarray  # memmap of n_docs int64
    fingerprint: str

    def __len__(self) -> int:
        return len(self.tokens)


def read_header(path: Path, fingerprint: str | None = None) -> Header:
    """Validate a shard's header and size (and its vocabulary fingerprint when given)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(HEADER_SIZE)
    except OSError as e:
        raise ShardError(f"cannot read shard {path}: {e.strerror}") from None
    if len(raw) < HEADER_SIZE or raw[:8] != MAGIC:
        raise ShardError(f"corrupt shard {path}: not a shard file (bad magic or header)")
    _, version, width, n_tokens, n_docs, fp, checksum, max_id = _HEADER.unpack(raw)
    if version == 1:
        raise ShardError(f"shard {path} has format version 1: re-run python -m xlm_pkm.data.preprocess to rebuild it")
    if version != VERSION or width not in (2, 4):
        raise ShardError(f"corrupt shard {path}: unsupported version {version} / token width {width}")
    expected = HEADER_SIZE + _tokens_nbytes(n_tokens, width) + 8 * n_docs
    if size != expected:
        raise ShardError(f"corrupt or truncated shard {path}: {size} bytes, header says {expected}")
    fp = fp.decode("ascii", errors="replace")
    if fingerprint is not None and fp != fingerprint:
        raise ShardError(f"shard {path} was built with another vocabulary (fingerprint {fp}, vocab has {fingerprint})")
    return Header(np.dtype(np.uint16 if width == 2 else np.uint32), n_tokens, n_docs, fp, checksum, max_id)


def hash_file(path: Path, digest, start: int = 0):
    """Update a hashlib object with the bytes of a file from offset `start` (one sequential read)."""
    with open(path, "rb") as f:
        f.seek(start)
        while block := f.read(HASH_BLOCK):
            digest.update(block)
    return digest


def verify_checksum(path: Path, header: Header) -> None:
    """Recompute the checksum of the bytes after the header."""
    try:
        digest = hash_file(path, _checksum(), HEADER_SIZE)
    except OSError as e:
        raise ShardError(f"cannot read shard {path}: {e.strerror}") from None
    if digest.digest() != header.checksum:
        raise ShardError(f"corrupt shard {path}: checksum mismatch (the file changed after it was written); "
                         "re-run python -m xlm_pkm.data.preprocess to rebuild it")


def read_shard(path: Path, fingerprint: str | None = None, verify: bool = False) -> Shard:
    """Memory-map a shard after validating it (fingerprint when given, checksum with `verify`)."""
    header = read_header(path, fingerprint)
    if verify:
        verify_checksum(path, header)
    dtype, n_tokens, n_docs = header.dtype, header.n_tokens, header.n_docs
    tokens = np.memmap(path, dtype, "r", HEADER_SIZE, (n_tokens,)) if n_tokens else np.zeros(0, dtype)
    doc_offset = HEADER_SIZE + _tokens_nbytes(n_tokens, dtype.itemsize)
    doc_starts = np.memmap(path, np.int64, "r", doc_offset, (n_docs,)) if n_docs else np.zeros(0, np.int64)
    return Shard(Path(path), tokens, doc_starts, header.fingerprint)


def is_complete(path: Path, fingerprint: str) -> bool:
    """True when `path` is a valid shard for this vocabulary, checksum included (a re-run skips it)."""
    try:
        verify_checksum(path, read_header(path, fingerprint))
        return True
    except ShardError:
        return False


class ShardWriter:
    """Stream documents into a temporary file; `close()` writes the header and renames it to `path`.

        with ShardWriter(path, dtype, fingerprint) as w:
            w.add_document(ids)   # ids start with <s>
    """

    def __init__(self, path: Path, dtype: np.dtype, fingerprint: str):
        self.path = Path(path)
        self.tmp = temporary_name(self.path)
        self.dtype = np.dtype(dtype)
        self.fingerprint = fingerprint
        self.doc_starts: list[int] = []
        self.n_tokens = self.max_id = 0
        self.checksum = _checksum()
        try:
            self.file = open(self.tmp, "wb")
        except OSError as e:
            raise write_error(self.path, e) from None
        self._write(b"\0" * HEADER_SIZE, hashed=False)

    def _write(self, data: bytes, hashed: bool = True) -> None:
        try:
            self.file.write(data)
        except OSError as e:
            self.abort()
            raise write_error(self.path, e) from None
        if hashed:
            self.checksum.update(data)

    def add_document(self, ids) -> None:
        ids = np.asarray(ids)
        if len(ids):
            if int(ids.max()) > np.iinfo(self.dtype).max:
                raise ShardError(f"token id {int(ids.max())} does not fit {self.dtype} in {self.path}")
            self.max_id = max(self.max_id, int(ids.max()))
        self.doc_starts.append(self.n_tokens)
        self._write(ids.astype(self.dtype).tobytes())
        self.n_tokens += len(ids)

    def close(self) -> None:
        self._write(b"\0" * (_tokens_nbytes(self.n_tokens, self.dtype.itemsize) - self.n_tokens * self.dtype.itemsize))
        self._write(np.asarray(self.doc_starts, dtype="<i8").tobytes())
        header = _HEADER.pack(MAGIC, VERSION, self.dtype.itemsize, self.n_tokens, len(self.doc_starts),
                              self.fingerprint.encode("ascii"), self.checksum.digest(), self.max_id)
        try:
            self.file.seek(0)
            self.file.write(header)
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            os.replace(self.tmp, self.path)
        except OSError as e:
            self.abort()
            raise write_error(self.path, e) from None

    def abort(self) -> None:
        try:
            self.file.close()
        except OSError:  # writing its buffer failed again (disk full): lost with the temporary file anyway
            pass
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
