#!/usr/bin/env bash
# Every benchmark, sized for the machine it runs on, each writing <benchmark>_<cpu|cuda>.json to OUT_DIR.
#
#   bash benchmarks/run_all.sh OUT_DIR        # `make bench` passes BENCH_OUT (default dumped/bench)
#
# On CPU the model-level benchmarks run the reduced sizes the committed *_cpu.json were made with
# (their "settings" and "note" say what was reduced); with CUDA, the paper's sizes (their defaults).
# OUT_DIR=benchmarks/results replaces the committed figures: only do that on purpose.
set -euo pipefail
cd "$(dirname "$0")/.."
# CPU tensors of 2 MB and more on huge pages, as train.py sets it (docs/benchmarks.md, "Huge pages")
export THP_MEM_ALLOC_ENABLE=${THP_MEM_ALLOC_ENABLE:-1}
PY=${PYTHON:-.venv/bin/python}
out=${1:?usage: run_all.sh OUT_DIR}
mkdir -p "$out"
dev=$($PY -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")
echo "benchmarks on $dev, results in $out/*_$dev.json"

if [ "$dev" = cpu ]; then
  INFER=(--batch 2 --seq 64 --rounds 3 --keys 128 256 512 1024 --layers 12 24 --dims 1024 --memories 0 1
         --note "CPU, reduced: batch 2 x seq 64 (default 32 x 256); table4 without 384 and 768; figure4 12 and 24 layers, dim 1024 only, 0 and 1 memories")
  TRAIN=(--batch 4 --seq 64 --precisions fp32 bf16 --override model.dim=256 model.n_heads=4
         --note "CPU, shrunk: dim 256, 4 attention heads (default 1024, 16), batch 4 x seq 64 (default 32 x 256)")
  READ=(--tokens 2048 --dim 512 --repeats 5)
  SHARD=(--verify)
else
  INFER=() TRAIN=(--precisions bf16 fp16 --compile) READ=() SHARD=(--worlds 1 --n-keys 512 1024 --batch 32 --seq 256)
fi

$PY benchmarks/preprocess_throughput.py --output "$out/preprocess_throughput_$dev.json"
$PY benchmarks/memory_layer_speed.py --out "$out/memory_layer_speed_$dev.json"
$PY benchmarks/profile_memory_layer.py --out "$out/profile_memory_layer_512.txt"
$PY benchmarks/sparse_training_step.py --out "$out/sparse_training_step_$dev.json"
$PY benchmarks/inference_speed.py "${INFER[@]}" --out "$out/inference_speed_$dev.json"
$PY benchmarks/training_speed.py "${TRAIN[@]}" --out "$out/training_speed_$dev.json"
$PY benchmarks/value_read_bandwidth.py "${READ[@]}" --out "$out/value_read_bandwidth_$dev.json"
OMP_NUM_THREADS=1 $PY benchmarks/generation_speed.py --out "$out/generation_speed_$dev.json"
$PY benchmarks/sharded_values.py --device "$dev" "${SHARD[@]}" --out "$out/sharded_values_$dev.json"
$PY benchmarks/checkpoint_cost.py --out "$out/checkpoint_cost_$dev.json"
$PY benchmarks/memory_estimate.py --out "$out/memory_estimate_cpu.json"  # the CPU's resident memory, on any machine
$PY benchmarks/ultramem_topm.py --out "$out/ultramem_topm_$dev.json"
OMP_NUM_THREADS=1 $PY benchmarks/variants_speed.py --out "$out/variants_speed_$dev.json"
