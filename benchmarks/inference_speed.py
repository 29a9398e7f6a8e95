"""Inference speed of whole models (paper Table 4 / Figure 7 and Figure 4), written to
dumped/bench/inference_speed_<cpu|cuda>.json (--out elsewhere).

    .venv/bin/python benchmarks/inference_speed.py [--device cuda] [--dtype fp16] [--parts table4 figure4]

table4: the 6-layer ablation model (configs/paper/ablation_base.yaml) with n_keys² slots for n_keys
  in --keys (128..1024: 16k..1M slots), product keys and, up to --flat-max-keys, flat keys.
figure4: the Table 1 models configs/paper/l{--layers}_d{--dims}_m{--memories}.yaml.
One step is the forward of the whole TransformerLM, output logits included, on (batch, seq) random
tokens, in eval mode under torch.inference_mode. --dtype fp16/bf16 runs it under autocast, as
evaluation does: parameters stay float32 (a flat key table is not copied to float32 each forward),
and the memory's search, softmax and value read run in float32 anyway.
Speed is tokens/s, and words/s = tokens/s × the words per token of --data's --split (the paper
reports words/s). Vocabulary: --vocab, else --data's (the bundled sample: 8k BPE codes), else
32000; the paper's has 60k BPE codes (§4.1). The output layer's share of the time grows with it, so
ratios between models of different depths depend on it.
Models that are compared are measured side by side, interleaved (best of --rounds): the two key
types at each size; the memory counts of each (layers, dim).
Ratios for issue 6's targets: table4 speed at the largest product size over the smallest (≥ 0.97)
and product over flat at each size, beside the paper's; figure4 speed of 12 layers with 1 memory
over 24 layers without (≥ 1.8; the paper: "almost twice faster"), per dim.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from machine import machine_info, write_result
from model_setup import REPO, benchmark_parser, build_model, common_settings, corpus_and_vocab, free, random_tokens
from timing import best_of_rounds

from xlm_pkm.runtime.precision import autocast, check_precision

PAPER = REPO / "configs" / "paper"
# Paper Table 4, inference speed in words/s by n_keys (|K| = n_keys²): (flat keys, product keys).
PAPER_TABLE4_WORDS_PER_S = {128: (35.0e3, 35.8e3), 256: (28.5e3, 36.7e3), 384: (13.9e3, 36.4e3),
                            512: (7.7e3, 36.3e3), 768: (4.7e3, 36.2e3), 1024: (1.2e3, 35.7e3)}


def forward_step(model, tokens: torch.Tensor, dtype: str, device: torch.device):
    @torch.inference_mode()
    def step():
        with autocast(dtype, device):
            model(tokens)  # (B, T) -> (B, T, vocab) logits
    return step


def measure(entries: list[tuple[Path, list[str]]], args, vocab: int, words_per_token: float | None) -> list[dict]:
    """One row per (config, overrides) entry; the entries' models are timed interleaved."""
    device = torch.device(args.device)
    tokens = random_tokens(args, vocab)[:, :-1]  # (B, T)
    models, steps = [], {}
    for i, (config, overrides) in enumerate(entries):
        model, cfg = build_model(config, overrides, args, vocab)
        model.eval()
        models.append((model, cfg))
        steps[i] = forward_step(torch.compile(model) if args.compile else model, tokens, args.dtype, device)
    speeds = best_of_rounds(steps, tokens.numel(), device, args.min_time, args.rounds)
    rows = []
    for i, (model, cfg) in enumerate(models):
        has_memory, mem = bool(model.memories()), cfg.model.memory
        tps = round(speeds[i])
        rows.append({"layers": cfg.model.n_layers, "dim": cfg.model.dim, "memories": len(model.memories()),
                     "n_keys": mem.n_keys if has_memory else None,
                     "slots": model.memories()[0][1].n_slots if has_memory else None,
                     "key_type": mem.key_type if has_memory else None, "params": model.param_counts()["total"],
                     "tokens_per_s": tps, "words_per_s": round(tps * words_per_token) if words_per_token else None})
        print(" ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    del models, steps
    free(args.device)
    return rows


def table4(args, vocab: int, words_per_token: float | None) -> dict:
    rows = []
    for n_keys in args.keys:
        key_types = ["product", "flat"] if n_keys <= args.flat_max_keys else ["product"]
        rows += measure([(PAPER / "ablation_base.yaml", [f"model.memory.n_keys={n_keys}",
                                                         f"model.memory.key_type={key_type}"])
                         for key_type in key_types], args, vocab, words_per_token)
    speed = {(r["key_type"], r["n_keys"]): r["tokens_per_s"] for r in rows}
    product = sorted(n for kind, n in speed if kind == "product")
    return {
        "rows": rows,
        "product_largest_over_smallest": {
            "slots": [product[0]**2, product[-1]**2], "target": ">= 0.97",
            "ratio": round(speed["product", product[-1]] / speed["product", product[0]], 3)},
        "product_over_flat": [product_over_flat(n, speed["product", n] / speed["flat", n])
                              for n in product if ("flat", n) in speed],
    }


def product_over_flat(n_keys: int, ratio: float) -> dict:
    """The measured speed ratio at n_keys² slots beside the paper's (Table 4), where it has one."""
    flat, product = PAPER_TABLE4_WORDS_PER_S.get(n_keys, (None, None))
    return {"n_keys": n_keys, "slots": n_keys**2, "ratio": round(ratio, 3),
            "paper_ratio": round(product / flat, 3) if flat else None,
            "paper_words_per_s": {"flat": flat, "product": product}}


def figure4(args, vocab: int, words_per_token: float | None) -> dict:
    rows = []
    for dim in args.dims:
        for layers in args.layers:
            rows += measure([(PAPER / f"l{layers}_d{dim}_m{m}.yaml", []) for m in args.memories],
                            args, vocab, words_per_token)
    speed = {(r["layers"], r["dim"], r["memories"]): r["tokens_per_s"] for r in rows}
    return {
        "rows": rows,
        "l12_m1_over_l24_m0": [{"dim": dim, "ratio": round(speed[12, dim, 1] / speed[24, dim, 0], 3),
                                "target": ">= 1.8"}
                               for dim in sorted({r["dim"] for r in rows})
                               if (12, dim, 1) in speed and (24, dim, 0) in speed],
    }


PARTS = {"table4": table4, "figure4": figure4}


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--dtype", choices=["fp32", "fp16", "bf16"],
                        default="fp16" if torch.cuda.is_available() else "fp32", help="autocast dtype")
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    parser.add_argument("--keys", type=int, nargs="+", default=[128, 256, 384, 512, 768, 1024],
                        help="table4: n_keys (|K| = n_keys²)")
    parser.add_argument("--flat-max-keys", type=int, default=512,
                        help="table4: flat keys up to this n_keys (1024: a 4 x 1M x 512 key table)")
    parser.add_argument("--layers", type=int, nargs="+", default=[12, 16, 24], help="figure4")
    parser.add_argument("--dims", type=int, nargs="+", default=[1024, 1600], help="figure4")
    parser.add_argument("--memories", type=int, nargs="+", default=[0, 1, 2], help="figure4")
    args = parser.parse_args()
    check_precision(args.dtype, torch.device(args.device))
    corpus, vocab = corpus_and_vocab(args)
    result = {
        "benchmark": "inference_speed",
        "settings": {**common_settings(args, vocab), "dtype": args.dtype,
                     "dtype_mode": "autocast, parameters float32" if args.dtype != "fp32" else "float32",
                     "mode": "eval, torch.inference_mode, whole model with output logits",
                     "parts": args.parts, "keys": args.keys, "flat_max_keys": args.flat_max_keys,
                     "layers": args.layers, "dims": args.dims, "memories": args.memories},
        "machine": machine_info(args.device),
        "corpus": corpus,
    }
    for part in args.parts:
        result[part] = PARTS[part](args, vocab, corpus["words_per_token"])
    write_result(result, args, "inference_speed")


if __name__ == "__main__":
    main()
