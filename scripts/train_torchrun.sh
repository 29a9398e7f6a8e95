#!/usr/bin/env bash
# Train on the GPUs of one node (or several, with NNODES/NODE_RANK/MASTER_ADDR set) with torchrun.
#   scripts/train_torchrun.sh NGPUS --config configs/paper/l12_d1024_m1.yaml [key.sub=value ...]
# Re-running the same command with train.exp_id=ID resumes that run.
# Ctrl-C (or SIGTERM, SIGHUP, SIGUSR1/2 to this script) reaches the workers only: they checkpoint at the next
# step and stop, and the script exits 75 with their resume command as its last line (torchrun itself, in its
# own session, never sees the signal: it would print a traceback and exit 1). A second Ctrl-C stops the
# workers at once (130). Otherwise the script exits with torchrun's status.
set -uo pipefail
source "$(dirname "$0")/common.sh"  # repo, PYTHONPATH, py; relative paths stay the caller's
ngpus=${1:?usage: $0 NGPUS [train.py arguments...]}
shift
report=$(mktemp "${TMPDIR:-/tmp}/train_torchrun.XXXXXX")
trap 'rm -f "$report"' EXIT
# read by the workers (xlm_pkm/launch/cli.py, resume.py): rank 0 writes its resume line to the report and a
# stopped worker exits 0, so that torchrun ends quietly; the resume command names this script
export XLM_PKM_STOP_REPORT=$report XLM_PKM_LAUNCHER="$0 $ngpus"
setsid "$py" -m torch.distributed.run \
  --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" --nproc_per_node "$ngpus" \
  --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29500}" \
  "$repo/train.py" "$@" &
launcher=$!
interrupts=0
forward() {  # SIGNAL: to torchrun's workers (its children), not to torchrun
  [ "$1" = INT ] && interrupts=$((interrupts + 1))
  pkill "-$1" -P "$launcher" 2>/dev/null || true
}
for sig in INT TERM HUP USR1 USR2; do trap "forward $sig" "$sig"; done
while kill -0 "$launcher" 2>/dev/null; do  # a trap runs between two naps; bash reaps torchrun when it ends
  sleep 1 & wait $!
done
wait "$launcher"
status=$?
if [ -s "$report" ]; then
  cat "$report" >&2
  exit 75
fi
[ "$interrupts" -gt 1 ] && exit 130
exit "$status"
