#!/usr/bin/env bash
# Issue 6's GPU checks and benchmarks, in steps that each fit a 10-minute command on one H100/H200.
#
#   bash benchmarks/gpu_suite.sh prepare          # here, after `make install data`: wheels to carry
#   bash benchmarks/gpu_suite.sh STEP OUT_DIR     # on the GPU machine, from the repository root
#
# STEP: setup (pip-installs the carried wheels and builds fastBPE's binding there; once per machine),
# tests (the fused read against its references, GPU training in fp32/bf16/fp16, eager and compiled),
# read (value_read_bandwidth.py), infer (inference_speed.py: Table 4 with flat keys up to 1M slots,
# Figure 4 with the sample's vocabulary and with 60k tokens as the paper's), train
# (training_speed.py: 12 layers d=1024 with and without a memory, bf16 and fp16, compiled), shard
# (sharded_values.py on one GPU: the sharded setting against replicated values, the paper's batch), fsdp
# (train.py under torchrun on NCCL, the default config in bf16 with train.parallel=ddp then =fsdp: FSDP2's
# mixed precision on CUDA; one GPU, so one rank: it checks the code path, not the sharding).
# Results go to OUT_DIR (JSON, plus the tests' summary). The GPU machine has a Python with torch and
# Triton but no sacremoses/fastBPE, and no network: carry .device, tools/fastbpe, data/processed/sample.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
step=${1:?usage: gpu_suite.sh prepare | setup | tests | read | infer | train | shard | fsdp OUT_DIR}
out=${2:-}
[ "$step" = prepare ] || { [ -n "$out" ] || { echo "gpu_suite.sh $step: give an output directory" >&2; exit 2; }; mkdir -p "$out"; }

case $step in
  prepare)
    rm -rf .device && mkdir -p .device/wheels
    .venv/bin/python -m pip download -q --no-deps -d .device/wheels sacremoses submitit
    ls .device/wheels tools/fastbpe/fast tools/fastbpe/fastBPE-0.1.0.tar.gz data/processed/sample/vocab ;;
  setup)
    $PY -m pip install -q --no-deps --no-index .device/wheels/*.whl
    $PY -m pip install -q --no-deps --no-index --no-build-isolation tools/fastbpe/fastBPE-0.1.0.tar.gz
    $PY -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" \
      | tee "$out/versions.txt" ;;
  tests)
    $PY -m pytest -q tests/test_fused_value_read.py tests/test_cuda.py tests/test_hardware.py 2>&1 \
      | tee "$out/gpu_tests.txt" | tail -25 ;;
  read)
    $PY benchmarks/value_read_bandwidth.py --out "$out/value_read_bandwidth_cuda.json" ;;
  infer)
    $PY benchmarks/inference_speed.py --dtype bf16 --flat-max-keys 1024 --out "$out/inference_speed_cuda.json"
    $PY benchmarks/inference_speed.py --dtype bf16 --parts figure4 --vocab 60000 \
      --note "the paper's 60k-code vocabulary" --out "$out/inference_speed_cuda_vocab60k.json" ;;
  train)
    $PY benchmarks/training_speed.py --precisions bf16 fp16 --compile --out "$out/training_speed_cuda.json" ;;
  shard)
    $PY benchmarks/sharded_values.py --device cuda --worlds 1 --n-keys 512 1024 --batch 32 --seq 256 \
      --budget-gib 60 --out "$out/sharded_values_cuda.json" ;;
  fsdp)
    for mode in ddp fsdp; do
      $PY -m torch.distributed.run --nproc_per_node=1 train.py --no-test train.parallel=$mode train.precision=bf16 \
        train.max_steps=200 train.eval_every=100 train.dump_path="$out/fsdp" train.exp_id=$mode 2>&1 | tail -3
      cp "$out/fsdp/default/$mode/metrics.jsonl" "$out/fsdp_${mode}_metrics.jsonl"
    done ;;
  *)
    echo "gpu_suite.sh: unknown step $step" >&2; exit 2 ;;
esac
