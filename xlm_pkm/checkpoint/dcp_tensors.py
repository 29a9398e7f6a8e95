"""The tensors of a run's checkpoint.pt (model and optimizer states), through PyTorch's Distributed Checkpoint.

checkpoint.pt at step S holds the run's small state (config, counters, every rank's TrainState, the loss
scaler, the optimizers' settings) and names the folder that holds its tensors. Saving, every rank together:

    every rank writes   checkpoint.dcp/stepS.partial/__R_0.distcp   its part of the tensors, in parallel (DCP)
    rank 0 renames      checkpoint.dcp/stepS.partial -> stepS       once DCP has written .metadata
    rank 0 writes       checkpoint.pt                               naming checkpoint.dcp/stepS (files.save_atomic)
    rank 0 removes      the other folders of checkpoint.dcp/        (remove_stale)

so checkpoint.pt always names a whole folder of its own step: a crash at any moment leaves the previous
checkpoint.pt and its folder (run_dir.remove_temporary_files removes a .partial folder at the next start).

Each tensor is saved under its name (`model.NAME`, `optimizers.GROUP.NAME.STATE` with NAME the parameter's)
in its layout: FSDP's parameters and their optimizer states are DTensors sharded on dim 0 (runtime/fsdp.py);
value tables sharded by column (model.memory.shard_values) and their optimizer states are wrapped as DTensors
sharded on dim 1 (each rank's columns, model/memory/value_shards.py); every other tensor is replicated, and
DCP writes one copy of it, spreading those copies over the ranks. Loading reads, for each tensor, the part
that the loading rank holds in its own layout: a checkpoint resumes on any number of processes (dividing the
value dimension when values are sharded) in either train.parallel, and loads whole on one process without a
process group (read_whole: evaluate.py, export, generation, or to look into a checkpoint).
"""

from __future__ import annotations

import os
import pickle
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from xlm_pkm.runtime.distributed import DistEnv, broadcast_object
from xlm_pkm.utils.atomic import OutputError
from xlm_pkm.utils.dtensors import is_dtensor, local_part

KEY = "dcp"  # in checkpoint.pt: its tensors' folder, relative to its directory; in an optimizer state: a tensor's name


def folder_of(path: Path) -> Path:
    """Where the tensor folders of the checkpoint `path` go: checkpoint.pt -> checkpoint.dcp/."""
    return path.parent / f"{path.stem}.dcp"


def _mesh(env: DistEnv, device: torch.device):
    """The 1-D mesh of the ranks, for the DTensor view of value shards (None on one process)."""
    if not env.is_distributed:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (env.world_size,))


def _placed(t: torch.Tensor, param: nn.Parameter | None, mesh):
    """t (a parameter's, or one of its optimizer states) in the layout DCP saves and loads: a value shard's
    columns, or a state of its shape, as a DTensor sharded on dim 1 (the whole table's shape); else t."""
    shard = getattr(param, "value_shard", None)
    if mesh is None or is_dtensor(t) or shard is None or shard.world == 1 or t.shape != param.shape:
        return t
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(t, mesh, [Shard(1)], run_check=False)


def _names(model: nn.Module) -> tuple[dict[str, nn.Parameter], dict[int, str]]:
    """({state-dict name: parameter}, every name of a shared table included; {id(parameter): its first name})."""
    return (dict(model.named_parameters(remove_duplicate=False)),
            {id(p): name for name, p in model.named_parameters()})


@contextmanager
def _quiet_single_process():
    """DCP warns at every save and load without a process group that it assumes one process: we ask for it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _os_error(error: BaseException) -> OSError | None:
    """The OSError that `error` is or came from (a full disk under torch.save's own `unexpected pos` error)."""
    while error is not None and not isinstance(error, OSError):
        error = error.__cause__ or error.__context__
    return error


def _writer(folder: Path):
    """DCP's FileSystemWriter for `folder`, whose failed write raises the OSError it came from, not what torch's zip
    writer made of it: DCP sends each rank's error to the others pickled, and pickling drops its cause (under
    several processes a full disk read `[enforce fail at inline_container.cc:672] unexpected pos 704 vs 598`)."""
    from torch.distributed.checkpoint import FileSystemWriter

    class Writer(FileSystemWriter):
        def write_data(self, plan, planner):
            try:
                return super().write_data(plan, planner)
            except Exception as e:
                cause = _os_error(e)
                if cause is None or cause is e:
                    raise
                raise OSError(cause.errno, cause.strerror, cause.filename) from e

    return Writer(folder)


def _summary(error: BaseException, ranks: bool = False) -> str:
    """An error in one line; of a CheckpointException (every failed rank's error with its traceback), the first
    failure, after its rank when `ranks`."""
    failures = getattr(error, "failures", None)
    if failures:
        rank, (error, _) = min(failures.items(), key=lambda item: item[0])
        return f"rank {rank}: {_summary(error)}" if ranks else _summary(error)
    cause = _os_error(error)
    if cause is not None and cause.strerror:
        return f"{cause.strerror}: {cause.filename}" if cause.filename else cause.strerror
    text = (str(error).strip().splitlines() or [""])[0][:300]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _unreadable(path: Path, folder: Path, why: str) -> ValueError:
    return ValueError(f"{path}: its tensors in {folder} cannot be read ({why}); restore the whole "
                      f"{folder.parent.name}/ folder of that checkpoint")


def _each_state(optimizers: dict, fn) -> dict:
    """Optimizers.state_dict()'s layout, each state value v of a group's parameter i replaced by fn(v, group, i)."""
    return {group: {**saved, "state": {i: {k: fn(v, group, i) for k, v in values.items()}
                                       for i, values in saved["state"].items()}}
            for group, saved in optimizers.items()}


def save(record: dict, path: Path, model: nn.Module, params: dict[str, list[nn.Parameter]], env: DistEnv,
         device: torch.device) -> dict:
    """Writes the tensors of record["model"] (the model's state dict, as it lays them out) and of
    record["optimizers"] (Optimizers.state_dict(); `params`: each group's parameters in its state's order)
    to a new folder of folder_of(path); returns the record for rank 0 to write to `path`: its optimizers'
    states with each tensor replaced by {KEY: name, shape, dtype}, and KEY naming the folder. Collective:
    if any rank cannot write its part, every rank raises OutputError (and no folder is left)."""
    from torch.distributed.checkpoint import CheckpointException
    from torch.distributed.checkpoint import save as dcp_save

    mesh, (named, first_name) = _mesh(env, device), _names(model)
    tensors = {f"model.{k}": _placed(t, named.get(k), mesh) for k, t in record["model"].items()}
    optimizers = {}
    for group, state in record["optimizers"].items():
        entries = {}
        for i, values in state["state"].items():
            param = params[group][i]
            entries[i] = {}
            for k, v in values.items():
                if isinstance(v, torch.Tensor):
                    name = f"optimizers.{group}.{first_name[id(param)]}.{k}"
                    tensors[name] = _placed(v, param, mesh)
                    v = {KEY: name, "shape": list(tensors[name].shape), "dtype": str(v.dtype).removeprefix("torch.")}
                entries[i][k] = v
        optimizers[group] = {**state, "state": entries}
    folder = folder_of(path)
    name = None
    if env.is_main:
        folder.mkdir(exist_ok=True)
        name, n = f"step{record['step']}", 1
        while (folder / name).exists():  # the same step saved again: a new folder, the named one stays whole
            n += 1
            name = f"step{record['step']}.{n}"
        shutil.rmtree(folder / f"{name}.partial", ignore_errors=True)
    name = broadcast_object(name, env)
    partial = folder / f"{name}.partial"
    try:
        with _quiet_single_process():
            dcp_save(tensors, storage_writer=_writer(partial), no_dist=not env.is_distributed)
    except CheckpointException as e:  # on every rank, with every failed rank's error
        if env.is_main:
            shutil.rmtree(partial, ignore_errors=True)
        kept = f"; the previous {path.name} is kept" if path.exists() else ""
        raise OutputError(f"cannot write {partial}: {_summary(e, env.is_distributed)}{kept}") from None
    if env.is_main:
        os.replace(partial, folder / name)
    rest = {k: v for k, v in record.items() if k not in ("model", "optimizers")}
    return {**rest, "optimizers": optimizers, KEY: f"{folder.name}/{name}"}


def remove_stale(path: Path, record: dict) -> None:
    """Removes the folders of folder_of(path) that `record` (just written to `path`) does not name."""
    folder = folder_of(path)
    keep = path.parent / record[KEY] if KEY in record else None
    for f in folder.iterdir() if folder.is_dir() else []:
        if f != keep:
            shutil.rmtree(f, ignore_errors=True)


def _template(ref: dict, param: nn.Parameter, mesh) -> torch.Tensor:
    """An empty tensor to load the optimizer state `ref` into: in the parameter's layout when it has its shape
    (a moment), else a plain one (a step count)."""
    dtype = getattr(torch, ref["dtype"])
    placed = _placed(param.detach(), param, mesh)
    if list(placed.shape) == ref["shape"]:
        return torch.empty_like(placed, dtype=dtype)
    return torch.empty(ref["shape"], dtype=dtype)


def _read(tensors: dict, path: Path, state: dict, env: DistEnv | None) -> None:
    """Fills `tensors` (name: tensor) from the folder that `state`, loaded from `path`, names; collective when
    `env` is distributed. A folder missing or damaged is one ValueError naming it."""
    from torch.distributed.checkpoint import CheckpointException
    from torch.distributed.checkpoint import load as dcp_load

    from xlm_pkm.checkpoint.dcp_reader import DataOnlyPlanner, DataOnlyReader

    folder, distributed = path.parent / state[KEY], env is not None and env.is_distributed
    try:
        with _quiet_single_process():
            dcp_load(tensors, checkpoint_id=folder, no_dist=not distributed, storage_reader=DataOnlyReader(folder),
                     planner=DataOnlyPlanner())
    except CheckpointException as e:  # on every rank, with every failed rank's error
        raise _unreadable(path, folder, _summary(e, distributed)) from None


def load(state: dict, path: Path, model: nn.Module, params: dict[str, list[nn.Parameter]], env: DistEnv,
         device: torch.device) -> dict:
    """The checkpoint `state` loaded from `path` (saved by `save`): its tensors loaded into the model in place,
    each rank its part in this run's layout, and state["optimizers"] with its tensors back, ready for
    Optimizers.load_state_dict. Collective: every rank raises the same one line if the folder cannot be read."""
    mesh, (named, _) = _mesh(env, device), _names(model)
    tensors = {f"model.{k}": _placed(t, named.get(k), mesh) for k, t in model.state_dict().items()}
    for group, saved in state["optimizers"].items():
        for i, values in saved["state"].items():
            for v in values.values():
                if isinstance(v, dict) and KEY in v:
                    tensors[v[KEY]] = _template(v, params[group][i], mesh)
    _read(tensors, path, state, env)

    def loaded(v, group, i):  # an FSDP parameter's state stays a DTensor; a value shard's is its local columns
        if not (isinstance(v, dict) and KEY in v):
            return v
        return tensors[v[KEY]] if is_dtensor(params[group][i]) else local_part(tensors[v[KEY]])

    state["optimizers"] = _each_state(state["optimizers"], loaded)
    return state


def read_whole(state: dict, path: Path, optimizers: bool = True) -> dict:
    """The checkpoint `state` (loaded from `path`) with its tensors read whole by this process alone (no
    collective, also in a process group): state["model"] (value tables with every column) and, with
    `optimizers`, the tensors of state["optimizers"]; no model needed (the folder's metadata gives each shape)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from xlm_pkm.checkpoint.dcp_reader import DataOnlyReader

    folder = path.parent / state[KEY]
    try:
        metadata = DataOnlyReader(folder).read_metadata().state_dict_metadata
    except (OSError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError) as e:  # missing, damaged
        raise _unreadable(path, folder, _summary(e)) from None
    tensors = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.items()
               if isinstance(m, TensorStorageMetadata) and (optimizers or k.startswith("model."))}
    _read(tensors, path, state, None)

    out = {**state, "model": {k.removeprefix("model."): t for k, t in tensors.items() if k.startswith("model.")}}
    if optimizers:
        out["optimizers"] = _each_state(
            state["optimizers"], lambda v, group, i: tensors[v[KEY]] if isinstance(v, dict) and KEY in v else v)
    return out
