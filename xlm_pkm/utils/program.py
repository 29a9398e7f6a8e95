"""The name a command was started by, for its usage and error lines: `xlm-pkm-train` for an installed
console command, `train.py` for a checkout's script, `python -m xlm_pkm.inference.export` for a module."""

from __future__ import annotations

import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]  # the package's parent: a checkout, or site-packages


def program_name(default: str) -> str:
    """From sys.argv[0]; `default` when this process is another program (pytest, a notebook)."""
    argv0 = Path(sys.argv[0])
    if argv0.name.startswith("xlm-pkm-"):
        return argv0.name
    path = argv0.resolve()
    if path.suffix != ".py" or not path.is_relative_to(CHECKOUT):
        return default
    module = path.relative_to(CHECKOUT).with_suffix("").parts
    if module[0] == "xlm_pkm":
        return "python -m " + ".".join(module)
    return argv0.name if len(module) == 1 else default  # train.py, evaluate.py, generate.py
