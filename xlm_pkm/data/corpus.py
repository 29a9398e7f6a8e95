"""Reading raw corpora as a stream of documents.

Formats, chosen by file name (after an optional `.gz` / `.xz` / `.bz2` suffix):
  * `*.jsonl` / `*.json`: one JSON object per line, the document in its `text` field;
  * anything else: plain text, documents separated by one or more blank lines (whitespace-only
    lines count as blank).
Bytes that are not UTF-8 are replaced by U+FFFD and counted (`Reader.replaced`: invalid sequences), never fatal.
A file that is not text (a NUL byte, or over 10% of the characters of its first 64 KB replacement or
control characters: an executable, an image) is refused. A UTF-8 byte-order mark is dropped.
Documents with no non-blank text are skipped, so every document yielded has at least one line.
"""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
from pathlib import Path
from typing import Iterator

REPLACEMENT_UTF8 = "\ufffd".encode()
BOM = "\ufeff"
SNIFF_BYTES = 1 << 16
MAX_NON_TEXT = 0.1  # share of replacement / control characters above which a file is not text
TEXT_CONTROLS = set("\t\n\r\f\v")
OPENERS = {".gz": gzip.open, ".xz": lzma.open, ".bz2": bz2.open}


class CorpusError(ValueError):
    """An input file is missing, unreadable or malformed."""


def input_format(path: Path) -> str:
    """'jsonl' or 'text'."""
    suffixes = Path(path).suffixes
    if suffixes and suffixes[-1] in OPENERS:
        suffixes = suffixes[:-1]
    return "jsonl" if suffixes and suffixes[-1] in (".jsonl", ".json") else "text"


def folder_files(folder: Path) -> tuple[list[Path], list[str]]:
    """The (not hidden) files of `folder`, sorted, and one glob per kind of file name among them, in order of
    first appearance: `*.jsonl`, `*.txt.gz` (a compression suffix keeps the one before it), `*` (no suffix)."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    kinds = []
    for f in files:
        kind = "*" + "".join(f.suffixes[-2:] if f.suffix in OPENERS else f.suffixes[-1:])
        if kind not in kinds:
            kinds.append(kind)
    return files, kinds


def replace_surrogates(text: str) -> tuple[str, int]:
    """`text` with its lone surrogates (from JSON escapes) replaced so that it encodes as UTF-8, and how many."""
    try:
        text.encode("utf-8")
        return text, 0
    except UnicodeEncodeError:
        clean = text.encode("utf-8", errors="replace").decode("utf-8")
        return clean, sum(a != b for a, b in zip(text, clean))


def missing_input(path: Path) -> str:
    """Why `path`, not a regular file, cannot be an input: absent, or a pipe (read only once)."""
    if path.exists():  # a pipe: <(cat f) is /dev/fd/63, or a FIFO
        return (f"input {path} is a pipe (a process substitution such as <(cat FILE), or a FIFO), which can be read "
                f"only once; preprocessing reads each input twice (its hash, then its documents): give a file")
    return f"input file not found: {path}"


class Reader:
    """Iterate over the documents (str) of one input file, counting replaced invalid UTF-8 sequences."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.replaced = 0
        if not self.path.is_file():
            raise CorpusError(missing_input(self.path))

    def _check_text(self, head: bytes) -> None:
        """Refuse a file whose first bytes are not text."""
        text = head.decode("utf-8", errors="replace")
        bad = sum(1 for c in text if c == "\ufffd" or (c < " " and c not in TEXT_CONTROLS) or c == "\x7f")
        if b"\0" in head or bad > MAX_NON_TEXT * len(text):
            what = "NUL bytes" if b"\0" in head else f"{bad / len(text):.0%} of the characters are not text"
            raise CorpusError(f"{self.path} is not text ({what} in its first {len(head)} bytes): "
                              "expected UTF-8 text or JSONL (.gz/.xz/.bz2 allowed)")

    def _lines(self) -> Iterator[str]:
        opener = OPENERS.get(self.path.suffix, open)
        try:
            with opener(self.path, "rb") as raw:
                self._check_text(raw.read(SNIFF_BYTES))
            with opener(self.path, "rb") as raw:
                for n, line in enumerate(raw):
                    text = line.decode("utf-8", errors="replace")
                    if n == 0 and text.startswith(BOM):
                        text = text[1:]
                    if "\ufffd" in text:
                        self.replaced += text.count("\ufffd") - line.count(REPLACEMENT_UTF8)
                    yield text
        except (OSError, EOFError, lzma.LZMAError) as e:
            raise CorpusError(f"cannot read {self.path}: {e}") from None

    def _clean(self, text: str) -> str:
        text, replaced = replace_surrogates(text)
        self.replaced += replaced
        return text

    def _jsonl(self) -> Iterator[str]:
        for n, line in enumerate(self._lines(), 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (ValueError, KeyError, TypeError):
                raise CorpusError(f"malformed JSONL {self.path}, line {n}: "
                                  "expected an object with a `text` string") from None
            if not isinstance(text, str):
                raise CorpusError(f"malformed JSONL {self.path}, line {n}: `text` is not a string")
            yield self._clean(text)

    def _text(self) -> Iterator[str]:
        lines: list[str] = []
        for line in self._lines():
            if line.strip():
                lines.append(line)
            elif lines:
                yield "".join(lines)
                lines = []
        if lines:
            yield "".join(lines)

    def __iter__(self) -> Iterator[str]:
        documents = self._jsonl() if input_format(self.path) == "jsonl" else self._text()
        return (doc for doc in documents if doc.strip())


def document_lines(text: str) -> list[str]:
    """The non-blank lines of a document (blank lines inside a document are dropped)."""
    return [line for line in text.split("\n") if line.strip()]
