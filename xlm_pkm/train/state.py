"""TrainState: the resumable counters of a run, one rank's RNG states, data cursor and stream caches.

    state = TrainState(stream, device)
    saved = state.state_dict()          # plain values; the trainer gathers one per rank
    state.load_state_dict(saved)        # continues exactly where `saved` was taken
    saved = resharded_states(saved_by_every_rank, world, seed)[rank]   # saved on another number of processes

The log window (losses summed since the last train log line) is part of it, so that the first line
logged after a resume averages the same steps as the uninterrupted run's; so are the caches that
all-attention layers carry from one batch to the next (model.stream_state()), which differ by rank.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
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
        if "seed" in state["rng"]:  # resharded_states: a rank of a resume on another number of processes
            seed = int(np.random.SeedSequence(state["rng"]["seed"]).generate_state(1)[0])
            torch.manual_seed(seed)  # and every CUDA device's
            random.seed(seed)
            return
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        if state["rng"]["cuda"] is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)


def resharded_states(ranks: list[dict], world: int, seed: int) -> list[dict]:
    """The per-rank states `ranks` that len(ranks) processes saved, for `world` processes (`ranks` itself when
    the counts are equal). What every rank shares carries over as saved: the counters and the data position
    (the streams' epoch and step are global, and the stream checks that the run reads the same streams:
    TokenStream.load_state_dict). The log window's loss becomes each new rank's share of the saved ranks' mean,
    and the stream caches (B rows per rank, one per stream, in rank order) are cut anew. The random states
    cannot carry over (each rank drew its own dropout masks): each new rank's is seeded from (seed, step,
    rank), so a resume on another number of processes draws other dropout masks than the uninterrupted run."""
    if len(ranks) == world:
        return ranks
    first = ranks[0]
    mean_loss = sum(r["log_loss_sum"] for r in ranks) / len(ranks)
    caches = [None if any(r["stream_cache"][i] is None for r in ranks)
              else torch.cat([r["stream_cache"][i] for r in ranks]).chunk(world)
              for i in range(len(first.get("stream_cache") or []))]
    return [{**first, "log_loss_sum": mean_loss, "rng": {"seed": [seed, first["step"], rank]},
             "stream_cache": [None if c is None else c[rank] for c in caches]} for rank in range(world)]


def from_earlier_version(checkpoint: dict) -> list[dict]:
    """Per-rank TrainState dicts from a checkpoint written before TrainState existed."""
    counters = {name: checkpoint[name] for name in COUNTERS if name != "log_steps"}  # log_steps: newer
    return [{**counters, "log_loss_sum": 0.0, "log_steps": 0, "data": data, "rng": rng, "stream_cache": []}
            for data, rng in zip(checkpoint["data"], checkpoint["rng"])]
