#!/usr/bin/env bash
# enwik8 (first 1e8 bytes of an English Wikipedia XML dump) -> byte-level shards, split as the
# authors' data (salesforce/awd-lstm-lm prep_enwik8.py): train 90M / valid 5M / test 5M bytes.
# Usage: scripts/get-enwik8.sh [DATA_DIR] [ARGS...]   (default data/enwik8; shards in DATA_DIR/processed)
# Environment: ENWIK8_URL (default http://mattmahoney.net/dc/enwik8.zip), PYTHON. ARGS go to
# `python -m xlm_pkm.data.bytes` (e.g. --held-out-bytes N for a small stand-in file).
set -euo pipefail
cd "$(dirname "$0")/.."
data=${1:-data/enwik8}
[ $# -gt 0 ] && shift
py=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
mkdir -p "$data"
if [ ! -f "$data/enwik8" ]; then
  curl -fL --retry 3 -o "$data/enwik8.zip.tmp" "${ENWIK8_URL:-http://mattmahoney.net/dc/enwik8.zip}"
  mv "$data/enwik8.zip.tmp" "$data/enwik8.zip"
  unzip -o -q "$data/enwik8.zip" enwik8 -d "$data"
fi
"$py" -m xlm_pkm.data.bytes --input "$data/enwik8" --output "$data/processed" --split enwik8 "$@"
