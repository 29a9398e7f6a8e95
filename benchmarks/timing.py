"""Timing of a benchmark step: tokens/s over a minimum time, in interleaved rounds (each round's, or the
best); or the median time of single steps.

    speeds = interleaved_rounds({"a": step_a, "b": step_b}, n_tokens, "cuda", min_time=1.0, rounds=5)
    best = best_of_rounds({"a": step_a, "b": step_b}, n_tokens, "cuda", min_time=1.0, rounds=2)
    seconds = median_seconds(step, steps=20, warmup=2, device="cuda")
"""

from __future__ import annotations

import statistics
import time

import torch


def synchronizer(device: str | torch.device):
    """A function that waits for the device's queued work (a no-op on CPU)."""
    return torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)


def median_seconds(step, steps: int, warmup: int, device: str | torch.device = "cpu") -> float:
    """Median wall time of step() over `steps` calls after `warmup` calls, waiting for the device each time."""
    sync = synchronizer(device)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def tokens_per_second(step, n_tokens: int, device: str | torch.device, min_time: float) -> float:
    """Run step() repeatedly for at least min_time seconds (and at least twice)."""
    sync = synchronizer(device)
    sync()
    reps, start = 0, time.perf_counter()
    while reps < 2 or time.perf_counter() - start < min_time:
        step()
        reps += 1
    sync()
    return n_tokens * reps / (time.perf_counter() - start)


def interleaved_rounds(steps: dict, n_tokens: int, device: str | torch.device, min_time: float, rounds: int,
                       warmup: int = 1) -> dict:
    """{name: [tokens/s of each round]}: each step run `warmup` times, then measured `rounds` times,
    interleaved, so that load from other processes on a shared machine hits every entry alike."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    speeds = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            speeds[name].append(tokens_per_second(step, n_tokens, device, min_time))
    return speeds


def best_of_rounds(steps: dict, n_tokens: int, device: str | torch.device, min_time: float, rounds: int,
                   warmup: int = 1) -> dict:
    """{name: best tokens/s} of interleaved_rounds."""
    return {name: max(speeds) for name, speeds in interleaved_rounds(steps, n_tokens, device, min_time, rounds,
                                                                     warmup).items()}
