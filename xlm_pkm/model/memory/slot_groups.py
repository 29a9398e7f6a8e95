"""Lookups grouped by the slot they read, shared by both value-read backends (value_read.py and
triton_value_read.py) and the key search's backward (selected_scores.py): a table's gradient is built per
slot from these groups.

Two groupings of the same stable sort: `group_by_slot` keeps the distinct slots read (U of them, a
data-dependent size: one host sync on a GPU, and a graph break under torch.compile), for a sparse
gradient; `slot_runs` gives every slot of the table a run, empty when unread (fixed shapes, no sync), for
a dense one."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def group_by_slot(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """indices: (N, L) -> slots (U,) the distinct slots ascending, order (N*L,) the flat lookups
    n*L + l grouped by slot (stable), row_starts (U + 1,) where each slot's run begins in `order`."""
    slots_read, order = torch.sort(indices.reshape(-1), stable=True)  # (N*L,)
    slots, counts = torch.unique_consecutive(slots_read, return_counts=True)  # (U,)
    return slots, order, F.pad(torch.cumsum(counts, 0), (1, 0))


def slot_runs(indices: torch.Tensor, n_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """indices: (N, L) in [0, n_slots) -> order (N*L,) the flat lookups n*L + l grouped by slot (stable, as
    group_by_slot's), row_starts (n_slots + 1,): slot s's run is order[row_starts[s]:row_starts[s + 1]]."""
    slots_read, order = torch.sort(indices.reshape(-1), stable=True)  # (N*L,)
    bounds = torch.arange(n_slots + 1, device=indices.device, dtype=slots_read.dtype)
    return order, torch.searchsorted(slots_read, bounds)  # (n_slots + 1,): the first lookup of slot >= s


def table_gradient(slots: torch.Tensor, rows: torch.Tensor, shape: torch.Size, sparse: bool) -> torch.Tensor:
    """The table's gradient from its distinct rows (U, dim): sparse COO (coalesced), or dense."""
    if sparse:
        return torch.sparse_coo_tensor(slots.unsqueeze(0), rows, shape, is_coalesced=True, check_invariants=False)
    return rows.new_zeros(shape).index_copy_(0, slots, rows)
