"""train.parallel=fsdp: the dense model fully sharded over the ranks with PyTorch's FSDP2 (`fully_shard`).

    fully_shard_model(model, env, device, "bf16", True)   # in place: its blocks, memories, root
    model = build_sharded(build, shard, device, weights.drawing)   # never whole on a rank (below)
    weights = full_state_dict(model, env)          # whole, on rank 0 (best.pt)

Each rank holds 1/W of every dense parameter, its gradient and its optimizer state, as a DTensor sharded on
dim 0 over a 1-D device mesh of the W ranks (gloo on CPU, NCCL on GPU). Every block is one FSDP unit (its
parameters all-gathered before its forward and backward, its gradients reduce-scattered after the backward),
and the root unit holds the rest (embeddings, final norm, parameters several blocks share). With
`reshard_after_forward` a block frees its gathered weights after its forward and gathers them again for the
backward (train.fsdp_reshard_after_forward).

The memory value tables and Engram tables are left out of FSDP (its `ignored_params`): each
rank keeps them as today, replicated or sharded by column (model/memory/value_shards.py, read through
sharded_read.py), and distributed.average_value_grads_ averages their gradients. Why not FSDP or DTensor
for them: their gradient is row-sparse (one row per slot read) and their optimizer (LazyAdam) updates only
those rows, so a step costs in proportion to the rows read, not the table size. FSDP all-gathers whole
parameters and reduce-scatters dense gradients, which for a 512² x 1024 table is the whole table every
step; and a DTensor cannot hold a row-sparse (sparse COO) gradient (in torch 2.13 DTensor.from_local of one
fails on aten::view for the sparse backend). Today's column split already keeps their cost in rows read and
their memory at 1/W per rank.

A model larger than one process's memory is built as torchtitan builds one: on the meta device (shapes, no
memory), made FSDP units there, its shards allocated on the device (`to_empty`), then filled (build_sharded).
The fill is the full build's own initialisation run again on the CPU, one block at a time: every init function
(torch's layers, our embeddings, keys, query nets, value tables) draws the whole tensor, as the full build does,
from the same random stream in the same order, and each rank keeps its rows of it; so the sharded model starts
from the full build's weights bit for bit (tests/test_fsdp.py). Drawing the tensors sharded instead (a DTensor's
own random ops) would give other values: a CPU generator cannot skip to a shard's place in the stream. A rank
holds its shards, the parts outside the blocks (embeddings, norms) whole, and one block whole at a time.

Mixed precision (bf16, fp16) is FSDP's MixedPrecisionPolicy instead of autocast: the blocks compute with
their weights gathered in the low precision, gradients are reduced in float32 and the sharded weights and
optimizer states stay float32. The memory and Engram sublayers (`float32_parts`) are units of their own
whose weights stay float32 (inputs cast to float32, outputs back to the low precision), so that their key
search, softmax and value sums run in float32 as they do under autocast (model/memory/dtypes.py).
"""

from __future__ import annotations

import warnings
from collections import Counter
from contextlib import AbstractContextManager
from typing import Callable

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


def fully_shard_model(model: nn.Module, env: DistEnv, device: torch.device, precision: str,
                      reshard_after_forward: bool) -> nn.Module:
    """The blocks of `model` (a TransformerLM: model.blocks, memories(), engrams(), memory_value_parameters()) and
    the model itself made FSDP units in place, its memory and Engram sublayers too under mixed precision (module
    docstring); returns it."""
    blocks, kept_out = list(model.blocks), model.memory_value_parameters()
    float32_parts = [m for _, m in [*model.memories(), *model.engrams()]]
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


def build_sharded(build: Callable[..., nn.Module], shard: Callable[[nn.Module], object], device: torch.device,
                  drawing: Callable[[], AbstractContextManager]) -> nn.Module:
    """The model build() makes, made FSDP units by shard(model) (fully_shard_model), never whole on this rank: built
    on the meta device and sharded there, its parts allocated on `device`, then filled from build(built) run again
    on the CPU inside drawing() (the run's random stream: the full build's draws), `built(index, block)` taking each
    block as soon as it is drawn and emptying it (module docstring). `build` takes that hook as its argument
    (TransformerLM's `built`)."""
    with torch.device("meta"):
        model = build()  # shapes only: nothing drawn, nothing allocated
    shard(model)
    model.to_empty(device=device)  # this rank's shards, the tables FSDP leaves out, the buffers: uninitialised
    taken: set[int] = set()

    def built(index: int, block: nn.Module) -> nn.Module:
        _take(model.blocks[index], block, device, taken)
        return block.to("meta")  # its memory free for the next block

    with drawing():
        whole = build(built)
    _take(model, whole, device, taken)  # the rest: embeddings, norms, what the blocks share
    return model


def _take(into: nn.Module, drawn: nn.Module, device: torch.device, taken: set[int]) -> None:
    """Every tensor of `drawn` (a part of the full build, on the CPU) into `into` (the same part of the sharded
    model), module by module, each module once (one several blocks share: with the first): this rank's rows of an
    FSDP parameter (a DTensor sharded on dim 0, as FSDP2 cuts it: torch.chunk), the others (the tables FSDP leaves
    out, with their marks: is_memory_value, value_shard...) and the buffers as drawn."""
    for target, source in zip(into.modules(), drawn.modules()):
        if id(target) in taken:
            continue
        taken.add(id(target))
        for key, p in target._parameters.items():
            if isinstance(p, DTensor):
                rows = source._parameters[key].chunk(p.device_mesh.size(), dim=0)
                rank = p.device_mesh.get_local_rank()
                with torch.no_grad():
                    p.to_local().copy_(rows[rank] if rank < len(rows) else rows[0][:0])
            elif p is not None:
                target._parameters[key] = _moved(source._parameters[key], device)
        for key, b in target._buffers.items():
            if b is not None:
                target._buffers[key] = source._buffers[key].to(device)


def _moved(p: nn.Parameter, device: torch.device) -> nn.Parameter:
    """p on `device`, a Parameter with p's attributes and gradient dtype (a bfloat16 table's float32) (itself when it
    is there)."""
    if p.device == device:
        return p
    moved = nn.Parameter(p.detach().to(device), p.requires_grad)
    moved.__dict__.update(p.__dict__)
    if p.grad_dtype != p.dtype:
        moved.grad_dtype = p.grad_dtype
    return moved


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
