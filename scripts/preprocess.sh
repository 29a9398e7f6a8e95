#!/usr/bin/env bash
# Moses -> fastBPE -> binary shards: a thin wrapper over `python -m xlm_pkm.data.preprocess`.
# Usage: scripts/preprocess.sh OUTPUT_DIR [INPUT ...] [-- extra options]
#   e.g. scripts/preprocess.sh data/ccnews/processed data/ccnews/jsonl/*.jsonl.gz -- --bpe-codes 60000
#   no INPUT for a Hugging Face dataset: scripts/preprocess.sh data/ccnews/processed -- --hf-dataset vblagoje/cc_news
# Environment: PYTHON (default .venv/bin/python, else python3), WORKERS (default: all cores).
set -euo pipefail
source "$(dirname "$0")/common.sh"  # repo, PYTHONPATH, py; relative paths stay the caller's
if [ $# -lt 2 ]; then
  sed -n '2,6p' "$0" >&2
  exit 2
fi
out=$1; shift
inputs=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do inputs+=("$1"); shift; done
[ $# -gt 0 ] && shift
exec "$py" -m xlm_pkm.data.preprocess ${inputs[@]+--input "${inputs[@]}"} --output "$out" \
  --workers "${WORKERS:-$(nproc)}" "$@"
