"""What a benchmark ran on, for its JSON (processor or GPU, threads, load, library versions), and where
the JSON goes: dumped/bench/<benchmark>_<cpu|cuda>.json unless --out says otherwise, so a run never
overwrites the committed figures in benchmarks/results/ unless asked to."""

from __future__ import annotations

import json
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
        "thp_mem_alloc_enable": os.environ.get("THP_MEM_ALLOC_ENABLE"),  # CPU tensors on huge pages (run_all.sh sets 1)
        "python": platform.python_version(),
    }


REPO = Path(__file__).resolve().parents[1]


def write_result(result: dict, args, name: str) -> None:
    """Writes `result` to args.out, by default dumped/bench/<name>_<device type>.json."""
    device = torch.device(getattr(args, "device", "cpu")).type
    out = Path(args.out or REPO / "dumped" / "bench" / f"{name}_{device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
