"""Where a run reports: console, `train.log`, `metrics.jsonl` (one JSON object per event), TensorBoard and, with
train.wandb.project, Weights & Biases (wandb_log.py).

On resume from a checkpoint at step s, the events a crashed run logged after s are dropped from
`metrics.jsonl` and TensorBoard, so the resumed run's metrics read like an uninterrupted run's.
A metrics line that cannot be written (disk full) is removed whole and the run stops with a one-line
OutputError: the file never holds half a line.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import torch

from xlm_pkm.config import WandbConfig
from xlm_pkm.train.wandb_log import WandbLog
from xlm_pkm.utils.atomic import write_bytes, write_error


def _format(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return "{" + " ".join(f"{k}={_format(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_format(v) for v in value) + "]"
    return str(value)


def _scalars(prefix: str, value):
    """Flattens nested metrics into (tag, number) pairs for TensorBoard and W&B."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        yield prefix, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _scalars(f"{prefix}/{k}", v)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, dict) and "layer" in item:
                yield from _scalars(f"{prefix}/layer{item['layer']}", {k: v for k, v in item.items() if k != "layer"})
            else:
                yield from _scalars(f"{prefix}/{i}", item)


class RunLogger:
    """Logs events of the main process; other ranks only print warnings to the console."""

    def __init__(self, run_dir: Path | None, enabled: bool, resume_step: int | None = None,
                 wandb: WandbConfig | None = None, config: dict | None = None):
        """`wandb` with a project: also to W&B, whose run gets `config` (the resolved one, as config.yaml)."""
        self.enabled = enabled and run_dir is not None
        self.log = logging.getLogger(f"xlm_pkm.run.{id(self)}")
        self.log.setLevel(logging.INFO if enabled else logging.WARNING)
        self.log.propagate = False
        fmt = logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S")
        handlers = [logging.StreamHandler(sys.stdout)]
        self.metrics = self.tb = self.wandb = None
        if self.enabled and wandb is not None and wandb.project:  # first: a W&B that fails to start leaves no file
            self.wandb = WandbLog(run_dir, wandb, config, resumed=resume_step is not None)
        if self.enabled:
            handlers.append(logging.FileHandler(run_dir / "train.log"))
            self.metrics_path = run_dir / "metrics.jsonl"
            if resume_step is not None and self.metrics_path.exists():
                drop_events_after(self.metrics_path, resume_step)
            self.metrics = open(self.metrics_path, "ab", buffering=0)  # each event goes to the file at once
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir), purge_step=None if resume_step is None else resume_step + 1)
        for h in handlers:
            h.setFormatter(fmt)
            self.log.addHandler(h)

    def info(self, msg: str) -> None:
        self.log.info(msg)

    def warning(self, msg: str) -> None:
        """On every rank's console (and in train.log on the main one), prefixed `warning:`."""
        self.log.warning(f"warning: {msg}")

    def event(self, name: str, step: int, /, progress: str = "", **metrics) -> None:
        """One line on the console and in train.log (`progress` after the step, there only), one JSON
        object, TensorBoard (and W&B) scalars."""
        if not self.enabled:
            return
        self.info(f"{name} step {step}{progress} " + " ".join(f"{k}={_format(v)}" for k, v in metrics.items()))
        line = (json.dumps({**metrics, "event": name, "step": step, "time": time.time()}) + "\n").encode()
        size = self.metrics.tell()
        try:
            written = 0
            while written < len(line):
                written += self.metrics.write(line[written:])
        except OSError as e:
            self.metrics.truncate(size)
            raise write_error(self.metrics_path, e) from None
        scalars = dict(_scalars(name, metrics))
        for tag, value in scalars.items():
            self.tb.add_scalar(tag, value, step)
        if self.wandb:
            self.wandb.log(scalars, step)

    def histogram(self, tag: str, values: torch.Tensor, step: int) -> None:
        if self.enabled:
            self.tb.add_histogram(tag, values.float().cpu(), step)

    def close(self) -> None:
        for h in list(self.log.handlers):
            h.close()
            self.log.removeHandler(h)
        if self.enabled:
            self.metrics.close()
            self.tb.close()
        if self.wandb:
            self.wandb.close()


def drop_events_after(path: Path, step: int) -> None:
    """Rewrites `path` without the events logged after `step` (and without a torn last line)."""
    kept = []
    for line in path.read_bytes().splitlines(keepends=True):
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("step", 0) <= step:
            kept.append(line)
    write_bytes(path, b"".join(kept))
