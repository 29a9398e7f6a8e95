"""The background of sparse memory finetuning: how often a trained model's memories read each slot on
its pretraining data (memory_finetune.py).

    python -m xlm_pkm.finetune.slot_counts dumped/default/demo/best.pt --data data/processed/sample \\
        --split train --doc-tokens 256 --documents 2000 --out dumped/default/demo/slot_counts.pt

Reads the split in order, one document of --doc-tokens tokens at a time (R = ceil(doc_tokens / data.bptt)
rows of doc_tokens / R tokens, from R places of the split, as a batch is; default: one training batch,
data.batch_size x data.bptt), in eval mode, with the memories' own statistics (memory_stats.SlotStats, as
evaluate.py counts usage). Size a document like one finetuning batch: TF-IDF then compares units alike.
For each value table it saves how many documents read each slot and how many reads each slot had, the
number of documents, their length and tokens, and the fingerprint of the model, which a run using the
file checks. --append adds the documents counted to an existing file of the same model and document length
(refused otherwise). The summary printed gives, per table, the mean share of slots one document reads
and the share every document reads (idf 0: never updated).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from xlm_pkm.checkpoint.trained import load_trained
from xlm_pkm.data.stream import TokenStream
from xlm_pkm.errors import USER_ERRORS, fail
from xlm_pkm.finetune.memory_finetune import Background, model_fingerprint, table_reads, value_tables
from xlm_pkm.utils.atomic import check_writable, refuse_foreign_file
from xlm_pkm.utils.program import program_name


@torch.no_grad()
def count_slots(model, stream: TokenStream, max_documents: int = 0) -> Background:
    """The Background of `model` (eval mode) over `stream`'s full batches (each a document), up to
    max_documents of them (0: all)."""
    tables = value_tables(model)
    if not tables:
        raise ValueError("the model has no memory: nothing to count")
    doc_freq = {name: torch.zeros(p.shape[0], dtype=torch.int64) for name, (p, _) in tables.items()}
    reads = {name: torch.zeros(p.shape[0], dtype=torch.int64) for name, (p, _) in tables.items()}
    documents = tokens = 0
    doc_tokens = stream.batch_size * stream.bptt
    model.set_memory_stats(True)
    for x, _ in stream:
        if (max_documents and documents >= max_documents) or x.numel() < doc_tokens:  # the split's short end
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
    return Background(doc_freq, reads, documents, tokens, model_fingerprint(model), doc_tokens)


def document_shape(doc_tokens: int, bptt: int) -> tuple[int, int]:
    """(rows, tokens per row) of a document of doc_tokens tokens whose rows fit in bptt."""
    rows = -(-doc_tokens // bptt)
    if doc_tokens < 1 or doc_tokens % rows:
        raise ValueError(f"--doc-tokens {doc_tokens}: must split into {rows} equal rows of at most data.bptt={bptt} "
                         f"tokens (a multiple of {rows})")
    return rows, doc_tokens // rows


def main(argv: list[str] | None = None) -> int:
    prog = program_name("python -m xlm_pkm.finetune.slot_counts")
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("checkpoint", help="best.pt or checkpoint.pt of the run that sparse finetuning starts from, "
                                           "or its exported folder")
    parser.add_argument("--data", help="processed data directory (default: the run's own)")
    parser.add_argument("--split", default="train", help="split to count on (default: train)")
    parser.add_argument("--doc-tokens", type=int, default=0,
                        help="tokens per document (default: one training batch, data.batch_size x data.bptt)")
    parser.add_argument("--documents", type=int, default=0,
                        help="stop after this many documents (default: the whole split)")
    parser.add_argument("--append", action="store_true", help="add to --out (same model and document length)")
    parser.add_argument("--out", required=True, help="file to write the counts to (torch format)")
    args = parser.parse_args(argv)
    try:
        if not args.append:  # before the counting: replaces only slot counts, and a folder it can write in
            refuse_foreign_file(Path(args.out), Background.holds_counts, "--out", "a file of slot counts")
            check_writable(Path(args.out))
        trained = load_trained(args.checkpoint, args.data)
        cfg, data_dir = trained.cfg, trained.data_dir
        rows, width = (document_shape(args.doc_tokens, cfg.data.bptt) if args.doc_tokens
                       else (cfg.data.batch_size, cfg.data.bptt))
        stream = TokenStream(data_dir, args.split, rows, width, train=False, shuffle=False)
        background = count_slots(trained.model, stream, args.documents)
        if args.append:
            background = Background.from_file(args.out).merged(background)
        background.to_file(args.out, source=str(args.checkpoint))
    except USER_ERRORS as e:
        return fail(prog, e)
    shares = background.read_share()
    print(f"{args.out}: slot reads of {args.checkpoint} over {background.documents:,} documents of "
          f"{background.doc_tokens} tokens ({rows}x{width}) of {data_dir} ({args.split}); "
          + "; ".join(f"{name}: {int((f > 0).sum()):,} of {len(f):,} slots read, "
                      f"{100 * shares[name]['per_document']:.2f}% per document, "
                      f"{100 * shares[name]['by_every_document']:.2f}% by every document"
                      for name, f in background.doc_freq.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
