"""Checkpoint files read as data, never as code.

A torch file is a pickle, and unpickling calls whatever function the file names: a downloaded checkpoint
read with torch.load(weights_only=False) runs its author's code in evaluate.py, generate.py, export, a resume
or train.init_from. Every checkpoint file of a run is read here instead:

    state = load_torch_file(path)   # torch.load(weights_only=True): tensors, numbers, strings, lists, tuples
                                    # and dicts; anything else is refused

(Distributed Checkpoint's folders, checkpoint.dcp/step*/, are read by dcp_reader.py, with the same rule.)
A file that names anything else is refused in one line naming it and what it names (UnsafeFileError): it
is never unpickled, so nothing it names runs.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import torch

from xlm_pkm.errors import UserError


class UnsafeFileError(UserError, ValueError):
    """A checkpoint file that names something beyond data (a function, a class): it is not unpickled."""


def refused(path: str | Path, named: str) -> UnsafeFileError:
    return UnsafeFileError(f"{path}: names {named}, which is neither a tensor, a number, a string, a list nor a "
                           f"dict: a checkpoint is read as data, never as code, so it was not loaded (a file "
                           f"not written by xlm-pkm, or made to run code when unpickled)")


def load_torch_file(path: str | Path, mmap: bool = False):
    """torch.load of `path` on the CPU with weights_only=True; UnsafeFileError when the file names anything
    torch's restricted unpickler refuses (other errors, of a truncated or foreign file, are torch's own)."""
    try:
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        if found is None and "Weights only load failed" not in str(e):
            raise
        raise refused(path, found.group(1) if found else "an object torch's safe loader refuses") from None
