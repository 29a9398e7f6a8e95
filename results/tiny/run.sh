#!/usr/bin/env bash
# The tiny-scale reproduction committed in results/tiny: 19 runs (one or more cells per direction of
# the paper), each with seeds 0, 1 and 2, in two streams of one CPU thread each, then the report.
# Run from the repository root after `make data`. Each stream makes every run of seed 0, then of
# seed 1, then of seed 2, so a stream cut short still covers every cell. A run already done is
# skipped and an interrupted one resumes, so re-running this script finishes what is missing.
# OMP_NUM_THREADS=1 also makes evaluate.py's speed single-threaded (the report takes speeds from
# the benchmark JSON, not from these runs).
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
R="scripts/reproduce.sh"
COMMON=(--scale tiny --dump dumped/reproduce --set train.num_threads=1)
SEEDS=${SEEDS:-"0 1 2"}
mkdir -p dumped/reproduce
{
  for s in $SEEDS; do
    $R table3 "${COMMON[@]}" --seeds "$s" --only ablation_no_memory table3_position5 table3_position1 \
      table3_position4 table3_position3
    $R table2 "${COMMON[@]}" --seeds "$s" --only table2_keys128_none table2_keys128_batchnorm \
      table2_keys512_none table2_keys1024_none table2_keys1024_batchnorm
  done
} > dumped/reproduce/stream_ablation.log 2>&1 &
{
  for s in $SEEDS; do
    $R table1 "${COMMON[@]}" --seeds "$s" --only l12_d1024_m0 l12_d1024_m1 l24_d1024_m0
    $R table4 "${COMMON[@]}" --seeds "$s" --only table4_keys128_flat table4_keys384_flat table4_keys384_product
    $R figure6 "${COMMON[@]}" --seeds "$s" --only figure6_heads1_knn8 figure6_heads1_knn32 figure6_heads4_knn8
  done
} > dumped/reproduce/stream_table1.log 2>&1 &
wait
.venv/bin/python -m xlm_pkm.experiments.report dumped/reproduce/*/tiny-seed* --out results/tiny \
  --bench benchmarks/results/inference_speed_cpu.json
