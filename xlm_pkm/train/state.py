"""TrainState: the resumable counters of a run, one rank's RNG states, data cursor and stream caches.

    state = TrainState(stream, device)
    saved = state.state_dict()          # plain values; the trainer gathers one per rank
    state.load_state_dict(saved)        # continues exactly where `saved` was taken

The log window (losses summed since the last train log line) is part of it, so that the first line
logged after a resume averages the same steps as the uninterrupted run's; so are the caches that
all-attention layers carry from one batch to the next (model.stream_state()), which differ by rank.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from xlm_pkm.data.fact_batches import FactBatches
from xlm_pkm.data.stream import TokenStream

COUNTERS = ("step", "best_ppl", "nonfinite_streak", "skipped_steps", "log_steps")


@dataclass
class TrainState:
    stream: TokenStream | FactBatches  # the rank's training batches: their cursor is saved
    device: torch.device
    model: torch.nn.Module  # its stream caches (all-attention layers) are saved
    step: int = 0  # optimizer steps done
    best_ppl: float = math.inf  # best valid perplexity so far (best.pt)
    nonfinite_streak: int = 0  # consecutive steps skipped for a non-finite loss or gradient
    skipped_steps: int = 0  # all steps skipped (fp16: loss-scale overflows)
    log_loss_sum: torch.Tensor | float = 0.0  # mean losses of the steps since the last train log line
    log_steps: int = 0
    saved_threads: int | None = None  # torch's CPU threads when the loaded state was saved (None: not recorded)

    def state_dict(self) -> dict:
        cuda = self.device.type == "cuda"
        return {
            **{name: getattr(self, name) for name in COUNTERS},
            "log_loss_sum": float(self.log_loss_sum),  # host sync, at checkpoints only
            "data": self.stream.state_dict(),
            "threads": torch.get_num_threads(),  # CPU float reductions round differently with it
            "stream_cache": [None if t is None else t.cpu() for t in self.model.stream_state()],
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                    "cuda": torch.cuda.get_rng_state(self.device) if cuda else None},
        }

    def load_state_dict(self, state: dict) -> None:
        for name in COUNTERS:
            setattr(self, name, state[name])
        self.log_loss_sum = state["log_loss_sum"]
        self.saved_threads = state.get("threads")
        self.stream.load_state_dict(state["data"])
        self.model.load_stream_state(state.get("stream_cache") or [None] * len(self.model.stream_layers()))
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        if state["rng"]["cuda"] is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)


def from_earlier_version(checkpoint: dict) -> list[dict]:
    """Per-rank TrainState dicts from a checkpoint written before TrainState existed."""
    counters = {name: checkpoint[name] for name in COUNTERS if name != "log_steps"}  # log_steps: newer
    return [{**counters, "log_loss_sum": 0.0, "log_steps": 0, "data": data, "rng": rng, "stream_cache": []}
            for data, rng in zip(checkpoint["data"], checkpoint["rng"])]
