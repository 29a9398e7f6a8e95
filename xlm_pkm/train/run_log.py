"""Where a run reports: console, `train.log`, `metrics.jsonl` (one JSON object per event), TensorBoard and, with
train.wandb.project, Weights & Biases (wandb_log.py).

On resume from a checkpoint at step s, the events a crashed run logged after s are dropped from
`metrics.jsonl` and TensorBoard, so the resumed run's metrics read like an uninterrupted run's.
A metrics line that cannot be written (disk full) is removed whole and the run stops with a one-line
OutputError: the file never holds half a line.

Every file of the run directory that the logger writes is opened without following a symbolic link
(utils/atomic.py's open_output): a link planted there as train.log or metrics.jsonl is one OutputError naming
it, and its target is left untouched. TensorBoard's events are written by `EventFile`, in this thread, to a file
this process created (O_EXCL): TensorBoard's own writer opens the file again by its name at every write, from
a thread of its own (a link followed; the run directory removed meanwhile: a thread's traceback).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

import torch

from xlm_pkm.config import WandbConfig
from xlm_pkm.train.wandb_log import WandbLog
from xlm_pkm.utils.atomic import open_output_file, write_bytes, write_error


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


class _LogFileHandler(logging.StreamHandler):
    """logging's handler of a file opened by open_output (logging.FileHandler opens it by name, following a link)."""

    def __init__(self, path: Path):
        super().__init__(open_output_file(path, "a", encoding="utf-8"))

    def close(self) -> None:
        self.acquire()
        try:
            stream, self.stream = self.stream, None
            if stream is not None:
                stream.close()  # flushes
        except OSError:
            pass  # a write that failed already went to logging's handleError
        finally:
            self.release()
            super().close()


_event_files = itertools.count()  # this process's event files: unique names, as TensorBoard's own writer numbers them


class EventFile:
    """A TensorBoard event file in `folder`, in TensorBoard's format and name (events.out.tfevents.TIME.HOST.PID.N:
    its record writer, its protocol buffers, torch's summaries), written in the caller's thread to a file this
    process created and holds open. `purge_step`: TensorBoard drops the events of earlier files from that step on
    (a resumed run's)."""

    def __init__(self, folder: Path, purge_step: int | None = None):
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.summary.writer.record_writer import RecordWriter

        while True:
            self.path = Path(folder) / (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
                                        f"{os.getpid()}.{next(_event_files)}")
            if not os.path.lexists(self.path):  # else left by an earlier process of the same pid, in this second
                break
        self.file = open_output_file(self.path, "xb")  # a new file (O_EXCL)
        self.records, self.Event = RecordWriter(self.file), Event
        self._add(Event(wall_time=time.time(), file_version="brain.Event:2"))
        if purge_step is not None:  # as torch's SummaryWriter(purge_step=...)
            self._add(Event(wall_time=time.time(), step=purge_step, file_version="brain.Event:2"))
            self._add(Event(wall_time=time.time(), step=purge_step, session_log=SessionLog(status=SessionLog.START)))
        self.flush()
        self._bins = None

    def _add(self, event) -> None:
        try:
            self.records.write(event.SerializeToString())
        except OSError as e:
            raise write_error(self.path, e) from None

    def add_summary(self, summary, step: int) -> None:
        self._add(self.Event(wall_time=time.time(), step=int(step), summary=summary))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        from torch.utils.tensorboard.summary import scalar

        self.add_summary(scalar(tag, value), step)

    def add_histogram(self, tag: str, values: torch.Tensor, step: int) -> None:
        """TensorBoard's default buckets (torch's SummaryWriter's "tensorflow" bins)."""
        from torch.utils.tensorboard.summary import histogram

        if self._bins is None:
            edges, v = [], 1e-12
            while v < 1e20:
                edges.append(v)
                v *= 1.1
            self._bins = [-e for e in reversed(edges)] + [0] + edges
        self.add_summary(histogram(tag, values, self._bins), step)

    def flush(self) -> None:
        try:
            self.file.flush()
        except OSError as e:
            raise write_error(self.path, e) from None

    def close(self) -> None:
        """Flushes and closes the file; once closed, nothing (as SummaryWriter.close: a trainer closed twice)."""
        if self.file.closed:
            return
        try:
            self.flush()
        finally:
            try:
                self.file.close()
            except OSError:
                pass  # its error raised by the flush


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
            handlers.append(_LogFileHandler(run_dir / "train.log"))
            self.metrics_path = run_dir / "metrics.jsonl"
            if resume_step is not None and os.path.lexists(self.metrics_path):
                drop_events_after(self.metrics_path, resume_step)
            # unbuffered: each event goes to the file at once
            self.metrics = open_output_file(self.metrics_path, "ab", buffering=0)
            self.tb = EventFile(run_dir, purge_step=None if resume_step is None else resume_step + 1)
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
        self.tb.flush()
        if self.wandb:
            self.wandb.log(scalars, step)

    def histogram(self, tag: str, values: torch.Tensor, step: int) -> None:
        if self.enabled:
            self.tb.add_histogram(tag, values.float().cpu(), step)
            self.tb.flush()

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
    with open_output_file(path, "rb") as f:  # a link is refused, not read: its target left as it is
        text = f.read()
    for line in text.splitlines(keepends=True):
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("step", 0) <= step:
            kept.append(line)
    write_bytes(path, b"".join(kept))
