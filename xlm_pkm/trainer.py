"""The training loop: mixed precision, gradient accumulation, clipping, DDP, evaluation, checkpoints.

A run lives in `dump_path/exp_name/exp_id/`. Starting a run whose directory holds `checkpoint.pt`
resumes it exactly: model, optimizers, loss scaler, step, every rank's data cursor and RNG state.
"""

from __future__ import annotations

import gc
import math
import os
import random
import secrets
import signal
import subprocess
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from xlm_pkm import checkpoint
from xlm_pkm.config import Config, ConfigError, save_config, to_dict
from xlm_pkm.data.stream import TokenStream
from xlm_pkm.distributed import (all_gather_objects, all_reduce_sparse_grad_, all_reduce_sum, any_rank,
                                 broadcast_object, init_distributed)
from xlm_pkm.evaluation import evaluate
from xlm_pkm.hardware import peak_flops
from xlm_pkm.model.transformer import TransformerLM
from xlm_pkm.optim import Optimizers
from xlm_pkm.precision import check_precision, grad_scaler, resolve_device
from xlm_pkm.run_log import RunLogger
from xlm_pkm.train_step import loss_backward, optimizer_update

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)


class NonFiniteLossError(RuntimeError):
    """The loss stayed non-finite for too many consecutive steps."""


def run_directory(cfg: Config, is_main: bool, env) -> Path:
    """dump_path/exp_name/exp_id; a new id (the SLURM job id when there is one) if none is given."""
    if not cfg.train.exp_id:
        new_id = os.environ.get("SLURM_JOB_ID") or time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)
        cfg.train.exp_id = broadcast_object(new_id, env)
    path = Path(cfg.train.dump_path) / cfg.train.exp_name / cfg.train.exp_id
    if is_main:
        path.mkdir(parents=True, exist_ok=True)
    return path


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.device = resolve_device(cfg.train.device)
        check_precision(cfg.train.precision, self.device)
        if cfg.optim.accumulate < 1:
            raise ConfigError(f"optim.accumulate must be >= 1, got {cfg.optim.accumulate}")
        if cfg.train.num_threads:
            torch.set_num_threads(cfg.train.num_threads)
        self.env = init_distributed(self.device)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", self.env.local_rank)

        data = cfg.data
        self.train_stream = TokenStream(data.path, "train", data.batch_size, data.bptt, self.env.rank,
                                        self.env.world_size, seed=cfg.train.seed, train=True)
        self.dictionary = self.train_stream.dictionary
        if cfg.model.vocab_size not in (0, len(self.dictionary)):
            raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} but {data.path}/vocab gives "
                              f"{len(self.dictionary)} tokens (set 0 to take it from the data)")
        cfg.model.vocab_size = len(self.dictionary)
        self.word_end = torch.from_numpy(self.dictionary.word_end_mask())

        torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
        self.model = TransformerLM(cfg.model).to(self.device)
        self.optimizers = Optimizers(self.model, cfg.optim, sparse_values=cfg.model.memory.sparse)
        self.scaler = grad_scaler(cfg.train.precision, self.device)
        self.sparse_values = self.model.memory_value_parameters() if cfg.model.memory.sparse else []
        self.forward_model = self.model
        if self.env.is_distributed:
            sparse_ids = {id(p) for p in self.sparse_values}  # synchronised by all_reduce_sparse_grad_
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                self.model, [name for name, p in self.model.named_parameters() if id(p) in sparse_ids])
            self.forward_model = DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        if cfg.train.compile:
            self.forward_model = torch.compile(self.forward_model)
        torch.manual_seed(cfg.train.seed * 1000 + self.env.rank)  # dropout differs across ranks
        random.seed(cfg.train.seed * 1000 + self.env.rank)

        self.run_dir = run_directory(cfg, self.env.is_main, self.env)  # only once the inputs are valid
        self.ckpt_path, self.best_path = self.run_dir / "checkpoint.pt", self.run_dir / "best.pt"
        self.step = 0
        self.best_ppl = math.inf
        self.nonfinite_streak = 0
        self.skipped_steps = 0
        self.stop_requested = False
        resumed = self.ckpt_path.exists()
        if resumed:
            self.resume()
        self.log = RunLogger(self.run_dir, self.env.is_main, purge_step=self.step + 1 if resumed else None)
        if self.env.is_main:
            save_config(cfg, self.run_dir / "config.yaml")
        counts = self.model.param_counts()
        self.flops_per_token = self.model.dense_flops_per_token(data.bptt)
        self.peak_flops = peak_flops(self.device, cfg.train.precision)
        self.log.info(f"run directory {self.run_dir} ({'resumed at step ' + str(self.step) if resumed else 'new run'})")
        self.log.info(f"device {self.device}, {self.env.world_size} process(es), precision {cfg.train.precision}, "
                      f"memories at layers {[layer for layer, _ in self.model.memories()]}")
        self.log.info("parameters: " + ", ".join(f"{k} {v:,}" for k, v in counts.items())
                      + f"; dense training FLOPs/token {self.flops_per_token:.3g}")

    # ---- checkpoints -------------------------------------------------------------------------
    def state(self) -> dict:
        """Everything needed to resume; data cursors and RNG states are gathered from every rank."""
        rng = {"torch": torch.get_rng_state(), "python": random.getstate(),
               "cuda": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None}
        return {
            "config": to_dict(self.cfg),
            "model": self.model.state_dict(),
            "optimizers": self.optimizers.state_dict(),
            "scaler": self.scaler.state_dict(),
            "step": self.step,
            "best_ppl": self.best_ppl,
            "nonfinite_streak": self.nonfinite_streak,
            "skipped_steps": self.skipped_steps,
            "world_size": self.env.world_size,
            "data": all_gather_objects(self.train_stream.state_dict(), self.env),
            "rng": all_gather_objects(rng, self.env),
        }

    def save(self, *paths: Path) -> None:
        state = self.state()  # collective: every rank takes part
        if self.env.is_main:
            for path in paths:
                checkpoint.save_atomic(state, path)

    def resume(self) -> None:
        state = checkpoint.load(self.ckpt_path)
        if state["world_size"] != self.env.world_size:
            raise ValueError(f"{self.ckpt_path}: saved with {state['world_size']} processes, resumed with "
                             f"{self.env.world_size}; exact resume needs the same number")
        checkpoint.load_model_state(self.model, state["model"], self.ckpt_path)
        self.optimizers.load_state_dict(state["optimizers"])
        self.scaler.load_state_dict(state["scaler"])
        self.step, self.best_ppl = state["step"], state["best_ppl"]
        self.nonfinite_streak, self.skipped_steps = state["nonfinite_streak"], state["skipped_steps"]
        self.train_stream.load_state_dict(state["data"][self.env.rank])
        rng = state["rng"][self.env.rank]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if rng["cuda"] is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.device)

    # ---- one optimizer step ------------------------------------------------------------------
    def train_step(self, batches) -> dict:
        """Forward/backward over `accumulate` micro-batches, then one update of every group."""
        cfg = self.cfg
        lrs = self.optimizers.set_step(self.step + 1)
        accumulate = cfg.optim.accumulate
        loss_sum = torch.zeros((), device=self.device)
        tokens = words = 0
        for i in range(accumulate):
            x, y = next(batches)  # (B, T) each
            words += int(self.word_end[y].sum())
            tokens += y.numel()
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            last = i == accumulate - 1
            sync = nullcontext() if last or not self.env.is_distributed else self.forward_model.no_sync()
            with sync:
                loss_sum += loss_backward(self.forward_model, x, y, cfg.train.precision, self.device, self.scaler,
                                          accumulate)
        for p in self.sparse_values:
            all_reduce_sparse_grad_(p, self.env)
        loss = loss_sum / accumulate
        norms, scale, skipped = optimizer_update(self.optimizers, self.scaler, loss)
        self.step += 1
        self.skipped_steps += skipped
        self.nonfinite_streak = self.nonfinite_streak + 1 if skipped and not self.scaler.is_enabled() else 0
        if self.nonfinite_streak >= cfg.train.max_nonfinite:
            raise NonFiniteLossError(
                f"loss or gradients were not finite for {self.nonfinite_streak} consecutive steps (last at step "
                f"{self.step}); stopping. Last good checkpoint: {self.ckpt_path if self.ckpt_path.exists() else 'none'}")
        return {"loss": loss, "norms": norms, "lrs": lrs, "scale": scale, "tokens": tokens, "words": words}

    # ---- the loop ----------------------------------------------------------------------------
    def train(self) -> dict:
        """Trains until max_steps (or max_time, or a stop signal); returns the last valid metrics."""
        cfg = self.cfg.train
        handlers = {s: signal.signal(s, self._request_stop) for s in STOP_SIGNALS}
        batches = iter(self.train_stream)
        window = new_log_window()
        start, last_valid = time.time(), {}
        try:
            while self.step < cfg.max_steps:
                out = self.train_step(batches)
                window["loss"] += out["loss"]
                window["steps"] += 1
                window["tokens"] += out["tokens"]
                window["words"] += out["words"]
                if self.step % cfg.log_every == 0 or self.step == cfg.max_steps:
                    self._log_train(out, window)
                    window = new_log_window()
                if self.step % cfg.eval_every == 0 or self.step == cfg.max_steps:
                    last_valid = self.validate()
                    self.save(self.ckpt_path)
                out_of_time = cfg.max_time_minutes > 0 and time.time() - start > 60 * cfg.max_time_minutes
                if any_rank(self.stop_requested or out_of_time, self.env, self.device):
                    self.log.info(f"stopping at step {self.step} ({'signal' if self.stop_requested else 'time limit'})")
                    self.save(self.ckpt_path)
                    if self.stop_requested and self.env.is_main and "SLURM_JOB_ID" in os.environ:
                        requeue_slurm_job(self.log)
                    break
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
        return last_valid

    def _request_stop(self, signum, frame) -> None:
        self.stop_requested = True

    def _log_train(self, out: dict, window: dict) -> None:
        world = self.env.world_size
        totals = torch.tensor([float(window["loss"]), window["tokens"], window["words"]], dtype=torch.float64,
                              device=self.device)
        loss, tokens, words = (all_reduce_sum(totals, self.env) / torch.tensor([world * window["steps"], 1, 1],
                                                                                device=self.device)).tolist()
        elapsed = time.perf_counter() - window["time"]
        tokens_per_sec = tokens / elapsed
        metrics = {
            "loss": loss,
            "ppl": math.exp(min(loss, 100.0)),
            "lr": out["lrs"],
            "grad_norm": {k: float(v) for k, v in out["norms"].items()},
            "loss_scale": out["scale"],
            "skipped_steps": self.skipped_steps,
            "tokens_per_sec": tokens_per_sec,
            "words_per_sec": words / elapsed,
        }
        if self.peak_flops:
            metrics["mfu"] = tokens_per_sec * self.flops_per_token / (self.peak_flops * world)
        if self.device.type == "cuda":
            metrics["peak_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.log.event("train", self.step, **metrics)

    def validate(self) -> dict:
        """Valid perplexity and memory statistics; writes best.pt when the perplexity improves."""
        data = self.cfg.data
        stream = TokenStream(data.path, "valid", data.eval_batch_size or data.batch_size, data.bptt,
                             self.env.rank, self.env.world_size, train=False)
        result = evaluate(self.model, stream, self.device, self.cfg.train.precision,
                          self.cfg.train.eval_max_batches, self.env)
        self.log.event("valid", self.step, **result)
        for layer, memory in self.model.memories():
            self.log.histogram(f"memory/layer{layer}_slot_weight", memory.slot_weights(), self.step)
        if result["ppl"] < self.best_ppl:
            self.best_ppl = result["ppl"]
            self.save(self.best_path)
        return result

    def close(self) -> None:
        """Closes the logs and drops the DDP wrapper, whose communication hooks must go before the
        process group does (gloo otherwise aborts at exit)."""
        self.log.close()
        self.forward_model = self.model
        gc.collect()


def new_log_window() -> dict:
    """Sums over the steps since the last train log line."""
    return {"loss": 0.0, "steps": 0, "tokens": 0, "words": 0, "time": time.perf_counter()}


def requeue_slurm_job(log: RunLogger) -> None:
    """Puts this SLURM job back in the queue; the requeued job resumes from checkpoint.pt."""
    job = os.environ["SLURM_JOB_ID"]
    log.info(f"requeuing SLURM job {job}")
    subprocess.run(["scontrol", "requeue", job], check=True)
