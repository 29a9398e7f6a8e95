"""Adds `per_fact` (xlm_pkm/experiments/fact_scores.py) to the verdict seeds' rows of scores/ that were scored
before it existed (issue 48's run): scores each row's checkpoint on its facts again, without perplexity, checks
that every score the row has equals the new one's, and writes the row back with per_fact. From the repository
root, after run.sh:

    .venv/bin/python results/continual/add_per_fact.py [--dump dumped/continual] [--jobs 2]

then run.sh again (it skips every run and writes scores.jsonl and the report).
"""

import argparse
import json
import math
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

SCORES = Path(__file__).resolve().parent / "scores"


def add_per_fact(file: Path, dump: str) -> str:
    import torch

    from xlm_pkm.experiments.continual import score_checkpoint

    torch.set_num_threads(1)
    row = json.loads(file.read_text(encoding="utf-8"))
    new = score_checkpoint(row["checkpoint"], f"{dump}/facts{row['seed']}")
    differ = [k for k, v in new.items() if k != "per_fact" and row.get(k) is not None
              and not (v == row[k] or isinstance(v, float) and math.isclose(v, row[k], abs_tol=1e-12))]
    if differ:
        raise ValueError(f"{file.name}: the new scores differ from the row's in {differ}: not the same model or facts")
    file.write_text(json.dumps({**row, "per_fact": new["per_fact"]}) + "\n", encoding="utf-8")
    return file.name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dump", default="dumped/continual")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    files = [f for f in sorted(SCORES.glob("*_seed[012].jsonl"))
             if "per_fact" not in (row := json.loads(f.read_text(encoding="utf-8"))) and row["method"] != "pretrained"]
    with ProcessPoolExecutor(args.jobs) as pool:
        for name in pool.map(add_per_fact, files, [args.dump] * len(files)):
            print(name, flush=True)


if __name__ == "__main__":
    main()
