"""Evaluation of a language model on one split: perplexity, memory usage and KL, speed."""

from __future__ import annotations

import math
import time

import torch

from xlm_pkm.checkpoint.trained import load_trained
from xlm_pkm.runtime.distributed import DistEnv, all_reduce_sum
from xlm_pkm.runtime.precision import autocast
from xlm_pkm.train.build import build_stream
from xlm_pkm.utils.progress import Progress


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def evaluate(model, stream, device: torch.device, precision: str = "fp32", max_batches: int = 0,
             env: DistEnv = DistEnv()) -> dict:
    """One pass over `stream` (a TokenStream with train=False), from its first batch; sums over all ranks.
    max_batches > 0: the tokens one process reads in its first max_batches batches, split across the ranks
    (the same tokens on any number of processes with the same stream batch size: TokenStream.rewind).

    Returns ppl, loss (nats per token), tokens, words, tokens_per_sec, words_per_sec and, for each
    memory, its layer and statistics (usage %, KL by weight and by count, slots holding 50/90/99%; the mean
    |w| of its values, value_abs_mean, and of its projections, proj_abs_mean (UltraMem's); the mean L2 norm of
    its outputs over the positions evaluated, out_norm), for
    each Engram layer (key "engrams", models with Engram only) its table's rows, the % of them read and the
    KL of the reads from uniform;
    on character-level data (meta.json "unit": "byte") also bpc = loss / ln 2.
    A word is a token that does not end in '@@' (specials excluded). A pass longer than 10 s prints
    its progress on stderr (progress.py).
    """
    was_training = model.training
    model.eval()
    model.reset_stream_state(training=False)  # every pass reads new streams, also on a model already in eval mode
    model.set_memory_stats(True)
    word_end = torch.from_numpy(stream.dictionary.word_end_mask())
    stream.rewind(max_batches)  # a stream evaluated before, perhaps with another cut
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    tokens = words = 0
    progress = Progress(f"evaluating {stream.split}", len(stream), env.is_main)
    synchronize(device)
    start = time.perf_counter()
    for i, (x, y) in enumerate(stream):
        with autocast(precision, device):
            nll = model(x.to(device, non_blocking=True), targets=y.to(device, non_blocking=True))  # (B, T)
        loss_sum += nll.double().sum()
        tokens += y.numel()
        words += int(word_end[y].sum())
        progress.update(i + 1)
    synchronize(device)
    elapsed = time.perf_counter() - start
    totals = all_reduce_sum(torch.tensor([loss_sum.item(), tokens, words, elapsed], dtype=torch.float64,
                                         device=device), env)
    loss, tokens, words = totals[0].item() / max(totals[1].item(), 1), int(totals[1]), int(totals[2])
    elapsed = totals[3].item() / env.world_size
    memories = []
    for layer, memory in model.memories():
        if memory.slot_stats.weights is not None:  # every rank evaluates at least one batch
            all_reduce_sum(memory.slot_stats.weights, env)
            all_reduce_sum(memory.slot_stats.counts, env)
        norms = {}  # each rank's (sum, count): of a value shard's columns, or of a copy, the whole's mean either way
        for name, sums in memory.norm_sums().items():
            sums = all_reduce_sum(sums, env)
            norms[name] = (sums[0] / sums[1]).item()
        memories.append({"layer": layer, **memory.stats(), **norms})
    engrams = []  # the share of each Engram table's rows read (its reads all count alike: usage = usage_count)
    for layer, engram in model.engrams():
        if engram.slot_stats.counts is not None:
            all_reduce_sum(engram.slot_stats.counts, env)
        stats = engram.slot_stats.summary()
        engrams.append({"layer": layer, "rows": engram.slot_stats.n_slots, "usage": stats["usage_count"],
                        "kl": stats["kl_count"]})
    model.set_memory_stats(False)
    model.train(was_training)
    per_unit = {"bpc": loss / math.log(2)} if stream.unit == "byte" else {}  # each token is a character
    return {
        **per_unit,
        "ppl": math.exp(min(loss, 100.0)),
        "loss": loss,
        "tokens": tokens,
        "words": words,
        "tokens_per_sec": tokens / elapsed if elapsed > 0 else 0.0,
        "words_per_sec": words / elapsed if elapsed > 0 else 0.0,
        "memories": memories,
        **({"engrams": engrams} if engrams else {}),  # models with Engram layers only
    }


def evaluate_checkpoint(path, split: str = "test", data_dir: str | None = None, batch_size: int = 0,
                        bptt: int = 0, device: torch.device = torch.device("cpu"), precision: str = "fp32",
                        max_batches: int = 0, env: DistEnv = DistEnv()) -> dict:
    """Evaluates the trained model of a run checkpoint or an exported folder (`path`) on `split` of its run's
    corpus (or of `data_dir`), which must have the vocabulary the model was trained with."""
    trained = load_trained(path, data_dir, env)  # every rank agrees whether it loaded
    stream = build_stream(trained.cfg, split, env, trained.data_dir, batch_size, bptt)
    result = evaluate(trained.model.to(device), stream, device, precision, max_batches, env)
    return {"checkpoint": str(path), "split": split, "step": trained.step, **result}
