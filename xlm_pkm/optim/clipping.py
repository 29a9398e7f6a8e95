"""Gradient norms and clipping that count sparse gradients (the memory values), sharded value tables and
FSDP's sharded parameters (DTensors: runtime/fsdp.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from xlm_pkm.utils.dtensors import is_dtensor, local_part
from xlm_pkm.utils.sparse_grads import coalesced


def _local(grad: torch.Tensor) -> torch.Tensor:
    """The gradient's entries held by this rank, as a plain tensor that scaling in place scales the gradient:
    a sparse gradient's values, a DTensor's local shard, else the gradient itself."""
    return grad._values() if grad.is_sparse else local_part(grad)


def grad_norm(params: list[nn.Parameter], coalesce: bool = True) -> torch.Tensor:
    """Total 2-norm of the gradients, like torch.nn.utils.get_total_norm, but sparse gradients count too
    (coalesced in place first), and the gradients each rank holds a part of count with every rank's part (one
    all-reduce): sharded value tables (model/value_shards.py), FSDP's DTensors. coalesce=False: a sparse gradient
    on a GPU is left as it is and counts by the norm of its rows summed (triton_rows.summed_rows_norm: one kernel,
    no host sync), for an optimizer that sums them itself (fused_rows.py)."""
    grads, sharded = [], []
    for p in params:
        if p.grad is None:
            continue
        if p.grad.is_sparse and p.grad.is_cuda and not coalesce:
            from xlm_pkm.optim.triton_rows import summed_rows_norm

            part = summed_rows_norm(p.grad)  # (): counts as the entries it is the norm of
        else:
            if p.grad.is_sparse:
                p.grad = coalesced(p.grad)
            part = _local(p.grad)
        split = hasattr(p, "value_shard") or is_dtensor(p.grad)
        (sharded if split else grads).append(part)
    norm = torch.nn.utils.get_total_norm(grads)
    if sharded:
        squares = torch.nn.utils.get_total_norm(sharded) ** 2
        if dist.is_initialized():
            dist.all_reduce(squares)
        norm = (norm**2 + squares).sqrt()
    return norm


def clip_scale(norm: torch.Tensor, max_norm: float) -> torch.Tensor | None:
    """The factor that scales gradients of total norm `norm` down to `max_norm`: min(1, max_norm / (norm + 1e-6)),
    on the norm's device; None when max_norm is 0 (no clipping)."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0) if max_norm > 0 else None


def scale_grads_(params: list[nn.Parameter], norm: torch.Tensor, max_norm: float) -> None:
    """Scales the gradients, whose total norm is `norm`, down to `max_norm` (nothing when it is 0)."""
    scale = clip_scale(norm, max_norm)
    if scale is not None:
        for p in params:
            if p.grad is not None:
                _local(p.grad).mul_(scale)


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """The gradients' total norm (grad_norm), and the gradients scaled down to `max_norm` when it is > 0."""
    norm = grad_norm(params)
    scale_grads_(params, norm, max_norm)
    return norm
