"""One preprocessing run per output directory: DIR/preprocess.lock.

The lock is an advisory `flock` on DIR/preprocess.lock, which also holds the holder's pid for the
error message. The kernel releases it when the holder dies (even by SIGKILL), so a lock file left by
a dead run never blocks the next one. The lock is not reliable on some network file systems.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from .atomic import write_error
from .plan import PlanError

LOCK_NAME = "preprocess.lock"


class OutputLock:
    """`with OutputLock(out):` holds DIR's lock, or raises PlanError naming the process holding it."""

    def __init__(self, out: Path):
        self.path = Path(out) / LOCK_NAME
        self.file = None

    def __enter__(self) -> "OutputLock":
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(self.path, "a+")
        except OSError as e:
            raise write_error(self.path, e) from None
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.seek(0)
            holder = self.file.read().strip() or "?"
            self.file.close()
            raise PlanError(f"{self.path.parent} is being written by process {holder} (lock {self.path}): "
                            "wait for it to finish or stop it") from None
        self.file.truncate(0)
        self.file.write(f"{os.getpid()}\n")
        self.file.flush()
        return self

    def __exit__(self, *_) -> None:
        self.file.close()
