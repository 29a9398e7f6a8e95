"""The device's peaks, for model FLOPs utilisation (MFU) and achieved memory bandwidth; its free memory
(the lowest of the machine's, the cgroup's and RLIMIT_AS's room on the CPU).

Both are looked up from the name torch.cuda.get_device_name() reports (substring match, most
specific first), never assumed; an unknown device (or CPU) gives None and the figure is left out.
"""

from __future__ import annotations

import torch

# Dense (no sparsity) tensor-core peak in FLOP/s by precision, from the vendors' data sheets.
PEAK_FLOPS = [
    ("H200", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    ("H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12}),
    ("H100", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}),
    ("A10G", {"bf16": 70e12, "fp16": 70e12, "fp32": 31e12}),
    ("L4", {"bf16": 121e12, "fp16": 121e12, "fp32": 30e12}),
    ("V100", {"bf16": 0.0, "fp16": 125e12, "fp32": 15.7e12}),
]

# Peak HBM/GDDR bandwidth in bytes/s, from the same data sheets.
PEAK_MEMORY_BANDWIDTH = [
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100", 1.555e12),
    ("A10G", 0.6e12),
    ("L4", 0.3e12),
    ("V100", 0.9e12),
]


def _lookup(table: list, device: torch.device):
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((value for key, value in table if key in name), None)


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The device's peak FLOP/s for `precision`, or None when unknown (CPU, unlisted GPU)."""
    table = _lookup(PEAK_FLOPS, device)
    return (table or {}).get(precision) or None


def peak_memory_bandwidth(device: torch.device) -> float | None:
    """The device's peak memory bandwidth in bytes/s, or None when unknown (CPU, unlisted GPU)."""
    return _lookup(PEAK_MEMORY_BANDWIDTH, device)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):  # absent, or "max" (no limit)
        return None


def _cgroup_room() -> int | None:
    """Bytes left under this process's cgroup memory limit (v2 memory.max, v1 memory.limit_in_bytes: a SLURM
    job's --mem, a container's limit); None without a limit."""
    try:
        with open("/proc/self/cgroup") as f:
            entries = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    for _, controllers, path in entries:
        if controllers == "":  # v2
            folders, limit_name, usage_name = ["/sys/fs/cgroup" + path, "/sys/fs/cgroup"], "memory.max", \
                "memory.current"
        elif "memory" in controllers.split(","):  # v1 (inside a container, the group is mounted at the root)
            folders = ["/sys/fs/cgroup/memory" + path, "/sys/fs/cgroup/memory"]
            limit_name, usage_name = "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        for folder in folders:
            limit, usage = _read_int(f"{folder}/{limit_name}"), _read_int(f"{folder}/{usage_name}")
            if limit is not None and limit < 2**60:  # v1's "no limit" is a huge number
                return max(0, limit - (usage or 0))
    return None


def _address_space_room() -> int | None:
    """Bytes of address space left under RLIMIT_AS (`ulimit -v`); None without a limit."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/status") as f:
            used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        used = 0
    return max(0, limit - used)


def available_memory(device: torch.device) -> tuple[int, str] | None:
    """(bytes a new allocation can take now, what they were read from): the GPU's free memory; on the CPU
    the lowest of the machine's available memory (MemAvailable), the room left under the process's cgroup
    memory limit and under its RLIMIT_AS; None when unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], f"free on {device}"
    rooms = []
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        rooms.append((int(fields["MemAvailable"].split()[0]) * 1024, "available on this machine (MemAvailable)"))
    except (OSError, KeyError, ValueError):
        pass
    for room, source in ((_cgroup_room(), "left under this process's cgroup memory limit (a SLURM --mem, a "
                                          "container's limit)"),
                         (_address_space_room(), "of address space left under its RLIMIT_AS (ulimit -v)")):
        if room is not None:
            rooms.append((room, source))
    return min(rooms) if rooms else None


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is a failed allocation: torch's on the GPU or the CPU (DefaultCPUAllocator), or Python's."""
    return isinstance(error, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error))
