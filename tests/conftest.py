"""Session fixtures shared by the test files: the fastBPE CLI and a tiny preprocessed corpus."""

from __future__ import annotations

import lzma
import os
from itertools import islice
from pathlib import Path

import pytest
import torch

# Without a GPU, the Triton kernels are checked under Triton's interpreter (read when Triton is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from xlm_pkm.data.fastbpe import find_fastbpe
from xlm_pkm.data.preprocess import preprocess

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "data" / "sample" / "python-docs.jsonl.xz"
TINY_DOCS = 40


@pytest.fixture(scope="session")
def fastbpe_bin() -> str:
    """Path of fastBPE's command-line tool (the Makefile builds it before the tests)."""
    return find_fastbpe()


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """The first 40 documents of the bundled corpus (0.4 MB) as JSONL."""
    path = tmp_path_factory.mktemp("corpus") / "tiny.jsonl"
    with lzma.open(SAMPLE, "rt", encoding="utf-8") as f:
        path.write_text("".join(islice(f, TINY_DOCS)), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def tiny_data_dir(tiny_corpus, tmp_path_factory) -> Path:
    """A processed data directory: 500 BPE codes, 4 valid and 4 test documents (>= 8k tokens each),
    two train shards, intermediate .tok/.bpe files kept. Built once per session (~2 s)."""
    out = tmp_path_factory.mktemp("data") / "tiny"
    preprocess([str(tiny_corpus)], out, n_codes=500, valid_docs=4, test_docs=4, seed=1, chunk_mb=0.25,
               keep_intermediate=True)
    return out
