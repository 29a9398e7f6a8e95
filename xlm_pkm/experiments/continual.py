"""Learning new facts against forgetting: scores of finetuned checkpoints and the report.

    python -m xlm_pkm.experiments.continual score CHECKPOINT --facts DIR --data data/processed/sample \\
        --model memory --method lora --setting rank=8 --seed 0 --out results.jsonl     # appends one row
    python -m xlm_pkm.experiments.continual score CHECKPOINT --facts DIR                # a one-off check: printed
    python -m xlm_pkm.experiments.continual score CHECKPOINT --facts DIR --data DIR --baseline BASE.pt
                                                              # ... and each score's change from the model it
                                                              # was finetuned from (scored once, then remembered)
    python -m xlm_pkm.experiments.continual score CHECKPOINT --facts DIR --knowledge data/knowledge/world.jsonl \
        --baseline BASE.pt                                    # ... and what the baseline knew, kept (knowledge.py)
    python -m xlm_pkm.experiments.continual report results.jsonl --out results/continual  # continual_report.py

Learning: exact match (EM) on the trained prompt and on the question form never trained on, forced choice
among the relation's objects, and the controls that place them against chance (shuffled subjects, the
facts whose object is not the relation's most common, EM by position in the stream): fact_scores.py.
Forgetting, on the pretraining corpus: perplexity on its valid split, and on its test split
(held out: the background slot counts read the train split only, and no checkpoint was chosen on it) with
the test split's next-token accuracy (a cloze score), read in CORPUS_ROWS rows of the model's bptt whatever
the run's eval batch size (a facts run evaluates its few-token valid split one row at a time: windows laid out
otherwise would change the perplexity); the report gives each one's change from the pretrained model of the
same kind. --knowledge FILE (world-knowledge questions in the facts file format, data/knowledge/) adds the
greedy EM on them (knowledge_em, knowledge_hits: knowledge.py), and with --baseline knowledge_kept, the EM over
the questions the baseline answered. Without --data only the facts are scored; --model, --method, --setting
and --seed are the study's labels, which the report needs and a one-off check does not.
--baseline scores the model a checkpoint was finetuned from alike, and adds each score's change (`change`:
points for EM and forced choice, percent for perplexity); the baseline's row is remembered in the facts dir
(BASELINES, keyed by the checkpoint file's hash, the data dir, --max-batches and the --knowledge file's hash), so
the next check reads it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from xlm_pkm.data.text_codec import data_unit, text_codec
from xlm_pkm.errors import USER_ERRORS, fail
from xlm_pkm.experiments.continual_report import (
    LEARNING_LEVELS,
    PRETRAINED,
    SELECT_SEED,
    best_settings,
    load_rows,
    write_report,
)
from xlm_pkm.experiments.fact_scores import fact_scores
from xlm_pkm.experiments.facts import load_facts, read_own_facts
from xlm_pkm.experiments.knowledge import knowledge_kept, knowledge_scores

CORPUS_ROWS = 16  # rows of the pretraining corpus's valid and test batches, the same for every checkpoint scored
BASELINES = "baseline_scores.jsonl"  # in a facts dir: the --baseline rows already scored
CHANGES = {"em": "points", "em_question": "points", "fc": "points", "fc_question": "points",  # the scores compared
           "valid_ppl": "percent", "test_ppl": "percent", "test_acc": "points", "knowledge_em": "points"}


@torch.no_grad()
def split_scores(model, stream, max_batches: int = 0) -> tuple[float, float]:
    """(perplexity, next-token accuracy) of the model over one pass of an evaluation TokenStream."""
    model.eval()
    device = next(model.parameters()).device
    nll, hits, total = 0.0, 0, 0
    stream.rewind()
    for i, (x, y) in enumerate(stream):
        if max_batches and i >= max_batches:
            break
        logits = model(x.to(device)).float()  # (B, T, V)
        y = y.to(device)
        nll += float(F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum"))
        hits += int((logits.argmax(-1) == y).sum())
        total += y.numel()
    return math.exp(min(nll / total, 100.0)), hits / total


def score_checkpoint(path: str | Path, facts_dir: str | Path, data_dir: str | Path | None = None,
                     max_batches: int = 0, knowledge: str | Path | None = None) -> dict:
    """The facts' scores (fact_scores.py); with the pretraining corpus `data_dir`, perplexity on its valid and
    test splits and next-token accuracy on its test split (at most max_batches batches of CORPUS_ROWS rows each,
    0: all); with a `knowledge` file of questions, their greedy EM (knowledge.py)."""
    from xlm_pkm.checkpoint.trained import load_trained
    from xlm_pkm.runtime.distributed import DistEnv
    from xlm_pkm.train.build import build_stream

    trained = load_trained(path, data_dir or facts_dir)  # a facts dir has the pretraining vocabulary
    text = data_dir or facts_dir  # its codec: BPE, or a retrofit's tokenizer
    codec, facts = text_codec(text, data_unit(text)), load_facts(Path(facts_dir) / "facts.jsonl")
    row = {"checkpoint": str(path), "step": trained.step, **fact_scores(trained.model, codec, facts)}
    if knowledge is not None:
        row.update(knowledge_scores(trained.model, codec, read_own_facts(knowledge)))
    if data_dir is not None:
        streams = (build_stream(trained.cfg, split, DistEnv(), str(data_dir), batch_size=CORPUS_ROWS)
                   for split in ("valid", "test"))
        (row["valid_ppl"], _), (row["test_ppl"], row["test_acc"]) = (split_scores(trained.model, s, max_batches)
                                                                     for s in streams)
    return row


def baseline_scores(path: str | Path, facts_dir: str | Path, data_dir: str | Path | None, max_batches: int,
                    knowledge: str | Path | None = None) -> dict:
    """score_checkpoint of the baseline `path`, read from the facts dir's BASELINES when scored before alike."""
    from xlm_pkm.data.meta import file_digest

    key = {"blake2b": file_digest(Path(path)), "data": None if data_dir is None else str(Path(data_dir).resolve()),
           "max_batches": max_batches}
    if knowledge is not None:
        key["knowledge"] = file_digest(Path(knowledge))
    remembered = Path(facts_dir) / BASELINES
    lines = remembered.read_text(encoding="utf-8").splitlines() if remembered.exists() else []
    for line in lines:
        entry = json.loads(line)
        if entry["key"] == key:
            return entry["row"]
    row = score_checkpoint(path, facts_dir, data_dir, max_batches, knowledge)
    with open(remembered, "a", encoding="utf-8") as f:
        f.write(json.dumps({"key": key, "row": row}) + "\n")
    return row


def changes(row: dict, baseline: dict) -> dict:
    """Each CHANGES score's change from the baseline: EM, forced choice and accuracy in points (x100), perplexity in
    percent of the baseline's."""
    out = {}
    for key, unit in CHANGES.items():
        if row.get(key) is not None and baseline.get(key) is not None:
            delta = 100 * (row[key] / baseline[key] - 1) if unit == "percent" else 100 * (row[key] - baseline[key])
            out[key] = {"baseline": baseline[key], "change": round(delta, 2), "unit": unit}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xlm_pkm.experiments.continual", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    score = sub.add_parser("score", help="a checkpoint's scores, printed (and appended to a JSONL file)")
    score.add_argument("checkpoint")
    score.add_argument("--facts", required=True, help="a facts data dir (python -m xlm_pkm.experiments.facts)")
    score.add_argument("--data", help="the pretraining data dir: adds valid/test perplexity and test accuracy")
    score.add_argument("--model", help="study label: which pretrained model this descends from (e.g. memory)")
    score.add_argument("--method", help=f"study label: the finetuning method ({PRETRAINED}: the baseline)")
    score.add_argument("--setting", help="study label: the method's setting (lr, steps, rank, ...)")
    score.add_argument("--seed", type=int, help="study label: the seed of the facts and the finetuning run")
    score.add_argument("--max-batches", type=int, default=0, help="valid and test batches (0: the whole splits)")
    score.add_argument("--out", help="JSONL file the row is appended to (else printed only)")
    score.add_argument("--knowledge", metavar="FILE",
                       help="world-knowledge questions (facts file format, e.g. data/knowledge/world.jsonl): adds "
                            "their greedy EM, and with --baseline the share of the baseline's answers kept")
    score.add_argument("--baseline", metavar="CHECKPOINT",
                       help="the model CHECKPOINT was finetuned from: adds each score's change from it (scored once, "
                            f"then remembered in the facts dir's {BASELINES})")
    report = sub.add_parser("report", help="report.md and the figure from a JSONL file of scores")
    report.add_argument("results")
    report.add_argument("--out", required=True, help="output directory")
    report.add_argument("--select-seed", type=int, default=SELECT_SEED,
                        help=f"the seed whose facts settings are chosen on (default {SELECT_SEED})")
    report.add_argument("--background", action="append", default=[], metavar="MODEL=FILE",
                        help="a model's background counts: adds their read shares (repeatable)")
    report.add_argument("--levels", type=float, nargs="+", default=list(LEARNING_LEVELS), metavar="EM",
                        help="EM levels (0-1) of the equal-learning comparison (default "
                             f"{' '.join(map(str, LEARNING_LEVELS))})")
    report.add_argument("--common-levels", type=float, nargs="+", metavar="EM",
                        help="EM levels (0-1) of the common-EM comparison (default: per seed, the lowest EM both "
                             "sweeps reach)")
    report.add_argument("--also-reference", action="append", default=[], metavar="METHOD",
                        help="adds a common-EM table against METHOD (of the reference's model), e.g. full (repeatable)")
    best = sub.add_parser("best", help="print MODEL METHOD SETTING of each method's best setting, a line each")
    best.add_argument("results")
    best.add_argument("--seed", type=int, default=SELECT_SEED, help=f"the selection seed (default {SELECT_SEED})")
    best.add_argument("--at-em", type=float, help="the least forgetting among the settings reaching this EM")
    args = parser.parse_args(argv)
    try:
        if args.command == "score":
            labels = {key: getattr(args, key) for key in ("model", "method", "setting", "seed")}
            row = {**{key: value for key, value in labels.items() if value is not None},
                   **score_checkpoint(args.checkpoint, args.facts, args.data, args.max_batches, args.knowledge)}
            if args.baseline:
                base = baseline_scores(args.baseline, args.facts, args.data, args.max_batches, args.knowledge)
                row["change"] = changes(row, base)
                print("; ".join(f"{key} {row[key]:.4g} ({c['change']:+.1f} {c['unit']} from {c['baseline']:.4g})"
                                for key, c in row["change"].items()), file=sys.stderr)
                if args.knowledge:
                    row["knowledge_kept"] = knowledge_kept(row["knowledge_hits"], base["knowledge_hits"])
                    kept = row["knowledge_kept"]
                    print(f"knowledge_kept {'n/a' if kept is None else f'{kept:.4g}'} (EM over the "
                          f"{base['knowledge_hits'].count('1')} questions the baseline answered)", file=sys.stderr)
            if args.out:
                with open(args.out, "a", encoding="utf-8") as f:
                    f.write(json.dumps(row) + "\n")
            print(json.dumps(row))
        elif args.command == "best":
            for (model, method), setting in best_settings(load_rows(args.results), args.seed, args.at_em).items():
                print(model, method, setting)
        else:
            if any("=" not in item for item in args.background):
                raise ValueError(f"--background: expected MODEL=FILE, got {args.background}")
            backgrounds = dict(item.split("=", 1) for item in args.background)
            print(write_report(args.results, args.out, backgrounds, args.select_seed, tuple(args.levels),
                               args.common_levels and tuple(args.common_levels), tuple(args.also_reference)))
    except (*USER_ERRORS, OSError) as e:
        return fail(parser.prog, e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
