"""Throughput of a benchmark step: tokens/s over a minimum time, best of interleaved rounds.

    best = best_of_rounds({"a": step_a, "b": step_b}, n_tokens, "cuda", min_time=1.0, rounds=2)
"""

from __future__ import annotations

import time

import torch


def tokens_per_second(step, n_tokens: int, device: str | torch.device, min_time: float) -> float:
    """Run step() repeatedly for at least min_time seconds (and at least twice)."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    sync()
    reps, start = 0, time.perf_counter()
    while reps < 2 or time.perf_counter() - start < min_time:
        step()
        reps += 1
    sync()
    return n_tokens * reps / (time.perf_counter() - start)


def best_of_rounds(steps: dict, n_tokens: int, device: str | torch.device, min_time: float, rounds: int,
                   warmup: int = 1) -> dict:
    """{name: best tokens/s}: each step run `warmup` times, then measured `rounds` times, interleaved,
    so that load from other processes on a shared machine hits every entry alike."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    best = dict.fromkeys(steps, 0.0)
    for _ in range(rounds):
        for name, step in steps.items():
            best[name] = max(best[name], tokens_per_second(step, n_tokens, device, min_time))
    return best
