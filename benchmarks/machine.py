"""What a benchmark ran on, for its JSON: processor or GPU, threads, load, library versions."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch


def machine_info(device: str = "cpu") -> dict:
    cpu = platform.processor() or platform.machine()
    if Path("/proc/cpuinfo").exists():
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                    if line.startswith("model name")), cpu)
    return {
        "device": device,
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "load_average_1min": round(os.getloadavg()[0], 2),  # other jobs may share the cores
        "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
