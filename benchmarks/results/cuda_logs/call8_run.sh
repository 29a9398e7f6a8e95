#!/usr/bin/env bash
# GPU call 8 (issue 59, right after call 7, the same session): the GPU tests again with the test-side fixes call 7
# showed (Triton kernels given CPU tensors on a GPU machine, torch's EmbeddingBag without a bf16 weights' gradient
# on CUDA), inference with the new settings on (call 7 measured them off, then ran out of time), the key search
# (fewer combinations than call 7's, which ran out of time) and the read's bandwidth (both backwards).
export PYTHONUNBUFFERED=1
g=/tmp/gpu60; mkdir -p $g; end=$((SECONDS + ${DEADLINE:-200}))
step() {  # name limit command...: under a time limit, none started past the deadline; $g packed into $OUT
  local name=$1 limit=$2; shift 2; local t=$SECONDS rc=0 left=$((end - SECONDS))
  if [ $left -lt 10 ]; then echo "$name: not started" | tee -a $g/all.log; return; fi
  timeout -k 5 $((limit < left ? limit : left)) "$@" > $g/$name.log 2>&1 || rc=$?
  echo "$name: rc=$rc in $((SECONDS - t)) s" | tee -a $g/all.log
  tar -czf $OUT/gpu59b.tgz -C $g .
}
step setup 40 bash benchmarks/gpu_suite.sh setup $g
step tests59 80 bash benchmarks/gpu_suite.sh tests59 $g
step infer_on 50 python3 benchmarks/inference_speed.py --dtype bf16 --parts table4 figure4 --keys 128 512 1024 \
  --flat-max-keys 128 --layers 12 24 --dims 1024 --memories 0 1 \
  --override $(python3 benchmarks/step_breakdown.py --show on) --out $g/inference_speed_cuda_on.json
step keysearch 40 python3 benchmarks/key_search_speed.py --device cuda --n-keys 128 512 1024 --repeats 10 \
  --score-precision float32 tf32 --out $g/key_search_speed_cuda.json
step read 25 python3 benchmarks/value_read_bandwidth.py --dtypes fp32 bf16 --repeats 10 --out $g/value_read_bandwidth_cuda.json
cat $g/all.log
