"""Process-group set-up from the launcher's environment: torchrun, SLURM's srun, or a single process.

Every collective waits at most `timeout` (train.collective_timeout_minutes). When one fails (a rank
froze, died or timed out), `describe_failure` asks every rank through a separate gloo group which of
them still answer, so the error names the missing ranks instead of hanging or printing two tracebacks.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from xlm_pkm import slurm

_health_group = None  # gloo group used only to find unresponsive ranks


class CollectiveError(RuntimeError):
    """A collective operation failed or timed out: another rank froze or died."""


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def read_env() -> DistEnv:
    """Ranks from torchrun (RANK, LOCAL_RANK, WORLD_SIZE) or else srun (SLURM_PROCID, ...)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return DistEnv(int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ["WORLD_SIZE"]))
    if "SLURM_PROCID" in os.environ and int(os.environ.get("SLURM_NTASKS", 1)) > 1:
        return DistEnv(int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_LOCALID"]), int(os.environ["SLURM_NTASKS"]))
    return DistEnv()


def init_distributed(device: torch.device, timeout_minutes: float = 10.0) -> DistEnv:
    """Joins the process group (NCCL on GPU, gloo on CPU) when launched on several processes."""
    global _health_group
    env = read_env()
    if not env.is_distributed or dist.is_initialized():
        return env
    if "MASTER_ADDR" not in os.environ:  # srun without torchrun
        slurm.set_rendezvous_env()
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(env.rank), str(env.world_size)
    if device.type == "cuda":
        torch.cuda.set_device(env.local_rank)
    timeout = datetime.timedelta(minutes=timeout_minutes)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)
    _health_group = dist.new_group(backend="gloo", timeout=timeout)
    return env


def describe_failure(env: DistEnv, error: BaseException, wait_seconds: float = 30.0) -> CollectiveError:
    """A one-line error for a failed collective, naming the ranks that no longer answer."""
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    missing = "unknown"
    if _health_group is not None:
        try:
            dist.monitored_barrier(_health_group, timeout=datetime.timedelta(seconds=wait_seconds),
                                   wait_all_ranks=True)
            missing = "none (every rank answers)"
        except RuntimeError as e:  # "Ranks 1, 3 failed to pass monitoredBarrier in ... ms"
            text = str(e)
            missing = text[text.find("Rank"):].split(" failed")[0] if "failed to pass" in text else "unknown"
        except Exception:  # noqa: BLE001 - this rank's own connection is gone too
            pass
    return CollectiveError(f"rank {env.rank}: a collective operation failed ({first_line}); "
                           f"ranks not answering: {missing}. A rank froze, died or was killed; see its log")


def all_gather_objects(obj, env: DistEnv) -> list:
    """The object of every rank, in rank order (just [obj] on one process)."""
    if not env.is_distributed:
        return [obj]
    out = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, env: DistEnv):
    """Rank 0's object, on every rank."""
    if not env.is_distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_reduce_sum(tensor: torch.Tensor, env: DistEnv) -> torch.Tensor:
    if env.is_distributed:
        dist.all_reduce(tensor)
    return tensor


def all_reduce_sparse_grad_(param: torch.Tensor, env: DistEnv) -> None:
    """Averages `param`'s sparse gradient over ranks: every rank's rows are gathered, duplicates summed.

    DDP's bucketed all-reduce carries dense tensors only (NCCL has no sparse collectives), so the
    sparse memory-value gradients are left out of DDP and synchronised here, in O(rows read).
    """
    if not env.is_distributed:
        return
    grad = param.grad.coalesce()
    rows, values = grad.indices()[0], grad.values()  # (nnz,), (nnz, dim)
    sizes = [torch.zeros(1, dtype=torch.long, device=rows.device) for _ in range(env.world_size)]
    dist.all_gather(sizes, torch.tensor([rows.numel()], device=rows.device))
    longest = int(max(sizes))
    pad = longest - rows.numel()
    all_rows = [rows.new_empty(longest) for _ in range(env.world_size)]
    all_values = [values.new_empty(longest, *values.shape[1:]) for _ in range(env.world_size)]
    dist.all_gather(all_rows, F.pad(rows, (0, pad)))
    dist.all_gather(all_values, F.pad(values, (0, 0) * (values.dim() - 1) + (0, pad)))
    rows = torch.cat([r[: int(n)] for r, n in zip(all_rows, sizes)])  # (Σ nnz,)
    values = torch.cat([v[: int(n)] for v, n in zip(all_values, sizes)])  # (Σ nnz, dim)
    merged = torch.sparse_coo_tensor(rows.unsqueeze(0), values, grad.shape)
    param.grad = merged.coalesce() / env.world_size


def any_rank(flag: bool, env: DistEnv, device: torch.device) -> bool:
    """True on every rank when `flag` is true on at least one."""
    if not env.is_distributed:
        return flag
    t = torch.tensor([float(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def shutdown() -> None:
    """Leaves the process group once every rank is done (gloo aborts a rank that leaves first)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
