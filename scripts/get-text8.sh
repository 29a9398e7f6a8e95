#!/usr/bin/env bash
# text8 (1e8 characters of cleaned English Wikipedia: a-z and space) -> byte-level shards, split as the
# authors' data (kimiyoung/transformer-xl prep_text8.py): train 90M / valid 5M / test 5M characters,
# each part stripped of leading/trailing spaces.
# Usage: scripts/get-text8.sh [DATA_DIR] [ARGS...]   (default data/text8; shards in DATA_DIR/processed)
# Environment: TEXT8_URL (default http://mattmahoney.net/dc/text8.zip), PYTHON. ARGS go to
# `python -m xlm_pkm.data.bytes` (e.g. --held-out-bytes N for a small stand-in file).
set -euo pipefail
cd "$(dirname "$0")/.."
data=${1:-data/text8}
[ $# -gt 0 ] && shift
py=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
mkdir -p "$data"
if [ ! -f "$data/text8" ]; then
  curl -fL --retry 3 -o "$data/text8.zip.tmp" "${TEXT8_URL:-http://mattmahoney.net/dc/text8.zip}"
  mv "$data/text8.zip.tmp" "$data/text8.zip"
  unzip -o -q "$data/text8.zip" text8 -d "$data"
fi
"$py" -m xlm_pkm.data.bytes --input "$data/text8" --output "$data/processed" --split text8 "$@"
