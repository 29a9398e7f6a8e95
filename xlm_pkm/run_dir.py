"""The run directory `dump_path/exp_name/exp_id/` and the lock that keeps it to one run at a time
(xlm_pkm/lock.py): a second run started on the same directory while the first lives gets a one-line
error naming it; a lock left by a dead process does not block a resume.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path

from xlm_pkm import slurm
from xlm_pkm.distributed import DistEnv, broadcast_object
from xlm_pkm.lock import DirectoryLock


def lock_run_directory(run_dir: Path) -> DirectoryLock:
    """Holds `run_dir/.lock` until released (or the process ends)."""
    return DirectoryLock(run_dir, ".lock", "use another train.exp_id, or wait for that run to end")


def run_directory(dump_path: str, exp_name: str, exp_id: str, env: DistEnv) -> tuple[Path, str]:
    """(dump_path/exp_name/exp_id, exp_id); a new id (the SLURM job id when there is one) if none is given."""
    if not exp_id:
        exp_id = broadcast_object(slurm.job_id() or time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3), env)
    return Path(dump_path) / exp_name / exp_id, exp_id
