"""Progress of a long loop for the person waiting on it: a line on stderr every `every` seconds.

    progress = Progress("evaluating valid", total=len(stream), enabled=env.is_main)
    for i, batch in enumerate(stream):
        ...
        progress.update(i + 1)     # 'evaluating valid: 120/400 batches (30%), ETA 41s' at most every 10 s

Plain lines, not a redrawn bar, so that they read the same in a terminal and in a SLURM log.
"""

from __future__ import annotations

import sys
from time import perf_counter


def format_duration(seconds: float) -> str:
    """3725 -> '1h02m', 125 -> '2m05s', 7 -> '7s'."""
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Progress:
    def __init__(self, label: str, total: int, enabled: bool = True, every: float = 10.0):
        self.label, self.total, self.enabled, self.every = label, total, enabled, every
        self.start = self.last = perf_counter()

    def update(self, done: int) -> None:
        """`done` of `total` units finished; prints when `every` seconds passed since the last line."""
        now = perf_counter()
        if not self.enabled or now - self.last < self.every or done >= self.total:
            return
        self.last = now
        eta = (now - self.start) / done * (self.total - done)
        print(f"{self.label}: {done}/{self.total} batches ({100 * done / self.total:.0f}%), ETA {format_duration(eta)}",
              file=sys.stderr, flush=True)
