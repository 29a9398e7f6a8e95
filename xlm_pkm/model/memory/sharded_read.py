"""The read of a sharded value table (value_shards.py): lookups all-gathered, local columns read, output
slices exchanged all-to-all; backward reversed, the weights' gradient reduce-scattered.

Imported by ProductKeyMemory only when it holds a shard of a table split over several processes:
`torch.compiler.disable` imports torch._dynamo (about a second), which unsharded runs do not pay.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from xlm_pkm.model.memory.value_read import read_values

# torch 2.13 renamed the single-tensor collectives (the old names warn); 2.6-2.12 have the old ones only
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _token_counts(n: int, device: torch.device, world: int) -> list[int]:
    """The token count of every rank (a host sync)."""
    counts = torch.empty(world, dtype=torch.long, device=device)
    all_gather_single(counts, torch.tensor([n], device=device))
    return counts.tolist()


def _blocks(x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """x: (Σ n, ...) every rank's rows in rank order -> (W·max n, ...), rank r's block at r·max n, zero-padded
    (x itself when the counts are equal, as in training: no copy)."""
    longest = max(counts)
    if all(c == longest for c in counts):
        return x.contiguous()
    padded = x.new_zeros(len(counts), longest, *x.shape[1:])
    for r, rows in enumerate(x.split(counts)):
        padded[r, : rows.shape[0]] = rows
    return padded.view(-1, *x.shape[1:])


def _unblock(x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The inverse of _blocks: (W·max n, ...) -> (Σ n, ...)."""
    longest = max(counts)
    if all(c == longest for c in counts):
        return x
    return torch.cat([x[r * longest: r * longest + c] for r, c in enumerate(counts)])


def _gather(x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """x: (n_r, ...) on rank r -> (Σ n, ...) every rank's rows in rank order."""
    longest = max(counts)
    if x.shape[0] < longest:
        x = torch.cat([x, x.new_zeros(longest - x.shape[0], *x.shape[1:])])
    out = x.new_empty(len(counts) * longest, *x.shape[1:])
    all_gather_single(out, x.contiguous())
    return _unblock(out, counts)


class _GatherLookups(torch.autograd.Function):
    """Forward: all-gather the rows of every rank. Backward: each rank gets the sum over ranks of the
    gradient of its own rows (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, counts):  # x: (n_r, L) -> (Σ n, L)
        ctx.counts, ctx.rank = counts, dist.get_rank()
        return _gather(x, counts)

    @staticmethod
    def backward(ctx, grad):  # (Σ n, L) -> (n_r, L)
        counts = ctx.counts
        out = grad.new_empty(max(counts), *grad.shape[1:])
        reduce_scatter_single(out, _blocks(grad, counts))
        return out[: counts[ctx.rank]], None


def _all_to_all(x: torch.Tensor, send: list[int], receive: list[int]) -> torch.Tensor:
    out = x.new_empty(sum(receive), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=receive, input_split_sizes=send)
    return out


class _ExchangeSlices(torch.autograd.Function):
    """Forward: (Σ n, d/W) this rank's columns of every rank's tokens -> (n_r, d) every column of this
    rank's tokens. Backward: the reverse exchange."""

    @staticmethod
    def forward(ctx, part, counts):
        ctx.counts, world = counts, len(counts)
        n = counts[dist.get_rank()]
        got = _all_to_all(part, counts, [n] * world)  # (W·n, d/W): block j is rank j's columns
        return got.view(world, n, -1).transpose(0, 1).reshape(n, -1)

    @staticmethod
    def backward(ctx, grad):  # (n, d) -> (Σ n, d/W)
        counts, world = ctx.counts, len(ctx.counts)
        n = grad.shape[0]
        blocks = grad.view(n, world, -1).transpose(0, 1).reshape(world * n, -1)  # block j: rank j's columns
        return _all_to_all(blocks, [n] * world, counts), None


@torch.compiler.disable  # collectives with Python-side sizes: run eagerly between compiled graphs
def sharded_read(table: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, sparse: bool,
                 backend: str = "torch") -> torch.Tensor:
    """table: (n_slots, d/W) this rank's columns; indices, weights: (N, L) this rank's lookups -> (N, d),
    equal to read_values on the whole table. Every rank of the process group must call it together."""
    counts = _token_counts(indices.shape[0], indices.device, dist.get_world_size())
    narrow = torch.int32 if table.shape[0] < 2**31 else torch.int64  # half the bytes on the wire
    all_indices = _gather(indices.to(narrow), counts).long()  # (Σ N, L)
    all_weights = _GatherLookups.apply(weights, counts)  # (Σ N, L)
    part = read_values(table, all_indices, all_weights, sparse, backend)  # (Σ N, d/W)
    return _ExchangeSlices.apply(part, counts)
