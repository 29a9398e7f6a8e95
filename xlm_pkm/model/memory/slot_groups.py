"""Lookups grouped by the slot they read, shared by both value-read backends (value_read.py and
triton_value_read.py): the table's gradient is built per distinct slot from these groups."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def group_by_slot(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """indices: (N, L) -> slots (U,) the distinct slots ascending, order (N*L,) the flat lookups
    n*L + l grouped by slot (stable), row_starts (U + 1,) where each slot's run begins in `order`."""
    slots_read, order = torch.sort(indices.reshape(-1), stable=True)  # (N*L,)
    slots, counts = torch.unique_consecutive(slots_read, return_counts=True)  # (U,)
    return slots, order, F.pad(torch.cumsum(counts, 0), (1, 0))


def table_gradient(slots: torch.Tensor, rows: torch.Tensor, shape: torch.Size, sparse: bool) -> torch.Tensor:
    """The table's gradient from its distinct rows (U, dim): sparse COO (coalesced), or dense."""
    if sparse:
        return torch.sparse_coo_tensor(slots.unsqueeze(0), rows, shape, is_coalesced=True, check_invariants=False)
    return rows.new_zeros(shape).index_copy_(0, slots, rows)
