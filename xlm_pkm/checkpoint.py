"""Checkpoints: written atomically (temporary file, then rename), loaded with an architecture check."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn


def save_atomic(obj: dict, path: str | Path) -> None:
    """torch.save to `path` such that a crash at any moment leaves the previous file intact."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # truncated or foreign file
        raise ValueError(f"{path}: not a readable checkpoint ({type(e).__name__}: {e})") from None


def load_model_state(model: nn.Module, state: dict, source: str | Path) -> None:
    """Loads weights after checking that every parameter and buffer exists with the same shape."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    mismatched = [f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
                  for k in own if k in state and state[k].shape != own[k].shape]
    problems = ([f"missing {', '.join(missing[:5])}"] if missing else []) \
        + ([f"unexpected {', '.join(unexpected[:5])}"] if unexpected else []) + mismatched[:5]
    if problems:
        raise ValueError(f"{source}: checkpoint is of another architecture: " + "; ".join(problems))
    model.load_state_dict(state)
