"""Sharded memory values in best.pt: one file per rank beside it, re-shardable on load; also read from a
checkpoint.pt of an earlier version, which kept them so (today's checkpoint.pt: dcp_tensors.py).

With model.memory.shard_values, rank r of W holds columns [r·w, (r+1)·w) of each value table and its
optimizer state (model/memory/value_shards.py, w = dim / W). Saving `best.pt` (an earlier `checkpoint.pt`
the same way, with the values optimizer's state) at step S:

    every rank writes   best.values/step{S}.rank{r}-of-{W}.pt   its tables' columns (and an earlier
                                                                checkpoint.pt's: the values optimizer's)
    then rank 0 writes  best.pt                                  the rest, naming the W files

Each file is written atomically and best.pt last, so best.pt always names complete files of its own
step: a crash while saving leaves the previous best.pt and its files. Files that no checkpoint names any
more are removed after the new best.pt is written.

Loading (`attach`) re-shards: the target shard (rank', W') takes its columns from the files that hold
them (memory-mapped, so only those are read), and optimizer tensors of the table's shape are cut the
same way; other optimizer entries (the step count) are the same on every rank. A checkpoint saved by
W processes thus loads on W' processes whose count divides the value dimension, and on one process
(evaluate.py, export, generation: the whole table); a checkpoint of replicated values loads into a
run that now shards them.

A damaged file (missing, truncated, not a shard) is a one-line error naming it. Under several processes
each rank reads only the files of its own columns, so one rank may fail where the others succeed:
`on_every_rank` wraps a load in an agreement that every rank reaches before any goes on, so that every
rank stops together with one line (instead of the others going on into collectives that wait for it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, TypeVar

import torch
from torch import nn

from xlm_pkm.checkpoint.files import inside_folder, save_atomic
from xlm_pkm.checkpoint.safe_load import UnsafeFileError, load_torch_file
from xlm_pkm.errors import USER_ERRORS, UserError
from xlm_pkm.model.memory.value_shards import ValueShard
from xlm_pkm.runtime.distributed import DistEnv, any_rank, broadcast_object, gather_objects
from xlm_pkm.utils.atomic import OutputError

T = TypeVar("T")

KEY = "value_shards"  # in the checkpoint: {"world": W, "width": w, "files": [paths relative to its directory]}


def model_shard(model: nn.Module) -> ValueShard | None:
    """The shard the model's value tables hold (None: not sharded)."""
    return next((p.value_shard for p in model.parameters() if hasattr(p, "value_shard")), None)


def sharded_names(model: nn.Module) -> set[str]:
    """State-dict names of the sharded value tables (a shared table under each of its names)."""
    return {name for name, p in model.named_parameters(remove_duplicate=False) if hasattr(p, "value_shard")}


def shard_folder(path: Path) -> Path:
    """Where the shard files of the checkpoint `path` go: checkpoint.pt -> checkpoint.values/."""
    return path.parent / f"{path.stem}.values"


def shard_file(path: Path, step: int, shard: ValueShard) -> str:
    """The file of `shard` for the checkpoint `path` at `step`, relative to path's directory."""
    return f"{shard_folder(path).name}/step{step}.rank{shard.rank}-of-{shard.world}.pt"


def _values_part(record: dict, names: set[str]) -> dict:
    """What a shard file holds, from a whole checkpoint record: its step, the tables `names` and the
    values optimizer's state (when the record has optimizers)."""
    part = {"step": record["step"], "model": {k: record["model"][k] for k in names}}
    if "optimizers" in record:
        part["optimizer"] = record["optimizers"]["values"]
    return part


def save(record: dict, path: Path, model: nn.Module, env: DistEnv, device: torch.device) -> dict:
    """Writes this rank's part of `record` (the sharded tables' columns, and its "optimizers"' "values"
    state when present) and returns the rest, naming every rank's file, for rank 0 to write to `path`.
    Collective: if any rank cannot write its file, every rank raises OutputError."""
    names = sharded_names(model)
    shard = model_shard(model)
    if shard is None:
        return record
    part = _values_part(record, names)
    rest = {**record, "model": {k: v for k, v in record["model"].items() if k not in names}}
    if "optimizers" in record:
        rest["optimizers"] = {k: v for k, v in record["optimizers"].items() if k != "values"}
    error = None
    try:
        target = path.parent / shard_file(path, record["step"], shard)
        target.parent.mkdir(exist_ok=True)
        save_atomic(part, target)
    except (OutputError, OSError) as e:
        error = e if isinstance(e, OutputError) else OutputError(f"{target.parent}: {e.strerror or e}")
    if any_rank(error is not None, env, device):
        raise error or OutputError(f"{path}: another rank could not write its value shard; not saved")
    width = next(iter(part["model"].values())).shape[1]
    files = [shard_file(path, record["step"], ValueShard(r, shard.world)) for r in range(shard.world)]
    return {**rest, KEY: {"world": shard.world, "width": width, "files": files}}


def remove_stale(path: Path, record: dict) -> None:
    """Removes the shard files of `path` that `record` (just written to it) does not name."""
    folder = shard_folder(path)
    keep = {path.parent / f for f in record.get(KEY, {}).get("files", [])}
    for f in folder.glob("step*.pt") if folder.is_dir() else []:
        if f not in keep:
            f.unlink(missing_ok=True)


def _cut(pieces: list[tuple[int, object]], start: int, stop: int, width: int):
    """pieces: (first column, a file's object) in column order -> the object with every (rows, width)
    tensor cut to columns [start, stop) of the whole table; other leaves from the first piece."""
    first = pieces[0][1]
    if isinstance(first, dict):
        return {k: _cut([(c, obj[k]) for c, obj in pieces], start, stop, width) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(_cut([(c, obj[i]) for c, obj in pieces], start, stop, width) for i in range(len(first)))
    if isinstance(first, torch.Tensor) and first.dim() == 2 and first.shape[1] == width:
        return torch.cat([t[:, max(start - c, 0): min(stop - c, width)] for c, t in pieces], dim=1)
    return first


def _read_part(path: Path, file: Path) -> dict:
    """The shard file `file` of the checkpoint `path` (memory-mapped), or a one-line error naming it."""
    if not file.is_file():
        raise FileNotFoundError(f"{path}: its value shard {file} is missing (copy the whole "
                                f"{file.parent.name}/ folder with the checkpoint)")
    try:
        part = load_torch_file(file, mmap=True)
    except UnsafeFileError:
        raise
    except Exception as e:  # truncated or damaged: torch's reader fails (RuntimeError, EOFError, pickle errors...)
        reason = (str(e).strip().splitlines() or [""])[0].split(". ")[0][:200]  # torch's first sentence
        raise ValueError(f"{path}: its value shard {file} is truncated or damaged ({type(e).__name__}: "
                         f"{reason}); restore the whole {file.parent.name}/ folder of that checkpoint") from None
    if not isinstance(part, dict) or not {"step", "model"} <= set(part):
        raise ValueError(f"{path}: its value shard {file} is a torch file, but not a value shard of an "
                         f"xlm-pkm checkpoint")
    return part


def attach(state: dict, path: Path, shard: ValueShard | None, names: set[str] = frozenset()) -> dict:
    """The checkpoint `state` loaded from `path`, with the value columns of `shard` (None: the whole
    tables) read from its shard files into state["model"] (and the values optimizer's state into
    state["optimizers"]). A checkpoint of replicated values loaded for a shard of a multi-process table
    (the run now shards its values) has its tables `names` and their optimizer state cut to the shard."""
    info = state.pop(KEY, None)
    shard = shard or ValueShard(0, 1)
    if info is None and (shard.world == 1 or not names):
        return state
    if info is None:
        whole = _values_part(state, names)
        world, width = 1, next(iter(whole["model"].values())).shape[1]
    else:
        world, width = info["world"], info["width"]
    dim = world * width
    if dim % shard.world:
        raise ValueError(f"{path}: its value tables ({dim} columns, saved by {world} processes) do not split "
                         f"into {shard.world} equal slices")
    columns = shard.columns(dim)
    pieces = [(0, whole)] if info is None else []
    for r, name in enumerate(info["files"] if info else []):
        if not inside_folder(name):
            raise ValueError(f"{path}: names the value shard {name!r}, not a file beside it (a damaged or hand-made "
                             f"checkpoint)")
        if r * width < columns.stop and (r + 1) * width > columns.start:
            pieces.append((r * width, _read_part(path, path.parent / name)))
    if any(part["step"] != state["step"] for _, part in pieces):
        raise ValueError(f"{path}: its value shards are of another step than the checkpoint ({state['step']})")
    part = _cut(pieces, columns.start, columns.stop, width)
    state["model"] = {**state["model"], **part["model"]}
    if "optimizer" in part and "optimizers" in state:
        state["optimizers"] = {**state["optimizers"], "values": part["optimizer"]}
    return state


class OtherRankError(UserError):
    """Another rank could not load its part of a checkpoint: this one stops too (on_every_rank)."""


def _summary(error: Exception) -> str:
    """An error in one line, for the other ranks' message."""
    text = (str(error).strip().splitlines() or [""])[0][:500]
    return text if isinstance(error, USER_ERRORS) else f"{type(error).__name__}: {text}"


def on_every_rank(load: Callable[[], T], env: DistEnv, source: Path | str) -> T:
    """load() on this rank, then an agreement every rank reaches before any goes on (collective when
    distributed): if it failed on any rank, every rank raises, the ranks that failed their own error, the
    others an OtherRankError naming the first rank that failed and its error (a value shard file it could
    not read, say). load() itself must not be collective (a rank that failed would not reach it); the
    agreement gathers object lists, so it needs no device."""
    if not env.is_distributed:
        return load()
    result, error = None, None
    try:
        result = load()
    except Exception as e:  # noqa: BLE001 - re-raised below, once every rank knows
        error = e
    errors = broadcast_object(gather_objects(None if error is None else _summary(error), env), env)
    if error is not None:
        try:
            raise error
        finally:  # no cycle error -> traceback -> this frame -> error: the caller's frames (a Trainer, its DDP
            error = None  # wrapper) go with the error, before the process group, not at exit (gloo aborts then)
    failed = [(rank, message) for rank, message in enumerate(errors) if message is not None]
    if failed:
        rank, message = failed[0]
        raise OtherRankError(f"rank {rank} could not load its part of {source}, so no rank goes on: {message}")
    return result
