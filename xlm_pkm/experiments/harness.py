"""EleutherAI's lm-evaluation-harness on a model trained here, and two small tasks it reads from local files.

    python -m xlm_pkm.experiments.harness tasks --data data/processed/sample [--facts DIR] --out harness_tasks
    python -m xlm_pkm.experiments.harness run dumped/default/demo/best.pt --tasks xlm_pkm_cloze \\
        --include harness_tasks [--limit N] [--batch-size 8] [--device cpu]

`run` evaluates a run checkpoint (exported first to RUN_DIR/hf, export.py) or an exported folder through the
harness's own Hugging Face model (`--model hf`, trust_remote_code), and writes the harness's results as JSON
next to the run (RUN_DIR/lm_eval.json; for a folder, FOLDER/lm_eval.json; or --json). Tasks are the harness's
own (hellaswag, piqa, nq_open, triviaqa: their datasets come from the Hugging Face hub, so a machine with
internet) and those of --include folders.

`tasks` writes two multiple-choice tasks whose data are local JSON lines (no download):
  xlm_pkm_cloze     the last word of a line of the corpus's held-out test split (a word of letters), against
                    3 last words of other lines (a LAMBADA-like cloze); the test documents are the token
                    stream decoded back to text (text_codec.py)
  xlm_pkm_facts_qa  the question form of each made-up fact of results/continual (xlm_pkm.experiments.facts),
                    against every object its relation allows
Both score acc (the choice with the highest log-likelihood after the context) and acc_norm.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from xlm_pkm.errors import USER_ERRORS, fail
from xlm_pkm.utils.atomic import check_writable, holds_json_with, refuse_foreign_file, write_text

CLOZE, FACTS_QA = "xlm_pkm_cloze", "xlm_pkm_facts_qa"
DISTRACTORS = 3
MIN_WORDS = 6  # a cloze sentence has at least this many words


def held_out_documents(data_dir: str | Path) -> list[str]:
    """The documents of a processed data dir's test split, as text (each document's ids decoded)."""
    import numpy as np

    from xlm_pkm.data.meta import check_split
    from xlm_pkm.data.shard import read_shard
    from xlm_pkm.data.text_codec import data_unit, text_codec

    codec = text_codec(data_dir, data_unit(data_dir))
    fingerprint = codec.dictionary.fingerprint()
    tokens = np.concatenate([read_shard(path, fingerprint).tokens for path, _ in check_split(Path(data_dir), "test")])
    starts = np.flatnonzero(tokens == codec.dictionary.bos).tolist() + [len(tokens)]
    return [codec.decode(tokens[a:b].tolist()) for a, b in zip(starts, starts[1:])]


def cloze_word(word: str) -> bool:
    """A last word worth guessing: letters (then at most one punctuation mark), at most 20 characters."""
    return len(word) <= 20 and word.rstrip(".,;:!?").isalpha() and len(word) - len(word.rstrip(".,;:!?")) <= 1


def cloze_items(documents: list[str], seed: int = 0, limit: int = 1000) -> list[dict]:
    """{context, choices, label} for up to `limit` sentences (lines) of at least MIN_WORDS words ending in a
    cloze_word: the context is the line without its last word; the choices its last word and DISTRACTORS
    last words of other such lines."""
    lines = [words for doc in documents for words in map(str.split, doc.splitlines())
             if len(words) >= MIN_WORDS and cloze_word(words[-1])]
    rng = random.Random(seed)
    rng.shuffle(lines)
    endings = sorted({words[-1] for words in lines})
    items = []
    for words in lines[:limit]:
        others = rng.sample([e for e in endings if e != words[-1]], DISTRACTORS)
        label = rng.randrange(DISTRACTORS + 1)
        items.append({"context": " ".join(words[:-1]), "choices": others[:label] + [words[-1]] + others[label:],
                      "label": label})
    return items


def facts_items(facts_dir: str | Path) -> list[dict]:
    """{context, choices, label}: each fact's question form, the objects its relation allows."""
    from xlm_pkm.experiments.facts import RELATIONS, load_facts

    objects = {r.name: list(r.objects) for r in RELATIONS}
    return [{"context": f.question, "choices": objects[f.relation], "label": objects[f.relation].index(f.object)}
            for f in load_facts(Path(facts_dir) / "facts.jsonl")]


def task_yaml(name: str, data: Path) -> str:
    """A harness task (multiple choice, acc and acc_norm) over the JSON lines of `data`."""
    return "\n".join([
        f"task: {name}",
        "dataset_path: json",
        "dataset_kwargs:",
        "  data_files:",
        f"    test: {json.dumps(str(data.resolve()))}",
        "test_split: test",
        "output_type: multiple_choice",
        'doc_to_text: "{{context}}"',
        "doc_to_choice: choices",
        "doc_to_target: label",
        "metric_list:",
        *(line for metric in ("acc", "acc_norm")
          for line in (f"  - metric: {metric}", "    aggregation: mean", "    higher_is_better: true")),
        "metadata:",
        "  version: 1.0",
        "",
    ])


def write_tasks(out: str | Path, data_dir: str | Path, facts_dir: str | Path | None = None) -> list[str]:
    """OUT/NAME.yaml and OUT/NAME.jsonl of each local task; returns their names."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tasks = {CLOZE: cloze_items(held_out_documents(data_dir))}
    if facts_dir:
        tasks[FACTS_QA] = facts_items(facts_dir)
    for name, items in tasks.items():
        if not items:
            raise ValueError(f"{name}: no items (the test split of {data_dir} has no line of {MIN_WORDS}+ words)")
        (out / f"{name}.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items), encoding="utf-8")
        (out / f"{name}.yaml").write_text(task_yaml(name, out / f"{name}.jsonl"), encoding="utf-8")
    return list(tasks)


def import_harness():
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise ImportError("lm-evaluation-harness is not installed: pip install 'xlm-pkm[eval]'") from None
    return lm_eval, TaskManager


def evaluate_tasks(model: str | Path, tasks: list[str], include: list[str] = (), limit: int | None = None,
                   batch_size: int = 8, device: str = "cpu", json_path: str | Path | None = None) -> dict:
    """The harness's results on `tasks` for a run checkpoint (exported to RUN_DIR/hf) or an exported folder,
    also written as JSON (default: next to the run, lm_eval.json)."""
    from xlm_pkm.inference.export import export

    model = Path(model)
    out = Path(json_path) if json_path else model / "lm_eval.json" if model.is_dir() else model.parent / "lm_eval.json"
    refuse_foreign_file(out, lambda path: holds_json_with(path, {"results"}), "--json", "a result of the harness")
    check_writable(out)  # before the work, which may take hours
    lm_eval, TaskManager = import_harness()
    manager = TaskManager(include_path=list(include), include_defaults=False) if include else None
    if manager is None or not set(tasks) <= set(manager.all_tasks):  # the harness's own tasks: a longer scan
        manager = TaskManager(include_path=list(include) or None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        local = [t for t in manager.all_tasks if t.startswith("xlm_pkm")]
        none = "none, give --include FOLDER of python -m xlm_pkm.experiments.harness tasks"
        raise ValueError(f"no lm-eval task {', '.join(unknown)} ({len(manager.all_tasks)} known; local ones found: "
                         f"{', '.join(local) or none})")
    folder = model if model.is_dir() else export(model, model.parent / "hf")
    results = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": str(folder), "trust_remote_code": True},
                                      tasks=tasks, task_manager=manager, limit=limit, batch_size=batch_size,
                                      device=device, log_samples=False)
    write_text(out, json.dumps(results, indent=2, default=str) + "\n")
    return results


def main(argv: list[str] | None = None) -> int:
    prog = "python -m xlm_pkm.experiments.harness"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    tasks = sub.add_parser("tasks", help="write the local tasks (YAML + JSON lines) to a folder")
    tasks.add_argument("--data", required=True, help="processed data dir whose test split makes the cloze task")
    tasks.add_argument("--facts", help="a data dir of xlm_pkm.experiments.facts: adds the facts QA task")
    tasks.add_argument("--out", required=True, help="folder to write the tasks to (give it to run --include)")
    run = sub.add_parser("run", help="evaluate a run checkpoint or an exported folder")
    run.add_argument("model", help="best.pt / checkpoint.pt of a run, or an exported folder")
    run.add_argument("--tasks", required=True, help="comma-separated task names")
    run.add_argument("--include", action="append", default=[], help="a folder of task YAMLs (repeatable)")
    run.add_argument("--limit", type=int, help="at most this many items per task")
    run.add_argument("--batch-size", type=int, default=8)
    run.add_argument("--device", default="cpu")
    run.add_argument("--json", help="results file (default: lm_eval.json next to the run, or in the folder)")
    args = parser.parse_args(argv)
    try:
        if args.command == "tasks":
            names = write_tasks(args.out, args.data, args.facts)
            print(f"{', '.join(names)} in {args.out}: {prog} run MODEL --tasks {','.join(names)} --include {args.out}")
            return 0
        results = evaluate_tasks(args.model, args.tasks.split(","), args.include, args.limit, args.batch_size,
                                 args.device, args.json)
    except USER_ERRORS + (ImportError,) as e:
        return fail(prog, e)
    for task, scores in results["results"].items():
        print(task, " ".join(f"{k}={v}" for k, v in scores.items() if isinstance(v, float)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
