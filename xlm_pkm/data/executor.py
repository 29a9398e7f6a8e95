"""Run a function over a list of tasks: in-process, on a pool of worker processes, or as SLURM array
jobs through submitit (`slurm_partition`; `slurm_cluster="local"`, or a machine without SLURM, runs
them as local processes through the same pickling). Results come back in task order; a tqdm bar counts the MB done.

Use it as a context manager: the worker pool (forkserver processes, heavy imports done once)
is started by the first parallel `map` and reused by the next ones until exit. Workers die with the
process that started them, even when it is killed (SIGKILL): a watchdog thread in each worker polls
that process, and on Linux the kernel also kills a worker whose parent (the forkserver) dies.

Ctrl-C is the parent's to handle: the workers (and the forkserver they are forked from) ignore SIGINT, which a
terminal sends to the whole process group, so that none of them prints a traceback; a KeyboardInterrupt (or any
other BaseException that is not an Exception) leaving the `with` block ends the workers at once (SIGTERM) instead
of waiting for the tasks they run. What they were writing is under a temporary name (utils/atomic.py), which the
next run removes; an ordinary error waits for the running tasks, whose results a re-run then keeps."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
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
    """Worker initializer: end this worker when process `pid` (the one that started the pool) ends; ignore Ctrl-C
    (SIGINT: the parent ends the pool)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    threading.Thread(target=_watch, args=(pid,), daemon=True, name="watchdog").start()


def _start_forkserver_without_sigint() -> None:
    """Starts multiprocessing's forkserver (if not running) with SIGINT blocked, a mask that it and every worker
    forked from it inherit from birth, before the initializer ignores SIGINT. In this process a Ctrl-C in the
    meantime waits, blocked, and comes when the mask is put back (or another thread takes it at once)."""
    from multiprocessing import forkserver, resource_tracker

    resource_tracker.ensure_running()  # first: starting it unblocks SIGINT (it ignores SIGINT itself)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


@contextmanager
def _sigint_deferred():
    """Inside, a Ctrl-C (SIGINT) is held, and raised again on leaving (to the handler there was before)."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous in (None, signal.SIG_IGN):
        yield
        return
    held: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            signal.raise_signal(signal.SIGINT)


def _end_workers(pool: ProcessPoolExecutor) -> None:
    """Ends the pool's workers now (SIGTERM), without waiting for their tasks."""
    terminate = getattr(pool, "terminate_workers", None)  # Python 3.14
    if terminate is not None:
        terminate()
        return
    processes = list((getattr(pool, "_processes", None) or {}).values())
    for process in processes:
        process.terminate()
    for process in processes:
        process.join(timeout=10)


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

    def __exit__(self, exc_type, *_) -> None:
        if self._pool:
            pool, self._pool = self._pool, None
            if exc_type is not None and not issubclass(exc_type, Exception):  # Ctrl-C, a stop signal: now
                _end_workers(pool)
            pool.shutdown(cancel_futures=True)

    def _get_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(["numpy", "sacremoses", "fastBPE"])
            _start_forkserver_without_sigint()
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
            with _sigint_deferred():  # a worker whose start a Ctrl-C cut is unknown to the pool, which cannot end it
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
