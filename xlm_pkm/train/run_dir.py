"""The run directory `dump_path/exp_name/exp_id/` and the lock that keeps it to one run at a time
(xlm_pkm/utils/lock.py): a second run started on the same directory while the first lives gets a one-line
error naming it; a lock left by a dead process does not block a resume.

`config.yaml` holds the resolved config of the run; resuming with another config than the checkpoint's (a key
given on the command line, or config.yaml edited by hand) says which keys differ (old -> new) and keeps the
previous file as `config.until-step<N>.yaml`.

`train.exp_id=last` resumes the run of the experiment that saved a checkpoint last, unless it is finished.

Nothing a run writes goes through a symbolic link: one planted in the run directory (or in its checkpoint
folders) is refused at the start in one line naming it (refuse_links), before the run opens any file there, and
the files it opens later are opened without following one (utils/atomic.py). A run directory removed while the
run trains (RunDirectoryRemoved) stops it at the end of that step with one line, and nothing about resuming:
its checkpoints went with it.

Under SLURM a run without train.exp_id is named by its job id, which a requeued job keeps. A cluster
may hand out the same job id again (its state reset): a job starting for the first time (not a
restart) whose directory already exists is refused, not resumed into an unrelated run.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from fnmatch import fnmatch
from pathlib import Path

import yaml

from xlm_pkm.checkpoint.safe_load import load_torch_file
from xlm_pkm.config import Config, flat, migrate, save_config, to_dict
from xlm_pkm.errors import ConfigError, UserError
from xlm_pkm.runtime import slurm_env
from xlm_pkm.runtime.distributed import DistEnv, broadcast_object
from xlm_pkm.utils.atomic import is_temporary, link_error
from xlm_pkm.utils.lock import DirectoryLock


class RunDirectoryRemoved(UserError, RuntimeError):
    """The run directory was removed (or moved away) while the run trained."""


def lock_run_directory(run_dir: Path) -> DirectoryLock:
    """Holds `run_dir/.lock` until released (or the process ends)."""
    return DirectoryLock(run_dir, ".lock", "use another train.exp_id, or wait for that run to end")


def latest_checkpoint(dump_path: str, exp_name: str) -> Path | None:
    """The checkpoint.pt that a run of `exp_name` saved last (None when no run has one)."""
    runs = sorted((Path(dump_path) / exp_name).glob("*/checkpoint.pt"), key=lambda p: p.stat().st_mtime)
    return runs[-1] if runs else None


def saved_step(checkpoint: Path) -> int:
    """The training step a checkpoint.pt was saved at (torch.load's error when it cannot be read; UnsafeFileError
    when it names more than data: safe_load.py)."""
    return int(load_torch_file(checkpoint, mmap=True)["step"])


def latest_unfinished(dump_path: str, exp_name: str, max_steps: int) -> str:
    """train.exp_id=last: the id of the run of `exp_name` that saved a checkpoint.pt last, if it has not
    reached `max_steps` (this command's); otherwise a one-line ConfigError saying what to do."""
    latest = latest_checkpoint(dump_path, exp_name)
    if latest is None:
        raise ConfigError(f"train.exp_id=last: no run of {exp_name} under {dump_path} has a checkpoint.pt to "
                          f"resume (start one without train.exp_id, or with a new one)")
    try:
        step = saved_step(latest)
    except Exception as e:  # noqa: BLE001 - empty, truncated, foreign, unreadable: torch raises any type
        why = e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}"
        raise ConfigError(f"train.exp_id=last: {latest}, the checkpoint a run of {exp_name} saved last, cannot be "
                          f"read ({' '.join(str(why).split())[:200]}): restore it from a copy, or give the "
                          f"train.exp_id of the run to resume (or move {latest.parent} away: train.exp_id=last then "
                          f"finds the run that saved before it)") from None
    if step >= max_steps:
        raise ConfigError(f"train.exp_id=last: the latest run of {exp_name}, {latest.parent}, is finished (step "
                          f"{step} of train.max_steps={max_steps}); to train it further give "
                          f"train.exp_id={latest.parent.name} and a larger train.max_steps")
    return latest.parent.name


def run_directory(dump_path: str, exp_name: str, exp_id: str, env: DistEnv, max_steps: int = 0) -> tuple[Path, str]:
    """(dump_path/exp_name/exp_id, exp_id); a new id (the SLURM job id when there is one) if none is given;
    `last`: the latest unfinished run's (latest_unfinished; rank 0 looks, and every rank raises its error)."""
    if exp_id == "last":
        found, error = None, None
        if env.is_main:
            try:
                found = latest_unfinished(dump_path, exp_name, max_steps)
            except Exception as e:  # noqa: BLE001 - raised below, once the other ranks know: none waits for rank 0
                error = e
                found = e if isinstance(e, ConfigError) else ConfigError(
                    f"train.exp_id=last: rank 0 could not find the run to resume ({type(e).__name__}: {e})")
        found = broadcast_object(found, env)
        if error is not None:
            raise error
        if isinstance(found, ConfigError):
            raise found
        exp_id = found
    if exp_id:
        return Path(dump_path) / exp_name / exp_id, exp_id
    job = slurm_env.job_id()
    exp_id = job or time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)
    reused = bool(job) and not slurm_env.restarted() and (Path(dump_path) / exp_name / exp_id).exists()
    exp_id, reused = broadcast_object((exp_id, reused), env)  # rank 0's, seen before it creates the directory
    run_dir = Path(dump_path) / exp_name / exp_id
    if reused:
        raise FileExistsError(f"{run_dir} exists, but SLURM job {exp_id} starts for the first time: the cluster "
                              f"reused the job id of an earlier run. Give train.exp_id (a new one, or "
                              f"train.exp_id={exp_id} to resume that run)")
    return run_dir, exp_id


# What a run writes in its directory (other files, e.g. the reproduction harness's reproduce.json, are not a run).
RUN_OUTPUTS = ("best.pt", "metrics.jsonl", "train.log", "config.yaml", "config.until-step*.yaml",
               "events.out.tfevents.*", "*.values", "*.dcp")


# What a run that failed before its first step leaves: nothing a new run there would lose.
UNTRAINED_OUTPUTS = ("metrics.jsonl", "train.log", "config.yaml", "events.out.tfevents.*")


def _trained_no_step(run_dir: Path, found: list[str]) -> bool:
    """Whether the outputs `found` are those of a run that failed before its first step: no best.pt, no
    values, no earlier config, and not one event in metrics.jsonl."""
    if not all(any(fnmatch(name, o) for o in UNTRAINED_OUTPUTS) for name in found):
        return False
    metrics = run_dir / "metrics.jsonl"
    return not metrics.exists() or metrics.stat().st_size == 0


def refuse_unresumable(run_dir: Path, resumed: bool, env: DistEnv) -> bool:
    """A new run (no checkpoint.pt) in a directory that holds a run's outputs (best.pt, metrics.jsonl...)
    would overwrite them: refused in one line, on every rank (rank 0 looks, once it holds the lock). The
    outputs of a run that trained no step (it failed at start-up or at its first step) are taken over, so
    that the same command runs again: returns True then."""
    found, untrained = [], False
    if env.is_main and not resumed:
        found = sorted(p.name for p in run_dir.iterdir() if any(fnmatch(p.name, o) for o in RUN_OUTPUTS))
        untrained = bool(found) and _trained_no_step(run_dir, found)
    found, untrained = broadcast_object((found, untrained), env)
    if found and not untrained:
        raise FileExistsError(f"{run_dir} holds a run ({', '.join(found[:4])}{', ...' if len(found) > 4 else ''}) "
                              f"but no checkpoint.pt to resume it from; a new run there would overwrite it: give "
                              f"another train.exp_id, or move that directory away")
    return untrained


# The folders of a run directory that the run writes files into (checkpoint.dcp/stepN/, the *.values shards).
RUN_FOLDERS = ("*.dcp", "*.values")


def symbolic_links(run_dir: Path) -> list[Path]:
    """The symbolic links in `run_dir` and, below it, in the folders the run writes into (RUN_FOLDERS), not
    followed; a W&B folder's own links (wandb/latest-run) are W&B's."""
    found, folders = [], [Path(run_dir)]
    while folders:
        folder = folders.pop()
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.is_symlink():
                    found.append(Path(entry.path))
                elif entry.is_dir(follow_symlinks=False) and (folder != Path(run_dir) or any(
                        fnmatch(entry.name, pattern) for pattern in RUN_FOLDERS)):
                    folders.append(Path(entry.path))
    return sorted(found)


def refuse_links(run_dir: Path, env: DistEnv) -> None:
    """A symbolic link planted in the run directory (train.log, metrics.jsonl, checkpoint.pt, checkpoint.dcp...)
    would have the run write, append or truncate where it points: refused in one line naming it, on every rank
    (rank 0 looks, once it holds the lock), before the run opens any file there."""
    links = symbolic_links(run_dir) if env.is_main else []
    links = broadcast_object(links, env)
    if links:
        error = link_error(links[0])
        raise type(error)(f"{error}" + (f" (and {len(links) - 1} more: {', '.join(p.name for p in links[1:4])}"
                                        f"{', ...' if len(links) > 4 else ''})" if len(links) > 1 else ""))


def directory_identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the directory at `path`; None when none is there."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def remove_temporary_files(run_dir: Path) -> int:
    """Removes the temporary files (NAME.PID.TOKEN.tmp) and checkpoint folders (checkpoint.dcp/*.partial) that a
    process killed while writing left in the run directory; the caller holds its lock, so no live writer owns
    one. Returns how many."""
    stale = [p for folder in (run_dir, run_dir / "checkpoint.values", run_dir / "best.values")
             if folder.is_dir() for p in folder.iterdir() if is_temporary(p)]
    for p in stale:
        p.unlink(missing_ok=True)
    partial = list((run_dir / "checkpoint.dcp").glob("*.partial"))
    for p in partial:
        shutil.rmtree(p, ignore_errors=True)
    return len(stale) + len(partial)


def config_changes(old: dict, new: dict) -> list[str]:
    """'key: old -> new' for every leaf that differs between two resolved configs."""
    before, after = flat(old), flat(new)
    return [f"{key}: {before.get(key, '(absent)')} -> {after.get(key, '(absent)')}"
            for key in sorted(before.keys() | after.keys()) if before.get(key) != after.get(key)]


def record_config(run_dir: Path, cfg: Config, resumed_step: int | None, trained_with: dict | None = None) -> list[str]:
    """Writes run_dir/config.yaml; on a resume (at `resumed_step`) with another config than `trained_with` (the
    checkpoint's, in today's keys; else config.yaml's), first keeps the previous file as config.until-step<N>.yaml.
    Returns the changes (config_changes). The checkpoint's: the resumed config starts from config.yaml, so an edit
    of that file is no change against it, but it is one against the config the run was trained with."""
    path = run_dir / "config.yaml"
    changes = []
    if resumed_step is not None and (trained_with is not None or path.is_file()):
        before = trained_with if trained_with is not None else migrate(yaml.safe_load(path.read_text()) or {})
        changes = config_changes(before, to_dict(cfg))  # in today's keys
        if changes and path.is_file():
            path.replace(path.with_name(f"config.until-step{resumed_step}.yaml"))
    save_config(cfg, path)
    return changes
