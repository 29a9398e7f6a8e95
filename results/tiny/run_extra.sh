#!/usr/bin/env bash
# Cells added once run.sh's streams had finished early (same scale and settings): the 512²-slot
# memory without BatchNorm (Table 2's middle size), memory positions 3 and 4 (Table 3), and flat
# vs product keys at 384² (Table 4's largest trained size; at 128² both used every slot).
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
R="scripts/reproduce.sh"
COMMON=(--scale tiny --dump dumped/reproduce --set train.num_threads=1)
{
  $R table2 "${COMMON[@]}" --only table2_keys512_none
  $R table3 "${COMMON[@]}" --only table3_position4 table3_position3
} > dumped/reproduce/stream_extra_a.log 2>&1 &
$R table4 "${COMMON[@]}" --only table4_keys384_flat table4_keys384_product > dumped/reproduce/stream_extra_b.log 2>&1 &
wait
