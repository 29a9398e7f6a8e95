"""The two checkpoints of a run directory, as a component the trainer calls.

    checkpoints = RunCheckpoints(run_dir, model, env, device)
    checkpoints.save_last(record, params)   # checkpoint.pt: everything to resume; refused if not finite
    checkpoints.save_best(record)           # best.pt: the model only, for evaluation
    state = checkpoints.load_last(vocab_fingerprint, vocab_path, cfg, params)   # into the model; the rest returned

`params` are each optimizer group's parameters (Optimizers.params()). Both are written collectively:
checkpoint.pt's tensors by every rank through Distributed Checkpoint (dcp_tensors.py), best.pt's sharded
values by every rank (sharded_values.py); then the rest by rank 0, whole or not at all (files.save_atomic).
`saved_step` is the step of the last good checkpoint.pt: a non-finite state is never written, so the
previous file stays the last good one. Loading is collective too: if one rank cannot load its part, every
rank raises before any goes on.

checkpoint.pt resumes on any number of processes and in either train.parallel (its tensors re-shard as they
load; the trainer re-shards the per-rank run state: train/state.py). A checkpoint.pt of an earlier version
(one file holding the model, and its value shard files) resumes as before: on the same number of processes,
with train.parallel=ddp.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from xlm_pkm.checkpoint import dcp_tensors, files, sharded_values
from xlm_pkm.config import Config, migrate, refuse_architecture_change
from xlm_pkm.runtime.distributed import DistEnv, any_rank
from xlm_pkm.utils.dtensors import is_dtensor


class RunCheckpoints:
    def __init__(self, run_dir: Path, model: nn.Module, env: DistEnv, device: torch.device):
        self.last_path, self.best_path = run_dir / "checkpoint.pt", run_dir / "best.pt"
        self.model, self.env, self.device = model, env, device
        self.saved_step: int | None = None  # step of the last good checkpoint.pt (None: none saved or loaded)

    def save_last(self, record: dict, params: dict[str, list[nn.Parameter]]) -> None:
        """checkpoint.pt, unless a parameter or an optimizer state is not finite (NonFiniteError, and the
        previous checkpoint.pt stays: it is the last good one). Collective: every rank takes part."""
        bad = files.first_non_finite({"model": record["model"], "optimizer": record["optimizers"]})
        if any_rank(bad is not None, self.env, self.device):  # a shard may be bad on one rank only
            raise files.NonFiniteError(f"{bad or 'a shard of another rank'} is not finite at step "
                                       f"{record['step']}: not saved. {self.last_good()}")
        record = dcp_tensors.save(record, self.last_path, self.model, params, self.env, self.device)
        if self.env.is_main:
            files.save_atomic(record, self.last_path)
            dcp_tensors.remove_stale(self.last_path, record)
            sharded_values.remove_stale(self.last_path, record)  # an earlier version's value files
        self.saved_step = record["step"]

    def save_best(self, record: dict) -> None:
        record = sharded_values.save(record, self.best_path, self.model, self.env, self.device)
        if self.env.is_main:
            files.save_atomic(record, self.best_path)
            sharded_values.remove_stale(self.best_path, record)

    def last_good(self) -> str:
        """Where the last good state is, for the error that stops a run."""
        if self.saved_step is None:
            return "No checkpoint was written by this run"
        return f"Last good checkpoint: {self.last_path} (step {self.saved_step})"

    def load_last(self, vocab_fingerprint: str, vocab_path: str, cfg: Config,
                  params: dict[str, list[nn.Parameter]]) -> dict:
        """checkpoint.pt, its weights loaded into the model (this rank's part), after checking the
        architecture (that of `cfg`) and the vocabulary; returns the checkpoint for the rest of the run's state
        (its recorded config in today's keys: config.migrate; its optimizers' states with their tensors).
        Collective: every rank takes part, and if any rank fails every rank raises, before any goes on into
        training (sharded_values.on_every_rank; Distributed Checkpoint's own agreement)."""
        state = sharded_values.on_every_rank(lambda: self._read_last(vocab_fingerprint, vocab_path, cfg), self.env,
                                             self.last_path)
        if dcp_tensors.KEY in state:
            state = dcp_tensors.load(state, self.last_path, self.model, params, self.env, self.device)
            bad = files.first_non_finite(self.model.state_dict())
            if any_rank(bad is not None, self.env, self.device):
                raise files.damaged_weight(bad or "of another rank", self.last_path)
        self.saved_step = state["step"]
        return state

    def _read_last(self, vocab_fingerprint: str, vocab_path: str, cfg: Config) -> dict:
        """checkpoint.pt read and checked on this rank alone; an earlier version's (one file) loaded into the model."""
        try:
            state = files.load(self.last_path)
        except (ValueError, FileNotFoundError) as e:  # damaged, emptied, replaced by a folder: nothing to resume
            raise ValueError(f"{e}; restore it from a copy to resume the run, or start a new run from its weights "
                             f"(another train.exp_id, with train.init_from={self.best_path})") from None
        state["config"] = migrate(state["config"])  # in today's keys, as the resume checks read it
        refuse_architecture_change(state["config"], cfg, self.last_path)
        files.check_vocabulary(state, vocab_fingerprint, vocab_path, self.last_path)
        if dcp_tensors.KEY in state:
            return state
        if any(is_dtensor(p) for p in self.model.parameters()):
            raise ValueError(f"{self.last_path}: saved by an earlier version (one file), which train.parallel=fsdp "
                             f"does not load; resume it with train.parallel=ddp on {state['world_size']} "
                             f"process(es): its next checkpoint resumes in either mode")
        if state["world_size"] != self.env.world_size:
            raise ValueError(f"{self.last_path}: saved by an earlier version with {state['world_size']} processes, "
                             f"resumed with {self.env.world_size}; it resumes on the same number only (its next "
                             f"checkpoint, through Distributed Checkpoint, resumes on any)")
        state = sharded_values.attach(state, self.last_path, sharded_values.model_shard(self.model),
                                      sharded_values.sharded_names(self.model))
        files.load_model_state(self.model, state["model"], self.last_path)
        return state
