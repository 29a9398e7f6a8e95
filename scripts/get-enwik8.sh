#!/usr/bin/env bash
# enwik8 (first 1e8 bytes of an English Wikipedia XML dump) -> byte-level shards, split as the
# authors' data (salesforce/awd-lstm-lm prep_enwik8.py): train 90M / valid 5M / test 5M bytes.
# Usage: scripts/get-enwik8.sh [DATA_DIR] [ARGS...]   (default data/enwik8; shards in DATA_DIR/processed)
# Environment: ENWIK8_URL (default http://mattmahoney.net/dc/enwik8.zip), PYTHON. ARGS go to
# `python -m xlm_pkm.data.bytes` (e.g. --held-out-bytes N for a small stand-in file).
exec "$(dirname "$0")/get-byte-corpus.sh" enwik8 "${ENWIK8_URL:-http://mattmahoney.net/dc/enwik8.zip}" "$@"
