"""Learning new facts against forgetting: scores of finetuned checkpoints and the report.

    python -m xlm_pkm.experiments.continual score CHECKPOINT --facts DIR --data data/processed/sample \\
        --model memory --method lora --setting rank=8 --seed 0 --out results.jsonl     # appends one row
    python -m xlm_pkm.experiments.continual report results.jsonl --out results/continual  # report.md + figure

Learning: exact match (EM) on the trained prompt and on the question form never trained on, forced choice
among the relation's objects, and the controls that place them against chance (shuffled subjects, the
facts whose object is not the relation's most common, EM by position in the stream): fact_scores.py.
Forgetting, on the pretraining corpus: perplexity on its valid split, and on its test split
(held out: the background slot counts read the train split only, and no checkpoint was chosen on it) with
the test split's next-token accuracy (a cloze score); the report gives each one's change from the
pretrained model of the same kind.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from xlm_pkm.data.text_codec import TextCodec
from xlm_pkm.experiments.fact_scores import fact_scores, prior_em
from xlm_pkm.experiments.facts import load_facts

PRETRAINED = "pretrained"  # the method of a model's baseline row


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
                     max_batches: int = 0) -> dict:
    """The facts' scores (fact_scores.py); with the pretraining corpus `data_dir`, perplexity on its valid and
    test splits and next-token accuracy on its test split (at most max_batches batches each, 0: all)."""
    from xlm_pkm.checkpoint.trained import load_trained
    from xlm_pkm.runtime.distributed import DistEnv
    from xlm_pkm.train.build import build_stream

    trained = load_trained(path, data_dir or facts_dir)  # a facts dir has the pretraining vocabulary
    codec, facts = TextCodec(data_dir or facts_dir), load_facts(Path(facts_dir) / "facts.jsonl")
    row = {"checkpoint": str(path), "step": trained.step, **fact_scores(trained.model, codec, facts)}
    if data_dir is not None:
        streams = (build_stream(trained.cfg, split, DistEnv(), str(data_dir)) for split in ("valid", "test"))
        (row["valid_ppl"], _), (row["test_ppl"], row["test_acc"]) = (split_scores(trained.model, s, max_batches)
                                                                     for s in streams)
    return row


CHANGES = {"valid_change": "valid_ppl", "test_change": "test_ppl", "acc_change": "test_acc"}


def with_changes(rows: list[dict]) -> list[dict]:
    """Each row with its forgetting: valid_change, test_change (perplexity) and acc_change (test next-token
    accuracy) from its model's pretrained row (the same on every seed: the facts do not enter them)."""
    base = {r["model"]: r for r in rows if r["method"] == PRETRAINED}
    missing = {r["model"] for r in rows} - set(base)
    if missing:
        raise ValueError(f"no {PRETRAINED} row for model(s) {', '.join(sorted(missing))}")
    return [{**r, **{change: r[key] - base[r["model"]][key] for change, key in CHANGES.items()}} for r in rows]


def best_settings(rows: list[dict], seed: int = 0, at_em: float | None = None) -> dict[tuple[str, str], str]:
    """(model, method) -> the setting of its sweep (rows of `seed`) with the highest EM, ties to the least
    held-out forgetting (test_change); with `at_em`, the least forgetting among the settings reaching that
    EM (methods reaching it with none left out)."""
    best: dict[tuple[str, str], dict] = {}
    for r in with_changes(rows):
        key = (r["model"], r["method"])
        rank = (r["test_change"],) if at_em is not None else (-r["em"], r["test_change"])
        if (r["method"] != PRETRAINED and r["seed"] == seed and (at_em is None or r["em"] >= at_em - 1e-9)
                and (key not in best or rank < best[key][0])):
            best[key] = rank, r
    return {key: r["setting"] for key, (_, r) in best.items()}


def over_seeds(rows: list[dict]) -> list[dict]:
    """Each setting run on more than seed 0, the best setting of each (model, method) and each model's
    pretrained row, over their seeds: mean and sample standard deviation of every score and change (sd 0
    with one seed)."""
    rows, best = with_changes(rows), best_settings(rows)
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["method"], r["setting"]), []).append(r)
    groups = {(model, method, setting): group for (model, method, setting), group in groups.items()
              if method == PRETRAINED or len(group) > 1 or best.get((model, method)) == setting}
    out = []
    for (model, method, setting), group in sorted(groups.items()):
        summary = {"model": model, "method": method, "setting": setting, "seeds": len(group)}
        for key in ("em", "em_question", *CHANGES):
            values = torch.tensor([r[key] for r in group], dtype=torch.float64)
            summary[key] = float(values.mean())
            summary[key + "_sd"] = float(values.std()) if len(group) > 1 else 0.0
        out.append(summary)
    return out


LEARNING_LEVELS = (0.10, 0.13, 0.20)  # EM levels at which the report compares forgetting


def at_equal_learning(rows: list[dict], levels=LEARNING_LEVELS) -> str:
    """The paper's comparison: for each (model, method), the least held-out forgetting (Δ test ppl) among its
    seed-0 settings that reach each EM level ("-": none does)."""
    change = {(r["model"], r["method"], r["setting"]): r["test_change"] for r in rows if r["seed"] == 0}
    chosen = [best_settings(rows, at_em=em) for em in levels]  # per level: (model, method) -> setting
    cells = []
    for model, method in sorted({(model, method) for model, method, _ in change if method != PRETRAINED}):
        settings = [best.get((model, method)) for best in chosen]  # None: no setting reaches the level
        cells.append([model, method, *("-" if s is None else f"{change[model, method, s]:+.2f} ({s})"
                                       for s in settings)])
    return markdown(["model", "method", *(f"Δ test ppl at EM ≥ {100 * em:.0f}%" for em in levels)], cells)


def markdown(header: list[str], cells: list[list[str]]) -> str:
    """A markdown table: its header row, the separator, a row per list of cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells]) + "\n"


def sweep_table(rows: list[dict]) -> str:
    return markdown(["model", "method", "setting", "EM", "EM question", "Δ valid ppl", "Δ test ppl", "Δ test acc"],
                    [[r["model"], r["method"], r["setting"], f"{100 * r['em']:.1f}%", f"{100 * r['em_question']:.1f}%",
                      f"{r['valid_change']:+.2f}", f"{r['test_change']:+.2f}", f"{100 * r['acc_change']:+.2f}"]
                     for r in rows])


def seeds_table(summaries: list[dict]) -> str:
    return markdown(["model", "method", "setting", "seeds", "EM", "EM question", "Δ test ppl", "Δ test acc"],
                    [[r["model"], r["method"], r["setting"], str(r["seeds"]),
                      f"{100 * r['em']:.1f} ± {100 * r['em_sd']:.1f}%",
                      f"{100 * r['em_question']:.1f} ± {100 * r['em_question_sd']:.1f}%",
                      f"{r['test_change']:+.2f} ± {r['test_change_sd']:.2f}",
                      f"{100 * r['acc_change']:+.2f} ± {100 * r['acc_change_sd']:.2f}"] for r in summaries])


def plot(rows: list[dict], summaries: list[dict], path: Path, prior: float | None = None) -> None:
    """EM against the held-out perplexity change: each (model, method)'s sweep (seed 0, faint points labelled
    with their setting) and its settings over seeds (mean ± sd both ways); a colour per method, a marker per
    model; the subject-blind guess's EM (`prior`) as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trained = [r for r in rows if r["method"] != PRETRAINED]
    colour = {m: f"C{i}" for i, m in enumerate(sorted({r["method"] for r in trained}))}
    marker = {m: "osv^D<>"[i % 7] for i, m in enumerate(sorted({r["model"] for r in trained}))}
    fig, ax = plt.subplots(figsize=(11, 6))
    for r in summaries:
        if r["method"] != PRETRAINED:
            ax.errorbar(r["test_change"], 100 * r["em"], xerr=r["test_change_sd"], yerr=100 * r["em_sd"],
                        color=colour[r["method"]], marker=marker[r["model"]], capsize=3,
                        label=f"{r['model']}: {r['method']} ({r['setting']}, {r['seeds']} seed"
                              f"{'s' * (r['seeds'] > 1)})")
    for r in trained:
        if r["seed"] == 0:
            ax.plot(r["test_change"], 100 * r["em"], marker[r["model"]], color=colour[r["method"]], alpha=0.35,
                    markersize=4)
            ax.annotate(r["setting"], (r["test_change"], 100 * r["em"]), fontsize=5, alpha=0.6, xytext=(2, 2),
                        textcoords="offset points")
    if prior is not None:
        ax.axhline(100 * prior, color="gray", linestyle="--", linewidth=1, label="subject-blind guess")
    ax.set_xscale("symlog", linthresh=1.0)  # linear below 1, logarithmic above: changes of 0.4 and 700 both show
    ax.set_xlim(left=min(0.0, *(r["test_change"] for r in rows)))
    ax.set_xlabel("forgetting: test perplexity change on the held-out split of the pretraining corpus (symlog)")
    ax.set_ylabel("learning: exact match on the trained form (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def backgrounds_table(backgrounds: dict[str, str | Path]) -> str:
    """Per model, its background counts (finetune/slot_counts.py): documents, their length, the mean share of
    a value table's slots one document reads, and the share every document reads (idf 0: never updated)."""
    from xlm_pkm.finetune.memory_finetune import Background

    cells = []
    for model, path in backgrounds.items():
        background = Background.from_file(path)
        for name, share in background.read_share().items():
            cells.append([model, f"{background.documents:,}", str(background.doc_tokens),
                          f"{len(background.doc_freq[name]):,}", f"{100 * share['per_document']:.1f}%",
                          f"{100 * share['by_every_document']:.2f}%"])
    return markdown(["model", "documents", "tokens each", "slots", "read by one document", "read by every document"],
                    cells)


def write_report(results: str | Path, out: str | Path, facts_dir: str | Path | None = None,
                 backgrounds: dict[str, str | Path] | None = None) -> Path:
    """out/report.md (the sweep, the best settings over seeds, forgetting at equal learning, the backgrounds'
    read shares) and out/learning_forgetting.png from the rows of `results` (JSONL); with the facts (of seed
    0), the EM of the subject-blind guess (prior_em) too."""
    rows = with_changes([json.loads(line) for line in Path(results).read_text().splitlines() if line])
    summaries = over_seeds(rows)
    prior = prior_em(load_facts(Path(facts_dir) / "facts.jsonl")) if facts_dir else None
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plot(rows, summaries, out / "learning_forgetting.png", prior)
    blind = ("" if prior is None else f" A guess that ignores the subject (each relation's most frequent object) "
             f"scores EM {100 * prior:.1f}% on the seed-0 facts (dashed line): only EM above it shows facts "
             f"learnt about the subjects.")
    text = ("# Learning new facts vs forgetting\n\n"
            "EM: greedy completion of the object after the trained prompt; EM question: after the question form, "
            "never trained on. Forgetting, from the pretrained model of the same kind: Δ valid ppl (pretraining "
            "valid split), Δ test ppl and Δ test acc (next-token accuracy, points) on the test split, held out "
            "from the background counts and from checkpoint selection." + blind + "\n\n"
            "## Over seeds (mean ± sd)\n\n"
            "Each method's best setting (the seed-0 sweep's highest EM; ties: the least Δ test ppl), and each "
            "setting run on more seeds (the least Δ test ppl at EM ≥ 13%); each seed has its own facts.\n\n"
            + seeds_table(summaries) + "\n![learning vs forgetting](learning_forgetting.png)\n\n"
            "## Forgetting at equal learning (seed 0)\n\nThe least Δ test ppl among a method's settings that reach "
            "each EM (the paper's comparison: the same new knowledge, how much is forgotten).\n\n"
            + at_equal_learning(rows) + "\n"
            "## The sweep (seed 0)\n\n" + sweep_table(sorted((r for r in rows if r["seed"] == 0),
                                                             key=lambda r: (r["model"], r["method"], r["setting"]))))
    if backgrounds:
        text += ("\n## Backgrounds of sparse memory finetuning\n\nDocuments of the pretraining corpus's train split, "
                 "sized like a fact batch.\n\n" + backgrounds_table(backgrounds))
    (out / "report.md").write_text(text, encoding="utf-8")
    return out / "report.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xlm_pkm.experiments.continual", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    score = sub.add_parser("score", help="append a checkpoint's scores to a JSONL file")
    score.add_argument("checkpoint")
    score.add_argument("--facts", required=True, help="a facts data dir (python -m xlm_pkm.experiments.facts)")
    score.add_argument("--data", help="the pretraining data dir: adds valid/test perplexity and test accuracy")
    score.add_argument("--model", help="study label: which pretrained model this descends from (e.g. memory)")
    score.add_argument("--method", help=f"study label: the finetuning method ({PRETRAINED}: the baseline)")
    score.add_argument("--setting", help="study label: the method's setting (lr, steps, rank, ...)")
    score.add_argument("--seed", type=int, help="study label: the seed of the facts and the finetuning run")
    score.add_argument("--max-batches", type=int, default=0, help="valid and test batches (0: the whole splits)")
    score.add_argument("--out", help="JSONL file the row is appended to (else printed only)")
    report = sub.add_parser("report", help="report.md and the figure from a JSONL file of scores")
    report.add_argument("results")
    report.add_argument("--out", required=True, help="output directory")
    report.add_argument("--facts", help="the data dir of xlm_pkm.experiments.facts: adds the subject-blind guess's EM")
    report.add_argument("--background", action="append", default=[], metavar="MODEL=FILE",
                        help="a model's background counts: adds their read shares (repeatable)")
    best = sub.add_parser("best", help="print MODEL METHOD SETTING of each method's best setting, a line each")
    best.add_argument("results")
    best.add_argument("--at-em", type=float, help="the least forgetting among the settings reaching this EM")
    args = parser.parse_args(argv)
    try:
        if args.command == "score":
            labels = {key: getattr(args, key) for key in ("model", "method", "setting", "seed")}
            row = {**{key: value for key, value in labels.items() if value is not None},
                   **score_checkpoint(args.checkpoint, args.facts, args.data, args.max_batches)}
            if args.out:
                with open(args.out, "a", encoding="utf-8") as f:
                    f.write(json.dumps(row) + "\n")
            print(json.dumps(row))
        elif args.command == "best":
            rows = [json.loads(line) for line in Path(args.results).read_text().splitlines() if line]
            for (model, method), setting in best_settings(rows, at_em=args.at_em).items():
                print(model, method, setting)
        else:
            if any("=" not in item for item in args.background):
                raise ValueError(f"--background: expected MODEL=FILE, got {args.background}")
            backgrounds = dict(item.split("=", 1) for item in args.background)
            print(write_report(args.results, args.out, args.facts, backgrounds))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
