#!/usr/bin/env bash
# A zipped character-level corpus (enwik8, text8: one file NAME inside NAME.zip) -> byte-level shards,
# split as the authors' data (`python -m xlm_pkm.data.bytes --split NAME`). Used by get-enwik8.sh and
# get-text8.sh. Usage: scripts/get-byte-corpus.sh NAME URL [DATA_DIR] [ARGS...]
# (default data/NAME; shards in DATA_DIR/processed; ARGS go to xlm_pkm.data.bytes). Environment: PYTHON.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)  # relative paths stay relative to the caller's directory
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
name=$1 url=$2
shift 2
data=${1:-data/$name}
[ $# -gt 0 ] && shift
py=${PYTHON:-$([ -x "$repo/.venv/bin/python" ] && echo "$repo/.venv/bin/python" || echo python3)}
mkdir -p "$data"
if [ ! -f "$data/$name" ]; then
  curl -fL --retry 3 -o "$data/$name.zip.tmp" "$url"
  mv "$data/$name.zip.tmp" "$data/$name.zip"
  unzip -o -q "$data/$name.zip" "$name" -d "$data"
fi
exec "$py" -m xlm_pkm.data.bytes --input "$data/$name" --output "$data/processed" --split "$name" "$@"
