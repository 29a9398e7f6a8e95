"""What the model-level speed benchmarks (inference_speed.py, training_speed.py) share: their
command-line options, the corpus and vocabulary they stand for (words per token from
xlm_pkm.data.stats), and models built from config files.

    parser = benchmark_parser(__doc__)                  # then the benchmark's own options
    args = parser.parse_args()
    corpus, vocab = corpus_and_vocab(args)
    model, cfg = build_model("configs/paper/l12_d1024_m1.yaml", ["optim.values_optimizer=lazy_adam"], args, vocab)
    write_result(result, args, "training_speed")          # dumped/bench/training_speed_<cpu|cuda>.json

The batch defaults to configs/paper/base.yaml's data.batch_size × bptt (32 × 256); `--override`
takes dotted config overrides (as train.py does), applied after the benchmark's own, so that a
CPU run can shrink the models (`--override model.dim=64 model.n_heads=2`).
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

import torch
from machine import REPO

from xlm_pkm.config import Config, load_config
from xlm_pkm.data.dictionary import Dictionary
from xlm_pkm.data.stats import split_stats
from xlm_pkm.model.transformer import TransformerLM
from xlm_pkm.train import build

FALLBACK_VOCAB = 32000  # when neither --vocab nor --data gives one


def benchmark_parser(doc: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=32, help="sequences per step")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence (the configs' max_len is 256)")
    parser.add_argument("--min-time", type=float, default=1.0, help="seconds measured per entry and round")
    parser.add_argument("--rounds", type=int, default=2, help="measurements per entry; best kept")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--data", default=str(REPO / "data" / "processed" / "sample"),
                        help="preprocessed corpus: vocabulary size and words per token")
    parser.add_argument("--split", default="test")
    parser.add_argument("--vocab", type=int, default=0, help=f"0: from --data, else {FALLBACK_VOCAB}")
    parser.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE",
                        help="config overrides for every model, e.g. model.dim=64")
    parser.add_argument("--note", default="", help="free text stored in the settings, e.g. what was reduced")
    parser.add_argument("--out", help="default: dumped/bench/<benchmark>_<device type>.json")
    return parser


def corpus_stats(data_dir: str | Path, split: str) -> dict | None:
    """{data, split, vocab_size, tokens, words, words_per_token} of a preprocessed split (a word is a
    token that ends one, as evaluation counts them), or None when `data_dir` has no vocab file."""
    data_dir = Path(data_dir)
    if not (data_dir / "vocab").is_file():
        return None
    dictionary = Dictionary.load(data_dir / "vocab")
    stats = split_stats(data_dir, split, dictionary)
    return {"data": str(data_dir), "split": split, "vocab_size": len(dictionary), "tokens": stats["tokens"],
            "words": stats["words"], "words_per_token": stats["words"] / max(stats["tokens"], 1)}


def corpus_and_vocab(args) -> tuple[dict, int]:
    """The corpus entry of the result (its statistics, or why there are none) and the vocabulary size."""
    stats = corpus_stats(args.data, args.split)
    corpus = stats or {"data": args.data, "split": args.split, "words_per_token": None,
                       "note": "no preprocessed corpus there: words/s not computed"}
    vocab = args.vocab or (stats["vocab_size"] if stats else FALLBACK_VOCAB)
    corpus["vocab_source"] = "--vocab" if args.vocab else "the corpus" if stats else "fallback"
    return corpus, vocab


def model_config(config: str | Path, overrides: list[str], args, vocab: int) -> Config:
    """`config` with the vocabulary, `overrides`, then args.override."""
    return load_config(config, [f"model.vocab_size={vocab}", *overrides, *args.override])


def build_model(config: str | Path, overrides: list[str], args, vocab: int) -> tuple[TransformerLM, Config]:
    """The trainer's model of model_config(...) (xlm_pkm.train.build), on args.device."""
    cfg = model_config(config, overrides, args, vocab)
    return build.build_model(cfg, torch.device(args.device)), cfg


def random_tokens(args, vocab: int) -> torch.Tensor:
    """(batch, seq + 1) token ids on args.device, the same at every run: inputs [:, :-1], targets [:, 1:]."""
    generator = torch.Generator(args.device).manual_seed(0)
    return torch.randint(0, vocab, (args.batch, args.seq + 1), device=args.device, generator=generator)


def common_settings(args, vocab: int) -> dict:
    return {"batch": args.batch, "seq": args.seq, "tokens_per_step": args.batch * args.seq, "vocab": vocab,
            "compile": args.compile, "overrides": args.override, "min_time_s": args.min_time,
            "rounds": args.rounds, "statistic": "best of rounds", "note": args.note}



def free(device: str) -> None:
    """Collects the models just dropped and returns their cached blocks to the device."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
