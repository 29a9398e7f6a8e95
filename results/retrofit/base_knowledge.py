"""What the base model alone knows: greedy exact match on world-knowledge questions (xlm_pkm/experiments/knowledge.py),
on the retrofit of configs/retrofit.yaml built with its gate at 0 (the base's logits exactly), as
`continual score --knowledge` scores a checkpoint.

    python results/retrofit/base_knowledge.py data/knowledge/world.jsonl --config configs/retrofit.yaml data.path=DIR

DIR: data made with the base's tokenizer (its codec tokenizes the questions). Prints the questions answered, in all
and per relation, and writes (--json) them with knowledge_em and knowledge_hits.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from base_perplexity import base_model  # noqa: E402

from xlm_pkm.data.text_codec import data_unit, text_codec  # noqa: E402
from xlm_pkm.experiments.facts import read_own_facts  # noqa: E402
from xlm_pkm.experiments.knowledge import knowledge_scores  # noqa: E402


def answered(model, codec, path: str | Path) -> dict:
    """knowledge_scores of the questions of `path`, with the count answered in all and per relation."""
    questions = read_own_facts(path)
    scores = knowledge_scores(model, codec, questions)
    hits = [h == "1" for h in scores["knowledge_hits"]]
    per_relation, total = Counter(), Counter(q.relation for q in questions)
    for q, hit in zip(questions, hits):
        per_relation[q.relation] += hit
    return {"questions": len(questions), "answered": sum(hits),
            "per_relation": {r: f"{per_relation[r]}/{n}" for r, n in total.items()}, **scores}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("knowledge", help="the questions (facts file format), e.g. data/knowledge/world.jsonl")
    parser.add_argument("--config", required=True)
    parser.add_argument("--json")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    cfg, model = base_model(args.config, args.overrides)
    result = answered(model, text_codec(cfg.data.path, data_unit(cfg.data.path)), args.knowledge)
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
