"""Numeric precision of a run: fp32, or mixed precision through torch.amp (fp16 with loss scaling, bf16)."""

from __future__ import annotations

import contextlib

import torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def check_precision(precision: str, device: torch.device) -> None:
    if precision not in ("fp32", *DTYPES):
        raise ValueError(f"train.precision: unknown precision {precision!r} (fp32 | fp16 | bf16)")
    if precision == "fp16" and device.type != "cuda":
        raise ValueError("train.precision=fp16 needs a CUDA device; on CPU use bf16 or fp32")


def autocast(precision: str, device: torch.device):
    """Autocast context for the forward pass; parameters and optimizer states stay float32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """Dynamic loss scaling for fp16; a disabled scaler (a no-op) otherwise."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"train.device={name}: CUDA is not available on this machine")
    return torch.device(name)
