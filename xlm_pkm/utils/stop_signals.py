"""The signals that stop train.py, handled from the command's first line to its last.

The training loop (train/trainer.py) turns each into a checkpoint at the end of the step and exit status 75.
Outside it (imports, start-up, a checkpoint load, the test evaluation after training) there is nothing to
save: `install_startup_handlers` makes each one raise StoppedBySignal (SIGINT: KeyboardInterrupt, as
Python's own handler), which the command reports in one line with its exit status, where the default
action of SIGTERM, SIGHUP or SIGUSR1 ended the process silently (exit 143, 129, 138). A signal arriving
before the command's first line (while Python itself starts) still has its default action.
"""

from __future__ import annotations

import signal

# SIGHUP: the terminal or ssh session closed; SIGUSR1/2: SLURM's warning before the time limit; SIGINT: Ctrl-C
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class StoppedBySignal(BaseException):
    """A stop signal arrived outside the training loop (a BaseException, as KeyboardInterrupt: no `except
    Exception` on its way may swallow it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.name = signal.Signals(signum).name


def _raise_stopped(signum, frame) -> None:
    raise StoppedBySignal(signum)


def install_startup_handlers() -> None:
    """Every stop signal but SIGINT raises StoppedBySignal; SIGINT raises KeyboardInterrupt."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else _raise_stopped)


def restore_defaults() -> None:
    """The default actions again, once the command has said how it ends: a signal then (torchrun ending a rank
    that is exiting too) ends the process without a second line."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
