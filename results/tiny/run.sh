#!/usr/bin/env bash
# The tiny-scale reproduction committed in results/tiny: the cells run, in two streams of one CPU
# thread each (ablation model; Table 1 models), then the report. Run from the repository root after
# `make data`. Budget: about 30 core-minutes on a 2-core machine (OMP_NUM_THREADS=1 also makes
# evaluate.py's speed single-threaded).
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
R="scripts/reproduce.sh"
COMMON=(--scale tiny --dump dumped/reproduce --set train.num_threads=1)
{
  $R table3 "${COMMON[@]}" --only ablation_no_memory table3_position5 table3_position1 table3_position3
  $R table2 "${COMMON[@]}" --only table2_keys128_none table2_keys128_batchnorm table2_keys512_none \
    table2_keys1024_none table2_keys1024_batchnorm
  $R table4 "${COMMON[@]}" --only table4_keys128_flat table4_keys384_flat
  $R figure6 "${COMMON[@]}" --only figure6_heads1_knn8 figure6_heads1_knn32 figure6_heads4_knn8
} > dumped/reproduce/stream_ablation.log 2>&1 &
{
  $R table1 "${COMMON[@]}" --only l12_d1024_m0 l12_d1024_m1 l24_d1024_m0
} > dumped/reproduce/stream_table1.log 2>&1 &
wait
