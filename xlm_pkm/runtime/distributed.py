"""Process-group set-up from the launcher's environment: torchrun, SLURM's srun, or a single process.

Every collective waits at most `timeout` (train.collective_timeout_minutes). The rendezvous store is
ours (a TCPStore on MASTER_ADDR:MASTER_PORT, hosted by rank 0, or by torchrun's agent under torchrun), so
that a training process can start a heartbeat in it (`start_heartbeat`): a counter each rank increments
from a thread every few seconds, beside the rank's host and process id. When a collective fails
(`is_collective_failure`), `describe_failure` names the ranks whose process is gone from this host (killed,
out of memory, crashed: seen at once, so before torchrun ends the survivors) and otherwise those whose counter
stopped (frozen, or on a lost host), so the job ends with one line instead of hanging or printing two chained
tracebacks.
"""

from __future__ import annotations

import datetime
import gc
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from xlm_pkm.errors import UserError
from xlm_pkm.runtime import slurm_env
from xlm_pkm.utils.sparse_grads import coalesced

_store: dist.Store | None = None  # the rendezvous store of the process group init_distributed joined
_heartbeat: Heartbeat | None = None  # this process's, once start_heartbeat started it

# gloo (torch 2.13) raises a plain RuntimeError, no DistError, when a peer died ("[.../gloo/transport/tcp/
# pair.cc] Connection closed by peer") or a collective timed out ("[.../gloo/transport/tcp/unbound_buffer.cc]
# Timed out waiting ..."): no exception type tells them from other errors, so gloo's messages are matched.
GLOO_TRANSPORT_FAILURES = ("gloo/transport/", "Connection closed by peer", "Timed out waiting")


class CollectiveError(UserError, RuntimeError):
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
        return DistEnv(int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_LOCALID"]),
                       int(os.environ["SLURM_NTASKS"]))
    return DistEnv()


def init_distributed(device: torch.device, timeout_minutes: float = 10.0) -> DistEnv:
    """Joins the process group (NCCL on GPU, gloo on CPU) when launched on several processes."""
    global _store
    env = read_env()
    if not env.is_distributed or dist.is_initialized():
        return env
    if "MASTER_ADDR" not in os.environ:  # srun without torchrun
        slurm_env.set_rendezvous_env()
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(env.rank), str(env.world_size)
    if device.type == "cuda":
        torch.cuda.set_device(env.local_rank)
    timeout = datetime.timedelta(minutes=timeout_minutes)
    _store = rendezvous_store(env, timeout)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout, rank=env.rank,
                            world_size=env.world_size, store=dist.PrefixStore("default_pg", _store))  # env://'s prefix
    return env


def rendezvous_store(env: DistEnv, timeout: datetime.timedelta) -> dist.TCPStore:
    """The store at MASTER_ADDR:MASTER_PORT that init_process_group's env:// would make: under torchrun its
    agent hosts it (TORCHELASTIC_USE_AGENT_STORE) and every rank is a client; otherwise rank 0 hosts it."""
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env.world_size,
                         is_master=env.is_main and not agent_hosts, timeout=timeout, multi_tenant=not agent_hosts)


def start_heartbeat(env: DistEnv, timeout_minutes: float) -> None:
    """Starts this rank's heartbeat in the rendezvous store and records its process there, for describe_failure;
    nothing on one process. A training process calls it once init_distributed has joined the group; shutdown
    stops it."""
    global _heartbeat
    if _store is None or _heartbeat is not None:
        return
    _heartbeat = Heartbeat(_store, env, interval=min(10.0, timeout_minutes * 60 / 4))
    _store.set(f"xlm_pkm/process/{env.rank}", f"{socket.gethostname()} {os.getpid()} {_started(os.getpid())}")
    _heartbeat.start()


def _started(pid: int) -> str | None:
    """When process `pid` started (/proc/PID/stat, in clock ticks: a reused pid has another), None if it is gone
    or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # from the state on
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


class Heartbeat(threading.Thread):
    """Increments `xlm_pkm/heartbeat/RANK` in `store` every `interval` seconds, once started."""

    def __init__(self, store: dist.Store, env: DistEnv, interval: float):
        super().__init__(daemon=True, name="xlm_pkm-heartbeat")
        self.store, self.env, self.interval = store, env, interval
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                self.store.add(f"xlm_pkm/heartbeat/{self.env.rank}", 1)
            except Exception:  # noqa: BLE001 - the store is gone: nothing left to report to
                return

    def dead_ranks(self) -> list[int] | None:
        """Other ranks on this host whose process is gone and that did not end on a failure they saw themselves
        (`ending`: torchrun ends the survivors, which then may be gone too); None if the store cannot be read, a
        rank is not recorded yet, or this host has no /proc."""
        ranks = [r for r in range(self.env.world_size) if r != self.env.rank]
        keys = [f"xlm_pkm/process/{r}" for r in ranks]
        try:
            if _started(os.getpid()) is None or not self.store.check(keys):
                return None
            processes = [self.store.get(k).decode().split() for k in keys]
            ending = {r for r in ranks if self.store.check([f"xlm_pkm/ending/{r}"])}
        except Exception:  # noqa: BLE001 - the store lived in a process that is gone
            return None
        host = socket.gethostname()
        return [r for r, (h, pid, started) in zip(ranks, processes)
                if h == host and r not in ending and _started(int(pid)) != started]

    def ending(self) -> None:
        """Marks this rank as ending on a failure it saw (it is not the one that died)."""
        try:
            self.store.set(f"xlm_pkm/ending/{self.env.rank}", "1")
        except Exception:  # noqa: BLE001 - the store is gone: nothing left to tell
            pass

    def silent_ranks(self) -> list[int] | None:
        """Other ranks whose heartbeat does not move over 2.5 intervals (None if the store cannot be read)."""
        keys = [f"xlm_pkm/heartbeat/{r}" for r in range(self.env.world_size)]
        try:
            before = [self.store.add(k, 0) for k in keys]
            time.sleep(2.5 * self.interval)
            after = [self.store.add(k, 0) for k in keys]
        except Exception:  # noqa: BLE001 - the store lived in a process that is gone
            return None
        return [r for r, (a, b) in enumerate(zip(before, after)) if a == b and r != self.env.rank]  # not us


def is_collective_failure(error: BaseException) -> bool:
    """Whether `error` is a failed or timed-out collective (a rank died or froze), once a group is joined:
    torch's DistError (NCCL's DistBackendError, the store's DistNetworkError and DistStoreError), or gloo's
    RuntimeError from its transport (GLOO_TRANSPORT_FAILURES)."""
    if not dist.is_initialized():
        return False
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and any(s in str(error) for s in GLOO_TRANSPORT_FAILURES)


def describe_failure(env: DistEnv, error: BaseException) -> CollectiveError:
    """A one-line error for a failed collective, naming the ranks that died (their process gone from this host),
    else those that stopped answering (their heartbeat still over 2.5 intervals)."""
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
    if _heartbeat is not None:
        _heartbeat.ending()
    dead = _heartbeat.dead_ranks() if _heartbeat is not None else None
    if dead:
        return CollectiveError(f"rank {env.rank}: a collective operation failed: rank(s) {', '.join(map(str, dead))} "
                               f"died (process gone: killed, out of memory or crashed; see its log)")
    silent = _heartbeat.silent_ranks() if _heartbeat is not None else None
    if silent is None:
        who = "the rendezvous store is gone too (rank 0 or its host died?)"
    elif silent:
        who = f"rank(s) {', '.join(map(str, silent))} stopped answering (frozen, killed or host lost)"
    else:
        who = "every rank still answers (one may be stuck in other work)"
    return CollectiveError(f"rank {env.rank}: a collective operation failed or timed out: {who}; "
                           f"see their logs ({first_line})")


def gather_objects(obj, env: DistEnv) -> list | None:
    """On rank 0, the object of every rank in rank order (just [obj] on one process); None on the others."""
    if not env.is_distributed:
        return [obj]
    out = [None] * env.world_size if env.is_main else None
    dist.gather_object(obj, out, dst=0)
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
    grad = coalesced(param.grad)
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


def synced_values(model: torch.nn.Module, sparse: bool, fsdp: bool = False) -> list[torch.nn.Parameter]:
    """The memory-value parameters that DDP or FSDP leave to average_value_grads_: under FSDP all of them
    (runtime/fsdp.py keeps them out); under DDP all of them when their gradients are sparse (DDP carries dense
    tensors only), else the sharded ones."""
    return [p for p in model.memory_value_parameters() if fsdp or sparse or hasattr(p, "value_shard")]


def data_parallel(model: torch.nn.Module, synced: list[torch.nn.Parameter], device: torch.device):
    """The model in DDP, its all-reduce leaving out `synced` (see synced_values)."""
    ids = {id(p) for p in synced}
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, [name for name, p in model.named_parameters() if id(p) in ids])
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def average_value_grads_(params: list[torch.Tensor], env: DistEnv) -> None:
    """Averages the memory values' gradients over ranks, as DDP or FSDP do the others (these are left out of
    them): a sharded table's gradient already sums every rank's tokens (model/memory/value_shards.py), so it is
    divided by the world size; a replicated sparse one goes through all_reduce_sparse_grad_, a replicated dense
    one (left out of FSDP only) through an all-reduce."""
    if not env.is_distributed:
        return
    for p in params:
        if p.grad is None:
            continue
        if hasattr(p, "value_shard"):
            p.grad.div_(env.world_size)
        elif p.grad.is_sparse:
            all_reduce_sparse_grad_(p, env)
        else:
            dist.all_reduce(p.grad)
            p.grad.div_(env.world_size)


def free_port() -> int:
    """A TCP port free on this host now, for MASTER_PORT when starting local processes by hand."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def any_ranks(flags: list[bool], env: DistEnv, device: torch.device) -> list[bool]:
    """Each flag true on every rank when it is true on at least one: one all-reduce for all of them."""
    if not env.is_distributed:
        return list(flags)
    t = torch.tensor([float(f) for f in flags], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def any_rank(flag: bool, env: DistEnv, device: torch.device) -> bool:
    """True on every rank when `flag` is true on at least one."""
    return any_ranks([flag], env, device)[0]


def shutdown(failed: bool = False) -> None:
    """Leaves the process group once every rank is done (gloo aborts a rank that leaves first); after
    a failed collective, or when that barrier fails (a rank died since), at once (the other ranks are not
    coming). A DDP wrapper left by a run that failed
    to start is collected first: its communication hooks must go before the process group does."""
    global _heartbeat, _store
    gc.collect()
    if _heartbeat is not None:
        _heartbeat.stopped.set()
        _heartbeat = None
    if dist.is_initialized():
        try:
            if not failed:
                dist.barrier()
        except Exception as e:  # a peer gone: no traceback at exit, the command has said how it ended
            if not is_collective_failure(e):
                raise
        dist.destroy_process_group()
    _store = None
