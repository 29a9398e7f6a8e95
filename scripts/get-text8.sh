#!/usr/bin/env bash
# text8 (1e8 characters of cleaned English Wikipedia: a-z and space) -> byte-level shards, split as the
# authors' data (kimiyoung/transformer-xl prep_text8.py): train 90M / valid 5M / test 5M characters,
# each part stripped of leading/trailing spaces.
# Usage: scripts/get-text8.sh [DATA_DIR] [ARGS...]   (default data/text8; shards in DATA_DIR/processed)
# Environment: TEXT8_URL (default http://mattmahoney.net/dc/text8.zip), PYTHON. ARGS go to
# `python -m xlm_pkm.data.bytes` (e.g. --held-out-bytes N for a small stand-in file).
exec "$(dirname "$0")/get-byte-corpus.sh" text8 "${TEXT8_URL:-http://mattmahoney.net/dc/text8.zip}" "$@"
