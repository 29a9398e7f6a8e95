"""Optimizers of a run (paper §4.3): one Adam for the dense parameters on the inverse square-root
schedule, and one for the memory values at a constant, higher learning rate (or, with
optim.values_lr_decay_steps, UltraMem's value lr decay: schedule.values_lr).

Each group has its own optimizer, learning-rate rule and gradient clipping (per group, or one global
norm with `optim.clip_scope=global`). Both optimizers are chosen by name. The dense one
(`optim.optimizer`) from DENSE_OPTIMIZERS:

    adam       torch AdamW (the paper, XLM)
    adagrad    Adagrad with per-tensor step clipping (xlm_pkm/optim/adagrad.py; the all-attention paper)

The values' one (`optim.values_optimizer`) from VALUE_OPTIMIZERS; it decides whether the value
gradients are sparse (one row per slot read, see model/memory/value_read.py):

    adam       torch AdamW on a dense gradient: every row's moments decay every step (the paper, XLM)
    lazy_adam  Adam on the rows read in the step only (xlm_pkm/optim/lazy_adam.py): sparse gradient, step
               cost independent of the table size; differs from adam in rows that are not read
    adagrad    torch Adagrad on a sparse gradient: equal to dense Adagrad (unread rows do not move)
    sgd        torch SGD on a sparse gradient: equal to dense SGD (no momentum)

A new optimizer (or schedule: SCHEDULES in schedule.py, by `optim.schedule`) is one `register(name)` entry
there or in a module named in the config's `plugins` (registry.py).

A run resumes with the optimizers its checkpoint was saved with (Optimizers.load_state_dict, given the
checkpoint's config): another one is refused in one line, since its state is not the saved one's (adam and
lazy_adam keep the same moments, and resume each other's: ValueOptimizer.state).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from xlm_pkm.config import ConfigError, OptimConfig, migrate
from xlm_pkm.optim.adagrad import ClippedAdagrad
from xlm_pkm.optim.clipping import clip_grad_norm, scale_grads_
from xlm_pkm.optim.lazy_adam import LazyAdam
from xlm_pkm.optim.schedule import scheduled_lr, values_lr
from xlm_pkm.registry import Registry

DENSE_OPTIMIZERS = Registry("dense optimizer")
DENSE_OPTIMIZERS.register("adam")(lambda params, cfg: torch.optim.AdamW(
    params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay))
DENSE_OPTIMIZERS.register("adagrad")(lambda params, cfg: ClippedAdagrad(
    params, lr=cfg.lr, eps=cfg.eps, clip=cfg.clip_per_tensor))


@dataclass(frozen=True)
class ValueOptimizer:
    build: Callable[[list[nn.Parameter], OptimConfig], torch.optim.Optimizer]
    sparse: bool  # the gradients it takes: sparse rows (True) or the dense table
    weight_decay: bool = True  # whether it supports optim.values_weight_decay
    # the per-parameter state it keeps: optimizers of the same one resume each other's checkpoints ("": its name)
    state: str = ""


VALUE_OPTIMIZERS = Registry("values optimizer")


def _betas(cfg: OptimConfig) -> dict:
    return {"betas": (cfg.values_beta1, cfg.values_beta2), "eps": cfg.values_eps,
            "weight_decay": cfg.values_weight_decay}


VALUE_OPTIMIZERS.register("adam")(ValueOptimizer(
    lambda params, cfg: torch.optim.AdamW(params, lr=cfg.values_lr, **_betas(cfg)), sparse=False,
    state="adam"))  # step, exp_avg, exp_avg_sq
VALUE_OPTIMIZERS.register("lazy_adam")(ValueOptimizer(
    lambda params, cfg: LazyAdam(params, lr=cfg.values_lr, **_betas(cfg)), sparse=True, state="adam"))
VALUE_OPTIMIZERS.register("adagrad")(ValueOptimizer(
    lambda params, cfg: torch.optim.Adagrad(params, lr=cfg.values_lr, eps=cfg.values_eps), sparse=True,
    weight_decay=False))
VALUE_OPTIMIZERS.register("sgd")(ValueOptimizer(
    lambda params, cfg: torch.optim.SGD(params, lr=cfg.values_lr), sparse=True, weight_decay=False))


def value_optimizer(cfg: OptimConfig) -> ValueOptimizer:
    """The registered values optimizer of `cfg`, checked against the other values settings."""
    spec = VALUE_OPTIMIZERS[cfg.values_optimizer]
    if cfg.values_weight_decay and not spec.weight_decay:
        raise ConfigError(f"optim.values_weight_decay: {cfg.values_optimizer} on sparse rows does not support "
                          f"weight decay (use adam or lazy_adam), got {cfg.values_weight_decay}")
    return spec


# each group's optimizer: the config key that names it, and the registry of the names
GROUP_OPTIMIZERS = {"dense": ("optimizer", DENSE_OPTIMIZERS), "values": ("values_optimizer", VALUE_OPTIMIZERS),
                    "engram": ("values_optimizer", VALUE_OPTIMIZERS)}


def _saved_state(group: str, name: str) -> str:
    """What a checkpoint's state of `group` saved by optimizer `name` is (ValueOptimizer.state, else the name)."""
    spec = GROUP_OPTIMIZERS[group][1].get(name)  # .get: a name no longer registered is only itself
    return spec.state or name if isinstance(spec, ValueOptimizer) else name


def _skip_on_every_rank(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
    """After unscale_: the optimizer's inf/nan flags are ORed over ranks, so that a step skipped for an
    overflow in one rank's value shard is skipped on every rank (replicated gradients agree already).
    GradScaler keeps the flags in its per-optimizer state (a private field, read here only)."""
    for found_inf in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)


@dataclass
class OptimGroup:
    name: str
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    lr_at: Callable[[int], float]
    clip: float
    sharded: bool = False  # its parameters are value shards: each rank holds other columns


class Optimizers:
    """The optimizer groups of a model: 'dense'; when the model has memories, 'values'; when it has Engram
    layers, 'engram': their tables, with the values optimizer at the dense lr times optim.engram_lr_scale and
    no weight decay (the Engram paper's 5x, §4.1). Each group only when it has a trainable parameter."""

    def __init__(self, model: nn.Module, cfg: OptimConfig):
        if cfg.clip_per_tensor and cfg.optimizer != "adagrad":
            raise ConfigError(f"optim.clip_per_tensor is Adagrad's (optim.optimizer=adagrad), "
                              f"got optim.optimizer={cfg.optimizer}")
        if cfg.values_lr_decay_steps < 0 or cfg.values_lr_start_factor <= 0:
            raise ConfigError(f"optim.values_lr_decay_steps must be >= 0 and optim.values_lr_start_factor > 0, got "
                              f"{cfg.values_lr_decay_steps} and {cfg.values_lr_start_factor}")
        tables = [p for p in model.memory_value_parameters() if p.requires_grad]
        engram = [p for p in tables if getattr(p, "engram_table", False)]
        values = [p for p in tables if not getattr(p, "engram_table", False)]
        table_ids = {id(p) for p in tables}
        dense = [p for p in model.parameters() if p.requires_grad and id(p) not in table_ids]
        self.cfg = cfg
        self.global_clip = cfg.clip_grad_norm if cfg.clip_scope == "global" else 0.0
        group_clip = 0.0 if self.global_clip else cfg.clip_grad_norm
        self.groups = []  # a group whose parameters are all frozen (optim.trainable) is left out
        if dense:
            self.groups.append(OptimGroup("dense", dense, DENSE_OPTIMIZERS[cfg.optimizer](dense, cfg),
                                          lambda step: scheduled_lr(step, cfg), group_clip))
        if values:
            self.groups.append(OptimGroup("values", values, value_optimizer(cfg).build(values, cfg),
                                          lambda step: values_lr(step, cfg), group_clip,
                                          sharded=any(hasattr(p, "value_shard") for p in values)))
        if engram:
            self.groups.append(OptimGroup("engram", engram, value_optimizer(cfg).build(
                engram, dataclasses.replace(cfg, values_weight_decay=0.0)),
                lambda step: scheduled_lr(step, cfg) * cfg.engram_lr_scale, group_clip))

    def set_step(self, step: int) -> dict[str, float]:
        """Sets each group's learning rate for optimizer step `step`; returns them by group name."""
        lrs = {}
        for g in self.groups:
            lrs[g.name] = g.lr_at(step)
            for pg in g.optimizer.param_groups:
                pg["lr"] = lrs[g.name]
        return lrs

    def unscale_and_clip(self, scaler: torch.amp.GradScaler) -> dict[str, torch.Tensor]:
        """Unscales the gradients (fp16) and clips each group to its norm, or all of them to one global
        norm; returns the pre-clip norms by group (and "global")."""
        norms = {}
        for g in self.groups:
            scaler.unscale_(g.optimizer)
            if g.sharded and scaler.is_enabled() and dist.is_initialized():
                _skip_on_every_rank(scaler, g.optimizer)
            norms[g.name] = clip_grad_norm(g.params, g.clip)
        if self.global_clip:  # the groups' norms (each all-reduced if sharded) give the global one
            norms["global"] = torch.stack(list(norms.values())).norm()
            scale_grads_([p for g in self.groups for p in g.params], norms["global"], self.global_clip)
        return norms

    def step(self, scaler: torch.amp.GradScaler) -> None:
        for g in self.groups:
            scaler.step(g.optimizer)

    def zero_grad(self) -> None:
        for g in self.groups:
            g.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        return {g.name: g.optimizer.state_dict() for g in self.groups}

    def load_state_dict(self, state: dict, saved_config: dict | None = None, source: str | Path | None = None) -> None:
        """Each group's state, from Optimizers.state_dict() of the checkpoint `source`; given the config
        the checkpoint recorded, refused first (nothing loaded) if a group's optimizer changed (check_resumable)."""
        names = [g.name for g in self.groups]
        if sorted(state) != sorted(names):
            raise ValueError(f"checkpoint has optimizer groups {sorted(state)}, this model has {sorted(names)}")
        if saved_config is not None:
            self.check_resumable(saved_config, source)
        for g in self.groups:
            g.optimizer.load_state_dict(state[g.name])

    def check_resumable(self, saved_config: dict, source: str | Path | None = None) -> None:
        """A ValueError naming the old and new optimizer of each group whose optimizer is not the one the
        checkpoint `source` was saved with (`saved_config`, its recorded config), unless both keep the
        same state: another optimizer would fail at the first step on state it does not know."""
        saved, defaults = migrate(saved_config).get("optim", {}), OptimConfig()
        changed = []
        for g in self.groups:
            key = GROUP_OPTIMIZERS[g.name][0]
            old, new = saved.get(key, getattr(defaults, key)), getattr(self.cfg, key)
            if _saved_state(g.name, old) != _saved_state(g.name, new):
                changed.append((f"optim.{key}", old, new))
        if changed:
            before = " and ".join(f"{key}={old}" for key, old, _ in changed)
            after = " and ".join(f"{key}={new}" for key, _, new in changed)
            keep = " ".join(f"{key}={old}" for key, old, _ in changed)
            raise ValueError(f"{source or 'the checkpoint'}: saved with {before}, resumed with {after}, which cannot "
                             f"take over its optimizer state; resume with {keep}, or start a new run from its "
                             f"weights: train.init_from={source or 'CHECKPOINT'} and a new train.exp_id")
