"""Peak dense matrix-multiply throughput of the device, for model FLOPs utilisation (MFU)."""

from __future__ import annotations

import torch

# Dense (no sparsity) tensor-core peak in FLOP/s by precision, from the vendors' data sheets.
# Matched against torch.cuda.get_device_name() by substring, most specific first.
PEAK_FLOPS = [
    ("H200", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    ("H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12}),
    ("H100", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}),
    ("A10G", {"bf16": 70e12, "fp16": 70e12, "fp32": 31e12}),
    ("L4", {"bf16": 121e12, "fp16": 121e12, "fp32": 30e12}),
    ("V100", {"bf16": 0.0, "fp16": 125e12, "fp32": 15.7e12}),
]


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The device's peak FLOP/s for `precision`, or None when unknown (CPU, unlisted GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, table in PEAK_FLOPS:
        if key in name:
            return table.get(precision) or None
    return None
