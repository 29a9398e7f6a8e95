"""Preprocessing throughput (MB of raw text per second, per step) at 1 and 2 workers.

    python benchmarks/preprocess_throughput.py [--repeat 2] [--workers 1 2] [--output FILE]

The corpus is the bundled one repeated `--repeat` times with distinct document ids (2 x 11 MB by
default). Steps: tokenize (Moses), learnbpe and getvocab (fastBPE CLI, single-threaded), apply_bpe
(fastBPE binding), binarize (held-out BPE + shards). Writes JSON to dumped/bench/ (--out elsewhere).
"""

from __future__ import annotations

import argparse
import json
import logging
import lzma
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from machine import machine_info, write_result  # noqa: E402

from xlm_pkm.data.executor import Executor  # noqa: E402
from xlm_pkm.data.preprocess import preprocess  # noqa: E402

SAMPLE = REPO / "data" / "sample" / "python-docs.jsonl.xz"


def build_corpus(path: Path, repeat: int) -> float:
    """Write the bundled corpus `repeat` times as JSONL; return its text size in MB."""
    docs = [json.loads(line) for line in lzma.open(SAMPLE, "rt", encoding="utf-8")]
    with open(path, "w", encoding="utf-8") as f:
        for r in range(repeat):
            for doc in docs:
                f.write(json.dumps({"id": f"{doc['id']}#{r}", "text": doc["text"]}, ensure_ascii=False) + "\n")
    return repeat * sum(len(d["text"].encode()) for d in docs) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--codes", type=int, default=8000)
    parser.add_argument("--out", help="default: dumped/bench/preprocess_throughput_cpu.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    result = {"machine": machine_info(), "bpe_codes": args.codes, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        mb = build_corpus(corpus, args.repeat)
        result["corpus"] = {"text_mb": round(mb, 2), "source": f"bundled corpus x{args.repeat}"}
        for workers in args.workers:
            start = time.perf_counter()
            times = preprocess([str(corpus)], Path(tmp) / f"out{workers}", n_codes=args.codes, valid_docs=20,
                               test_docs=20, executor=Executor(workers=workers))
            total = time.perf_counter() - start
            run = {"workers": workers, "load_average_1min_after": round(os.getloadavg()[0], 2),
                   "total_s": round(total, 2), "total_mb_per_s": round(mb / total, 3),
                   "seconds": {k: round(v, 2) for k, v in times.items()},
                   "mb_per_s": {k: round(mb / v, 3) for k, v in times.items() if v > 0}}
            result["runs"].append(run)
            print(json.dumps(run))
    slowest = max(result["runs"][0]["seconds"], key=result["runs"][0]["seconds"].get)
    result["slowest_step"] = slowest
    print(f"slowest step: {slowest}")
    write_result(result, args, "preprocess_throughput")


if __name__ == "__main__":
    main()
