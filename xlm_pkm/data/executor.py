"""Run a function over a list of tasks: in-process, on a pool of worker processes, or as SLURM array
jobs through submitit (`slurm_partition`; `slurm_cluster="local"`, or a machine without SLURM, runs
them as local processes through the same pickling). Results come back in task order; a tqdm bar counts the MB done.

Use it as a context manager: the worker pool (forkserver processes, heavy imports done once)
is started by the first parallel `map` and reused by the next ones until exit. Workers die with the
process that started them, even when it is killed (SIGKILL): a watchdog thread in each worker polls
that process, and on Linux the kernel also kills a worker whose parent (the forkserver) dies."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from tqdm import tqdm

PR_SET_PDEATHSIG = 1
WATCHDOG_SECONDS = 0.2


def _watch(pid: int) -> None:
    while True:
        time.sleep(WATCHDOG_SECONDS)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os._exit(1)


def _die_with(pid: int) -> None:
    """Worker initializer: end this worker when process `pid` (the one that started the pool) ends."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    threading.Thread(target=_watch, args=(pid,), daemon=True, name="watchdog").start()


@dataclass
class Executor:
    workers: int = 1
    slurm_partition: str | None = None
    slurm_cluster: str | None = None  # submitit's: None picks SLURM when sbatch is found; "local"
    slurm_folder: Path = Path("slurm")
    slurm_time_min: int = 240
    slurm_parallelism: int = 256
    _pool: ProcessPoolExecutor | None = field(default=None, init=False, repr=False)

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, *_) -> None:
        if self._pool:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    def _get_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(["numpy", "sacremoses", "fastBPE"])
            self._pool = ProcessPoolExecutor(self.workers, mp_context=context, initializer=_die_with,
                                             initargs=(os.getpid(),))
        return self._pool

    def map(self, fn: Callable, tasks: Sequence, desc: str, sizes_mb: Sequence[float]) -> list:
        """[fn(task) for task in tasks], run in parallel; `sizes_mb` drive the progress bar."""
        sizes = [round(s, 1) for s in sizes_mb]
        bar = tqdm(total=round(sum(sizes), 1), desc=desc, unit="MB", leave=False)
        with bar:
            if self.slurm_partition:
                return self._submitit(fn, tasks, sizes, bar)
            if self.workers <= 1 or len(tasks) <= 1:
                return [self._done(fn(t), s, bar) for t, s in zip(tasks, sizes)]
            futures = [self._get_pool().submit(fn, t) for t in tasks]
            return [self._done(f.result(), s, bar) for f, s in zip(futures, sizes)]

    @staticmethod
    def _done(result, size: float, bar: tqdm):
        bar.update(size)
        return result

    def _submitit(self, fn: Callable, tasks: Sequence, sizes: Sequence[float], bar: tqdm) -> list:
        import submitit

        executor = submitit.AutoExecutor(folder=self.slurm_folder, cluster=self.slurm_cluster)
        executor.update_parameters(timeout_min=self.slurm_time_min, cpus_per_task=1, mem_gb=8,
                                   slurm_partition=self.slurm_partition,
                                   slurm_array_parallelism=self.slurm_parallelism)
        jobs = executor.map_array(fn, tasks)
        return [self._done(job.result(), s, bar) for job, s in zip(jobs, sizes)]
