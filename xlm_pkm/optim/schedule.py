"""The dense learning rate by optimizer step (paper §4.3: Vaswani et al.'s inverse square root after a
linear warmup), chosen by `optim.schedule` from SCHEDULES (optim_settings.py: this module registers into
it); the memory values keep a constant rate, or decay with UltraMem's value lr decay (values_lr)."""

from __future__ import annotations

import math

from xlm_pkm.optim.optim_settings import SCHEDULES, OptimConfig

# the dense schedules by optim.schedule: (optimizer step, 1-based; OptimConfig) -> lr

def _warmup(step: int, cfg: OptimConfig, after: float) -> float:
    """Linear from warmup_init_lr to lr over warmup_steps, then `after`."""
    if step < cfg.warmup_steps:
        return cfg.warmup_init_lr + (cfg.lr - cfg.warmup_init_lr) * step / cfg.warmup_steps
    return after


# inverse_sqrt (Vaswani et al.): the warmup, then lr * sqrt(warmup_steps / step)
SCHEDULES.register("inverse_sqrt")(
    lambda step, cfg: _warmup(step, cfg, cfg.lr * math.sqrt(max(cfg.warmup_steps, 1) / step)))
SCHEDULES.register("linear_warmup")(lambda step, cfg: _warmup(step, cfg, cfg.lr))  # the warmup, then lr
SCHEDULES.register("constant")(lambda step, cfg: cfg.lr)


def scheduled_lr(step: int, cfg: OptimConfig) -> float:
    """Dense learning rate at optimizer step `step` (1-based), by cfg.schedule (SCHEDULES)."""
    return SCHEDULES[cfg.schedule](step, cfg)


def values_lr(step: int, cfg: OptimConfig) -> float:
    """The memory values' learning rate at optimizer step `step` (1-based): values_lr, constant; or, with
    values_lr_decay_steps = S > 0, UltraMem's value lr decay (Huang et al. 2025, Table 2 "+value lr decay": the
    values' lr starts at 10x the other parameters' and decays linearly to 1x over training, as summaries of the
    paper give it), a factor on the lr the values would otherwise have, their base (optim.values_lr_decay_base):

        lr_values(t) = base(t) · (1 + (F - 1) · max(0, 1 - t / S))      F = values_lr_start_factor

    base "values_lr": the values' own constant values_lr, so that the decay goes from F · values_lr down to
    values_lr, the lr of the same model without the decay (UltraMem's ablation step before it; in the paper
    and their released code the values otherwise train at the other parameters' lr, which the factor then
    multiplies). base "dense" (the default, as before this key): the dense schedule (scheduled_lr, warmup
    included), as their released code (olmo/optim.py) multiplies its schedule; the values then end at the
    dense lr, which is below values_lr when the values otherwise train faster than the rest (PKM's)."""
    if cfg.values_lr_decay_steps <= 0:
        return cfg.values_lr
    factor = 1.0 + (cfg.values_lr_start_factor - 1.0) * max(0.0, 1.0 - step / cfg.values_lr_decay_steps)
    base = cfg.values_lr if cfg.values_lr_decay_base == "values_lr" else scheduled_lr(step, cfg)
    return base * factor
