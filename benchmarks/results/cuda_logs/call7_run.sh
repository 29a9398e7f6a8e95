#!/usr/bin/env bash
# GPU call 7 (issue 59, the session of 2026-11-27): issue 59's steps of benchmarks/gpu_suite.sh in one call, most
# important first (the step breakdown with every new setting off, on and alone), each under its own limit, none
# started past GPU_DEADLINE; OUT_DIR packed into $OUT/gpu59.tgz after each step, so a cut call keeps what ran.
export PYTHONUNBUFFERED=1 GPU_PACK=$OUT/gpu59.tgz GPU_DEADLINE=${GPU_DEADLINE:-470}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,driver_version --format=csv > /tmp/gpu59_smi.csv 2>&1
mkdir -p /tmp/gpu59 && cp /tmp/gpu59_smi.csv /tmp/gpu59/nvidia_smi.csv
GPU_STEPS=${GPU_STEPS:-"setup:40 breakdown:230 tests59:120 keysearch59:45 infer59:80 read59:30 breakdown_dense:90"} \
  bash benchmarks/gpu_suite.sh all /tmp/gpu59
cat /tmp/gpu59/all.log
