"""Value stores: what a memory's slots hold, and how the slots a token selected become its output.

    store = VALUE_STORES[cfg.values](cfg, input_dim, output_dim, n_slots)
    out = store(x, indices, weights, sparse, backend)   # x (N, input_dim); indices (N, heads, knn) int64;
                                                        # weights (N, heads, knn[, cores]) -> (N, output_dim)
    store.tables()                                      # its row-sparse tables (marked is_memory_value)

Every table a store reads by slot is marked `is_memory_value`: the optimizers put it in the values
group (LazyAdam, Adagrad, SGD on sparse rows), sparse memory finetuning selects its rows, and with
`sparse` its gradient holds one row per distinct slot read. Everything else in a store (projections)
is dense. One store may be shared by several memories (memory.share_values, Memory+).

"table" is the paper's (§3.1): one (n_slots, output_dim) table, out = Σ_heads Σ_knn w · values[slot].
Variants register theirs from their own module (peer.py, ultramem.py), which pkm.py imports: importing
the layer registers every store (into VALUE_STORES, memory_settings.py's).
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod

import torch
from torch import nn

from xlm_pkm.errors import ConfigError
from xlm_pkm.model.memory.memory_settings import VALUE_STORES, MemoryConfig
from xlm_pkm.model.memory.value_read import read_values, read_values_op
from xlm_pkm.model.memory.value_shards import ValueShard, current_shard, init_shard


def mark_memory_value(p: nn.Parameter) -> nn.Parameter:
    """Marks p as a table read by slot (is_memory_value); returns it."""
    p.is_memory_value = True
    return p


def is_memory_value(p: torch.Tensor) -> bool:
    """Whether p is a table read by slot (marked by mark_memory_value)."""
    return getattr(p, "is_memory_value", False)


class ValueStore(nn.Module, ABC):
    """The interface; subclasses check their own constraints on cfg (one-line ValueErrors)."""

    stores_bfloat16 = False  # whether it honours cfg.value_dtype=bfloat16 (its tables stored in bfloat16)

    def __init__(self, cfg: MemoryConfig, input_dim: int, output_dim: int, n_slots: int):
        super().__init__()
        if cfg.value_dtype != "float32" and not self.stores_bfloat16:
            raise ConfigError(f"model.memory.value_dtype={cfg.value_dtype}: model.memory.values={cfg.values} keeps "
                              f"float32 tables (values=table stores bfloat16 ones)")
        self.input_dim, self.output_dim, self.n_slots = input_dim, output_dim, n_slots

    @abstractmethod
    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, sparse: bool,
                backend: str) -> torch.Tensor:
        """x (N, input_dim), indices (N, H, K), weights (N, H, K[, cores]) -> (N, output_dim). sparse: the
        tables' gradients are row-sparse; backend: the resolved value-read backend (value_read.py)."""

    def tables(self) -> list[nn.Parameter]:
        """The tables read by slot (each (n_slots, width))."""
        return [p for p in self.parameters() if is_memory_value(p)]

    def projections(self) -> list[nn.Parameter]:
        """The dense maps the values go through after their read (UltraMem's implicit value expansion), if any."""
        return []

    def table_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """The rows of the tables that `slots` read (here the same: a table row per slot; UltraMem's
        expanded store maps virtual slots to physical rows)."""
        return slots

    def flops_per_token(self, heads: int, knn: int) -> float:
        """Training FLOPs per token of the store's reads and dense parts (forward + backward)."""
        dense = sum(p.numel() for p in self.parameters() if not is_memory_value(p))
        return 6.0 * (dense + heads * knn * sum(p.shape[1] for p in self.tables()))

    def check(self, n_slots: int, output_dim: int) -> None:
        """Raises if this (shared) store cannot serve a memory of n_slots slots and output_dim outputs."""
        if (self.n_slots, self.output_dim) != (n_slots, output_dim):
            raise ValueError(f"shared values hold {self.n_slots} slots of {self.output_dim} outputs, "
                             f"this memory needs {n_slots} of {output_dim}")


def read_without_grad(table: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, backend: str,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """read_values of a table with no gradient, (N, dim) in out_dtype: the Triton read sums in float32 and writes
    out_dtype; the torch read writes the table's dtype, at least float32 (value_read.py), then cast."""
    if backend == "triton":
        from xlm_pkm.model.memory.triton_value_read import fused_read  # imports Triton only when used
        return fused_read(table, indices, weights, out_dtype)
    return read_values(table, indices, weights, False, backend).to(out_dtype)


@VALUE_STORES.register("table")
class TableValues(ValueStore):
    """One (n_slots, output_dim) table `weight`, init N(0, 1/output_dim); read as weighted sums (value_read.py,
    with cfg.read_backward and cfg.read_op). With cfg.shard_values, this rank's (n_slots, output_dim / W) columns
    (value_shards.py), marked `value_shard`, and the read exchanges lookups and output slices with the other
    ranks (eagerly, in two passes: read_op does not apply).
    cfg.inference_values=bfloat16: a read without gradients (evaluation, generation) of a float32 table reads a
    bfloat16 copy of it instead, made at the first such read and again whenever the table changed (its version
    counter: an optimizer step, a load), kept out of the state dict; the output stays float32 (the Triton read
    sums in float32 and writes float32; the torch read sums the distinct rows read in float32). The copy costs half
    the table's memory again.
    cfg.value_dtype=bfloat16: the table itself is stored in bfloat16, drawn as the float32 one and rounded to
    nearest; it is read in float32 (value_read.py) and its gradient is float32 (the parameter's grad_dtype), which
    the values optimizer adds to its rows rounding stochastically (optim/stochastic_rounding.py)."""

    stores_bfloat16 = True

    def __init__(self, cfg: MemoryConfig, input_dim: int, output_dim: int, n_slots: int):
        super().__init__(cfg, input_dim, output_dim, n_slots)
        shard = current_shard(output_dim) if cfg.shard_values is True else ValueShard(0, 1)
        weight = torch.empty(n_slots, shard.width(output_dim), dtype=getattr(torch, cfg.value_dtype))
        init_shard(weight, output_dim, shard)  # drawn in float32 a chunk of rows at a time: no float32 table
        self.weight = mark_memory_value(nn.Parameter(weight))
        if cfg.value_dtype != "float32":
            self.weight.grad_dtype = torch.float32  # its gradient rows, summed in float32, stay float32
        if cfg.shard_values is True:
            self.weight.value_shard = shard
        self.read = functools.partial(read_values, read_backward=cfg.read_backward, read_op=cfg.read_op)
        self.inference_bfloat16 = cfg.inference_values == "bfloat16"
        self._copy, self._copy_of = None, None  # the bfloat16 copy, and (data_ptr, version) of the table it copies
        if cfg.read_op == "custom_op":
            read_values_op()  # defined here, eagerly: a compiled forward finds it
        if shard.world > 1 and cfg.value_dtype != "float32":
            raise ConfigError(f"model.memory.value_dtype={cfg.value_dtype}: model.memory.shard_values=true splits "
                              f"each row over the processes, but the stochastic rounding keys its bits by the column "
                              f"of a whole row: set model.memory.shard_values=false (auto keeps bfloat16 tables whole)")
        if shard.world > 1:  # a shard of a table split over processes: the exchanging read, eager, in two passes
            if cfg.read_backward == "one_pass" or cfg.inference_values != "table":
                raise ValueError(f"model.memory.shard_values: a sharded table is read by its own exchanging read, "
                                 f"in two passes from the table itself: read_backward=one_pass and "
                                 f"inference_values=bfloat16 do not apply, got read_backward={cfg.read_backward} "
                                 f"and inference_values={cfg.inference_values}")
            from xlm_pkm.model.memory.sharded_read import sharded_read  # imported only here: it loads torch._dynamo
            self.read = sharded_read

    def forward(self, x, indices, weights, sparse, backend):
        if weights.dim() != 3:
            raise ValueError("memory.values=table reads one weight per slot; scores with a cores axis "
                             "need a store that splits values by core")
        N = indices.shape[0]
        indices, weights = indices.reshape(N, -1), weights.reshape(N, -1)  # (N, heads * knn): heads summed
        if self.inference_bfloat16 and not torch.is_grad_enabled() and self.weight.dtype == torch.float32:
            return read_without_grad(self.bfloat16_copy(), indices, weights, backend, self.weight.dtype)
        return self.read(self.weight, indices, weights, sparse, backend)

    def bfloat16_copy(self) -> torch.Tensor:
        """The table in bfloat16, copied again when the table changed since the last copy."""
        current = (self.weight.data_ptr(), self.weight._version)
        if self._copy_of != current:
            self._copy, self._copy_of = self.weight.detach().to(torch.bfloat16), current
        return self._copy

    def flops_per_token(self, heads: int, knn: int) -> float:
        return 6.0 * heads * knn * self.output_dim  # every column, also when this rank holds a shard

    def extra_repr(self) -> str:
        return f"slots={self.n_slots}, width={self.weight.shape[1]}"
