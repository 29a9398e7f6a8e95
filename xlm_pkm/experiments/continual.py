"""Learning new facts against forgetting the pretraining corpus: scores of finetuned checkpoints and the report.

    python -m xlm_pkm.experiments.continual score CHECKPOINT --facts DIR --data data/processed/sample \\
        --model memory --method lora --setting rank=8 --out results.jsonl      # appends one row
    python -m xlm_pkm.experiments.continual report results.jsonl --out results/continual  # report.md + learning_forgetting.png

Learning: exact match (EM) of the greedy completion of each fact's object after its prompt (facts.jsonl of
xlm_pkm.experiments.facts), and after its paraphrase where it has one. Greedy decoding produces the object's tokens iff
the argmax after the prompt and each gold prefix of the object is the next gold token, so one teacher-forced
forward per batch decides it (the batch right-padded: the model is causal). Forgetting: perplexity on the
pretraining corpus's valid split; the report gives its change from the pretrained model of the same kind.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch

from xlm_pkm.data.text_codec import TextCodec
from xlm_pkm.experiments.facts import Fact, load_facts

PRETRAINED = "pretrained"  # the method of a model's baseline row


def prompt_and_object(codec: TextCodec, prompt: str, obj: str) -> tuple[list[int], list[int]]:
    """(ids of <s> + the prompt, ids of the object that follows it), tokenised as in training."""
    prompt_ids, full = codec.encode(prompt), codec.encode(f"{prompt} {obj}")
    if full[:len(prompt_ids)] != prompt_ids:
        raise ValueError(f"{prompt!r} is tokenised differently when followed by {obj!r}")
    return prompt_ids, full[len(prompt_ids):]


@torch.no_grad()
def greedy_matches(model, pairs: list[tuple[list[int], list[int]]], pad: int, batch_size: int = 64) -> list[bool]:
    """For each (prompt ids, object ids): whether greedy decoding after the prompt produces the object."""
    model.eval()
    device = next(model.parameters()).device
    matches = []
    for start in range(0, len(pairs), batch_size):
        batch = pairs[start:start + batch_size]
        width = max(len(p) + len(o) for p, o in batch) - 1
        tokens = torch.full((len(batch), width), pad, dtype=torch.long)  # (B, T): prompt + object[:-1], padded
        for row, (p, o) in enumerate(batch):
            seq = (p + o)[:-1]
            tokens[row, :len(seq)] = torch.tensor(seq)
        predicted = model(tokens.to(device)).argmax(-1).cpu()  # (B, T): the greedy next token at each position
        for row, (p, o) in enumerate(batch):
            matches.append(predicted[row, len(p) - 1:len(p) - 1 + len(o)].tolist() == o)
    return matches


def exact_match(model, codec: TextCodec, facts: list[Fact], paraphrase: bool = False) -> float:
    """Fraction of facts (with a paraphrase, when `paraphrase`) whose object greedy decoding completes."""
    prompts = [(f.paraphrase if paraphrase else f.prompt, f.object) for f in facts if not paraphrase or f.paraphrase]
    pairs = [prompt_and_object(codec, prompt, obj) for prompt, obj in prompts]
    return sum(greedy_matches(model, pairs, codec.dictionary.pad)) / len(pairs)


def score_checkpoint(path: str | Path, facts_dir: str | Path, data_dir: str | Path, max_batches: int = 0) -> dict:
    """EM on the facts (prompts, paraphrases) and valid perplexity on the pretraining corpus `data_dir`."""
    from xlm_pkm.checkpoint.trained import load_trained
    from xlm_pkm.train.evaluation import evaluate_checkpoint

    model, _, state, _ = load_trained(path, data_dir)
    codec, facts = TextCodec(data_dir), load_facts(Path(facts_dir) / "facts.jsonl")
    forgetting = evaluate_checkpoint(path, "valid", str(data_dir), max_batches=max_batches)
    return {"checkpoint": str(path), "step": state["step"], "em": exact_match(model, codec, facts),
            "em_paraphrase": exact_match(model, codec, facts, paraphrase=True), "valid_ppl": forgetting["ppl"]}


def prior_em(facts: list[Fact]) -> float:
    """EM of a guess that ignores the subject: each relation's most frequent object. A model above it has
    learnt something about the subjects, not only which objects go with which relation."""
    counts: dict[str, Counter] = {}
    for f in facts:
        counts.setdefault(f.relation, Counter())[f.object] += 1
    return sum(max(c.values()) for c in counts.values()) / len(facts)


def with_ppl_change(rows: list[dict]) -> list[dict]:
    """Each row with `ppl_change`: its valid perplexity minus that of its model's pretrained row."""
    base = {r["model"]: r["valid_ppl"] for r in rows if r["method"] == PRETRAINED}
    missing = {r["model"] for r in rows} - set(base)
    if missing:
        raise ValueError(f"no {PRETRAINED} row for model(s) {', '.join(sorted(missing))}")
    return [{**r, "ppl_change": r["valid_ppl"] - base[r["model"]]} for r in rows]


def markdown_table(rows: list[dict]) -> str:
    lines = ["| model | method | setting | EM | EM paraphrase | valid ppl | Δ ppl |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['method']} | {r['setting']} | {100 * r['em']:.1f}% | "
                     f"{100 * r['em_paraphrase']:.1f}% | {r['valid_ppl']:.2f} | {r['ppl_change']:+.2f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, prior: float | None = None) -> None:
    """EM against the valid-ppl change, one curve per (model, method), points labelled with their setting;
    the subject-blind guess's EM (`prior`) as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    curves: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        if r["method"] != PRETRAINED:
            curves.setdefault((r["model"], r["method"]), []).append(r)
    for (model, method), points in curves.items():
        points = sorted(points, key=lambda r: r["ppl_change"])
        ax.plot([p["ppl_change"] for p in points], [100 * p["em"] for p in points], "o-", label=f"{model}: {method}")
        for p in points:
            ax.annotate(p["setting"], (p["ppl_change"], 100 * p["em"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    for r in rows:
        if r["method"] == PRETRAINED:
            ax.plot([0], [100 * r["em"]], "*", markersize=10, label=f"{r['model']}: {PRETRAINED}")
    if prior is not None:
        ax.axhline(100 * prior, color="gray", linestyle="--", linewidth=1, label="subject-blind guess")
    ax.set_xscale("symlog", linthresh=1.0)  # linear below 1, logarithmic above: changes of 0.4 and 700 both show
    ax.set_xlim(left=min(0.0, *(r["ppl_change"] for r in rows)))
    ax.set_xlabel("forgetting: valid perplexity change on the pretraining corpus (symlog)")
    ax.set_ylabel("learning: exact match on the new facts (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(results: str | Path, out: str | Path, facts_dir: str | Path | None = None) -> Path:
    """out/report.md (the table) and out/learning_forgetting.png from the rows of `results` (JSONL); with
    the facts, the EM of the subject-blind guess (prior_em) too."""
    rows = with_ppl_change([json.loads(line) for line in Path(results).read_text().splitlines() if line])
    prior = prior_em(load_facts(Path(facts_dir) / "facts.jsonl")) if facts_dir else None
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plot(rows, out / "learning_forgetting.png", prior)
    blind = ("" if prior is None else f" A guess that ignores the subject (each relation's most frequent object) "
             f"scores EM {100 * prior:.1f}% (dashed line): only EM above it shows facts learnt about the subjects.")
    text = ("# Learning new facts vs forgetting\n\n"
            "EM: greedy completion of the object equals it exactly (prompts as trained; paraphrases never seen). "
            "Δ ppl: valid perplexity on the pretraining corpus minus the pretrained model's (★ in the figure)."
            + blind + "\n\n" + markdown_table(rows) + "\n![learning vs forgetting](learning_forgetting.png)\n")
    (out / "report.md").write_text(text, encoding="utf-8")
    return out / "report.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xlm_pkm.experiments.continual", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    score = sub.add_parser("score", help="append a checkpoint's scores to a JSONL file")
    score.add_argument("checkpoint")
    score.add_argument("--facts", required=True, help="the data dir of xlm_pkm.experiments.facts (its facts.jsonl)")
    score.add_argument("--data", required=True, help="the pretraining data dir (valid perplexity, codes, vocab)")
    score.add_argument("--model", required=True, help="which pretrained model this descends from (e.g. memory)")
    score.add_argument("--method", required=True, help=f"finetuning method ({PRETRAINED}: the baseline)")
    score.add_argument("--setting", default="-", help="the method's setting (lr, steps, rank, ...)")
    score.add_argument("--max-batches", type=int, default=0, help="valid batches (0: the whole split)")
    score.add_argument("--out", required=True, help="JSONL file the row is appended to")
    report = sub.add_parser("report", help="report.md and the figure from a JSONL file of scores")
    report.add_argument("results")
    report.add_argument("--out", required=True, help="output directory")
    report.add_argument("--facts", help="the data dir of xlm_pkm.experiments.facts: adds the subject-blind guess's EM")
    args = parser.parse_args(argv)
    try:
        if args.command == "score":
            row = {"model": args.model, "method": args.method, "setting": args.setting,
                   **score_checkpoint(args.checkpoint, args.facts, args.data, args.max_batches)}
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row))
        else:
            print(write_report(args.results, args.out, args.facts))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
