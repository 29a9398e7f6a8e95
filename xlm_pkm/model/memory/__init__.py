"""The product-key memory layer (Lample et al. 2019) and its parts. A new memory design goes here.

    pkm.py                ProductKeyMemory: query network, key search, softmax, value read (§3, on one screen)
    keys.py               key searches by name (KEY_SEARCHES): product keys, flat keys (Table 4)
    value_read.py         out[n] = Σ w · values[idx]: dense or row-sparse table gradient
    triton_value_read.py  the same read as Triton kernels (GPUs; Triton's interpreter on CPU)
    slot_groups.py        lookups grouped by slot, shared by both value-read backends
    value_shards.py       the value table sharded across ranks by embedding dimension
    sharded_read.py       the read of a sharded table (lookups all-gathered, local columns)
    stats.py              usage and KL of the slot weights (§4.2)
    dtypes.py             search, softmax and sums in at least float32

    from xlm_pkm.model.memory import ProductKeyMemory   # the layer alone: needs only torch

May import: errors, config, registry (never the rest of model/: the transformer imports the memory).
"""

from xlm_pkm.model.memory.pkm import ProductKeyMemory

__all__ = ["ProductKeyMemory"]
