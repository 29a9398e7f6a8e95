#!/usr/bin/env bash
# Train on the GPUs of one node (or several, with NNODES/NODE_RANK/MASTER_ADDR set) with torchrun.
#   scripts/train_torchrun.sh NGPUS --config configs/paper/l12_d1024_m1.yaml [key.sub=value ...]
# Re-running the same command with train.exp_id=ID resumes that run.
set -euo pipefail
source "$(dirname "$0")/common.sh"  # repo, PYTHONPATH, py; relative paths stay the caller's
ngpus=${1:?usage: $0 NGPUS [train.py arguments...]}
shift
exec "$py" -m torch.distributed.run \
  --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" --nproc_per_node "$ngpus" \
  --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29500}" \
  "$repo/train.py" "$@"
