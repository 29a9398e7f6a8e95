"""The run directory `dump_path/exp_name/exp_id/` and the lock that keeps it to one run at a time.

The lock is an flock on `run_dir/.lock`, which records its holder (pid, host, start time). The
kernel drops it when the holder exits, however it dies, so a stale lock file never blocks a resume;
a second run started on the same directory while the first lives gets a one-line error naming it.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import socket
import time
from pathlib import Path

from xlm_pkm import slurm
from xlm_pkm.distributed import DistEnv, broadcast_object


class RunDirectoryBusy(RuntimeError):
    """Another live process holds the run directory."""


def run_directory(dump_path: str, exp_name: str, exp_id: str, env: DistEnv) -> tuple[Path, str]:
    """(dump_path/exp_name/exp_id, exp_id); a new id (the SLURM job id when there is one) if none is given."""
    if not exp_id:
        exp_id = broadcast_object(slurm.job_id() or time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3), env)
    return Path(dump_path) / exp_name / exp_id, exp_id


class RunLock:
    """Holds `run_dir/.lock` until release() or the end of the process."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / ".lock"
        run_dir.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 4096, 0).decode(errors="replace").strip() or "another process"
            os.close(self.fd)
            raise RunDirectoryBusy(f"run directory {run_dir} is in use by {holder} (lock {self.path}); "
                                   f"use another train.exp_id, or wait for that run to end") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
                  .encode(), 0)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # drops the flock
            self.fd = None
