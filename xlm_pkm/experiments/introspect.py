"""What a trained memory stores: for its most used slots, the contexts that read them most strongly.

    found = slot_contexts("dumped/run/best.pt", split="test", top_slots=8, per_slot=3)
    # [{"layer": 5, "slots": [{"slot": 1234, "weight": 88.1, "reads": [{"weight": 0.93,
    #     "context": "the return value of", "token": "len", "next": "("}, ...]}, ...]}]

Two passes over the first `max_batches` batches of the split, in eval mode: the first sums every
slot's read weight with the memories' own statistics (its usage, as evaluate.py counts it) to pick
the most used slots, the second keeps, for each of them, the positions that read it with the largest
weight (summed over heads).
Contexts are detokenised: BPE pieces merged ('@@ ' removed), then Moses' detokenizer.
"""

from __future__ import annotations

from pathlib import Path

import torch

from xlm_pkm.checkpoint.trained import load_trained
from xlm_pkm.data.dictionary import BPE_CONTINUATION
from xlm_pkm.data.moses import detokenize_pieces
from xlm_pkm.model.transformer import TransformerLM
from xlm_pkm.runtime.distributed import DistEnv
from xlm_pkm.train.build import build_stream


def memory_inputs(model: TransformerLM, tokens: torch.Tensor) -> dict[int, torch.Tensor]:
    """{layer: (B, T, dim) input of that layer's memory} for one forward of tokens (B, T)."""
    captured, hooks = {}, []
    for layer, memory in model.memories():
        hooks.append(memory.register_forward_pre_hook(
            lambda module, args, layer=layer: captured.__setitem__(layer, args[0].detach())))
    try:
        model(tokens)
    finally:
        for h in hooks:
            h.remove()
    return captured


@torch.no_grad()
def slot_contexts(path: str | Path, split: str = "test", top_slots: int = 8, per_slot: int = 3,
                  max_batches: int = 20, window: int = 12, data_dir: str | None = None) -> list[dict]:
    """For each memory of the checkpoint at `path`: its `top_slots` most used slots on `split`, each
    with the `per_slot` reads of largest weight and their text (see the module docstring)."""
    trained = load_trained(path, data_dir)  # in eval mode, vocabulary checked
    model, data_dir = trained.model, trained.data_dir
    stream = build_stream(trained.cfg, split, DistEnv(), data_dir)
    batches = [x for i, (x, _) in zip(range(max_batches), stream)]  # (B, T) each
    memories = dict(model.memories())

    model.set_memory_stats(True)  # the memories' own per-slot statistics (eval mode), from zero
    try:
        for x in batches:
            model(x)
        usage = {layer: m.slot_weights().clone() for layer, m in memories.items()}  # (n_slots,) float64 each
    finally:
        model.set_memory_stats(False)
        for m in memories.values():
            m.reset_stats()

    top = {layer: u.topk(min(top_slots, int((u > 0).sum()))).indices for layer, u in usage.items()}
    best = {layer: [[] for _ in t] for layer, t in top.items()}  # per top slot: [(weight, batch, row, pos)]
    for b, x in enumerate(batches):
        B, T = x.shape
        for layer, inputs in memory_inputs(model, x).items():
            weights, indices = memories[layer].lookup(inputs.reshape(-1, inputs.shape[-1]))  # (N, H, K) each
            for s, slot in enumerate(top[layer].tolist()):
                per_position = (weights * (indices == slot)).sum(dim=(1, 2))  # (N,) summed over heads
                w, n = per_position.topk(min(per_slot, per_position.numel()))
                best[layer][s] += [(float(wi), b, ni // T, ni % T) for wi, ni in zip(w.tolist(), n.tolist()) if wi > 0]

    words = stream.dictionary
    out = []
    for layer, slots in top.items():
        found = []
        for s, slot in enumerate(slots.tolist()):
            reads = []
            for w, b, row, pos in sorted(best[layer][s], reverse=True)[:per_slot]:
                seq = batches[b][row].tolist()
                left = [words[i] for i in seq[max(0, pos - window):pos]]
                reads.append({"weight": round(w, 4), "context": detokenize_pieces(left),
                              "token": words[seq[pos]].removesuffix(BPE_CONTINUATION),
                              "next": words[seq[pos + 1]].removesuffix(BPE_CONTINUATION) if pos + 1 < len(seq) else ""})
            found.append({"slot": slot, "weight": round(float(usage[layer][slot]), 3), "reads": reads})
        out.append({"layer": layer, "tokens": sum(x.numel() for x in batches), "slots": found})
    return out
