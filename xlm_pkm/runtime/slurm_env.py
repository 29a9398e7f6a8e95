"""What a run reads from SLURM while it runs: its job id, its restarts, the rendezvous of srun-launched
ranks, and its own requeue. Low level (standard library only): distributed.py, run_dir.py and the
trainer use it; launching jobs is xlm_pkm/launch/slurm.py's.
"""

from __future__ import annotations

import os
import subprocess


def job_id() -> str | None:
    """The SLURM job id (the same after a requeue), or None outside SLURM."""
    return os.environ.get("SLURM_JOB_ID")


def restarted() -> bool:
    """True when this SLURM job runs again after a requeue (SLURM_RESTART_COUNT > 0)."""
    return int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0


def set_rendezvous_env() -> None:
    """MASTER_ADDR/PORT for ranks started by srun without torchrun: the allocation's first host."""
    hosts = subprocess.check_output(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]])
    os.environ["MASTER_ADDR"] = hosts.split()[0].decode()
    os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ["SLURM_JOB_ID"]) % 20000))


def requeue() -> str | None:
    """Puts this SLURM job back in the queue (the requeued job resumes from checkpoint.pt); None when
    done, else why not in one line (submitted with --no-requeue, already being requeued, no scontrol)."""
    try:
        result = subprocess.run(["scontrol", "requeue", job_id()], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"scontrol requeue {job_id()} failed: {e}"
    if result.returncode:
        why = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
        return f"scontrol requeue {job_id()} failed: {why}"
    return None
