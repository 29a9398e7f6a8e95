#!/usr/bin/env bash
# Submit a training run to SLURM through submitit (one process per GPU; requeued on time-out or
# pre-emption, resuming from its checkpoint). Options before the config go to xlm_pkm.slurm:
#   scripts/train_slurm.sh --nodes 4 --gpus-per-node 8 --partition learn --time 4320 \
#       --config configs/paper/l12_d1024_m1.yaml [key.sub=value ...]
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)  # relative paths stay relative to the caller's directory
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-$repo/.venv/bin/python}" -m xlm_pkm.slurm "$@"
