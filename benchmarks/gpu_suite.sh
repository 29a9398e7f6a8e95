#!/usr/bin/env bash
# Issue 6's GPU checks and benchmarks, in steps that each fit a 10-minute command on one H100/H200.
#
#   bash benchmarks/gpu_suite.sh prepare          # here, after `make install data`: wheels to carry
#   bash benchmarks/gpu_suite.sh STEP OUT_DIR     # on the GPU machine, from the repository root
#   bash benchmarks/gpu_suite.sh all OUT_DIR      # every step below in turn, within GPU_DEADLINE seconds
#
# STEP: setup (pip-installs the carried wheels and builds fastBPE's binding there; once per machine),
# tests (the fused read against its references, GPU training in fp32/bf16/fp16, eager and compiled),
# read (value_read_bandwidth.py), infer (inference_speed.py: Table 4 with flat keys up to 1M slots,
# Figure 4 with the sample's vocabulary and with 60k tokens as the paper's), train
# (training_speed.py: 12 layers d=1024 with and without a memory, bf16 and fp16, compiled), shard
# (sharded_values.py on one GPU: the sharded setting against replicated values, the paper's batch), fsdp
# (train.py under torchrun on NCCL, the default config: bf16 with train.parallel=ddp then =fsdp, and fp16
# with ddp (loss scaling); on one GPU there is one rank, which trains the model itself, so the two bf16
# runs are one computation: FSDP2 on CUDA needs two GPUs), profile (profile_memory_layer.py: the memory
# layer's kernels by device time, fp32 and under bf16 autocast), tiles (value_read_tiles.py: the fused
# read's kernels over tiles and warps; key_search_speed.py: the key search's top-k and backward),
# variants (variants_speed.py: every cell of results/variants at its scale, training tokens/s).
# Issue 59's steps, each with its settings off (as before the issue), at this checkout's defaults and on
# (step_breakdown.py --show off|default|on: the overrides): tests59 (the GPU tests of the fused optimizer, the
# one-pass read, the key search), breakdown (step_breakdown.py: the 12-layer d=1024 bf16 compiled step split into
# phases, host syncs and graph breaks, every setting alone and all together, in one process), defaults59 (the
# same, off, at the defaults and on only), breakdown_dense (the same with dense value gradients and AdamW),
# keysearch59 (key_search_speed.py at 128, 512 and 1,024 sub-keys, every pair/precision option), read59
# (value_read_bandwidth.py, both backwards), infer59 (inference_speed.py's Table 4 and Figure 4 at the defaults,
# off, on).
# all: the steps in the order the GPU issue needs them (or GPU_STEPS="step:seconds ..."), each under its
# own time limit and none started past GPU_DEADLINE seconds (default 480); a step whose log in OUT_DIR
# already ends in rc=0 is skipped, so the same command on a machine still warm picks up what is left;
# after each step OUT_DIR (its checkpoints left out) is packed into GPU_PACK when set (one file back).
# Results go to OUT_DIR (JSON, plus the tests' summary). The GPU machine has a Python with torch and
# Triton but no sacremoses/fastBPE, and no network: carry .device, tools/fastbpe, data/processed/sample.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
step=${1:?usage: gpu_suite.sh prepare | setup | tests | read | infer | train | shard | fsdp | profile | tiles | variants | tests59 | breakdown | defaults59 | breakdown_dense | keysearch59 | read59 | infer59 | all OUT_DIR}
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
    $PY -m pytest -q -n 8 tests/test_fused_value_read.py tests/test_cuda.py tests/test_hardware.py 2>&1 \
      | tee "$out/gpu_tests.txt" | tail -25 ;;
  read)
    $PY benchmarks/value_read_bandwidth.py --out "$out/value_read_bandwidth_cuda.json" ;;
  infer)
    $PY benchmarks/inference_speed.py --dtype bf16 --flat-max-keys 1024 --out "$out/inference_speed_cuda.json"
    $PY benchmarks/inference_speed.py --dtype bf16 --parts figure4 --vocab 60000 \
      --note "the paper's 60k-code vocabulary" --out "$out/inference_speed_cuda_vocab60k.json" ;;
  train)
    $PY benchmarks/training_speed.py --precisions bf16 --compile --out "$out/training_speed_cuda.json"
    $PY benchmarks/training_speed.py --precisions fp16 --compile --values sparse --out "$out/training_speed_cuda_fp16.json" ;;
  shard)
    $PY benchmarks/sharded_values.py --device cuda --worlds 1 --n-keys 512 1024 --batch 32 --seq 256 \
      --budget-gib 60 --out "$out/sharded_values_cuda.json" ;;
  fsdp)
    for run in ddp-bf16 fsdp-bf16 ddp-fp16; do
      $PY -m torch.distributed.run --nproc_per_node=1 train.py --no-test train.parallel=${run%-*} \
        train.precision=${run#*-} train.max_steps=200 train.eval_every=100 train.dump_path="$out/fsdp" \
        train.exp_id=$run 2>&1 | tail -3
      cp "$out/fsdp/default/$run/metrics.jsonl" "$out/fsdp_${run}_metrics.jsonl"
    done ;;
  profile)
    $PY benchmarks/profile_memory_layer.py --device cuda --out "$out/profile_memory_layer_512_cuda.txt"
    $PY benchmarks/profile_memory_layer.py --device cuda --bf16 --out "$out/profile_memory_layer_512_bf16_cuda.txt" ;;
  tiles)
    $PY benchmarks/value_read_tiles.py --out "$out/value_read_tiles_cuda.json"
    $PY benchmarks/key_search_speed.py --device cuda --out "$out/key_search_speed_cuda.json" ;;
  variants)
    $PY benchmarks/variants_speed.py --device cuda --rounds 3 --out "$out/variants_speed_cuda.json" ;;
  tests59)
    $PY -m pytest -q -n 8 -p no:cacheprovider tests/test_fused_optim.py tests/test_fused_value_read.py \
      tests/test_value_read_op.py tests/test_key_search.py tests/test_slot_groups.py tests/test_cuda.py \
      tests/test_hardware.py 2>&1 | tee "$out/gpu_tests59.txt" | tail -25 ;;
  breakdown)
    $PY benchmarks/step_breakdown.py --compile --min-time 0.5 --variants off default on fused_values fused_dense \
      one_pass custom_op winnable tf32 half_topk --probe off default on --out "$out/step_breakdown_cuda.json" ;;
  defaults59)
    $PY benchmarks/step_breakdown.py --compile --min-time 0.5 --variants off default on --probe off default on \
      --out "$out/step_breakdown_defaults_cuda.json" ;;
  breakdown_dense)
    $PY benchmarks/step_breakdown.py --compile --min-time 0.5 --values dense --variants off default on \
      --out "$out/step_breakdown_dense_cuda.json" ;;
  keysearch59)
    $PY benchmarks/key_search_speed.py --device cuda --n-keys 128 512 1024 --out "$out/key_search_speed_cuda.json"
    $PY benchmarks/key_search_speed.py --device cuda --n-keys 512 --compile --score-precision float32 tf32 \
      --out "$out/key_search_speed_compiled_cuda.json" ;;
  read59)
    $PY benchmarks/value_read_bandwidth.py --dtypes fp32 bf16 --out "$out/value_read_bandwidth_cuda.json" ;;
  infer59)
    # the defaults first (issue 59 chose them, no call measured them together), up to 1M flat slots; off (call 7
    # measured it at 1M) and on up to 16k
    for entry in default:1024 off:128 on:128; do
      variant=${entry%:*}
      # shellcheck disable=SC2046  # the variant's overrides are words
      $PY benchmarks/inference_speed.py --dtype bf16 --parts table4 figure4 --keys 128 512 1024 \
        --flat-max-keys "${entry#*:}" --layers 12 24 --dims 1024 --memories 0 1 \
        --override $($PY benchmarks/step_breakdown.py --show "$variant") --out "$out/inference_speed_cuda_$variant.json"
    done ;;
  all)
    deadline=$((SECONDS + ${GPU_DEADLINE:-480}))
    for entry in ${GPU_STEPS:-setup:90 tests:180 read:45 infer:120 train:240 fsdp:120 shard:60 profile:45 tiles:60 variants:90}; do
      name=${entry%%:*} limit=${entry#*:} left=$((deadline - SECONDS))
      if [ "$(tail -n 1 "$out/$name.log" 2>/dev/null)" = rc=0 ]; then continue; fi
      if [ $left -lt 20 ]; then echo "$name: not started, ${left} s left" | tee -a "$out/all.log"; continue; fi
      start=$SECONDS rc=0
      timeout -k 10 $((limit < left ? limit : left)) bash "$0" "$name" "$out" > "$out/$name.log" 2>&1 || rc=$?
      echo "rc=$rc" >> "$out/$name.log"
      echo "$name: rc=$rc in $((SECONDS - start)) s" | tee -a "$out/all.log"
      if [ -n "${GPU_PACK:-}" ]; then tar -czf "$GPU_PACK" -C "$out" --exclude=./fsdp .; fi
    done ;;
  *)
    echo "gpu_suite.sh: unknown step $step" >&2; exit 2 ;;
esac
