"""The two checkpoints of a run directory, as a component the trainer calls.

    checkpoints = RunCheckpoints(run_dir, model, env, device)
    checkpoints.save_last(record)    # checkpoint.pt: everything to resume; refused if not finite
    checkpoints.save_best(record)    # best.pt: the model only, for evaluation
    state = checkpoints.load_last(vocab_fingerprint, vocab_path, cfg)   # into the model; the rest returned

Both are written collectively: the sharded values by every rank (sharded_values.py), then the rest by
rank 0, whole or not at all (files.save_atomic). `saved_step` is the step of the last good
checkpoint.pt: a non-finite state is never written, so the previous file stays the last good one.
Loading is collective too: if one rank cannot load its part (its value shard file missing or damaged),
every rank raises before any goes on.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from xlm_pkm.checkpoint import files, sharded_values
from xlm_pkm.config import Config, migrate, refuse_architecture_change
from xlm_pkm.runtime.distributed import DistEnv, any_rank


class RunCheckpoints:
    def __init__(self, run_dir: Path, model: nn.Module, env: DistEnv, device: torch.device):
        self.last_path, self.best_path = run_dir / "checkpoint.pt", run_dir / "best.pt"
        self.model, self.env, self.device = model, env, device
        self.saved_step: int | None = None  # step of the last good checkpoint.pt (None: none saved or loaded)

    def save_last(self, record: dict) -> None:
        """checkpoint.pt, unless a parameter or an optimizer state is not finite (NonFiniteError, and the
        previous checkpoint.pt stays: it is the last good one). Collective: every rank takes part."""
        bad = files.first_non_finite({"model": record["model"], "optimizer": record["optimizers"]})
        if any_rank(bad is not None, self.env, self.device):  # a value shard may be bad on one rank only
            raise files.NonFiniteError(f"{bad or 'a value shard of another rank'} is not finite at step "
                                       f"{record['step']}: not saved. {self.last_good()}")
        self._write(record, self.last_path)
        self.saved_step = record["step"]

    def save_best(self, record: dict) -> None:
        self._write(record, self.best_path)

    def _write(self, record: dict, path: Path) -> None:
        record = sharded_values.save(record, path, self.model, self.env, self.device)
        if self.env.is_main:
            files.save_atomic(record, path)
            sharded_values.remove_stale(path, record)

    def last_good(self) -> str:
        """Where the last good state is, for the error that stops a run."""
        if self.saved_step is None:
            return "No checkpoint was written by this run"
        return f"Last good checkpoint: {self.last_path} (step {self.saved_step})"

    def load_last(self, vocab_fingerprint: str, vocab_path: str, cfg: Config) -> dict:
        """checkpoint.pt, its weights loaded into the model (this rank's value shard), after checking the
        number of processes, the architecture (that of `cfg`) and the vocabulary; returns the checkpoint for the
        rest of the run's state (its recorded config in today's keys: config.migrate).
        Collective: every rank takes part, and if any rank fails (its value shard file missing or damaged,
        say) every rank raises, before any goes on into training (sharded_values.on_every_rank)."""
        state = sharded_values.on_every_rank(lambda: self._load_last(vocab_fingerprint, vocab_path, cfg), self.env,
                                             self.last_path)
        self.saved_step = state["step"]
        return state

    def _load_last(self, vocab_fingerprint: str, vocab_path: str, cfg: Config) -> dict:
        """load_last on this rank alone."""
        state = files.load(self.last_path)
        state["config"] = migrate(state["config"])  # in today's keys, as the resume checks read it
        refuse_architecture_change(state["config"], cfg, self.last_path)
        if state["world_size"] != self.env.world_size:
            raise ValueError(f"{self.last_path}: saved with {state['world_size']} processes, resumed with "
                             f"{self.env.world_size}; exact resume needs the same number (each rank's data "
                             f"position and random state are saved; sharded memory values re-shard, and "
                             f"evaluate.py loads the checkpoint on any number of processes)")
        state = sharded_values.attach(state, self.last_path, sharded_values.model_shard(self.model),
                                      sharded_values.sharded_names(self.model))
        files.check_vocabulary(state, vocab_fingerprint, vocab_path, self.last_path)
        files.load_model_state(self.model, state["model"], self.last_path)
        return state
