"""The lookups grouped by slot (model/memory/slot_groups.py) against a grouping written out in Python."""

from __future__ import annotations

import torch

from xlm_pkm.model.memory.slot_groups import group_by_slot, slot_runs


def _python_groups(indices: torch.Tensor, n_slots: int) -> list[list[int]]:
    """Each slot's flat lookups n*L + l, in order: the stable grouping both functions promise."""
    groups = [[] for _ in range(n_slots)]
    for flat, slot in enumerate(indices.reshape(-1).tolist()):
        groups[slot].append(flat)
    return groups


def test_slot_runs_give_every_slot_its_lookups_in_order_and_unread_slots_empty_runs():
    gen = torch.Generator().manual_seed(0)
    n_slots = 37
    for shape in [(50, 6), (1, 1), (3, 4), (0, 4)]:
        indices = torch.randint(0, n_slots, shape, generator=gen)
        indices[..., :1] = n_slots - 1 if indices.numel() else indices[..., :1]  # the last slot read too
        order, row_starts = slot_runs(indices, n_slots)
        assert row_starts.shape == (n_slots + 1,) and order.shape == (indices.numel(),)
        groups = _python_groups(indices, n_slots)
        assert [order[row_starts[s]:row_starts[s + 1]].tolist() for s in range(n_slots)] == groups
        if indices.numel():  # the distinct slots' runs are group_by_slot's
            slots, sparse_order, sparse_starts = group_by_slot(indices)
            assert torch.equal(sparse_order, order)
            assert torch.equal(sparse_starts, row_starts[torch.cat([slots, slots[-1:] + 1])])


def test_slot_runs_trace_as_one_graph():
    """Fixed shapes: torch.compile sees one graph (group_by_slot's unique count is a graph break)."""
    explained = torch._dynamo.explain(lambda i: slot_runs(i, 16))(torch.randint(0, 16, (8, 4)))
    assert explained.graph_break_count == 0 and explained.graph_count == 1
