"""Gradient norms and clipping that count sparse gradients (the memory values) and sharded value tables."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from xlm_pkm.utils.sparse_grads import coalesced


def grad_norm(params: list[nn.Parameter]) -> torch.Tensor:
    """Total 2-norm of the gradients, like torch.nn.utils.get_total_norm, but sparse gradients count too
    (coalesced in place first), and sharded value tables (model/value_shards.py) count with every rank's
    columns (one all-reduce)."""
    grads, sharded = [], []
    for p in params:
        if p.grad is not None and p.grad.is_sparse:
            p.grad = coalesced(p.grad)
        if p.grad is not None:
            (sharded if hasattr(p, "value_shard") else grads).append(p.grad._values() if p.grad.is_sparse else p.grad)
    norm = torch.nn.utils.get_total_norm(grads)
    if sharded:
        squares = torch.nn.utils.get_total_norm(sharded) ** 2
        if dist.is_initialized():
            dist.all_reduce(squares)
        norm = (norm**2 + squares).sqrt()
    return norm


def scale_grads_(params: list[nn.Parameter], norm: torch.Tensor, max_norm: float) -> None:
    """Scales the gradients, whose total norm is `norm`, down to `max_norm` (nothing when it is 0)."""
    if max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in params:
            if p.grad is not None:
                (p.grad._values() if p.grad.is_sparse else p.grad).mul_(scale)


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """The gradients' total norm (grad_norm), and the gradients scaled down to `max_norm` when it is > 0."""
    norm = grad_norm(params)
    scale_grads_(params, norm, max_norm)
    return norm
