#!/usr/bin/env bash
# The memory variants' study committed in results/variants (issue 47), with the study harness: each cell's
# learning rates chosen on seed 0's valid perplexity (grid ×2, ×4, ×8 of the configs', grown past an end and
# refined once), seeds 0, 1 and 2 at the chosen factor, test perplexity read only there, the papers'
# orderings compared seed by seed under Holm. From the repository root after `make data`; a finished run is
# skipped and a cut one resumes, so re-running finishes what is missing. The compute plan is README.md's.
# The speeds the report shows come from the interleaved benchmark, run alone on the machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
$PY -m xlm_pkm.experiments.study run results/variants/study.yaml --streams 2
THP_MEM_ALLOC_ENABLE=1 OMP_NUM_THREADS=1 $PY benchmarks/variants_speed.py --scale tiny --threads 1 --rounds 5 \
  --out benchmarks/results/variants_speed_cpu.json
$PY -m xlm_pkm.experiments.study report results/variants/study.yaml --bench benchmarks/results/variants_speed_cpu.json
# Where Engram's gain lies (ngram_gain.json): the chosen factors' checkpoints (report.md's choices), seeds 0-2.
runs() { echo "--run $1=$(printf "dumped/study/variants/$1/lr$2-seed%s," 0 1 2 | sed 's/,$//')"; }
$PY -m xlm_pkm.experiments.ngram_gain --json results/variants/ngram_gain.json --n 3 --frequent 100 $(runs pkm 8) \
  $(runs engram_share25 8) $(runs engram_share50 8) $(runs engram 8) $(runs dense_params 5.65685)
