#!/usr/bin/env bash
# Submit a training run to SLURM through submitit (one process per GPU; requeued on time-out or
# pre-emption, resuming from its checkpoint). Options before the config go to xlm_pkm.slurm:
#   scripts/train_slurm.sh --nodes 4 --gpus-per-node 8 --partition learn --time 4320 \
#       --config configs/paper/l12_d1024_m1.yaml [key.sub=value ...]
set -euo pipefail
source "$(dirname "$0")/common.sh"  # repo, PYTHONPATH, py; relative paths stay the caller's
exec "$py" -m xlm_pkm.slurm "$@"
