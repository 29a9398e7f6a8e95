"""Device peaks are looked up by the name CUDA reports, never assumed."""

import pytest
import torch

from xlm_pkm.runtime import hardware


@pytest.mark.parametrize("name, bf16, bandwidth", [
    ("NVIDIA H100 80GB HBM3", 989e12, 3.35e12),
    ("NVIDIA H100 PCIe", 756e12, 2.0e12),
    ("NVIDIA H200", 989e12, 4.8e12),
    ("NVIDIA A100-SXM4-80GB", 312e12, 2.039e12),
    ("NVIDIA A100-SXM4-40GB", 312e12, 1.555e12),
    ("Some Future GPU", None, None),
])
def test_peaks_by_device_name(monkeypatch, name, bf16, bandwidth):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    cuda = torch.device("cuda", 0)
    assert hardware.peak_flops(cuda, "bf16") == bf16
    assert hardware.peak_memory_bandwidth(cuda) == bandwidth


def test_no_peaks_on_cpu():
    cpu = torch.device("cpu")
    assert hardware.peak_flops(cpu, "fp32") is None and hardware.peak_memory_bandwidth(cpu) is None
