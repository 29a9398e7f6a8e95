#!/usr/bin/env bash
# The tiny-scale reproduction committed in results/tiny: the cells run, in two streams of one CPU
# thread each, then the report. Run from the repository root after `make data`. Budget: about 45
# core-minutes on a shared 2-core machine, hence one or two cells per direction of the issue (the
# rest of each table is left out). OMP_NUM_THREADS=1 also makes evaluate.py's speed single-threaded.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
R="scripts/reproduce.sh"
COMMON=(--scale tiny --dump dumped/reproduce --set train.num_threads=1)
mkdir -p dumped/reproduce
{
  $R table3 "${COMMON[@]}" --only ablation_no_memory table3_position5 table3_position1
  $R table4 "${COMMON[@]}" --only table4_keys128_flat table4_keys128_product
  $R table2 "${COMMON[@]}" --only table2_keys128_none table2_keys1024_none table2_keys1024_batchnorm
} > dumped/reproduce/stream_ablation.log 2>&1 &
{
  $R table1 "${COMMON[@]}" --only l12_d1024_m0 l12_d1024_m1 l24_d1024_m0
  $R figure6 "${COMMON[@]}" --only figure6_heads1_knn8 figure6_heads1_knn32 figure6_heads4_knn8
} > dumped/reproduce/stream_table1.log 2>&1 &
wait
.venv/bin/python -m xlm_pkm.report dumped/reproduce/*/tiny --out results/tiny \
  --bench benchmarks/results/inference_speed_cpu.json
