"""train.parallel=fsdp: the dense model fully sharded over the ranks with PyTorch's FSDP2 (`fully_shard`).

    model = fully_shard_model(model, blocks, float32_parts, kept_out, env, device, "bf16", True)  # in place
    weights = full_state_dict(model, env)          # whole, on rank 0 (best.pt)

Each rank holds 1/W of every dense parameter, its gradient and its optimizer state, as a DTensor sharded on
dim 0 over a 1-D device mesh of the W ranks (gloo on CPU, NCCL on GPU). Every block is one FSDP unit (its
parameters all-gathered before its forward and backward, its gradients reduce-scattered after the backward),
and the root unit holds the rest (embeddings, final norm, parameters several blocks share). With
`reshard_after_forward` a block frees its gathered weights after its forward and gathers them again for the
backward (train.fsdp_reshard_after_forward).

The memory value tables and Engram tables (`kept_out`) are left out of FSDP (its `ignored_params`): each
rank keeps them as today, replicated or sharded by column (model/memory/value_shards.py, read through
sharded_read.py), and distributed.average_value_grads_ averages their gradients. Why not FSDP or DTensor
for them: their gradient is row-sparse (one row per slot read) and their optimizer (LazyAdam) updates only
those rows, so a step costs in proportion to the rows read, not the table size. FSDP all-gathers whole
parameters and reduce-scatters dense gradients, which for a 512² x 1024 table is the whole table every
step; and a DTensor cannot hold a row-sparse (sparse COO) gradient (in torch 2.13 DTensor.from_local of one
fails on aten::view for the sparse backend). Today's column split already keeps their cost in rows read and
their memory at 1/W per rank.

Mixed precision (bf16, fp16) is FSDP's MixedPrecisionPolicy instead of autocast: the blocks compute with
their weights gathered in the low precision, gradients are reduced in float32 and the sharded weights and
optimizer states stay float32. The memory and Engram sublayers (`float32_parts`) are units of their own
whose weights stay float32 (inputs cast to float32, outputs back to the low precision), so that their key
search, softmax and value sums run in float32 as they do under autocast (model/memory/dtypes.py).
"""

from __future__ import annotations

import warnings
from collections import Counter

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from xlm_pkm.runtime.distributed import DistEnv
from xlm_pkm.runtime.precision import DTYPES


def world_mesh(device: torch.device, env: DistEnv) -> DeviceMesh:
    """The 1-D mesh of every rank, on the default process group."""
    return init_device_mesh(device.type, (env.world_size,))


def fully_shard_model(model: nn.Module, blocks: list[nn.Module], float32_parts: list[nn.Module],
                      kept_out: list[nn.Parameter], env: DistEnv, device: torch.device, precision: str,
                      reshard_after_forward: bool) -> nn.Module:
    """`model`, its `blocks` and `model` itself made FSDP units in place (module docstring); returns it."""
    # FSDP warns at the first forward that the model's output (the NLL, a view) would lose its backward hook to an
    # in-place op: the training step only takes its mean
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    mesh = world_mesh(device, env)
    ignored = set(kept_out)
    low = DTYPES.get(precision)  # None: fp32
    policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low else None)
    uses = Counter(id(p) for block in blocks for p in {id(q): q for q in block.parameters()}.values())
    shared = {p for block in blocks for p in block.parameters() if uses[id(p)] > 1}  # to the root unit
    for block in blocks:
        if low:  # float32 units inside the block first: FSDP gives each parameter to the first unit made on it
            for part in float32_parts:
                if any(part is m for m in block.modules()):
                    fully_shard(part, mesh=mesh, reshard_after_forward=reshard_after_forward,
                                mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                                               output_dtype=low),
                                ignored_params=ignored | shared)
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy,
                    ignored_params=ignored | shared)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy,
                ignored_params=ignored)
    return model


def full_state_dict(model: nn.Module, env: DistEnv) -> dict[str, torch.Tensor]:
    """model.state_dict() with each FSDP-sharded tensor gathered whole (one at a time), on rank 0 only; every
    rank keeps the tensors that FSDP does not shard (buffers, value tables: its own columns of sharded ones)."""
    out = {}
    for name, t in model.state_dict().items():
        if isinstance(t, DTensor):
            whole = t.full_tensor()  # collective: every rank gathers it
            if env.is_main:
                out[name] = whole.cpu()
        else:
            out[name] = t
    return out
