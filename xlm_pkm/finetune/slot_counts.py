"""The background of sparse memory finetuning: how often a trained model's memories read each slot on
its pretraining data (memory_finetune.py).

    python -m xlm_pkm.finetune.slot_counts dumped/default/demo/best.pt --data data/processed/sample \\
        --split train --max-tokens 200000 --out dumped/default/demo/slot_counts.pt

Reads the split in order, in batches shaped as the run's training batches (data.batch_size x data.bptt:
one document each), in eval mode, with the memories' own statistics (memory_stats.SlotStats, as
evaluate.py counts usage). For each value table it saves how many documents read each slot and how many
reads each slot had, the number of documents and tokens, and the fingerprint of the model, which a run
using the file checks.
"""

from __future__ import annotations

import argparse
import sys

import torch

from xlm_pkm.checkpoint.trained import load_trained
from xlm_pkm.data.stream import TokenStream
from xlm_pkm.errors import USER_ERRORS, fail
from xlm_pkm.finetune.memory_finetune import Background, model_fingerprint, table_reads, value_tables
from xlm_pkm.utils.program import program_name


@torch.no_grad()
def count_slots(model, stream: TokenStream, max_tokens: int) -> Background:
    """The Background of `model` (eval mode) over `stream`, up to max_tokens tokens (0: all of it)."""
    tables = value_tables(model)
    if not tables:
        raise ValueError("the model has no memory: nothing to count")
    doc_freq = {name: torch.zeros(p.shape[0], dtype=torch.int64) for name, (p, _) in tables.items()}
    reads = {name: torch.zeros(p.shape[0], dtype=torch.int64) for name, (p, _) in tables.items()}
    documents = tokens = 0
    model.set_memory_stats(True)
    for x, _ in stream:
        if max_tokens and tokens >= max_tokens:
            break
        for _, memory in model.memories():
            memory.reset_stats()
        model.hidden(x)
        for name, (_, memories) in tables.items():
            counts = table_reads(memories, "slot_stats").long()  # (n_slots,) this document's reads
            doc_freq[name] += counts > 0
            reads[name] += counts
        documents += 1
        tokens += x.numel()
    model.set_memory_stats(False)
    return Background(doc_freq, reads, documents, tokens, model_fingerprint(model))


def main(argv: list[str] | None = None) -> int:

    prog = program_name("python -m xlm_pkm.finetune.slot_counts")
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("checkpoint", help="best.pt or checkpoint.pt of the run that sparse finetuning starts from")
    parser.add_argument("--data", help="processed data directory (default: the run's own)")
    parser.add_argument("--split", default="train", help="split to count on (default: train)")
    parser.add_argument("--max-tokens", type=int, default=0, help="stop after this many tokens (default: the whole split)")
    parser.add_argument("--out", required=True, help="file to write the counts to (torch format)")
    args = parser.parse_args(argv)
    try:
        model, cfg, _, data_dir = load_trained(args.checkpoint, args.data)
        stream = TokenStream(data_dir, args.split, cfg.data.batch_size, cfg.data.bptt, train=False, shuffle=False)
        background = count_slots(model, stream, args.max_tokens)
        background.to_file(args.out, source=str(args.checkpoint))
    except USER_ERRORS as e:
        return fail(prog, e)
    print(f"{args.out}: slot reads of {args.checkpoint} over {background.tokens:,} tokens of {data_dir} "
          f"({args.split}; {background.documents} documents of {cfg.data.batch_size}x{cfg.data.bptt} tokens); "
          + ", ".join(f"{name}: {int((f > 0).sum()):,} of {len(f):,} slots read" for name, f in background.doc_freq.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
