"""Optimizers of a run (paper §4.3): one Adam for the dense parameters on the inverse square-root
schedule, and one for the memory values at a constant, higher learning rate (or, with
optim.values_lr_decay_steps, UltraMem's value lr decay from a multiple of the dense or the values' lr:
schedule.values_lr).

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
    rowwise_adagrad  FBGEMM's exact row-wise Adagrad on a sparse gradient: one accumulator per row, the mean of
               its squared gradients (xlm_pkm/optim/rowwise_adagrad.py): 4/width bytes of state per element
    sgd        torch SGD on a sparse gradient: equal to dense SGD (no momentum)

A new optimizer (or schedule: SCHEDULES, registered in schedule.py, by `optim.schedule`) is one `register(name)`
entry there or in a module named in the config's `plugins` (registry.py; the registries are optim_settings.py's).
An optimizer's entry declares the state it keeps per parameter element (and, a values optimizer, per table row),
which the memory check before training counts (train/build.py):

    DENSE_OPTIMIZERS.register("my_adam")(DenseOptimizer(lambda params, cfg: MyAdam(params, lr=cfg.lr), state_size=2))

The run's settings of this section are OptimConfig (optim in a run's config; optim_settings.py, which this
module imports), with LoRA's and sparse memory finetuning's (optim.lora, optim.memory_finetune; their code is in
finetune/).

With optim.fused_dense and optim.fused_values (off until a GPU run measures them) the dense group's AdamW is torch's
fused one and the values' optimizer updates its rows in one pass (fused_rows.py); both take the group's clip scale
in their step (no scaling pass over the gradients) and skip a non-finite step on the device, so that a step has no
host sync (train/step.py) when every group's optimizer does. Either way the state is the same: a run resumes with
them on or off, the implementation the resuming run built kept.

A bfloat16 value or Engram table (model.memory.value_dtype, model.engram.table_dtype) takes an optimizer whose row
update rounds stochastically (stochastic_rounding.py: lazy_adam, rowwise_adagrad, and adagrad and sgd with
optim.fused_values; those that take a rounding_seed); one that rounds to nearest is refused in one line.

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

from xlm_pkm.errors import ConfigError
from xlm_pkm.optim.adagrad import ClippedAdagrad
from xlm_pkm.optim.clipping import clip_scale, grad_norm, scale_grads_
from xlm_pkm.optim.fused_rows import FusedLazyAdam, FusedRowwiseAdagrad, FusedSparseAdagrad, FusedSparseSGD
from xlm_pkm.optim.lazy_adam import LazyAdam
from xlm_pkm.optim.optim_settings import DENSE_OPTIMIZERS, VALUE_OPTIMIZERS, DenseOptimizer, OptimConfig, ValueOptimizer
from xlm_pkm.optim.rowwise_adagrad import RowwiseAdagrad
from xlm_pkm.optim.schedule import scheduled_lr, values_lr
from xlm_pkm.optim.stochastic_rounding import rounds
from xlm_pkm.utils.dtensors import is_dtensor


def _keep_fused(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """A load_state_dict pre-hook of torch's AdamW: the state loads into the implementation this run built
    (optim.fused_*), where torch would take the saved one's `fused`, with its step counts where that one keeps
    them (fused: on the parameter's device, as torch moves them; else on the CPU)."""
    fused = [group.get("fused") for group in optimizer.param_groups]
    saved = [{**group, "fused": f} for group, f in zip(state_dict["param_groups"], fused)]
    on_cpu = {i for group in saved if not group["fused"] for i in group["params"]}
    state = {i: {**s, "step": s["step"].cpu()} if i in on_cpu and torch.is_tensor(s.get("step")) else s
             for i, s in state_dict["state"].items()}
    return {**state_dict, "param_groups": saved, "state": state}


def _adamw(params: list[nn.Parameter], fused: bool, **kwargs) -> torch.optim.AdamW:
    """torch's AdamW, fused (one kernel for all the parameters; it takes grad_scale and found_inf) when asked."""
    optimizer = torch.optim.AdamW(params, fused=fused or None, **kwargs)
    optimizer.register_load_state_dict_pre_hook(_keep_fused)
    return optimizer


DENSE_OPTIMIZERS.register("adam")(DenseOptimizer(lambda params, cfg: _adamw(
    params, cfg.fused_dense, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay),
    state_size=2, fuses=True))
DENSE_OPTIMIZERS.register("adagrad")(DenseOptimizer(lambda params, cfg: ClippedAdagrad(
    params, lr=cfg.lr, eps=cfg.eps, clip=cfg.clip_per_tensor), state_size=1))


def rounding_seed(cfg: OptimConfig) -> int | None:
    """The seed of a values optimizer's stochastic rounding (a bfloat16 table's); None: it rounds to nearest."""
    return None if cfg.values_rounding == "nearest" else cfg.values_rounding_seed


def _betas(cfg: OptimConfig) -> dict:
    return {"betas": (cfg.values_beta1, cfg.values_beta2), "eps": cfg.values_eps,
            "weight_decay": cfg.values_weight_decay}


VALUE_OPTIMIZERS.register("adam")(ValueOptimizer(
    lambda params, cfg: _adamw(params, cfg.fused_values, lr=cfg.values_lr, **_betas(cfg)), sparse=False,
    state_size=2, state="adam", fuses=True))  # step, exp_avg, exp_avg_sq
VALUE_OPTIMIZERS.register("lazy_adam")(ValueOptimizer(
    lambda params, cfg: (FusedLazyAdam if cfg.fused_values else LazyAdam)(
        params, lr=cfg.values_lr, **_betas(cfg), rounding_seed=rounding_seed(cfg)),
    sparse=True, state_size=2, state="adam", fuses=True))
VALUE_OPTIMIZERS.register("adagrad")(ValueOptimizer(
    lambda params, cfg: FusedSparseAdagrad(params, lr=cfg.values_lr, eps=cfg.values_eps,
                                           rounding_seed=rounding_seed(cfg)) if cfg.fused_values else
    torch.optim.Adagrad(params, lr=cfg.values_lr, eps=cfg.values_eps), sparse=True, state_size=1, weight_decay=False,
    fuses=True))
VALUE_OPTIMIZERS.register("rowwise_adagrad")(ValueOptimizer(
    lambda params, cfg: (FusedRowwiseAdagrad if cfg.fused_values else RowwiseAdagrad)(
        params, lr=cfg.values_lr, eps=cfg.values_eps, rounding_seed=rounding_seed(cfg)), sparse=True,
    state_size=0, row_state_size=1, weight_decay=False, fuses=True))
VALUE_OPTIMIZERS.register("sgd")(ValueOptimizer(
    lambda params, cfg: FusedSparseSGD(params, lr=cfg.values_lr, rounding_seed=rounding_seed(cfg))
    if cfg.fused_values else torch.optim.SGD(params, lr=cfg.values_lr), sparse=True, state_size=0, weight_decay=False,
    fuses=True))


def value_optimizer(cfg: OptimConfig) -> ValueOptimizer:
    """The registered values optimizer of `cfg`, checked against the other values settings."""
    spec = VALUE_OPTIMIZERS[cfg.values_optimizer]
    if cfg.values_weight_decay and not spec.weight_decay:
        raise ConfigError(f"optim.values_weight_decay: {cfg.values_optimizer} on sparse rows does not support "
                          f"weight decay (use adam or lazy_adam), got {cfg.values_weight_decay}")
    if cfg.fused_values and not spec.fuses:
        fusing = ", ".join(name for name in VALUE_OPTIMIZERS if VALUE_OPTIMIZERS[name].fuses)
        raise ConfigError(f"optim.fused_values: optim.values_optimizer={cfg.values_optimizer} has no fused step "
                          f"(those with one: {fusing})")
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
    overflow in one rank's part (a value shard, an FSDP shard) is skipped on every rank (replicated gradients
    agree already).
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
    sharded: bool = False  # its parameters are split over the ranks (value shards, FSDP's DTensors): each holds a part
    grad_scale: torch.Tensor | None = None  # this step's 1 / clip scale, for an optimizer that skips on the device

    @property
    def skips_on_device(self) -> bool:
        """Whether its optimizer takes grad_scale (gradients divided by it) and found_inf (set: the step changes
        nothing) as attributes, as torch's GradScaler gives them to fused optimizers: the clip scale folds into its
        step, and a non-finite step is skipped on the device (optim.fused_dense, optim.fused_values)."""
        return getattr(self.optimizer, "_step_supports_amp_scaling", False)


class Optimizers:
    """The optimizer groups of a model: 'dense'; when the model has memories, 'values'; when it has Engram
    layers, 'engram': their tables, with the values optimizer at the dense lr times optim.engram_lr_scale and
    no weight decay (the Engram paper's 5x, §4.1). Each group only when it has a trainable parameter."""

    def __init__(self, model: nn.Module, cfg: OptimConfig):
        if cfg.clip_per_tensor and cfg.optimizer != "adagrad":
            raise ConfigError(f"optim.clip_per_tensor is Adagrad's (optim.optimizer=adagrad), "
                              f"got optim.optimizer={cfg.optimizer}")
        if cfg.fused_dense and not DENSE_OPTIMIZERS[cfg.optimizer].fuses:
            fusing = ", ".join(name for name in DENSE_OPTIMIZERS if DENSE_OPTIMIZERS[name].fuses)
            raise ConfigError(f"optim.fused_dense: optim.optimizer={cfg.optimizer} has no fused step "
                              f"(those with one: {fusing})")
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
            self.groups.append(OptimGroup("dense", dense, DENSE_OPTIMIZERS[cfg.optimizer].build(dense, cfg),
                                          lambda step: scheduled_lr(step, cfg), group_clip,
                                          sharded=any(map(is_dtensor, dense))))
        if value_optimizer(cfg).row_state_size and any(getattr(p, "value_shard", None) and p.value_shard.world > 1
                                                       for p in values):
            raise ConfigError(f"optim.values_optimizer={cfg.values_optimizer} keeps one state per value row, over all "
                              f"its columns, which model.memory.shard_values=true splits over the processes: set "
                              f"model.memory.shard_values=false, or another values optimizer")
        if values:
            self.groups.append(OptimGroup("values", values, value_optimizer(cfg).build(values, cfg),
                                          lambda step: values_lr(step, cfg), group_clip,
                                          sharded=any(hasattr(p, "value_shard") for p in values)))
        if engram:
            own = dataclasses.replace(cfg, values_weight_decay=0.0, values_rounding_seed=rounding_seed(cfg) + 1)
            self.groups.append(OptimGroup("engram", engram, value_optimizer(cfg).build(engram, own),
                lambda step: scheduled_lr(step, cfg) * cfg.engram_lr_scale, group_clip))
        for g in self.groups:
            if any(map(rounds, g.params)) and not hasattr(g.optimizer, "rounding_seed"):
                key = "model.engram.table_dtype" if g.name == "engram" else "model.memory.value_dtype"
                raise ConfigError(f"{key}=bfloat16: optim.values_optimizer={cfg.values_optimizer} (optim.fused_values="
                                  f"{str(cfg.fused_values).lower()}) rounds a bfloat16 table's updates to nearest, "
                                  f"losing those below half a bfloat16 step: use lazy_adam or rowwise_adagrad, or "
                                  f"adagrad or sgd with optim.fused_values=true (stochastic rounding)")

    def set_step(self, step: int) -> dict[str, float]:
        """Sets each group's learning rate for optimizer step `step`; returns them by group name."""
        lrs = {}
        for g in self.groups:
            lrs[g.name] = g.lr_at(step)
            for pg in g.optimizer.param_groups:
                pg["lr"] = lrs[g.name]
        return lrs

    @property
    def skip_on_device(self) -> bool:
        """Whether every group's optimizer skips a non-finite step on the device (OptimGroup.skips_on_device)."""
        return all(g.skips_on_device for g in self.groups)

    def unscale_and_clip(self, scaler: torch.amp.GradScaler) -> dict[str, torch.Tensor]:
        """Unscales the gradients (fp16) and clips each group to its norm, or all of them to one global
        norm; returns the pre-clip norms by group (and "global"). A group whose optimizer skips on the device
        keeps its gradients: its clip scale goes to its step (OptimGroup.grad_scale), and its sparse gradients
        are not coalesced (no host sync)."""
        norms = {}
        for g in self.groups:
            scaler.unscale_(g.optimizer)
            if g.sharded and scaler.is_enabled() and dist.is_initialized():
                _skip_on_every_rank(scaler, g.optimizer)
            norms[g.name] = grad_norm(g.params, coalesce=not g.skips_on_device)
            g.grad_scale = self._clip(g, norms[g.name], g.clip)
        if self.global_clip:  # the groups' norms (each all-reduced if sharded) give the global one
            norms["global"] = torch.stack(list(norms.values())).norm()
            scale_grads_([p for g in self.groups if not g.skips_on_device for p in g.params], norms["global"],
                         self.global_clip)
            for g in self.groups:
                if g.skips_on_device:
                    g.grad_scale = self._clip(g, norms["global"], self.global_clip)
        return norms

    @staticmethod
    def _clip(g: OptimGroup, norm: torch.Tensor, max_norm: float) -> torch.Tensor | None:
        """Scales g's gradients down to max_norm, or, if its optimizer skips on the device, returns the
        grad_scale that does it in its step (None: no clipping)."""
        if not g.skips_on_device:
            scale_grads_(g.params, norm, max_norm)
            return None
        scale = clip_scale(norm, max_norm)
        return None if scale is None else scale.reciprocal()

    def step(self, scaler: torch.amp.GradScaler, found_inf: torch.Tensor | None = None) -> None:
        """Steps every group; found_inf: a device flag (float32 0 or 1) for groups that skip on the device
        (all of them when given), set: their step changes nothing."""
        for g in self.groups:
            for name, value in (("grad_scale", g.grad_scale), ("found_inf", found_inf)):
                if value is not None:
                    setattr(g.optimizer, name, value)
            scaler.step(g.optimizer)  # fp16: GradScaler sets found_inf, keeps grad_scale, and removes both
            for name in ("grad_scale", "found_inf"):
                vars(g.optimizer).pop(name, None)

    def zero_grad(self) -> None:
        for g in self.groups:
            g.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        return {g.name: g.optimizer.state_dict() for g in self.groups}

    def params(self) -> dict[str, list[nn.Parameter]]:
        """Each group's parameters, in the order of its state_dict's indices."""
        return {g.name: g.params for g in self.groups}

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
        checkpoint `source` was saved with (`saved_config`, its recorded config in today's keys: config.migrate,
        as RunCheckpoints.load_last gives it), unless both keep the
        same state: another optimizer would fail at the first step on state it does not know."""
        saved, defaults = saved_config.get("optim", {}), OptimConfig()
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
