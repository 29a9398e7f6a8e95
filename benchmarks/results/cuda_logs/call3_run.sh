#!/usr/bin/env bash
# The last GPU call of this session: the fixes' checks, and the kernel change side by side with HEAD's (.base).
export PYTHONUNBUFFERED=1
g=/tmp/gpu; mkdir -p $g
step() {  # name limit command...: runs under a time limit, logs to $g/name.log, packs $g into $OUT
  local name=$1 limit=$2; shift 2; local t=$SECONDS rc=0
  timeout -k 5 $limit "$@" > $g/$name.log 2>&1 || rc=$?
  echo "$name: rc=$rc in $((SECONDS - t)) s" | tee -a $g/all.log
  tar -czf $OUT/gpu_results3.tgz -C $g --exclude=./fsdp .
}
step setup 40 bash benchmarks/gpu_suite.sh setup $g
step tests 70 python3 -m pytest -q -n 8 tests/test_fused_value_read.py tests/test_cuda.py tests/test_hardware.py
step read_after 25 python3 benchmarks/value_read_bandwidth.py --dtypes fp32 bf16 --out $g/value_read_bandwidth_cuda.json
step read_before 25 bash -c "cd .base && python3 benchmarks/value_read_bandwidth.py --dtypes fp32 bf16 --out $g/value_read_bandwidth_cuda_before.json"
step profile_after 20 python3 benchmarks/profile_memory_layer.py --device cuda --out $g/profile_memory_layer_512_cuda.txt
step profile_before 20 python3 .base/benchmarks/profile_memory_layer.py --device cuda --out $g/profile_memory_layer_512_cuda_before.txt
step shard 40 python3 benchmarks/sharded_values.py --device cuda --worlds 1 --n-keys 512 1024 --batch 32 --seq 256 --budget-gib 60 --out $g/sharded_values_cuda.json
step infer 60 python3 benchmarks/inference_speed.py --dtype bf16 --keys 128 512 1024 --flat-max-keys 1024 --layers 12 24 --dims 1024 --memories 0 1 --out $g/inference_speed_cuda.json
step train 70 python3 benchmarks/training_speed.py --precisions bf16 --compile --out $g/training_speed_cuda.json
