"""DTensors (FSDP's sharded parameters, runtime/fsdp.py) told apart and read locally, without importing
torch.distributed.tensor where none can exist: that import takes a second or more of every command's start.
"""

from __future__ import annotations

import sys

import torch


def is_dtensor(t: object) -> bool:
    """Whether `t` is a DTensor (none can be before torch.distributed.tensor is imported)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The entries this rank holds, as a plain tensor sharing t's storage: a DTensor's local shard, else t."""
    return t.to_local() if is_dtensor(t) else t
