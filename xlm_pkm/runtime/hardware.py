"""The device's peaks, for model FLOPs utilisation (MFU) and achieved memory bandwidth; its free memory.

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


def available_memory(device: torch.device) -> int | None:
    """Bytes a new allocation can take now: the GPU's free memory, or the machine's available memory
    (MemAvailable on Linux); None when unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
