"""LoRA finetuning (`optim.lora`): low-rank adapters, through peft, on the model's attention and FFN linears.

    trainable = add_adapters(model, cfg.optim)   # after the weights are loaded: only the adapters train
    state = merged_state_dict(model)             # a plain TransformerLM state dict, adapters merged in

Each targeted `nn.Linear` W becomes W + (alpha / rank) · B A with A (rank, in) and B (out, rank); B starts at
zero, so the adapted model starts as the base model. LoRA replaces `optim.trainable`: it must be `all`,
read as "every adapter", and every other parameter is frozen (memory values included). In a retrofit
(model/retrofit.py) the adapters go on the base's linears and train with the memories and their gates (the base's
own weights stay frozen), or, with optim.trainable's glob patterns, those they name (`*.lora_*`: the adapters
alone, the LoRA of Lin et al. 2025's comparison), and both checkpoints keep the adapters apart (they hold no base
weight to merge them into: checkpoint/trained.py merges them when it loads the run's model).

Checkpoints: checkpoint.pt holds the adapted model's state dict (base weights under `….base_layer.…`, the
adapters under `….lora_A/lora_B.…`) and the adapters' optimizer state, so a run resumes exactly; best.pt holds
the merged weights under the plain names, so evaluate.py, generate.py, export and train.init_from load it
as any other model (its config still records optim.lora, which they ignore).
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from xlm_pkm.errors import ConfigError
from xlm_pkm.finetune.trainable import freeze
from xlm_pkm.model.retrofit import is_base_weight
from xlm_pkm.optim.optim_settings import LoraConfig, OptimConfig

ADAPTER = "default"  # peft's adapter name
# each attention and FFN linear: our names (model/attention.py, blocks.py), then the Llama family's (a retrofit's base)
TARGET_PRESETS = {"attention_ffn": ("*.qkv", "*.out", "*.fc1", "*.fc2", "base.*.q_proj", "base.*.k_proj",
                                    "base.*.v_proj", "base.*.o_proj", "base.*.gate_proj", "base.*.up_proj",
                                    "base.*.down_proj")}
MISSING_PEFT = "optim.lora needs peft: pip install 'xlm-pkm[lora]' (or pip install peft)"


def target_modules(model: nn.Module, targets: list[str]) -> list[str]:
    """Names of the linears `targets` (globs over module names, or a preset) selects; a glob (a preset) matching no
    linear is a ConfigError."""
    preset = len(targets) == 1 and targets[0] in TARGET_PRESETS
    globs = TARGET_PRESETS[targets[0]] if preset else targets
    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    chosen = [name for name in linears if any(fnmatch.fnmatchcase(name, pattern) for pattern in globs)]
    if preset:  # a preset names every model's linears: some of them match
        unmatched = [] if chosen else targets
    else:
        unmatched = [pattern for pattern in globs if not fnmatch.filter(linears, pattern)]
    if unmatched:
        raise ConfigError(f"optim.lora.targets: {unmatched[0]!r} matches no linear layer of the model "
                          f"(presets: {', '.join(TARGET_PRESETS)})")
    return chosen


def add_adapters(model: nn.Module, optim: OptimConfig) -> int:
    """Injects optim.lora's adapters into `model` in place and freezes everything else; returns the
    number of trainable parameter elements."""
    retrofit = any(is_base_weight(p) for p in model.parameters())  # its memories may train too, never its base
    if optim.trainable != ["all"] and not retrofit:
        raise ConfigError(f"optim.lora.rank={optim.lora.rank} trains the adapters only: optim.trainable must "
                          f"be all, got {' '.join(optim.trainable)}")
    try:
        import peft
    except ImportError:
        raise ConfigError(MISSING_PEFT) from None
    lora: LoraConfig = optim.lora
    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0,
                             target_modules=target_modules(model, lora.targets))
    peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    return freeze(model, optim.trainable if retrofit else ["*.lora_A.*", "*.lora_B.*"], optim.freeze_norm_stats)


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict the model would have without adapters, each adapted weight W + (alpha/rank) B A."""
    from peft.tuners.lora import LoraLayer

    deltas = {f"{name}.weight": module.get_delta_weight(ADAPTER).detach()
              for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    merged = {}
    for key, value in model.state_dict().items():
        if ".lora_" in key:
            continue
        plain = key.replace(".base_layer.", ".")
        merged[plain] = value + deltas[plain] if plain in deltas else value
    return merged


def uses_lora(optim: OptimConfig) -> bool:
    return optim.lora.rank > 0
