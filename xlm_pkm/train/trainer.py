"""The training loop: mixed precision, gradient accumulation, clipping, DDP or FSDP, evaluation, checkpoints.

A run lives in `dump_path/exp_name/exp_id/`, locked to one process group at a time (run_dir.py).
Starting a run whose directory holds `checkpoint.pt` resumes it exactly: model, optimizers, loss
scaler and every rank's TrainState (counters, RNG states, data cursor, log window). Nothing non-finite
is ever saved: `checkpoint.pt` is always the last good state. A run stopped by a signal or its time
limit saves a checkpoint and sets `stopped`; train.py then exits with status 75 (resume me); so does
SIGHUP (the terminal or ssh session closed), and so does a rank whose torchrun launcher is gone. Ctrl-C
(SIGINT) stops the same way; a second one stops at once, but never in the middle of a checkpoint write; a second
SIGTERM (SIGHUP, SIGUSR1/2) while the run stops changes nothing (train.py: ignored until its process ends). Under
SLURM, the time-limit warning (SIGUSR1/SIGUSR2) also requeues the job; SIGTERM (scancel, or SLURM
requeueing or pre-empting the job itself) does not: a cancelled job ends, its checkpoint kept.
Besides evaluations, a checkpoint is written every `train.save_every_steps` steps and/or
`train.save_every_minutes` minutes, so that a node lost without a signal loses at most that much.
The run directory removed (or moved away) while the run trains stops it at the end of that step with one
line (RunDirectoryRemoved: rank 0 looks once a step), nothing written anywhere else, no resume command.
"""

from __future__ import annotations

import gc
import math
import os
import random
import signal
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from xlm_pkm.checkpoint.files import first_non_finite
from xlm_pkm.checkpoint.run_checkpoints import RunCheckpoints
from xlm_pkm.checkpoint.trained import load_trained
from xlm_pkm.config import Config, to_dict
from xlm_pkm.data.fact_batches import PAD_TARGET
from xlm_pkm.data.meta import file_digest
from xlm_pkm.data.shard import ShardError
from xlm_pkm.data.tokenized import UNIT, load_tokenizer, surface_forms
from xlm_pkm.errors import ConfigError, UserError
from xlm_pkm.finetune import lora
from xlm_pkm.finetune.init_from import load_weights, summarize
from xlm_pkm.finetune.memory_finetune import SparseMemoryFinetuning
from xlm_pkm.finetune.trainable import freeze
from xlm_pkm.optim.optimizers import value_optimizer
from xlm_pkm.runtime import slurm_env
from xlm_pkm.runtime.distributed import (
    all_reduce_sum,
    any_ranks,
    average_value_grads_,
    broadcast_object,
    data_parallel,
    gather_objects,
    init_distributed,
    start_heartbeat,
    synced_values,
)
from xlm_pkm.runtime.hardware import peak_flops
from xlm_pkm.runtime.precision import check_precision, grad_scaler, resolve_device
from xlm_pkm.train.build import (
    InitialWeights,
    build_model,
    build_optimizers,
    build_stream,
    resolved_config,
    shard_values_choice,
)
from xlm_pkm.train.evaluation import evaluate
from xlm_pkm.train.memory_estimate import estimate
from xlm_pkm.train.run_dir import (
    RunDirectoryRemoved,
    directory_identity,
    lock_run_directory,
    record_config,
    refuse_links,
    refuse_unresumable,
    remove_temporary_files,
    run_directory,
)
from xlm_pkm.train.run_log import RunLogger
from xlm_pkm.train.state import TrainState, from_earlier_version, resharded_states
from xlm_pkm.train.step import loss_backward, optimizer_update
from xlm_pkm.train.wandb_log import import_wandb
from xlm_pkm.utils.progress import format_duration
from xlm_pkm.utils.stop_signals import STOP_SIGNALS, raise_held_signal

REQUEUE_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)  # SLURM's warning before the time limit (sbatch --signal)


class NonFiniteLossError(UserError, RuntimeError):
    """The loss stayed non-finite for too many consecutive steps, or the valid perplexity is not finite."""


class Trainer:
    def __init__(self, cfg: Config, test: bool = True):
        """Builds everything a run needs and checks every input it will read (train, valid, and test
        unless `test` is False) before the first step. `cfg` is left as given; self.cfg is the run's, resolved
        (resolved_config: the data's vocabulary size, the run's id)."""
        self.cfg, self.test = cfg, test  # test: evaluate best.pt on test at the end (a resume keeps it off: resume())
        # (evaluation reads its own; a retrofit's are its base's: build.resolved_base)
        if cfg.model.family == "transformer" and not cfg.model.base.path and cfg.data.bptt > cfg.model.max_len:
            raise ConfigError(f"data.bptt={cfg.data.bptt} is longer than model.max_len={cfg.model.max_len}, the "
                              f"positions the model learns: lower data.bptt or raise model.max_len")
        if cfg.train.wandb.project:
            import_wandb()  # installed? Checked on every rank, before anything is read or written
        self.device, self.env = self._setup_process()
        self.train_stream = build_stream(cfg, "train", self.env)
        self.dictionary = self.train_stream.dictionary
        self.vocab_fingerprint = self.dictionary.fingerprint()
        self.word_end = torch.from_numpy(self.dictionary.word_end_mask())
        codes = Path(cfg.data.path) / "codes"  # BPE data: the codes that split text into this vocabulary
        self.codes_digest = file_digest(codes) if codes.is_file() else None
        self.valid_stream = build_stream(cfg, "valid", self.env)  # its shards' checksums verified once a run
        if test:
            build_stream(cfg, "test", self.env)  # read by evaluate_checkpoint after training: checked now
        train = cfg.train  # the run directory is created below, once every input is checked
        self.run_dir, exp_id = run_directory(train.dump_path, train.exp_name, train.exp_id, self.env, train.max_steps)
        shard_auto = cfg.model.memory.shard_values == "auto"
        self.cfg = cfg = resolved_config(cfg, self.dictionary, exp_id, self.env.world_size)
        # what shard_values=auto chose under fsdp, and why (logged)
        self.shard_values_choice = (shard_values_choice(cfg, self.env.world_size) if shard_auto and
                                    cfg.train.parallel == "fsdp" and self.env.is_distributed else None)
        self.initial_weights = InitialWeights(cfg.train.seed, self.device)  # the model's, then LoRA adapters'
        self.fsdp = cfg.train.parallel == "fsdp" and self.env.is_distributed  # one process: the model itself
        # fsdp: each rank builds its shards only, unless train.init_from loads a whole trained model into it first
        loads_whole = cfg.train.init_from and not (self.run_dir / "checkpoint.pt").exists()
        self.model = build_model(cfg, self.device, self.initial_weights, self.env.world_size,
                                 self._fully_shard if self.fsdp and not loads_whole else None)
        if cfg.model.engram.layers:  # the vocabulary's canonical ids, saved with the model
            if self.train_stream.unit == "byte":
                raise ConfigError(f"model.engram: {cfg.data.path} is character-level data (one token per byte), "
                                  f"whose tokens have no surface form to compress; Engram needs BPE or word data")
            self.model.set_token_compression(self.token_surface_forms())
        self.checkpoints = RunCheckpoints(self.run_dir, self.model, self.env, self.device)
        self.ckpt_path, self.best_path = self.checkpoints.last_path, self.checkpoints.best_path
        self.resumed = self.ckpt_path.exists()
        self.trained_with = None  # on a resume: the config recorded in checkpoint.pt (today's keys)
        self.initialised = None  # an InitReport when train.init_from loaded a trained model
        if cfg.train.init_from and not self.resumed:  # before anything wraps or freezes the weights
            self.initialise(cfg.train.init_from)
        self.lora = lora.uses_lora(cfg.optim)  # adapters on the loaded weights; best.pt gets them merged
        with self.initial_weights.drawing():  # LoRA's adapters draw their initial weights
            self.trainable = (lora.add_adapters(self.model, cfg.optim) if self.lora
                              else freeze(self.model, cfg.optim.trainable, cfg.optim.freeze_norm_stats))
        # with FSDP, its MixedPrecisionPolicy casts the weights (runtime/fsdp.py) in place of autocast
        self.autocast_precision = "fp32" if self.fsdp else cfg.train.precision
        self.synced_values = synced_values(self.model, value_optimizer(cfg.optim).sparse, self.fsdp)
        self.forward_model = self._wrap_model()  # before the optimizers: FSDP (if not yet) replaces the parameters
        self.optimizers = build_optimizers(self.model, cfg)
        self.scaler = grad_scaler(cfg.train.precision, self.device)
        torch.manual_seed(cfg.train.seed * 1000 + self.env.rank)  # the only seeding: dropout differs across ranks
        random.seed(cfg.train.seed * 1000 + self.env.rank)
        self.state = TrainState(self.train_stream, self.device, self.model)

        self.lock = self._lock_run_directory()  # rank 0's; creates the directory
        self.run_dir_identity = directory_identity(self.run_dir)  # another one (or none) later: removed
        self.run_dir_removed = False  # seen removed (or replaced) while the run trained
        refuse_links(self.run_dir, self.env)  # before any file there is opened
        self.removed_temporary = remove_temporary_files(self.run_dir) if self.env.is_main else 0
        self.took_over = refuse_unresumable(self.run_dir, self.resumed, self.env)  # a run that trained no step
        if self.resumed:
            self.resume()
        self.memory_finetune = None if not cfg.optim.memory_finetune.top_t else SparseMemoryFinetuning(
            self.model, cfg.optim.memory_finetune, value_optimizer(cfg.optim).sparse, self.env,
            check_fingerprint=not self.resumed)
        self.stopped = False  # by a signal or the time limit, before max_steps
        # torchrun's process, the parent of this rank: a rank whose launcher was killed (kill -9) stops like one
        # sent a signal (checkpoint, lock released), rather than train on as an orphan holding the run's lock
        self.launcher_pid = os.getppid() if os.environ.get("TORCHELASTIC_RUN_ID") else None
        self.stop_signal: int | None = None  # the signal that asked to stop, if one did
        self.writing = self.interrupt_after_write = False  # a checkpoint being written; a second Ctrl-C during it
        self.log = RunLogger(self.run_dir, self.env.is_main, resume_step=self.state.step if self.resumed else None,
                             wandb=cfg.train.wandb, config=to_dict(cfg))
        if self.env.is_main:
            changes = record_config(self.run_dir, cfg, self.step if self.resumed else None, self.trained_with)
            if changes:
                self.log.info(f"resumed with another config than the run's (previous one kept as "
                              f"config.until-step{self.step}.yaml): " + "; ".join(changes))
            self._log_eval_cut_change()
        self._log_init()
        self.flops_per_token = self.model.dense_flops_per_token(cfg.data.bptt)
        self.peak_flops = peak_flops(self.device, cfg.train.precision)
        self._log_start()

    def _lock_run_directory(self):
        """Rank 0 takes the run directory's lock; every rank learns whether it could (a live run holding it, an
        unwritable folder), so that all end with the one line at once, not rank 0 alone while the others wait
        for it in a collective until the timeout."""
        lock, refused = None, None
        if self.env.is_main:
            try:
                lock = lock_run_directory(self.run_dir)
            except UserError as e:
                refused = (type(e), str(e))
        refused = broadcast_object(refused, self.env)
        if refused is not None:
            error_type, message = refused
            raise error_type(message)
        return lock

    @property
    def step(self) -> int:
        return self.state.step

    def _setup_process(self) -> tuple[torch.device, object]:
        """The device, CPU threads and process group of this rank."""
        train = self.cfg.train
        device = resolve_device(train.device)
        check_precision(train.precision, device)
        if train.num_threads:
            torch.set_num_threads(train.num_threads)
        env = init_distributed(device, train.collective_timeout_minutes)
        start_heartbeat(env, train.collective_timeout_minutes)  # lets a failed collective name the silent ranks
        return (torch.device("cuda", env.local_rank) if device.type == "cuda" else device), env

    def _fully_shard(self, model: torch.nn.Module) -> None:
        """The model made FSDP units in place (runtime/fsdp.py): its blocks, its memory and Engram sublayers (float32
        under mixed precision), the root; the value and Engram tables left out (synced_values)."""
        from xlm_pkm.runtime.fsdp import fully_shard_model  # FSDP's import: only its runs pay it

        fully_shard_model(model, self.env, self.device, self.cfg.train.precision,
                          self.cfg.train.fsdp_reshard_after_forward)

    def _wrap_model(self) -> torch.nn.Module:
        """The module the step calls: with train.parallel=fsdp on several processes, the model fully sharded
        (built so, or in place now after train.init_from); else the model, in DDP when distributed and a parameter
        trains outside the values that average_value_grads_ synchronises (sparse or sharded ones, left out of DDP's
        all-reduce); compiled when asked."""
        model = self.model
        synced = {id(p) for p in self.synced_values}
        if self.fsdp:
            from torch.distributed.fsdp import FSDPModule

            if not isinstance(model, FSDPModule):
                self._fully_shard(model)
        elif self.env.is_distributed and any(p.requires_grad and id(p) not in synced for p in model.parameters()):
            model = data_parallel(model, self.synced_values, self.device)
        return torch.compile(model) if self.cfg.train.compile else model

    def _warn_if_busy(self, threads: int) -> None:
        """A CPU run on a machine that other processes already load beyond its cores: each of this run's threads
        waits for a core, and one thread can train faster than several (issue 63: 516 against 257 tokens/s)."""
        cores, load = len(os.sched_getaffinity(0)), os.getloadavg()[0]
        if load > cores:
            self.log.info(f"warning: this machine is busy (load {load:.1f} on {cores} cores before this run started): "
                          f"this run's {threads} CPU thread(s) share the cores with other processes; fewer threads "
                          f"may train faster: train.num_threads=1 (make demo THREADS=1)")

    def _log_start(self) -> None:
        counts = self.model.param_counts()
        self.log.info(f"run directory {self.run_dir} "
                      f"({'resumed at step ' + str(self.step) if self.resumed else 'new run'})")
        max_steps = self.cfg.train.max_steps
        if self.resumed and self.step >= max_steps:  # run again once finished (make demo twice)
            self.log.info(f"the run is already finished (step {self.step} of train.max_steps={max_steps}): nothing "
                          f"to train" + ("; its test evaluation follows" if self.test else "") +
                          "; to train it further, give a larger train.max_steps")
        if self.took_over:
            self.log.info("this directory held a run that trained no step (it failed at start-up or at its first "
                          "step): taken over by this one")
        if self.removed_temporary:
            self.log.info(f"removed {self.removed_temporary} temporary file(s) left by a process killed while writing")
        threads, saved = torch.get_num_threads(), self.state.saved_threads
        if self.resumed and self.device.type == "cpu" and saved not in (None, threads):
            self.log.info(f"resumed on {threads} CPU thread(s), saved on {saved}: float reductions round differently, "
                          f"so the losses will not be bit-identical to an uninterrupted run's "
                          f"(train.num_threads={saved} would make them so)")
        if self.device.type == "cpu" and self.env.is_main:
            self._warn_if_busy(threads)
        parallel = f" ({self.cfg.train.parallel})" if self.env.is_distributed else ""
        self.log.info(f"device {self.device}, {self.env.world_size} process(es){parallel}, "
                      f"precision {self.cfg.train.precision}, "
                      f"memories at layers {[layer for layer, _ in self.model.memories()]}")
        if self.shard_values_choice is not None and self.model.memories():
            shard, why = self.shard_values_choice
            held = (f"1/{self.env.world_size} of every value table's columns and of their optimizer state" if shard
                    else "every value table whole, and its optimizer state")
            self.log.info(f"model.memory.shard_values=auto: {str(shard).lower()} ({why}): each rank holds {held}; "
                          f"set it true or false to choose")
        if self.model.ngram_hash is not None:
            canonical = int(self.model.ngram_hash.canonical.max()) + 1
            self.log.info(f"Engram at layers {self.cfg.model.engram.layers}: tokenizer compression "
                          f"{len(self.dictionary):,} -> {canonical:,} canonical ids "
                          f"({100 * (1 - canonical / len(self.dictionary)):.1f}% fewer), "
                          f"table rows per layer {[e.slot_stats.n_slots for _, e in self.model.engrams()]}")
        self.log.info("parameters: " + ", ".join(f"{k} {v:,}" for k, v in counts.items())
                      + f"; trainable {self.trainable:,} "
                      + f"({'LoRA adapters' if self.lora else ' '.join(self.cfg.optim.trainable)})"
                      + f"; dense training FLOPs/token {self.flops_per_token:.3g}")
        if not self.cfg.model.base.path:  # the estimate counts TransformerLM's parts
            self.log.info(estimate(self.cfg, self.env.world_size, self.cfg.train.parallel, self.device.type).summary())
        if self.memory_finetune:
            self.log.info(self.memory_finetune.describe())
        if self.cfg.data.fact_batches:
            self.log.info(f"fact batches: each step one fact's first {self.cfg.data.fact_batches} paraphrases, "
                          f"{len(self.train_stream)} facts in order, padding out of the loss and the slot counts")
        self.log.info(f"train lines (step 1, then every {self.cfg.train.log_every}): loss, ppl, tokens/s and "
                      f"words/s are means since the previous line; lr, grad_norm (before clipping) and, with "
                      f"optim.memory_finetune, slots_read/slots_updated are the last step's; ETA from this run's "
                      f"steps so far, evaluations included")
        accumulate, streams = self.cfg.optim.accumulate, self.cfg.data.batch_size
        if accumulate > 1 and self.model.stream_layers() and self.env.is_main:
            self.log.warning(f"optim.accumulate={accumulate} with stream caches: a step reads {accumulate} "
                             f"consecutive blocks of the same {streams} streams per rank (one stream of "
                             f"{accumulate}x data.bptt tokens each), not {accumulate * streams} streams; "
                             f"to train on more streams raise data.batch_size")

    # ---- checkpoints -------------------------------------------------------------------------
    def _model_record(self, weights: dict) -> dict:
        """What evaluation needs: best.pt is this, checkpoint.pt adds the optimizer and run state."""
        return {"config": to_dict(self.cfg), "model": weights, "step": self.step,
                "vocab_fingerprint": self.vocab_fingerprint, "codes_digest": self.codes_digest}

    def save_checkpoint(self) -> None:
        """checkpoint.pt: the model, optimizers, loss scaler and every rank's TrainState (gathered to rank 0);
        the tensors as each rank holds them (RunCheckpoints: Distributed Checkpoint). Refused if not finite
        (RunCheckpoints.save_last). Collective: every rank takes part."""
        record = {**self._model_record(self.model.state_dict()), "optimizers": self.optimizers.state_dict(),
                  "scaler": self.scaler.state_dict(), "world_size": self.env.world_size, "test": self.test,
                  "train_state": gather_objects(self.state.state_dict(), self.env)}
        with self._write_whole():
            self.checkpoints.save_last(record, self.optimizers.params())

    def save_best(self) -> None:
        """best.pt: the model only (for evaluation), whole (FSDP's shards gathered), LoRA adapters merged into
        plain weights (a retrofit's kept apart: its checkpoints hold no base weight to merge them into)."""
        if self.lora and not self.cfg.model.base.path:
            weights = lora.merged_state_dict(self.model)
        elif self.fsdp:
            from xlm_pkm.runtime.fsdp import full_state_dict

            weights = full_state_dict(self.model, self.env)
        else:
            weights = self.model.state_dict()
        with self._write_whole():
            self.checkpoints.save_best(self._model_record(weights))

    @property
    def saved_step(self) -> int | None:
        """Step of the last good checkpoint.pt (None: none yet)."""
        return self.checkpoints.saved_step

    def resume(self) -> None:
        """The run's checkpoint.pt loaded: saved on W processes, it resumes on any number (resharded_states)."""
        state = self.checkpoints.load_last(self.vocab_fingerprint, f"{self.cfg.data.path}/vocab", self.cfg,
                                           self.optimizers.params())
        self.trained_with = state["config"]
        self.test = self.test and state.get("test", True)  # a run started with --no-test stays without its test
        self.optimizers.load_state_dict(state["optimizers"], state["config"], self.ckpt_path)
        self.scaler.load_state_dict(state["scaler"])
        ranks = state["train_state"] if "train_state" in state else from_earlier_version(state)
        self.state.load_state_dict(resharded_states(ranks, self.env.world_size, self.cfg.train.seed)[self.env.rank])

    def token_surface_forms(self) -> list[str]:
        """The text of each token id, for Engram's tokenizer compression: the vocabulary's words, or for a
        tokenizer's data (a retrofit) each id decoded by that tokenizer, one per row of the model's embedding."""
        if self.train_stream.unit != UNIT:
            return self.dictionary.words
        return surface_forms(load_tokenizer(self.cfg.data.path), self.cfg.model.vocab_size)

    def initialise(self, path: str) -> None:
        """The weights of the trained model at `path` (train.init_from), checked against the data's vocabulary."""
        trained = load_trained(path, self.cfg.data.path)  # alone on each rank: whole value tables
        if trained.cfg.model.base.path and trained.cfg.optim.lora.rank:
            raise ConfigError(f"train.init_from={path}: a retrofit trained with LoRA adapters, which its checkpoint "
                              f"keeps apart from the base (merged into it when loaded): a new run from it would "
                              f"lose them; start from a retrofit trained without LoRA")
        if trained.cfg.model.base.trainable and not self.cfg.model.base.trainable:
            raise ConfigError(f"train.init_from={path}: a retrofit whose base's weights trained "
                              f"(model.base.trainable), which this run's checkpoints would not hold (they read the "
                              f"base from its files): set model.base.trainable=true")
        self.initialised = load_weights(self.model, trained, self.cfg.train.init_strict)

    def _log_eval_cut_change(self) -> None:
        """On a resume with train.eval_max_batches and another evaluation batch size than the run's (data.
        eval_batch_size 0 follows data.batch_size, which a resume on another number of processes changes): the
        validation reads other tokens than those best.pt's perplexity was measured on."""
        data, cut = (self.trained_with or {}).get("data", {}), self.cfg.train.eval_max_batches
        before = data.get("eval_batch_size") or data.get("batch_size")
        now = self.cfg.data.eval_batch_size or self.cfg.data.batch_size
        if cut and before and before != now:
            self.log.info(f"train.eval_max_batches={cut}: validation now reads one process's first {cut} batches of "
                          f"{now} rows, not of {before} as before the resume: other tokens than those of best.pt's "
                          f"perplexity; resume with data.eval_batch_size={before} to keep them")

    def _log_init(self) -> None:
        if self.resumed and self.cfg.train.init_from:
            self.log.info(f"train.init_from={self.cfg.train.init_from} ignored: "
                          "the run resumes from its own checkpoint")
        if self.initialised is None:
            return
        report = self.initialised
        self.log.info(f"initialised from {report.source} (step {report.step} of its run): "
                      f"{len(report.loaded)} tensors loaded, {len(report.new)} new, {len(report.dropped)} dropped")
        for kind in ("loaded", "new", "dropped"):
            if getattr(report, kind):
                self.log.info(f"  {kind}: {summarize(getattr(report, kind), limit=1000)}")

    # ---- one optimizer step ------------------------------------------------------------------
    def train_step(self, batches) -> dict:
        """Forward/backward over `accumulate` micro-batches, then one update of every group."""
        cfg, state = self.cfg, self.state
        lrs = self.optimizers.set_step(state.step + 1)
        accumulate = cfg.optim.accumulate
        loss_sum = torch.zeros((), device=self.device)
        tokens = words = 0
        aux = self.model.aux_loss if self.model.has_aux_loss() else None  # training-only loss terms
        if self.memory_finetune:
            self.memory_finetune.begin_step(state.step + 1)
        for i in range(accumulate):
            epoch = self.train_stream.epoch
            x, y = next(batches)  # (B, T) each, on the CPU: counting words there needs no device sync
            if self.train_stream.epoch != epoch:
                self.model.reset_stream_state()  # new streams (a new offset): caches start from zero
            real = y != PAD_TARGET if cfg.data.fact_batches else None  # (B, T): fact batches' padding is no token
            targets = y if real is None else y[real]
            words += int(self.word_end[targets].sum())
            tokens += targets.numel()
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            if real is not None:
                real = real.to(self.device, non_blocking=True)
            if self.memory_finetune:
                self.memory_finetune.count_only(real)
            last = i == accumulate - 1
            in_ddp = hasattr(self.forward_model, "no_sync")  # also through torch.compile's wrapper
            sync = self.forward_model.no_sync() if in_ddp and not last else nullcontext()
            if self.fsdp:
                self.model.set_requires_gradient_sync(last)  # reduce-scatter after the last micro-batch only
            with sync:
                loss_sum += loss_backward(self.forward_model, x, y, self.autocast_precision, self.device,
                                          self.scaler, accumulate, aux, real)
        average_value_grads_(self.synced_values, self.env)  # host sync if sparse and replicated: row counts
        slots = self.memory_finetune.restrict_gradients() if self.memory_finetune else {}  # host sync
        loss = loss_sum / accumulate
        norms, scale, skipped = optimizer_update(self.optimizers, self.scaler, loss)  # host sync: finite check
        skipped = bool(skipped)  # fused optimizers (optim.fused_*): a device flag, read once the step is queued
        if not skipped:
            self.model.clamp_spans()  # span ratios back into [0, 1]
        state.step += 1
        state.skipped_steps += skipped
        state.nonfinite_streak = state.nonfinite_streak + 1 if skipped and not self.scaler.is_enabled() else 0
        if state.nonfinite_streak >= cfg.train.max_nonfinite:
            raise NonFiniteLossError(f"loss or gradients were not finite for {state.nonfinite_streak} consecutive "
                                     f"steps (last at step {state.step}); stopping. {self.checkpoints.last_good()}")
        return {"loss": loss, "norms": norms, "lrs": lrs, "scale": scale, "tokens": tokens, "words": words, **slots}

    # ---- the loop ----------------------------------------------------------------------------
    def train(self, keep_stopping: bool = False) -> dict:
        """Trains until max_steps (or max_time, or a stop signal); returns the last valid metrics.
        `keep_stopping` (train.py, whose process ends once the run is closed): when a stop signal stopped the run
        before max_steps, the stop signals other than Ctrl-C are left ignored, not given back to the caller's
        handlers: a second SIGTERM while the run closes and the process exits changes nothing (it ended the
        process with status 143, or was reported as a stop during the test evaluation that --no-test skips)."""
        cfg, state = self.cfg.train, self.state
        raise_held_signal()  # one that came while the trainer was built but was swallowed (utils/stop_signals.py)
        handlers = {s: signal.signal(s, self._request_stop) for s in STOP_SIGNALS}
        batches = iter(self.train_stream)
        speed = {"tokens": 0, "words": 0, "time": time.perf_counter()}  # since the last log line or start
        start, last_valid = time.time(), {}
        last_save = start
        self.session = {"step": state.step, "time": time.perf_counter()}  # where this process started: the ETA
        try:
            while state.step < cfg.max_steps:
                out = self.train_step(batches)
                state.log_loss_sum += out["loss"]  # stays on the device: no sync
                state.log_steps += 1
                speed["tokens"] += out["tokens"]
                speed["words"] += out["words"]
                if state.step % cfg.log_every == 0 or state.step in (1, cfg.max_steps):  # step 1: no long silence
                    self._log_train(out, speed)  # host sync: the logged values
                    state.log_loss_sum, state.log_steps = 0.0, 0
                    speed = {"tokens": 0, "words": 0, "time": time.perf_counter()}
                if state.step % cfg.eval_every == 0 or state.step == cfg.max_steps:
                    last_valid = self.validate()
                    self.save_checkpoint()
                out_of_time = cfg.max_time_minutes > 0 and time.time() - start > 60 * cfg.max_time_minutes
                stop = self.stop_signal is not None
                orphaned = self.launcher_pid is not None and os.getppid() != self.launcher_pid
                minutes_due = (self.env.is_main and cfg.save_every_minutes > 0  # rank 0's clock decides
                               and time.time() - last_save >= 60 * cfg.save_every_minutes)
                gone = self.env.is_main and self._run_dir_gone()  # one stat
                # one host sync per step (if distributed) for all: a stop asked anywhere, a save due by time, the
                # run directory gone
                stop_anywhere, minutes_due, gone = any_ranks([stop or out_of_time or orphaned, minutes_due, gone],
                                                             self.env, self.device)
                if gone:
                    raise self._removed()
                if self.saved_step != state.step and (minutes_due or self._steps_due()):
                    self.save_checkpoint()
                if self.saved_step == state.step:
                    last_save = time.time()
                if stop_anywhere:
                    self._stop(signal.Signals(self.stop_signal).name if stop else
                               "time limit" if out_of_time else "the torchrun launcher is gone" if orphaned
                               else "a signal to another rank, or its launcher gone")
                    break
        except Exception as e:  # a write into the removed directory (an evaluation's best.pt) before the check
            if not isinstance(e, RunDirectoryRemoved) and self._run_dir_gone():
                raise self._removed() from None
            raise
        finally:
            stopping = keep_stopping and self.stopped and state.step < cfg.max_steps
            for s, h in handlers.items():
                signal.signal(s, signal.SIG_IGN if stopping and s != signal.SIGINT else h)
        return last_valid

    def _run_dir_gone(self) -> bool:
        """Whether the run directory is no longer the one this run locked (removed, moved away, replaced)."""
        return directory_identity(self.run_dir) != self.run_dir_identity

    def _removed(self) -> RunDirectoryRemoved:
        self.run_dir_removed = True
        return RunDirectoryRemoved(f"{self.run_dir} was removed (or moved away) while the run trained: stopped at "
                                   f"step {self.step}; its checkpoints and logs went with it")

    def _request_stop(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.stop_signal == signal.SIGINT:  # a second Ctrl-C: stop now...
            if self.writing:
                self.interrupt_after_write = True  # ...once the file being written is whole
                return
            raise KeyboardInterrupt
        self.stop_signal = signum

    @contextmanager
    def _write_whole(self):
        """A checkpoint write that a second Ctrl-C does not cut: the interrupt waits until it ends."""
        self.writing = True
        try:
            yield
        finally:
            self.writing = False
        if self.interrupt_after_write:
            raise KeyboardInterrupt

    def _steps_due(self) -> bool:
        """A checkpoint is due by train.save_every_steps (train.save_every_minutes: in the loop)."""
        every = self.cfg.train.save_every_steps
        return bool(every) and self.step % every == 0

    def _stop(self, why: str) -> None:
        """Checkpoints (unless just done) and stops; under SLURM, requeues the job on its time-limit warning."""
        self.log.info(f"stopping at step {self.step} ({why})")
        if self.saved_step != self.step:  # not just saved after an evaluation
            self.save_checkpoint()
        self.stopped = True
        if self.stop_signal in REQUEUE_SIGNALS and self.env.is_main and slurm_env.job_id():
            failed = slurm_env.requeue()
            self.log.info(f"SLURM job {slurm_env.job_id()} " + (f"not requeued: {failed}" if failed else "requeued"))

    def _log_train(self, out: dict, speed: dict) -> None:
        world, state = self.env.world_size, self.state
        totals = torch.tensor([float(state.log_loss_sum), speed["tokens"], speed["words"]], dtype=torch.float64,
                              device=self.device)
        loss, tokens, words = (all_reduce_sum(totals, self.env) / torch.tensor([world * state.log_steps, 1, 1],
                                                                                device=self.device)).tolist()
        elapsed = time.perf_counter() - speed["time"]
        tokens_per_sec = tokens / elapsed
        metrics = {
            "loss": loss,
            "ppl": math.exp(min(loss, 100.0)),
            "lr": out["lrs"],
            "grad_norm": {k: float(v) for k, v in out["norms"].items()},
            "loss_scale": out["scale"],
            "skipped_steps": state.skipped_steps,
            **{k: out[k] for k in ("slots_read", "slots_updated") if k in out},  # the last step's
            "tokens_per_sec": tokens_per_sec,
            "words_per_sec": words / elapsed,
        }
        if self.peak_flops:
            metrics["mfu"] = tokens_per_sec * self.flops_per_token / (self.peak_flops * world)
        if self.device.type == "cuda":
            metrics["peak_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        max_steps = self.cfg.train.max_steps
        per_step = (time.perf_counter() - self.session["time"]) / (state.step - self.session["step"])  # evals too
        metrics["eta_s"] = per_step * (max_steps - state.step)
        threads = f", {torch.get_num_threads()} CPU thread(s)" if self.device.type == "cpu" else ""  # shared machines
        self.log.event("train", state.step, f"/{max_steps} ({100 * state.step / max_steps:.0f}%, "
                                            f"ETA {format_duration(metrics['eta_s'])}{threads})", **metrics)

    def validate(self) -> dict:
        """Valid perplexity and memory statistics; writes best.pt when the perplexity improves."""
        try:
            result = evaluate(self.model, self.valid_stream, self.device, self.autocast_precision,
                              self.cfg.train.eval_max_batches, self.env)
        except (ShardError, OSError) as e:  # the data moved, deleted or damaged since the start
            raise self._saved_before_stopping(e) from None
        self.log.event("valid", self.step, **result)
        if not math.isfinite(result["ppl"]):  # diverged (its weights may be finite, yet useless): not saved
            bad = first_non_finite(self.model.state_dict())  # this rank's
            raise NonFiniteLossError(f"valid perplexity is {result['ppl']} at step {self.step}: " +
                                     (f"{bad} is not finite" if bad else "the run diverged (lower optim.lr, raise "
                                      "optim.warmup_steps or clip the gradients)") +
                                     f"; not saved. {self.checkpoints.last_good()}")
        for layer, memory in self.model.memories():
            self.log.histogram(f"memory/layer{layer}_slot_weight", memory.slot_weights(), self.step)
        if result["ppl"] < self.state.best_ppl:
            self.state.best_ppl = result["ppl"]
            self.save_best()
        return result

    def _saved_before_stopping(self, error: Exception) -> UserError:
        """Checkpoints the in-memory state (it is good: only the data failed), then the error that stops the run."""
        if self.saved_step != self.step:
            self.save_checkpoint()
        return UserError(f"{error} (the evaluation at step {self.step}); the run was saved first: {self.ckpt_path} "
                         f"(step {self.step}); resume it once the data is readable again")

    def close(self) -> None:
        """Closes the logs, releases the run directory and drops the DDP wrapper, whose communication
        hooks must go before the process group does (gloo otherwise aborts at exit)."""
        self.log.close()
        if self.lock is not None:
            self.lock.release()
        self.forward_model = self.model
        gc.collect()

