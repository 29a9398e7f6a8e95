"""The optimizer section of a run's config (optim), and the registries its names are chosen from: the leaf
of optim/, which imports none of its code, so that the code imports its settings and never the reverse.

    OptimConfig           optim: the dense group's optimizer and schedule, the memory values' own group
    MemoryFinetuneConfig  optim.memory_finetune (finetune/memory_finetune.py)
    LoraConfig            optim.lora (finetune/lora.py)
    DENSE_OPTIMIZERS      optim.optimizer: DenseOptimizer entries, registered by optimizers.py
    VALUE_OPTIMIZERS      optim.values_optimizer: ValueOptimizer entries, registered by optimizers.py
    SCHEDULES             optim.schedule: (step, OptimConfig) -> lr, registered by schedule.py

A registry is filled when the module that registers into it is imported (optimizers.py imports schedule.py):
config.py imports them before it checks a config, and a plugin registers here as they do (registry.py).
LoRA and sparse memory finetuning run in finetune/, which loads checkpoints and so sits above config.py; their
settings are part of this section (which parameters and rows a step updates), so they live here, below it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Literal

from xlm_pkm.errors import ConfigError
from xlm_pkm.registry import Registry
from xlm_pkm.settings import execution, non_negative, one_of, positive, probability

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass(frozen=True)
class DenseOptimizer:
    """An entry of DENSE_OPTIMIZERS: how the dense group's optimizer is built, and the state it keeps."""

    build: Callable[[list[nn.Parameter], OptimConfig], torch.optim.Optimizer]
    # state values it keeps per parameter element (Adam's two moments, Adagrad's sum, SGD's none): the memory
    # a model needs to train (train/memory_estimate.py, and so train/build.check_memory_fits)
    state_size: int
    fuses: bool = False  # whether its build honours optim.fused_dense


@dataclass(frozen=True)
class ValueOptimizer:
    """An entry of VALUE_OPTIMIZERS: how the memory values' optimizer is built, the gradient it takes, its state."""

    build: Callable[[list[nn.Parameter], OptimConfig], torch.optim.Optimizer]
    sparse: bool  # the gradients it takes: sparse rows (True) or the dense table
    state_size: int  # state values per parameter element, as DenseOptimizer's
    # state values per row of a (rows, width) table, beside those per element (rowwise_adagrad's 1: its
    # accumulator); such a row state spans the row's columns, so the table cannot be split by column
    # (model.memory.shard_values)
    row_state_size: int = 0
    weight_decay: bool = True  # whether it supports optim.values_weight_decay
    # the per-parameter state it keeps: optimizers of the same one resume each other's checkpoints ("": its name)
    state: str = ""
    fuses: bool = False  # whether its build honours optim.fused_values


# The names optim.optimizer, optim.values_optimizer and optim.schedule take (optimizers.py and schedule.py
# register theirs); a schedule is a function (optimizer step, 1-based; OptimConfig) -> the dense lr.
DENSE_OPTIMIZERS = Registry("dense optimizer", DenseOptimizer)
VALUE_OPTIMIZERS = Registry("values optimizer", ValueOptimizer)
SCHEDULES = Registry("learning-rate schedule")


@dataclass
class MemoryFinetuneConfig:
    """Sparse memory finetuning (finetune/memory_finetune.py): each step updates only top_t of the slots it read,
    by TF-IDF (the paper) or, as controls, by read count alone or at random: optim.memory_finetune."""
    # slots updated per value table and step; 0: off (every slot read is updated)
    top_t: int = field(default=0, metadata=non_negative())
    # tfidf: the paper's specificity against the background | count: the most read (no IDF, no background) |
    # random: top_t of the slots read, drawn from (seed, step, table): reproducible, and the same on resume
    ranking: Literal["tfidf", "count", "random"] = "tfidf"
    seed: int = 0  # ranking=random's draws
    background: str = ""  # slot counts on the pretraining data: python -m xlm_pkm.finetune.slot_counts (tfidf)

    def check(self, prefix: str) -> None:
        if self.top_t and self.ranking == "tfidf" and not self.background:
            raise ConfigError(f"{prefix}top_t needs {prefix}background: the slot counts of "
                              f"python -m xlm_pkm.finetune.slot_counts CHECKPOINT --data DIR --out FILE")
        if self.ranking != "tfidf" and self.background:
            raise ConfigError(f"{prefix}background is read by {prefix}ranking=tfidf only, got "
                              f"ranking={self.ranking}: leave it empty")


@dataclass
class LoraConfig:
    """Low-rank adapters (LoRA, through peft: finetune/lora.py) on the linears `targets` names; only the
    adapters train: optim.lora."""

    rank: int = field(default=0, metadata=non_negative())  # 0: off
    alpha: float = field(default=16.0, metadata=positive())  # the adapter's output is scaled by alpha / rank
    # module-name globs, or the preset attention_ffn: every attention (qkv, out) and FFN (fc1, fc2) linear
    targets: list[str] = field(default_factory=lambda: ["attention_ffn"])


@dataclass
class OptimConfig:
    """Adam with the inverse square-root schedule (Vaswani et al.); memory values in their own group: optim."""

    # adam (AdamW, the paper) | adagrad (per-tensor step clipping, the all-attention paper) | a registered one
    optimizer: str = field(default="adam", metadata=one_of(DENSE_OPTIMIZERS))
    lr: float = field(default=2.5e-4, metadata=positive())  # peak learning rate of the dense parameters
    beta1: float = field(default=0.9, metadata=probability())  # adam
    beta2: float = field(default=0.98, metadata=probability())  # adam
    eps: float = field(default=1e-8, metadata=positive())  # adam / adagrad epsilon
    weight_decay: float = field(default=0.0, metadata=non_negative())  # adam
    # inverse_sqrt: linear warmup then lr·sqrt(warmup/step); linear_warmup: linear warmup then constant
    schedule: str = field(default="inverse_sqrt", metadata=one_of(SCHEDULES))
    warmup_steps: int = field(default=4000, metadata=non_negative())  # linear warmup from warmup_init_lr to lr
    warmup_init_lr: float = field(default=1e-7, metadata=non_negative())  # lr at step 0 of the warmup
    clip_grad_norm: float = field(default=0.0, metadata=non_negative())  # 0: off
    clip_scope: Literal["group", "global"] = "group"  # one norm per optimizer group (XLM), or over all
    # adagrad: each tensor's step scaled to this gradient norm (all-attention)
    clip_per_tensor: float = field(default=0.0, metadata=non_negative())
    accumulate: int = field(default=1, metadata=positive())  # forward/backward passes per optimizer step
    # all | memory (keys, query networks, values) | memory_values | glob patterns over parameter names
    trainable: list[str] = field(default_factory=lambda: ["all"])
    # every BatchNorm stays in eval mode (normalises with, and keeps, its running statistics) whatever trains;
    # false: only a BatchNorm none of whose parameters train (finetune/trainable.py)
    freeze_norm_stats: bool = False
    memory_finetune: MemoryFinetuneConfig = field(default_factory=MemoryFinetuneConfig)
    # The memory values' own group, at a constant lr (paper: Adam, lr 1e-3; XLM: `adam,lr=0.001`, whose
    # betas are torch's defaults). The optimizer decides whether value gradients are sparse (ValueOptimizer.sparse).
    values_optimizer: str = field(default="adam", metadata=one_of(VALUE_OPTIMIZERS))
    values_lr: float = field(default=1e-3, metadata=positive())  # constant learning rate of the memory values
    values_beta1: float = field(default=0.9, metadata=probability())  # adam / lazy_adam
    values_beta2: float = field(default=0.999, metadata=probability())  # adam / lazy_adam
    values_eps: float = field(default=1e-8, metadata=positive())  # epsilon of the values optimizer
    values_weight_decay: float = field(default=0.0, metadata=non_negative())  # adam / lazy_adam only
    # UltraMem's value lr decay (optim/schedule.py values_lr): > 0: the values take their base lr times a factor
    # going linearly from values_lr_start_factor to 1 over this many steps; 0: constant values_lr
    values_lr_decay_steps: int = 0
    values_lr_start_factor: float = 10.0  # the values' lr over their base lr at step 0 (values_lr_decay_steps > 0)
    # the lr that factor multiplies: dense (the dense schedule, as UltraMem's released code; values_lr unused) |
    # values_lr (the values' own constant lr: from values_lr_start_factor x values_lr down to values_lr)
    values_lr_decay_base: Literal["dense", "values_lr"] = "dense"
    # Engram's tables (model.engram): the values optimizer at the dense lr times this, weight decay 0 (the
    # Engram paper's setting for its embeddings: Adam, 5x the backbone's lr, no weight decay)
    engram_lr_scale: float = field(default=5.0, metadata=positive())
    # the stochastic rounding of bfloat16 value tables' updates (model.memory.value_dtype; Engram's tables, with
    # model.engram.table_dtype, take this + 1): the seed of its random bits (optim/stochastic_rounding.py)
    values_rounding_seed: int = field(default=0, metadata=non_negative())
    # how those updates are rounded: stochastic (unbiased), or nearest (even), which loses every update below half
    # a bfloat16 step (to measure what the stochastic bits buy)
    values_rounding: Literal["stochastic", "nearest"] = "stochastic"
    # Fused steps (off until a GPU run measures them): each group's clip scale folded into its step, and a step
    # with a non-finite loss or norm skipped on the device (train/step.py), so no host sync when every group's is.
    # The values' (and Engram tables') update in one pass over the rows read, repeated rows summed in it (Triton on
    # CUDA; optim/fused_rows.py): lazy_adam, adagrad, rowwise_adagrad, sgd; adam: torch's fused AdamW
    fused_values: bool = field(default=False, metadata=execution())
    # the dense group's torch AdamW with fused=True (one kernel; optim.optimizer=adam)
    fused_dense: bool = field(default=False, metadata=execution())
    # rank > 0: adapters only (optim.trainable must be all; a retrofit's memories train too, or what its patterns name)
    lora: LoraConfig = field(default_factory=LoraConfig)
