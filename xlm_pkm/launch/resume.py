"""The command that resumes a run, as the user launched it, printed whenever a run stops before its end.

    python train.py ... train.exp_id=ID                 a script (its path as typed: it works from where
                                                        the user stands), run by the interpreter on PATH
                                                        when that is this one, else by its full path
    xlm-pkm-train ... train.exp_id=ID                   the installed console command
    torchrun --nproc_per_node=4 train.py ... ID         under torchrun (more nodes: their rendezvous options too)

Inside another program (pytest, a notebook, submitit's SLURM job) the script is `train.py`. A launcher script
names itself in XLM_PKM_LAUNCHER (scripts/train_torchrun.sh: `scripts/train_torchrun.sh 4`), and reports a stop
itself when it sets XLM_PKM_STOP_REPORT (`stop_status`).
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

from xlm_pkm.errors import EXIT_STOPPED

LAUNCHER = "XLM_PKM_LAUNCHER"  # the words that start train.py, set by a launcher script
STOP_REPORT = "XLM_PKM_STOP_REPORT"  # a file where rank 0 writes why and how to resume, for the launcher to print


def _interpreter() -> str:
    """`python` or `python3` when that name on PATH is this interpreter (an activated venv), else its path."""
    for name in ("python", "python3"):
        found = shutil.which(name)
        if found and os.path.abspath(found) == os.path.abspath(sys.executable):
            return name
    return sys.executable


def launcher(argv0: str | None = None, environ=None) -> list[str]:
    """The words before train.py's arguments: interpreter and script, the console command, or torchrun's."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    environ = os.environ if environ is None else environ
    if environ.get(LAUNCHER):
        return shlex.split(environ[LAUNCHER])
    if Path(argv0).name == "xlm-pkm-train":
        return [Path(argv0).name]
    script = argv0 if Path(argv0).name == "train.py" else "train.py"
    if "TORCHELASTIC_RUN_ID" in environ:  # set by torchrun in every worker
        per_node = int(environ.get("LOCAL_WORLD_SIZE", 1))
        nodes = int(environ.get("WORLD_SIZE", per_node)) // per_node
        return ["torchrun", *([f"--nnodes={nodes}"] if nodes > 1 else []), f"--nproc_per_node={per_node}", script]
    return [_interpreter(), script]


def resume_command(argv: list[str], exp_id: str, argv0: str | None = None, environ=None) -> str:
    """The command line that resumes the run of `argv` (train.py's arguments), its exp_id made explicit."""
    words = launcher(argv0, environ)
    args = [a for a in argv if not a.startswith("train.exp_id=")]
    command = shlex.join([*words, *args, f"train.exp_id={exp_id}"])
    return command + (" (with the same rendezvous options)" if any(w.startswith("--nnodes") for w in words) else "")


def stop_status(line: str, is_main: bool, environ=None) -> int:
    """The exit status of a run stopped to be resumed: EXIT_STOPPED (75); under a launcher that reports the stop
    itself (STOP_REPORT names a file), 0, after rank 0 wrote `line` to that file: torchrun, whose workers then all
    end with 0, exits quietly, and the launcher prints the line last and exits 75."""
    environ = os.environ if environ is None else environ
    if not environ.get(STOP_REPORT):
        return EXIT_STOPPED
    if is_main:
        Path(environ[STOP_REPORT]).write_text(line + "\n")
    return 0
