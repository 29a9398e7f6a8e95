"""Checkpoints and other run outputs: written atomically, never with non-finite weights; loaded with checks.

Checkpoints are written whole or not at all (xlm_pkm/utils/atomic.py): a crash, a full disk or a
read-only directory at any moment leaves the previous file intact and no temporary file behind; the
error is one line naming the file (OutputError).

A run checkpoint is a dict with at least `config`, `model` and `step`; `checkpoint.pt` adds the
optimizer and run state (resume), `best.pt` holds the model only (evaluation). Both record the
vocabulary's fingerprint (`vocab_fingerprint`), checked against the data on resume and evaluation.
checkpoint.pt keeps its tensors in a folder beside it instead (`dcp`, in place of `model`: dcp_tensors.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from xlm_pkm.checkpoint.safe_load import UnsafeFileError, load_torch_file
from xlm_pkm.errors import UserError
from xlm_pkm.utils.atomic import atomic_file, write_error
from xlm_pkm.utils.chunks import slices
from xlm_pkm.utils.dtensors import local_part

RUN_KEYS = ("config", "model", "step")  # "model", or "dcp": the folder of its tensors (dcp_tensors.py)


class NonFiniteError(UserError, RuntimeError):
    """Parameters or optimizer state are not finite: such a state is never written."""


def save_atomic(obj: dict, path: str | Path) -> None:
    """torch.save to `path`, whole or not at all (xlm_pkm/utils/atomic.py). A failed write (disk full) is
    one OutputError naming `path`, although torch's zip writer replaces it on its way out by its own
    `RuntimeError ... unexpected pos` (writing the end of the archive after the failure): atomic_file
    raises the error of the failed write, whatever the body raised."""
    with atomic_file(Path(path)) as f:
        try:
            torch.save(obj, f)
        except OSError as e:  # raised by torch's own writer: about this file too
            raise write_error(Path(path), e) from None


def _tensors(obj, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in obj (nested dicts/lists); of a DTensor, the part this rank holds."""
    if isinstance(obj, torch.Tensor):
        yield prefix, local_part(obj)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}.{i}")


def all_finite(t: torch.Tensor) -> bool:
    """Whether the floating-point tensor `t` holds no nan or inf, read a slice at a time (utils/chunks.py):
    torch.isfinite builds |t| and a mask of its input's size, a second table at a checkpoint's peak."""
    return all(bool(torch.isfinite(part).all()) for part in slices(t.coalesce().values() if t.is_sparse else t))


def first_non_finite(obj) -> str | None:
    """The name of the first floating-point tensor in `obj` (nested dicts/lists) with a nan or inf."""
    for name, t in _tensors(obj, ""):
        if t.is_floating_point() and not all_finite(t):
            return name
    return None


def damaged_weight(name: str, source: str | Path) -> NonFiniteError:
    """The error for a weight `name` of `source` that holds a nan or inf: training never saves one."""
    return NonFiniteError(f"{source}: weight {name} holds nan or inf, which training never saves: the file is "
                          f"damaged; use another checkpoint of the run (best.pt, checkpoint.pt, a copy)")


def refuse_non_finite(weights: dict, source: str | Path) -> None:
    """NonFiniteError naming the first weight with a nan or inf: training never saves one, so the file is damaged."""
    bad = first_non_finite(weights)
    if bad is not None:
        raise damaged_weight(bad, source)


def load(path: str | Path, mmap: bool = False) -> dict:
    """A run checkpoint file (a dict with config, model and step), on the CPU; trained.load_trained also reads
    exported folders. With `mmap` its tensors are paged in from the file (no copy of a table in the process's
    memory while it is loaded into a model), so the file must not be rewritten in place meanwhile (a save renames)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: is a directory, not a checkpoint file" if path.is_dir() else
                                f"checkpoint not found: {path}")
    try:
        state = load_torch_file(path, mmap=mmap)
    except UnsafeFileError:
        raise
    except Exception as e:  # truncated or foreign file
        raise ValueError(f"{path}: not a readable checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or not all(k in state for k in RUN_KEYS if k != "model" or "dcp" not in state):
        raise ValueError(f"{path}: a torch file, but not a checkpoint of an xlm-pkm run "
                         f"(expected a dict with {', '.join(RUN_KEYS)})")
    wrong = _wrong_type(state)
    if wrong:
        raise ValueError(f"{path}: its {wrong}: not as an xlm-pkm run writes it (a damaged or hand-made file)")
    return state


def _wrong_type(state: dict) -> str | None:
    """'KEY is TYPE, not WHAT' for the first entry of a checkpoint that has not the type a run writes."""
    expected = {"config": (dict, "a dict"), "step": (int, "an integer"), "model": (dict, "a dict of tensors"),
                "dcp": (str, "a folder name"), "vocab_fingerprint": ((str, type(None)), "a string")}
    for key, (kind, what) in expected.items():
        if key in state and (not isinstance(state[key], kind) or isinstance(state[key], bool)):
            return f"{key} is {type(state[key]).__name__}, not {what}"
    bad = next((k for k, t in state.get("model", {}).items() if not isinstance(t, torch.Tensor)), None)
    if bad is not None:
        return f"weight {bad} is {type(state['model'][bad]).__name__}, not a tensor"
    if "dcp" in state and not inside_folder(state["dcp"]):
        return f"dcp names {state['dcp']!r}, not a folder beside it"
    return None


def inside_folder(name: str) -> bool:
    """Whether `name`, a file a checkpoint names, is a relative path that stays in the checkpoint's folder: it
    reads nothing elsewhere."""
    return isinstance(name, str) and bool(name) and not Path(name).is_absolute() and ".." not in Path(name).parts


def check_vocabulary(state: dict, fingerprint: str, vocab_path: str | Path, source: str | Path) -> None:
    """The checkpoint's model was trained on the vocabulary at `vocab_path` (fingerprints equal)."""
    saved = state.get("vocab_fingerprint")
    if saved is not None and saved != fingerprint:
        raise ValueError(f"{source}: the model was trained with another vocabulary than {vocab_path} "
                         f"(fingerprint {saved}, the data's is {fingerprint})")


def migrate_model_state(state: dict, own: dict) -> dict:
    """Model weights saved by earlier versions under today's names (memory keys: `.keys` became
    `.keys.weight` when key searches became modules)."""
    return {(f"{k}.weight" if k not in own and f"{k}.weight" in own else k): v for k, v in state.items()}


def load_model_state(model: nn.Module, state: dict, source: str | Path) -> None:
    """Loads weights after checking that every parameter and buffer exists with the same shape and is finite."""
    refuse_non_finite(state, source)
    own = model.state_dict()
    state = migrate_model_state(state, own)
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    mismatched = [f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
                  for k in own if k in state and state[k].shape != own[k].shape]
    problems = ([f"missing {', '.join(missing[:5])}"] if missing else []) \
        + ([f"unexpected {', '.join(unexpected[:5])}"] if unexpected else []) + mismatched[:5]
    if problems:
        raise ValueError(f"{source}: checkpoint is of another architecture: " + "; ".join(problems))
    model.load_state_dict(state)
