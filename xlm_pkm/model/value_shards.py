"""Memory values sharded across ranks by embedding dimension (model.memory.shard_values=true).

With W processes, rank r holds columns [r·d/W, (r+1)·d/W) of every row of a value table, and its
optimizer holds the moments of those columns only: the table and its optimizer state take 1/W of
the memory on each rank, so the memory's size grows with the number of GPUs. A read of N tokens per
rank, L = heads·knn lookups each:

    all-gather the lookups        (N, L) indices and weights -> (W·N, L): every rank's tokens
    read the local columns        (W·N, d/W) = Σ_l w · values_shard[idx]   (value_read.py, any backend)
    all-to-all the slices         rank j gets its tokens' slice from every rank -> (N, d)

and the backward reverses it: all-to-all of the output gradient, the local table gradient (dense, or
sparse rows for LazyAdam) needs no communication, and the weights' gradient is a reduce-scatter of
the per-slice partial dot products. The key search stays replicated, so the memory statistics are
unchanged. The table gradient is the sum over every rank's tokens: the trainer divides it by W
(distributed.average_value_grads_), as DDP averages the other gradients.

Why by dimension rather than by slot: a slot split routes each lookup to the rank owning its slot,
and with L = 128 lookups a token touches almost every rank, so each sends and receives ~min(W, L)
partial rows of d values per token; the dimension split moves W·L lookups (8 bytes each) and 2·d
output values per token. For the paper's memory (heads 4, knn 32, d 1024) on 32 ranks that is
~56 KB against ~250 KB per token (README: "Sharded memory values"), and every rank does exactly
1/W of every read (no hot-slot imbalance).

Initialisation is the unsharded table's: the rows are drawn in chunks of the same random stream and
each rank keeps its columns, so a sharded model starts from the same weights as a replicated one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from xlm_pkm.model.value_read import read_values

# torch 2.13 renamed the single-tensor collectives (the old names warn); 2.6-2.12 have the old ones only
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

INIT_CHUNK_ROWS = 4096  # rows drawn at a time when initialising a shard (a multiple of 16, see init_shard)


@dataclass(frozen=True)
class ValueShard:
    """Rank `rank` of `world` holds columns [start(dim), stop(dim)) of each value row."""

    rank: int
    world: int

    def width(self, dim: int) -> int:
        return dim // self.world

    def columns(self, dim: int) -> slice:
        return slice(self.rank * dim // self.world, (self.rank + 1) * dim // self.world)


def current_shard(dim: int) -> ValueShard:
    """This process's shard in the default process group (rank 0 of 1 without one)."""
    shard = ValueShard(dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else ValueShard(0, 1)
    if dim % shard.world:
        raise ValueError(f"model.memory.shard_values: the value dimension {dim} does not split into "
                         f"{shard.world} equal slices (one per process); use a world size dividing it")
    return shard


def init_shard(weight: torch.Tensor, dim: int, shard: ValueShard) -> None:
    """weight: (n_slots, dim/W), set to this shard's columns of an (n_slots, dim) N(0, 1/dim) table, the
    unsharded init, drawn row-chunk by row-chunk. torch's CPU normal_ draws blocks of 16 values, so
    chunks whose sizes are multiples of 16 (all but the last, which ends where the whole table ends)
    consume the random stream exactly as one draw of the whole table (tests/test_value_shards.py)."""
    n, columns = weight.shape[0], shard.columns(dim)
    with torch.no_grad():
        start = 0
        while start < n:
            stop = n if n - start < 2 * INIT_CHUNK_ROWS else start + INIT_CHUNK_ROWS  # no small last chunk
            weight[start:stop] = torch.empty(stop - start, dim).normal_(0.0, dim**-0.5)[:, columns]
            start = stop


def _token_counts(n: int, device: torch.device, world: int) -> list[int]:
    """The token count of every rank (a host sync)."""
    counts = torch.empty(world, dtype=torch.long, device=device)
    all_gather_single(counts, torch.tensor([n], device=device))
    return counts.tolist()


def _gather(x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """x: (n_r, ...) on rank r -> (Σ n, ...) every rank's rows in rank order."""
    longest = max(counts)
    padded = x.new_zeros(longest, *x.shape[1:])
    padded[: x.shape[0]] = x
    out = x.new_empty(len(counts) * longest, *x.shape[1:])
    all_gather_single(out, padded)
    if all(c == longest for c in counts):
        return out
    return torch.cat([out[r * longest: r * longest + c] for r, c in enumerate(counts)])


class _GatherLookups(torch.autograd.Function):
    """Forward: all-gather the rows of every rank. Backward: each rank gets the sum over ranks of the
    gradient of its own rows (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, counts):  # x: (n_r, L) -> (Σ n, L)
        ctx.counts, ctx.rank = counts, dist.get_rank()
        return _gather(x, counts)

    @staticmethod
    def backward(ctx, grad):  # (Σ n, L) -> (n_r, L)
        counts, longest = ctx.counts, max(ctx.counts)
        padded = grad.new_zeros(len(counts), longest, *grad.shape[1:])
        for r, rows in enumerate(grad.split(counts)):
            padded[r, : rows.shape[0]] = rows
        out = grad.new_empty(longest, *grad.shape[1:])
        reduce_scatter_single(out, padded.view(-1, *grad.shape[1:]).contiguous())
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
