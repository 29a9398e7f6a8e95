#!/usr/bin/env bash
# A zipped character-level corpus (enwik8, text8: one file NAME inside NAME.zip) -> byte-level shards,
# split as the authors' data (`python -m xlm_pkm.data.bytes --split NAME`). Used by get-enwik8.sh and
# get-text8.sh. Usage: scripts/get-byte-corpus.sh NAME URL [DATA_DIR] [ARGS...]
# (default data/NAME; shards in DATA_DIR/processed; ARGS go to xlm_pkm.data.bytes). Environment: PYTHON.
set -euo pipefail
source "$(dirname "$0")/common.sh"  # repo, PYTHONPATH, py; relative paths stay the caller's
name=$1 url=$2
shift 2
data=${1:-data/$name}
[ $# -gt 0 ] && shift
mkdir -p "$data"
if [ ! -f "$data/$name" ]; then
  fetch_zip "$url" "$data/$name.zip" "$data" "$name"
fi
exec "$py" -m xlm_pkm.data.bytes --input "$data/$name" --output "$data/processed" --split "$name" "$@"
