"""What one run directory (dump_path/exp_name/exp_id) holds, read without loading a checkpoint.

    status     running: a live process holds its .lock;  finished: it logged train.max_steps;
               stopped: it can resume (a checkpoint.pt before max_steps: Ctrl-C, a signal, a time limit, a crash);
               failed: it ended before its first checkpoint (nothing to resume from)
    step       the last step it logged (metrics.jsonl)
    best valid the lowest valid perplexity it logged
    test       its test.json (evaluate.py --json) when it holds the test split, else the test event train.py
               logged at its end

A file that cannot be read (a truncated metrics.jsonl, config.yaml that is not YAML) is a one-line ValueError
naming it (read_json_lines, read_yaml): a listing shows that run as unreadable and goes on.
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
    root: Path | None = None  # the folder it was found under, if any

    @property
    def name(self) -> str:
        """Its path below the folder it was found under, at least exp_name/exp_id (a study's runs:
        study/<study>/<cell>/<run>, not <cell>/<run> alone)."""
        below = self.path.relative_to(self.root).parts if self.root and self.path.is_relative_to(self.root) else ()
        return "/".join(self.path.parts[-max(2, len(below)):])

    @cached_property
    def raw_config(self) -> dict:
        """config.yaml as stored (keys of earlier versions migrated by `config`)."""
        return read_yaml(self.path / "config.yaml")

    @cached_property
    def config(self) -> Config:
        return load_config_dict(self.raw_config, source=str(self.path / "config.yaml"), run_config=True)

    @cached_property
    def events(self) -> list[dict]:
        metrics = self.path / "metrics.jsonl"
        return read_json_lines(metrics) if metrics.is_file() else []

    def logged(self, event: str) -> list[dict]:
        return [e for e in self.events if e.get("event") == event]

    def unreadable(self) -> str | None:
        """None when the files a listing reads (config.yaml, metrics.jsonl, test.json) are readable, else the
        one-line error naming the file."""
        try:
            self.config, self.events, self.test  # noqa: B018 (read and cached)
        except (OSError, ValueError) as e:  # ValueError: ConfigError and this module's readers' too
            return str(e)
        return None

    @property
    def step(self) -> int:
        return max((e["step"] for e in self.logged("train")), default=0)

    @property
    def best_valid_ppl(self) -> float | None:
        return min((e["ppl"] for e in self.logged("valid")), default=None)

    @cached_property
    def test(self) -> dict | None:
        """test.json if it holds the test split (evaluate.py --split valid --json RUN/test.json holds the valid
        one), else the test event logged at the end of training."""
        path = self.path / "test.json"
        if path.is_file():
            result = read_json(path)
            if result.get("split", "test") == "test":
                return result
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


def read_json_lines(path: Path) -> list[dict]:
    """The JSON objects of a JSON-lines file (metrics.jsonl); a line that is not one is a ValueError naming the file
    and line."""
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not a JSON line ({e.msg}, column {e.colno}): truncated or "
                                 f"damaged") from None
            if not isinstance(rows[-1], dict):
                raise ValueError(f"{path}:{number}: not a JSON object")
    return rows


def read_json(path: Path) -> dict:
    """A JSON object file (test.json); one that is not is a ValueError naming it."""
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg}, line {e.lineno} column {e.colno}): truncated or damaged") \
            from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: not a JSON object")
    return value


def read_yaml(path: Path) -> dict:
    """A YAML mapping file (config.yaml); one that is not is a ValueError naming it."""
    try:
        value = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) or {}  # libyaml
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: not a YAML mapping of config keys")
    return value


def is_run(path: Path) -> bool:
    return (path / "config.yaml").is_file() and ((path / "metrics.jsonl").is_file() or (path / "train.log").is_file())


def find_runs(paths: list[str | Path]) -> list[RunRecord]:
    """Every run directory given, and every one below a folder given, in path order; a path that is neither is a
    one-line ValueError."""
    found = {}  # run directory -> the folder given that holds it (None: given itself)
    for p in map(Path, paths):
        if is_run(p):
            found.setdefault(p, None)
        elif p.is_dir():
            for run in sorted(c.parent for c in p.rglob("config.yaml") if is_run(c.parent)):
                found.setdefault(run, p)
        else:
            raise ValueError(f"{p}: not a run directory (no config.yaml and metrics.jsonl) nor a folder holding runs")
    return [RunRecord(p, root) for p, root in found.items()]
