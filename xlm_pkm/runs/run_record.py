"""What one run directory (dump_path/exp_name/exp_id) holds, read without loading a checkpoint.

    status     running: a live process holds its .lock;  finished: it logged train.max_steps;
               stopped: it can resume (a checkpoint.pt before max_steps: Ctrl-C, a signal, a time limit, a crash);
               failed: it ended before its first checkpoint (nothing to resume from)
    step       the last step it logged (metrics.jsonl)
    best valid the lowest valid perplexity it logged
    test       its test.json (evaluate.py --json), else the test event train.py logged at its end
"""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import yaml

from xlm_pkm.config import Config, load_config_dict


@dataclass
class RunRecord:
    path: Path

    @property
    def name(self) -> str:
        """exp_name/exp_id: the last two parts of its path."""
        return f"{self.path.parent.name}/{self.path.name}"

    @cached_property
    def raw_config(self) -> dict:
        """config.yaml as stored (keys of earlier versions migrated by `config`)."""
        return yaml.safe_load((self.path / "config.yaml").read_text()) or {}

    @cached_property
    def config(self) -> Config:
        return load_config_dict(self.raw_config, source=str(self.path / "config.yaml"))

    @cached_property
    def events(self) -> list[dict]:
        metrics = self.path / "metrics.jsonl"
        lines = metrics.read_text().splitlines() if metrics.is_file() else []
        return [json.loads(line) for line in lines if line.strip()]

    def logged(self, event: str) -> list[dict]:
        return [e for e in self.events if e["event"] == event]

    @property
    def step(self) -> int:
        return max((e["step"] for e in self.logged("train")), default=0)

    @property
    def best_valid_ppl(self) -> float | None:
        return min((e["ppl"] for e in self.logged("valid")), default=None)

    @cached_property
    def test(self) -> dict | None:
        path = self.path / "test.json"
        if path.is_file():
            return json.loads(path.read_text())
        tests = self.logged("test")
        return tests[-1] if tests else None

    @property
    def tokens_per_sec(self) -> float | None:
        """The median of its train lines' tokens/s, step 1 (warm-up) left out when there are others."""
        lines = [e for e in self.logged("train") if e.get("tokens_per_sec") is not None]
        speeds = sorted(e["tokens_per_sec"] for e in ([e for e in lines if e["step"] > 1] or lines))
        return (speeds[(len(speeds) - 1) // 2] + speeds[len(speeds) // 2]) / 2 if speeds else None

    @property
    def status(self) -> str:
        if self.running():
            return "running"
        if self.step >= self.config.train.max_steps:
            return "finished"
        return "stopped" if (self.path / "checkpoint.pt").exists() else "failed"

    def running(self) -> bool:
        """Whether a live process holds the run directory's lock (train/run_dir.py)."""
        try:
            fd = os.open(self.path / ".lock", os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # released at once: never keeps a run from starting
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False


def is_run(path: Path) -> bool:
    return (path / "config.yaml").is_file() and ((path / "metrics.jsonl").is_file() or (path / "train.log").is_file())


def find_runs(paths: list[str | Path]) -> list[RunRecord]:
    """Every run directory given, and every one below a folder given, in path order; a path that is neither is a
    one-line ValueError."""
    found = []
    for p in map(Path, paths):
        if is_run(p):
            found.append(p)
        elif p.is_dir():
            found += sorted(c.parent for c in p.rglob("config.yaml") if is_run(c.parent))
        else:
            raise ValueError(f"{p}: not a run directory (no config.yaml and metrics.jsonl) nor a folder holding runs")
    return [RunRecord(p) for p in dict.fromkeys(found)]
