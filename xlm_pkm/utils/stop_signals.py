"""The signals that stop train.py, handled from the command's first line to its last.

The training loop (train/trainer.py) turns each into a checkpoint at the end of the step and exit status 75.
Outside it (imports, start-up, a checkpoint load, the test evaluation after training) there is nothing to
save: `install_startup_handlers` makes each one raise StoppedBySignal (SIGINT: KeyboardInterrupt, as
Python's own handler), which the command reports in one line with its exit status, where the default
action of SIGTERM, SIGHUP or SIGUSR1 ended the process silently (exit 143, 129, 138). A signal arriving
before the command's first line (while Python itself starts) still has its default action.

Python runs a handler wherever the main thread is, also inside a weakref callback or a __del__ (importlib's
module locks have one), where an exception cannot propagate: Python prints "Exception ignored in ..." and
goes on, and the command ran to its end as if no signal had come. Start-up therefore also holds such a
swallowed signal, silently (sys.unraisablehook), and `raise_held_signal` raises it again where start-up
moves on: after the imports (launch/commands.py) and before the training loop (train/trainer.py).
"""

from __future__ import annotations

import signal
import sys

# SIGHUP: the terminal or ssh session closed; SIGUSR1/2: SLURM's warning before the time limit; SIGINT: Ctrl-C
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGHUP, signal.SIGINT)

_held_signum: int | None = None  # the start-up signal whose exception Python swallowed, if one was


class StoppedBySignal(BaseException):
    """A stop signal arrived outside the training loop (a BaseException, as KeyboardInterrupt: no `except
    Exception` on its way may swallow it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


def _raise_stopped(signum, frame) -> None:
    raise KeyboardInterrupt if signum == signal.SIGINT else StoppedBySignal(signum)


def _hold_swallowed(unraisable) -> None:
    """sys.unraisablehook during start-up: a stop signal's exception raised where Python cannot propagate it is
    held for `raise_held_signal`, without its traceback; any other goes to Python's hook."""
    global _held_signum
    error = unraisable.exc_value
    if isinstance(error, (KeyboardInterrupt, StoppedBySignal)):
        if _held_signum is None:  # the first: the one the command reports
            _held_signum = signal.SIGINT if isinstance(error, KeyboardInterrupt) else error.signum
    else:
        sys.__unraisablehook__(unraisable)


def raise_held_signal() -> None:
    """Raises the stop signal that landed where Python swallowed its exception, if one did."""
    global _held_signum
    signum, _held_signum = _held_signum, None
    if signum is not None:
        _raise_stopped(signum, None)


def install_startup_handlers() -> None:
    """Every stop signal raises StoppedBySignal, SIGINT KeyboardInterrupt; a swallowed one is held."""
    sys.unraisablehook = _hold_swallowed
    for signum in STOP_SIGNALS:
        signal.signal(signum, _raise_stopped)


def ignore_stop_signals() -> None:
    """Every stop signal ignored, while the command writes the line it ends with: torchrun's SIGTERM to the ranks
    that survive a dead one lands then, and would replace that line by its own."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def restore_defaults() -> None:
    """The default actions again, once the command has said how it ends: a signal then (torchrun ending a rank
    that is exiting too) ends the process without a second line."""
    global _held_signum
    sys.unraisablehook, _held_signum = sys.__unraisablehook__, None
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
