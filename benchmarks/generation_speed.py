"""Generation speed with and without the key/value cache, written to
dumped/bench/generation_speed_<cpu|cuda>.json (--out elsewhere).

    .venv/bin/python benchmarks/generation_speed.py [--config configs/default.yaml] [--batch 1] [--seq 128]

One step generates --seq tokens for --batch samples from the prompt <s>, sampling from the full
softmax (xlm_pkm.inference.generation.generate), in eval mode, with a context window of --seq tokens (so it
never restarts): cached, each token is one forward of one position attending to the cached keys and
values; uncached, each token is a full forward over the whole context so far. Models: --config with
its memories and the same with none (model.n_memories=0). Weights are the initialisation (the cost
does not depend on them). tokens/s counts generated tokens of all samples; best of --rounds,
interleaved.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from machine import machine_info, write_result
from model_setup import REPO, benchmark_parser, build_model, common_settings, corpus_and_vocab, free
from timing import best_of_rounds

from xlm_pkm.inference.generation import generate

MODELS = {"memory": [], "no memory": ["model.n_memories=0", "model.mem_layers=[]"]}


def generation_step(model, args, use_cache: bool):
    return lambda: generate(model, [0], args.seq, num_samples=args.batch, window=args.seq, use_cache=use_cache)


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--config", default=str(REPO / "configs" / "default.yaml"), help="the model's config")
    parser.set_defaults(batch=1, seq=128, min_time=1.0, rounds=2)
    args = parser.parse_args()
    corpus, vocab = corpus_and_vocab(args)
    rows = []
    for name, overrides in MODELS.items():
        model, cfg = build_model(args.config, overrides, args, vocab)
        if args.seq > cfg.model.max_len:
            parser.error(f"--seq {args.seq} exceeds the model's max_len {cfg.model.max_len}")
        model.eval()
        speeds = best_of_rounds({cached: generation_step(model, args, cached) for cached in (True, False)},
                                args.batch * args.seq, args.device, args.min_time, args.rounds)
        cached, uncached = round(speeds[True], 1), round(speeds[False], 1)
        rows.append({"model": name, "layers": cfg.model.n_layers, "dim": cfg.model.dim,
                     "memories": len(model.memories()), "params": model.param_counts()["total"],
                     "cached_tokens_per_s": cached, "uncached_tokens_per_s": uncached,
                     "cached_over_uncached": round(cached / uncached, 3)})
        print(" ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
        del model
        free(args.device)
    result = {
        "benchmark": "generation_speed",
        "settings": {**common_settings(args, vocab), "config": args.config,
                     "prompt": "<s>", "generated_per_sample": args.seq, "window": args.seq,
                     "sampling": "full softmax, temperature 1", "mode": "eval, torch.inference_mode, fp32"},
        "machine": machine_info(args.device),
        "corpus": corpus,
        "rows": rows,
    }
    write_result(result, args, "generation_speed")


if __name__ == "__main__":
    main()
