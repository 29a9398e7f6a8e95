"""The base model alone on a split, as evaluate.py reads it: a retrofit of configs/retrofit.yaml built with its gate
at 0 (the base's logits exactly) and no training, evaluated on the same windows a run's evaluation reads.

    python results/retrofit/base_perplexity.py --config configs/retrofit.yaml data.path=DIR [--split test]

Prints and writes (--json) perplexity, tokens and words/s, beside a trained run's `evaluate.py --json` figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from xlm_pkm.config import load_config  # noqa: E402
from xlm_pkm.data.dictionary import Dictionary  # noqa: E402
from xlm_pkm.runtime.distributed import DistEnv  # noqa: E402
from xlm_pkm.train.build import build_model, build_stream, resolved_config  # noqa: E402
from xlm_pkm.train.evaluation import evaluate  # noqa: E402


def base_model(config: str, overrides: list[str]):
    """(the run's resolved config, its retrofit built on the CPU with every gate at 0: the base alone)."""
    cfg = load_config(config, overrides)
    cfg = resolved_config(cfg, len(Dictionary.load(Path(cfg.data.path) / "vocab")), "base")
    model = build_model(cfg, torch.device("cpu"))
    gates = [p for n, p in model.named_parameters() if n.endswith("gate")]
    assert gates and all(bool((g == 0).all()) for g in gates), "the base alone: every gate at 0"
    return cfg, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--split", default="test", choices=["valid", "test"])
    parser.add_argument("--json")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg, model = base_model(args.config, args.overrides)
    stream = build_stream(cfg, args.split, DistEnv())
    result = {"split": args.split, **evaluate(model, stream, torch.device("cpu"))}
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
