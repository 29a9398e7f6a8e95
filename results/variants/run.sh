#!/usr/bin/env bash
# The memory variants' study committed in results/variants: every config of configs/variants/paper at
# the tiny scale of results/tiny, seeds 0, 1 and 2, in two streams of one CPU thread each (the cells
# dealt alternately to the streams), then the interleaved speed benchmark (alone on the machine), then
# the report, then where Engram's gain lies (per-token loss on frequent 3-grams against the rest, every
# Engram cell and the dense one beside the PKM reference: results/variants/ngram_gain.json). Run from the
# repository root after `make data`. A run already done is skipped and an interrupted one resumes, so re-running this script finishes what is missing; a config added to
# configs/variants/paper joins the study.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
PY=.venv/bin/python
COMMON=(--scale tiny --dump dumped/variants --set train.num_threads=1)
SEEDS=${SEEDS:-"0 1 2"}
read -r -a CELLS <<< "$($PY -c "from xlm_pkm.experiments.reproduce import TABLES; print(*(c.name for c in TABLES['variants']))")"
A=() B=()
for i in "${!CELLS[@]}"; do if (( i % 2 )); then B+=("${CELLS[$i]}"); else A+=("${CELLS[$i]}"); fi; done
mkdir -p dumped/variants
for stream in A B; do
  declare -n mine=$stream
  { for s in $SEEDS; do
      $PY -m xlm_pkm.experiments.reproduce variants "${COMMON[@]}" --seeds "$s" --only "${mine[@]}" || true
    done; } > "dumped/variants/stream_$stream.log" 2>&1 &
done
wait
$PY benchmarks/variants_speed.py --scale tiny --threads 1 --rounds 5 --out benchmarks/results/variants_speed_cpu.json
$PY -m xlm_pkm.experiments.variants_report dumped/variants --out results/variants \
  --bench benchmarks/results/variants_speed_cpu.json
runs() { local cell=$1 run=${2:-$1}; echo "--run $cell=$(printf 'dumped/variants/'"$run"'/tiny-seed%s,' $SEEDS | sed 's/,$//')"; }
$PY -m xlm_pkm.experiments.ngram_gain --json results/variants/ngram_gain.json --n 3 --frequent 100 $(runs pkm ablation_base) \
  $(runs engram_share25) $(runs engram_share50) $(runs engram_share75) $(runs engram) $(runs dense_params)
