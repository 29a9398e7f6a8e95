"""The preprocessing plan: which documents form which chunk, and which are held out.

A scan reads every input once (in parallel over files) and records, per file, its number of documents
and the document index at which each 256 KB block of text starts. From these:

* **Held-out split**: documents are numbered globally in input order (files in the order given);
  `numpy.random.default_rng(seed).choice(n_docs, valid + test, replace=False)` picks the held-out
  documents, the first `valid` of them for valid and the rest for test. Valid and test are thus
  disjoint from train, chosen per document, reproducible for a seed, and independent of `--workers`.
  A size not given (None) is `default_held_out(n_docs)`: the paper's 5,000 from 100,000 documents on,
  else 5% (at least 1); the plan records the sizes used, so a re-run of the same command matches.
* **Chunks**: consecutive documents of one file, about `chunk_mb` of text each (by default
  total / 64, clamped to [1, 64] MB, so a small corpus still keeps several workers busy and a large
  one makes shards of ~64 MB of text). A chunk is the unit of work and gives one train shard.

The plan is saved as `DIR/plan.json`; a re-run with other inputs or options into the same DIR is refused.
Inputs are identified by content: (path, size, blake2b of the bytes), so a file whose modification
time changed but whose bytes did not (a git checkout, a copy) is the same input. An input is a text or
JSONL file, or one file or shard of a Hugging Face dataset (hf_source.DatasetInput: a hub dataset's shard
is identified by the dataset's revision).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from xlm_pkm.utils.atomic import write_text

from .corpus import CorpusError, Reader
from .hf_source import DatasetInput, DatasetReader
from .meta import file_digest

BLOCK_BYTES = 1 << 18  # chunks are made of 256 KB blocks
MB = 1 << 20
PAPER_HELD_OUT = 5000  # documents in each of valid and test (the paper's, on CC-News)
HELD_OUT_SHARE = 20  # by default each held-out split is 1/20 (5%) of the documents, at most PAPER_HELD_OUT
log = logging.getLogger(__name__)


class PlanError(ValueError):
    """The requested split or output directory does not fit the inputs."""


@dataclass
class FileScan:
    path: str
    n_docs: int
    n_bytes: int  # UTF-8 bytes of document text
    block_starts: list[int]  # document index where each BLOCK_BYTES block of text starts
    replaced: int  # invalid UTF-8 sequences replaced by U+FFFD


@dataclass
class Chunk:
    index: int
    path: str
    doc_start: int  # first document (index within the file)
    doc_stop: int
    global_start: int  # global index of doc_start
    n_bytes: int


def open_input(source: str | DatasetInput) -> Reader | DatasetReader:
    """A reader of the documents of an input: a text or JSONL file, or a dataset's file or shard (hf_source.py)."""
    return DatasetReader(source) if isinstance(source, DatasetInput) else Reader(source)


def input_mb(source: str | DatasetInput) -> float:
    """The size of an input in MB (0 for a hub dataset's shard: unknown before it is read)."""
    path = source.file if isinstance(source, DatasetInput) else source
    return os.path.getsize(path) / MB if path else 0.0


def scan_file(source: str | DatasetInput) -> FileScan:
    """Count the documents of one input and where its blocks start."""
    reader = open_input(source)
    n_docs = n_bytes = 0
    block_starts = []
    for text in reader:
        while n_bytes >= len(block_starts) * BLOCK_BYTES:
            block_starts.append(n_docs)
        n_bytes += len(text.encode("utf-8"))
        n_docs += 1
    if n_docs == 0:
        raise CorpusError(f"empty input: no documents in {source}")
    return FileScan(str(source), n_docs, n_bytes, block_starts, reader.replaced)


def input_identity(source: str | DatasetInput) -> list:
    """[absolute path, size, blake2b hex] of an input file (a dataset's local file too), to recognise the same
    corpus on a re-run; for a hub dataset's shard, [its name, None, the dataset's revision]."""
    if isinstance(source, DatasetInput) and not source.file:
        return [str(source), None, source.revision]
    path = source.file if isinstance(source, DatasetInput) else source
    try:
        return [str(Path(path).resolve()), os.stat(path).st_size, file_digest(Path(path))]
    except OSError as e:
        raise CorpusError(f"cannot read {path}: {e.strerror}") from None


def default_chunk_mb(total_bytes: int) -> float:
    return round(min(64.0, max(1.0, total_bytes / MB / 64)), 2)


def default_held_out(n_docs: int) -> int:
    """Documents held out for valid, and as many for test, when not given: the paper's 5,000 from
    100,000 documents on, else 5% (at least 1), so that 90% stays for training."""
    return min(PAPER_HELD_OUT, max(1, n_docs // HELD_OUT_SHARE))


def _default_rule(n_docs: int) -> str:
    if n_docs >= PAPER_HELD_OUT * HELD_OUT_SHARE:
        return "the paper's"
    return "5% each" if n_docs >= HELD_OUT_SHARE else "1 each, the fewest"


def resolve_held_out(options: dict, n_docs: int) -> dict:
    """`options` with valid_docs / test_docs that are None (not given) set to `default_held_out(n_docs)`;
    PlanError when the sizes do not leave a training document, naming sizes that do."""
    default = default_held_out(n_docs)
    valid, test = (default if options[k] is None else options[k] for k in ("valid_docs", "test_docs"))
    if valid + test >= n_docs:  # negative sizes are refused before the scan (preprocess)
        if 2 * default < n_docs:
            fit = (f"--valid-docs {default} --test-docs {default} fit ({_default_rule(n_docs)}, "
                   "as when both are left out)")
        else:
            fit = "at least 3 are needed (a valid, a test and a training document)"
        if options["valid_docs"] is None and options["test_docs"] is None:
            raise PlanError(f"the input has {n_docs} document{'s' * (n_docs != 1)}: {fit}")
        raise PlanError(f"--valid-docs {valid} + --test-docs {test} must leave training documents: the input has "
                        f"{n_docs} documents; {fit}")
    return {**options, "valid_docs": valid, "test_docs": test}


def held_out_notice(requested: dict, options: dict, n_docs: int) -> str | None:
    """The line telling the user the held-out sizes chosen for them (`requested` None, resolved in
    `options`) when they are not the paper's 5,000; None when there is nothing to tell."""
    chosen = [s for s in ("valid", "test") if requested[f"{s}_docs"] is None]
    if all(options[f"{s}_docs"] == PAPER_HELD_OUT for s in chosen):
        return None
    rule = _default_rule(n_docs)
    if len(chosen) == 1:
        rule = f"{chosen[0]}: {rule.replace(' each', '')}"
    flags = "/".join(f"--{s}-docs" for s in chosen)
    return (f"{n_docs} documents: holding out {options['valid_docs']} valid + {options['test_docs']} test "
            f"({rule}; the paper's {PAPER_HELD_OUT:,} need {PAPER_HELD_OUT * HELD_OUT_SHARE:,} documents or more; "
            f"set {flags} to choose)")


def make_chunks(scans: list[FileScan], chunk_mb: float) -> list[Chunk]:
    blocks = max(1, round(chunk_mb * MB / BLOCK_BYTES))
    chunks: list[Chunk] = []
    global_start = 0
    for scan in scans:
        for block in range(0, len(scan.block_starts), blocks):
            stop_block = block + blocks
            start = scan.block_starts[block]
            stop = scan.block_starts[stop_block] if stop_block < len(scan.block_starts) else scan.n_docs
            n_bytes = min(stop_block * BLOCK_BYTES, scan.n_bytes) - block * BLOCK_BYTES
            if stop > start:
                chunks.append(Chunk(len(chunks), scan.path, start, stop, global_start + start, n_bytes))
        global_start += scan.n_docs
    return chunks


@dataclass
class Plan:
    inputs: list[list]
    options: dict  # as requested, held-out sizes resolved (resolve_held_out): a re-run with others is refused
    scans: list[FileScan]
    chunk_mb: float
    valid_docs: list[int]
    test_docs: list[int]

    @property
    def n_docs(self) -> int:
        return sum(s.n_docs for s in self.scans)

    @property
    def n_bytes(self) -> int:
        return sum(s.n_bytes for s in self.scans)

    def chunks(self) -> list[Chunk]:
        return make_chunks(self.scans, self.chunk_mb)

    def save(self, path: Path) -> None:
        write_text(path, json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: Path) -> "Plan":
        try:
            d = json.loads(path.read_text())
            d["scans"] = [FileScan(**s) for s in d["scans"]]
            return cls(**d)
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise PlanError(f"cannot read {path} ({e}): use another --output or delete it") from None


def make_plan(inputs: list[list], options: dict, scans: list[FileScan]) -> Plan:
    """Choose the held-out documents and the chunk size from the scans of the inputs (`input_identity`s).

    `options` holds valid_docs, test_docs, seed and chunk_mb (None: automatic), plus anything else
    that must match on a re-run; the plan records them with valid_docs and test_docs resolved."""
    total = sum(s.n_docs for s in scans)
    options = resolve_held_out(options, total)
    valid, test = options["valid_docs"], options["test_docs"]
    held_out = np.random.default_rng(options["seed"]).choice(total, valid + test, replace=False)
    chunk_mb = options["chunk_mb"] or default_chunk_mb(sum(s.n_bytes for s in scans))
    for s in scans:
        if s.replaced:
            log.warning("%s: replaced %d invalid UTF-8 sequences with U+FFFD", s.path, s.replaced)
    return Plan(inputs, options, scans, chunk_mb,
                sorted(int(i) for i in held_out[:valid]), sorted(int(i) for i in held_out[valid:]))
