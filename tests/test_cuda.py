"""Training on a GPU: fp16 with loss scaling, bf16, torch.compile and the fused value read, each against
the float32 CPU run of the same tiny model; speed metrics in the log. Skipped without CUDA (run them
on a GPU machine: `.venv/bin/python -m pytest -q tests/test_cuda.py tests/test_fused_value_read.py`)."""

import math

import pytest
import torch
from conftest import read_events

from xlm_pkm.model.memory.value_read import resolve_backend
from xlm_pkm.runtime.hardware import peak_flops

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("precision, rel_tol", [("fp32", 1e-3), ("bf16", 0.03), ("fp16", 0.01)])
@pytest.mark.parametrize("values", ["adam", "lazy_adam"])
@pytest.mark.parametrize("compile", ["false", "true"])
def test_gpu_training_tracks_cpu_float32(reference_run, tiny_run, train_losses, tmp_path, precision, rel_tol, values,
                                         compile):
    assert resolve_backend("auto", torch.device("cuda")) == "triton"  # the fused read is what runs
    cpu_losses = train_losses(reference_run(f"optim.values_optimizer={values}").run_dir)
    trainer = tiny_run(tmp_path, "train.exp_id=gpu", "train.device=cuda", f"train.precision={precision}",
                       f"optim.values_optimizer={values}", f"train.compile={compile}")
    losses = train_losses(trainer.run_dir)
    assert sorted(losses) == sorted(cpu_losses)
    for step, loss in cpu_losses.items():
        assert math.isclose(losses[step], loss, rel_tol=rel_tol), (step, losses[step], loss)
    train = read_events(trainer.run_dir)
    assert all(e["tokens_per_sec"] > 0 and e["peak_memory_gib"] > 0 for e in train)
    if peak_flops(trainer.device, precision):  # a listed GPU: MFU on dense FLOPs is reported
        assert all(0 < e["mfu"] < 1 for e in train)
