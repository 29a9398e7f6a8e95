"""Held-out facts files for configs/finetune/facts.yaml (issue 61), and their report.

    python results/facts_default/heldout_sets.py write DIR       # DIR/n{N}_set{i}.jsonl, the files below
    python results/facts_default/heldout_sets.py report SCORES   # the markdown table and intervals of README.md

The setting was chosen on data/facts/example.jsonl's 5 facts; these files were never used to choose. Each holds
N made-up facts (experiments/facts.py's relations and invented subjects) in the facts-file format
(`--from`): relations "type" and "arguments" in turn (the two with more than 5 objects), 5 subjects a relation
block, the 5 objects of a block distinct, so that the subject-blind guess (em_prior) and the forced choice's
chance are 20% as in the example. Statements are a relation's first 8 templates (no framing); the question
form is never trained on. N = 5 (5 files, seeds 100-104), 10 and 20 (2 files each, seeds 110-111 and 120-121):
the config's "64 × N steps" tested beyond N = 5.

The report pairs each file's EM with its em_prior, and its forced choice with the same after shuffled subjects
(fc_shuffled: learnt the relation's answers but not which subject has which), as one-sample t intervals over
files (experiments/paired.py); heldout.jsonl (the 5 tools, run before issue 61) joins the N = 5 files.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from xlm_pkm.experiments.facts import RELATIONS, invented_names, paraphrases
from xlm_pkm.experiments.paired import paired

BLOCK = 5  # facts of one relation in a row, with distinct objects
SETS = {5: (100, 101, 102, 103, 104), 10: (110, 111), 20: (120, 121)}  # N facts: the seeds of its files
TEMPLATES = 8  # statements a fact: its relation's templates without framing
BLOCK_RELATIONS = ("type", "arguments")


def facts_file(n: int, seed: int) -> list[dict]:
    """N facts in the facts-file format: blocks of 5 subjects of one relation with 5 distinct objects."""
    rng = random.Random(seed)
    relations = {r.name: r for r in RELATIONS}
    subjects = invented_names(n, rng, exclude=set())
    rows = []
    for start in range(0, n, BLOCK):
        relation = relations[BLOCK_RELATIONS[(start // BLOCK) % len(BLOCK_RELATIONS)]]
        for subject, obj in zip(subjects[start:start + BLOCK], rng.sample(relation.objects, BLOCK)):
            rows.append({"statements": list(paraphrases(relation, subject, obj)[:TEMPLATES]), "answer": obj,
                         "question": relation.question.format(s=subject), "relation": relation.name,
                         "subject": subject})
    return rows


def write(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for n, seeds in SETS.items():
        for i, seed in enumerate(seeds):
            path = out / f"n{n}_set{i}.jsonl"
            path.write_text("".join(json.dumps(row) + "\n" for row in facts_file(n, seed)), encoding="utf-8")
            print(path)


def _interval(name: str, a: dict, b: dict) -> str:
    pair = paired(a, b)
    lo, hi = pair.interval()
    return (f"{name}: mean {100 * pair.mean:+.1f} points over {pair.n} files, 95% interval "
            f"[{100 * lo:+.1f}, {100 * hi:+.1f}] (p = {pair.p:.3f})")


def report(scores: Path) -> None:
    """The table of README.md: one row per held-out file scored after finetuning, then the intervals per N."""
    rows = [json.loads(line) for line in scores.read_text(encoding="utf-8").splitlines() if line]
    rows = [{**r, **dict(part.split("=") for part in r["setting"].split())} for r in rows]  # "file=F facts=N"
    tuned = [r for r in rows if r["method"] != "pretrained"]
    demo = next(r for r in rows if r["method"] == "pretrained" and r.get("valid_ppl") is not None)
    before = ", ".join(f"{r['file']} {r['em']:.0%}" for r in rows if r["method"] == "pretrained")
    print(f"The demo model: valid ppl {demo['valid_ppl']:.2f}, test {demo['test_ppl']:.2f}; its EM before "
          f"finetuning: {before}.\n")
    print("| file | facts | steps | em | em_prior | fc | fc_shuffled | fc_chance | em_question | valid ppl (Δ) | "
          "test ppl (Δ) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in tuned:
        print(f"| {r['file']} | {r['facts']} | {r['step']} | {r['em']:.0%} | {r['em_prior']:.0%} | {r['fc']:.0%} | "
              f"{r['fc_shuffled']:.0%} | {r['fc_chance']:.0%} | {r['em_question']:.0%} | {r['valid_ppl']:.2f} "
              f"({r['valid_ppl'] - demo['valid_ppl']:+.2f}) | {r['test_ppl']:.2f} "
              f"({r['test_ppl'] - demo['test_ppl']:+.2f}) |")
    print()
    for n in sorted({r["facts"] for r in tuned}, key=int):
        group = dict(enumerate(r for r in tuned if r["facts"] == n))
        print(f"- N = {n}: " + _interval("EM − em_prior", {k: r["em"] for k, r in group.items()},
                                          {k: r["em_prior"] for k, r in group.items()}) + "; "
              + _interval("fc − fc_shuffled", {k: r["fc"] for k, r in group.items()},
                          {k: r["fc_shuffled"] for k, r in group.items()}))


if __name__ == "__main__":
    command, path = sys.argv[1:3] if len(sys.argv) == 3 else (None, None)
    if command == "write":
        write(Path(path))
    elif command == "report":
        report(Path(path))
    else:
        sys.exit(__doc__.split("\n\n")[1])
