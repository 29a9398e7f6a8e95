"""Held-out facts files for configs/finetune/facts.yaml (issue 61), and their report.

    python results/facts_default/heldout_sets.py write DIR       # DIR/n{N}_set{i}.jsonl, the files below
    python results/facts_default/heldout_sets.py report SCORES   # the markdown table and intervals of README.md
    python results/facts_default/heldout_sets.py overlap CHECKPOINT FILE...   # the memory slots subjects share

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
`overlap` counts, for each file, the memory slots that a fact's prompt reads at its last position (the one that
predicts the answer; every head's top k, on the model before finetuning) and how many of them the prompt of
another fact of the file reads too: the rows sparse memory finetuning could move for one subject alone.
"""

from __future__ import annotations

import itertools
import json
import random
import sys
from pathlib import Path

import torch

from xlm_pkm.checkpoint.trained import load_trained
from xlm_pkm.data.text_codec import text_codec
from xlm_pkm.experiments.facts import RELATIONS, invented_names, paraphrases, read_own_facts
from xlm_pkm.experiments.introspect import memory_inputs
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


@torch.no_grad()
def overlap(checkpoint: Path, files: list[Path]) -> None:
    """Per file: the slots each prompt reads at its last position, and the fewest and most of them another
    prompt of the file reads too (the first memory layer)."""
    trained = load_trained(checkpoint)
    model, codec = trained.model.eval(), text_codec(trained.data_dir)
    layer, memory = next(iter(model.memories()))
    for path in files:
        read = []
        for fact in read_own_facts(path):
            inputs = memory_inputs(model, torch.tensor([codec.encode(fact.prompt)]))[layer]  # (1, T, dim)
            _, indices = memory.lookup(inputs[0, -1:])  # (1, heads, knn)
            read.append(set(indices.flatten().tolist()))
        shared = [len(a & b) for a, b in itertools.combinations(read, 2)]
        print(f"{path.stem}: slots read {min(map(len, read))}-{max(map(len, read))}, shared with another "
              f"subject's prompt {min(shared)}-{max(shared)}")


if __name__ == "__main__":
    command, paths = (sys.argv[1], [Path(p) for p in sys.argv[2:]]) if len(sys.argv) > 2 else (None, [])
    if command == "write" and len(paths) == 1:
        write(paths[0])
    elif command == "report" and len(paths) == 1:
        report(paths[0])
    elif command == "overlap" and len(paths) > 1:
        overlap(paths[0], paths[1:])
    else:
        sys.exit(__doc__.split("\n\n")[1])
