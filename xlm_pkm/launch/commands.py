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

PROCESS_DEFAULTS = {"THP_MEM_ALLOC_ENABLE": "1"}


def set_process_defaults() -> None:
    """PROCESS_DEFAULTS in this process's environment (and its children's), where not already set."""
    for name, value in PROCESS_DEFAULTS.items():
        os.environ.setdefault(name, value)


def train(argv: list[str] | None = None) -> int:
    set_process_defaults()
    from xlm_pkm.launch.cli import train_main

    return train_main(argv)


def evaluate(argv: list[str] | None = None) -> int:
    set_process_defaults()
    from xlm_pkm.launch.cli import evaluate_main

    return evaluate_main(argv)


def generate(argv: list[str] | None = None) -> int:
    set_process_defaults()
    from xlm_pkm.launch.cli import generate_main

    return generate_main(argv)


def export(argv: list[str] | None = None) -> int:
    set_process_defaults()
    from xlm_pkm.inference.export import main

    return main(argv)


def runs(argv: list[str] | None = None) -> int:
    set_process_defaults()
    from xlm_pkm.runs.__main__ import main

    return main(argv)
