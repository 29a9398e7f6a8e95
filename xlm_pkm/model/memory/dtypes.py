"""The memory's numeric rule: key search, softmax and value sums run in at least float32, under
fp16/bf16 autocast too (pkm.py)."""

from __future__ import annotations

import torch


def at_least_float32(t: torch.Tensor) -> torch.Tensor:
    """float16/bfloat16 -> float32; float32 and float64 unchanged."""
    return t.to(compute_dtype(t))


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype at_least_float32(t) has, without converting t (of a bfloat16 table: a float32 copy of it)."""
    return torch.promote_types(t.dtype, torch.float32)
