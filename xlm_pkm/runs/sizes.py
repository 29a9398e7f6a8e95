"""The size of a config's model, built on the meta device (no memory used), and how the tables write a count."""

from __future__ import annotations

import dataclasses

import torch

from xlm_pkm.config import Config
from xlm_pkm.model.transformer import TransformerLM

PLACEHOLDER_VOCAB = 1000  # the vocabulary size of a config that takes it from its data (model.vocab_size=0)


def model_size(cfg: Config, seq_len: int) -> dict[str, float]:
    """total and active parameters (per token: the dense ones, the value rows and Engram rows read), training FLOPs
    per token, of cfg's model built on the meta device (no memory used): as trained, with the vocabulary size of a
    run's resolved config; a config that leaves it to the data (0) is counted with PLACEHOLDER_VOCAB tokens (enough
    to compare models of one data set: it adds the same to each)."""
    with torch.device("meta"):
        model = TransformerLM(dataclasses.replace(cfg.model, vocab_size=cfg.model.vocab_size or PLACEHOLDER_VOCAB))
    counts = model.param_counts()
    read = sum(m.heads * m.knn * sum(p.shape[1] for p in m.values.tables()) for _, m in model.memories())
    read += len(cfg.model.engram.layers) * (cfg.model.engram.max_ngram - 1) * cfg.model.engram.ngram_dim  # Engram rows
    return {"total": counts["total"], "active": counts["dense"] + read,
            "flops": model.dense_flops_per_token(seq_len)}


def count_text(n: float) -> str:
    """A parameter count as the tables show it: 2.35M, 281.2k, 950."""
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e3 else f"{n:.0f}"
