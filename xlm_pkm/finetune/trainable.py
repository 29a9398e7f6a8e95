"""Which parameters a run trains (`optim.trainable`): all of them, the memories, the value tables only,
or those whose names match glob patterns. A retrofit's base weights (model/retrofit.py) never train: `all` is
then every memory, its gate, and LoRA's adapters; `memory` a memory and its gate (MemoryBeside). With
model.base.trainable (full finetuning) they are the model's own weights: `all` trains them too, patterns may
name them (base.*).

Frozen parameters get requires_grad=False, so no gradient and no optimizer state. A module none of whose
parameters train (a frozen query network's BatchNorm, say) stays in eval mode whatever model.train()
asks, so its running statistics do not drift and the key search of a memory whose values alone train
stays as it was. With `optim.freeze_norm_stats` every BatchNorm stays in eval mode, trainable or not: it
normalises with its running statistics, which no step changes, while its affine weights may still train
(full finetuning on one-fact batches would otherwise move the memory's query statistics).
"""

from __future__ import annotations

import fnmatch

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from xlm_pkm.errors import ConfigError
from xlm_pkm.model.memory.pkm import ProductKeyMemory
from xlm_pkm.model.memory.value_stores import is_memory_value
from xlm_pkm.model.retrofit import MemoryBeside, is_base_weight

PRESETS = ("all", "memory", "memory_values")


def trains(name: str, param: nn.Parameter, memory_names: set[str], spec: list[str]) -> bool:
    """Whether parameter `name` trains under `spec` (one preset, or glob patterns over parameter names)."""
    if is_base_weight(param):
        return False
    if spec == ["all"]:
        return True
    if spec == ["memory_values"]:
        return is_memory_value(param)
    if spec == ["memory"]:
        return is_memory_value(param) or any(name.startswith(prefix + ".") for prefix in memory_names)
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in spec)


def freeze(model: nn.Module, spec: list[str], freeze_norm_stats: bool = False) -> int:
    """Freezes the parameters `spec` does not train and pins fully frozen modules (with `freeze_norm_stats`,
    every BatchNorm too) to eval mode; returns the number of trainable parameter elements. A pattern matching
    no parameter, or a spec that trains nothing, is a ConfigError."""
    names = [name for name, _ in model.named_parameters()]
    if not (len(spec) == 1 and spec[0] in PRESETS):
        for pattern in spec:
            if not fnmatch.filter(names, pattern):
                raise ConfigError(f"optim.trainable: pattern {pattern!r} matches no parameter of the model")
    memory_names = {name for name, m in model.named_modules() if isinstance(m, (ProductKeyMemory, MemoryBeside))}
    chosen = {name: trains(name, p, memory_names, spec) for name, p in model.named_parameters()}
    if not any(chosen.values()):
        why = "the model has no memory" if spec in (["memory"], ["memory_values"]) else "it selects no parameter"
        raise ConfigError(f"optim.trainable={spec}: nothing to train ({why}); use all, memory, memory_values "
                          f"(with a memory) or glob patterns over parameter names")
    for name, p in model.named_parameters():
        p.requires_grad_(chosen[name])
    for module in model.modules():
        params = list(module.parameters())
        frozen = bool(params) and not any(p.requires_grad for p in params)
        if frozen or freeze_norm_stats and isinstance(module, _BatchNorm):
            module.train = _pinned_eval(module)
            module.train(False)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _pinned_eval(module: nn.Module):
    """A train() for `module` that keeps it (and its children) in eval mode."""
    return lambda mode=True: nn.Module.train(module, False)
