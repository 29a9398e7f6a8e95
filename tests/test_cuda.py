"""Training on a GPU: fp16 with loss scaling, bf16, torch.compile and the fused value read, each against
the float32 CPU run of the same tiny model; speed metrics in the log. Skipped without CUDA (run them
on a GPU machine: `.venv/bin/python -m pytest -q tests/test_cuda.py tests/test_fused_value_read.py`)."""

import json
import math

import pytest
import torch
from test_train import run, train_losses

from xlm_pkm.hardware import peak_flops
from xlm_pkm.model.value_read import resolve_backend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def cpu_losses(tiny_data_dir, tmp_path_factory):
    """{sparse: {step: loss}} of the float32 CPU reference runs."""
    dump = tmp_path_factory.mktemp("cpu")
    return {sparse: train_losses(run(tiny_data_dir, dump, f"train.exp_id=cpu_{sparse}",
                                     f"model.memory.sparse={sparse}").run_dir) for sparse in ("false", "true")}


@pytest.mark.parametrize("precision, rel_tol", [("fp32", 1e-3), ("bf16", 0.03), ("fp16", 0.01)])
@pytest.mark.parametrize("sparse", ["false", "true"])
@pytest.mark.parametrize("compile", ["false", "true"])
def test_gpu_training_tracks_cpu_float32(tiny_data_dir, tmp_path, cpu_losses, precision, rel_tol, sparse, compile):
    assert resolve_backend("auto", torch.device("cuda")) == "triton"  # the fused read is what runs
    trainer = run(tiny_data_dir, tmp_path, "train.exp_id=gpu", "train.device=cuda", f"train.precision={precision}",
                  f"model.memory.sparse={sparse}", f"train.compile={compile}")
    losses = train_losses(trainer.run_dir)
    assert sorted(losses) == sorted(cpu_losses[sparse])
    for step, loss in cpu_losses[sparse].items():
        assert math.isclose(losses[step], loss, rel_tol=rel_tol), (step, losses[step], loss)
    events = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [e for e in events if e["event"] == "train"]
    assert all(e["tokens_per_sec"] > 0 and e["peak_memory_gib"] > 0 for e in train)
    if peak_flops(trainer.device, precision):  # a listed GPU: MFU on dense FLOPs is reported
        assert all(0 < e["mfu"] < 1 for e in train)
