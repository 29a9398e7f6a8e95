"""The size of a config's model, built on the meta device (no memory used)."""

from __future__ import annotations

import dataclasses

import torch

from xlm_pkm.config import Config
from xlm_pkm.model.transformer import TransformerLM


def model_size(cfg: Config, seq_len: int) -> dict[str, float]:
    """total and active parameters (per token: the dense ones, the value rows and Engram rows read), training FLOPs
    per token, of cfg's model built on the meta device (no memory used; any vocabulary size will do
    for comparisons: it adds the same to every model of one data set, 1000 here)."""
    with torch.device("meta"):
        model = TransformerLM(dataclasses.replace(cfg.model, vocab_size=1000))
    counts = model.param_counts()
    read = sum(m.heads * m.knn * sum(p.shape[1] for p in m.values.tables()) for _, m in model.memories())
    read += len(cfg.model.engram.layers) * (cfg.model.engram.max_ngram - 1) * cfg.model.engram.ngram_dim  # Engram rows
    return {"total": counts["total"], "active": counts["dense"] + read,
            "flops": model.dense_flops_per_token(seq_len)}
