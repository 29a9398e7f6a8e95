"""The commands that start torch processes: train.py, evaluate.py, generate.py and the console commands
xlm-pkm-train, -evaluate, -generate, -export, -runs (pyproject.toml). Each sets the process's defaults, then
imports its command line, and torch with it, and runs it; this module imports nothing at import time.

The one default: THP_MEM_ALLOC_ENABLE=1 (unless set), PyTorch's switch for CPU tensors of 2 MB and more
on transparent huge pages. A sparse step allocates hundreds of MB of fresh gradient rows and optimizer
temporaries, whose 4 KB page faults otherwise cost more than the arithmetic (docs/benchmarks.md,
"Huge pages"). PyTorch reads it once, at its first CPU allocation, so it must be set before torch is
imported: importing xlm_pkm never sets it; a library user exports it (or sets os.environ) first.
"""

import os
import sys

PROCESS_DEFAULTS = {"THP_MEM_ALLOC_ENABLE": "1"}


def set_process_defaults() -> None:
    """PROCESS_DEFAULTS in this process's environment (and its children's), where not already set."""
    for name, value in PROCESS_DEFAULTS.items():
        os.environ.setdefault(name, value)


def _run(default_program: str, load_main, argv: list[str] | None, stop_signals: bool = False) -> int:
    """Imports the command line (torch with it: seconds) and runs it. A Ctrl-C during the imports, or during
    a command that has no handling of its own, is one line and exit status 130, not a traceback; with
    `stop_signals` (train.py) the stop signals are handled from here on (utils/stop_signals.py)."""
    set_process_defaults()  # before torch is imported
    from xlm_pkm.errors import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_STOPPED
    from xlm_pkm.utils.program import program_name
    from xlm_pkm.utils.stop_signals import StoppedBySignal, install_startup_handlers, raise_held_signal

    program = program_name(default_program)
    try:
        if stop_signals:  # inside the try: a signal caught by the first handler installed may land before the last
            install_startup_handlers()
        main = load_main()
        raise_held_signal()  # one that landed in an import's weakref callback, where Python swallowed it
        return main(argv)
    except KeyboardInterrupt:
        print(f"{program}: error: interrupted (Ctrl-C)", file=sys.stderr)
        return EXIT_INTERRUPTED
    except MemoryError:  # a limit (ulimit -v, a cgroup) too low for the imports themselves
        print(f"{program}: error: out of memory while starting (importing torch): raise the process's memory "
              f"limit (ulimit -v, the job's --mem)", file=sys.stderr)
        return EXIT_ERROR
    except StoppedBySignal as e:  # during the imports: nothing done yet
        print(f"{program}: error: stopped by {e.name} while starting, nothing done: run the same command again",
              file=sys.stderr)
        return EXIT_STOPPED


def _train_main():
    from xlm_pkm.launch.cli import train_main

    return lambda argv: train_main(argv, exits=True)  # this process ends once it returns


def _evaluate_main():
    from xlm_pkm.launch.cli import evaluate_main

    return evaluate_main


def _generate_main():
    from xlm_pkm.launch.cli import generate_main

    return generate_main


def _export_main():
    from xlm_pkm.inference.export import main

    return main


def train(argv: list[str] | None = None) -> int:
    return _run("train.py", _train_main, argv, stop_signals=True)


def evaluate(argv: list[str] | None = None) -> int:
    return _run("evaluate.py", _evaluate_main, argv)


def generate(argv: list[str] | None = None) -> int:
    return _run("generate.py", _generate_main, argv)


def export(argv: list[str] | None = None) -> int:
    return _run("python -m xlm_pkm.inference.export", _export_main, argv)


def _runs_main():
    from xlm_pkm.runs.__main__ import main

    return main


def runs(argv: list[str] | None = None) -> int:
    return _run("python -m xlm_pkm.runs", _runs_main, argv)
