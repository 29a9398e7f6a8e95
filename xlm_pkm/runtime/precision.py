"""Numeric precision of a run: fp32, or mixed precision through torch.amp (fp16 with loss scaling, bf16)."""

from __future__ import annotations

import contextlib
import re

import torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
DEVICES = r"auto|cpu|cuda(:\d+)?"  # the device names train.device and evaluate.py --device take


def check_precision(precision: str, device: torch.device, source: str = "train.precision") -> None:
    """fp32 | fp16 | bf16 (checked by the config loader); fp16 needs CUDA. `source`: the key or option
    that set it, for the error."""
    if precision == "fp16" and device.type != "cuda":
        raise ValueError(f"{source}{'=' if '.' in source else ' '}fp16 needs a CUDA device; on CPU use bf16 or fp32")


def autocast(precision: str, device: torch.device):
    """Autocast context for the forward pass; parameters and optimizer states stay float32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """Dynamic loss scaling for fp16; a disabled scaler (a no-op) otherwise."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


def resolve_device(name: str, source: str = "train.device") -> torch.device:
    """auto (CUDA when available, else CPU) | cpu | cuda | cuda:N. `source`: the config key or
    command-line option that set it, named in the errors."""
    setting = f"{source}{'=' if '.' in source else ' '}{name}"  # train.device=cuda, --device cuda
    if not re.fullmatch(DEVICES, name):
        raise ValueError(f"{setting}: expected auto, cpu, cuda or cuda:N")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"{setting}: CUDA is not available on this machine")
    return torch.device(name)
