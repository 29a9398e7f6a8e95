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
the per-slice partial dot products (sharded_read.py). The key search stays replicated, so the memory statistics are
unchanged. The table gradient is the sum over every rank's tokens: the trainer divides it by W
(distributed.average_value_grads_), as DDP averages the other gradients.

Why by dimension rather than by slot: a slot split routes each lookup to the rank owning its slot,
and with L = 128 lookups a token touches almost every rank, so each sends and receives ~min(W, L)
partial rows of d values per token; the dimension split moves W·L lookups (8 bytes each) and 2·d
output values per token. For the paper's memory (heads 4, knn 32, d 1024) on 32 ranks that is
~56 KB against ~250 KB per token (docs/sparse-and-sharded-values.md), and every rank does exactly
1/W of every read (no hot-slot imbalance).

Initialisation is the unsharded table's: the rows are drawn in chunks of the same random stream and
each rank keeps its columns, so a sharded model starts from the same weights as a replicated one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

INIT_CHUNK_ROWS = 4096  # rows drawn at a time when initialising a shard (a multiple of 16, see init_shard)


@dataclass(frozen=True)
class ValueShard:
    """Rank `rank` of `world` holds columns `columns(dim)` of each value row, `width(dim)` of them."""

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
    if weight.is_meta:  # shapes only (a model built on the meta device to count its parameters)
        return
    n, columns = weight.shape[0], shard.columns(dim)
    with torch.no_grad():
        start = 0
        while start < n:
            stop = n if n - start < 2 * INIT_CHUNK_ROWS else start + INIT_CHUNK_ROWS  # no small last chunk
            weight[start:stop] = torch.empty(stop - start, dim).normal_(0.0, dim**-0.5)[:, columns]
            start = stop
