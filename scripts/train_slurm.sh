#!/usr/bin/env bash
# Submit a training run to SLURM through submitit (one process per GPU; requeued on time-out or
# pre-emption, resuming from its checkpoint). Options before the config go to xlm_pkm.launch.slurm:
#   scripts/train_slurm.sh --nodes 4 --gpus-per-node 8 --partition learn --time 4320 \
#       --config configs/paper/l12_d1024_m1.yaml [key.sub=value ...]
# On a CPU partition: --gpus-per-node 0 --tasks-per-node 1 --cpus-per-task N train.device=cpu
# train.num_threads=N (the defaults, 8 GPUs and 10 CPUs per task, are refused where no node has them).
# scancel ends the job (with a checkpoint); the time limit's USR2 requeues it. To try it on this
# machine: scripts/local_slurm.sh start.
set -euo pipefail
source "$(dirname "$0")/common.sh"  # repo, PYTHONPATH, py; relative paths stay the caller's
exec "$py" -m xlm_pkm.launch.slurm "$@"
