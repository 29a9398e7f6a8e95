#!/usr/bin/env bash
# English CC-News (the paper's corpus) -> JSONL -> Moses + 60k fastBPE codes -> binary shards.
# Usage: scripts/get-ccnews.sh [DATA_DIR]     (default data/ccnews; output in DATA_DIR/processed)
#   1. download: news-please extracts the articles of the Common Crawl CC-NEWS WARC files into
#      DATA_DIR/raw/*.jsonl (needs internet, `pip install news-please`, and disk: ~1 TB of WARC
#      passes through, deleted after extraction). START/END=YYYY-MM-DD restrict the WARC dates.
#   2. export: English articles with text, each URL once -> DATA_DIR/jsonl/ccnews.NNNN.jsonl.gz
#   3. preprocess: 5,000 valid and 5,000 test articles held out (seeded, by article), 60k codes.
# Environment: SKIP_DOWNLOAD=1 reuses DATA_DIR/raw; CODES (60000), VALID_DOCS / TEST_DOCS (5000),
# SEED (0), WORKERS (all cores), PYTHON; extra arguments after DATA_DIR go to the preprocessing
# (e.g. --slurm-partition learnfair to spread the chunks over SLURM array jobs).
set -euo pipefail
source "$(dirname "$0")/common.sh"  # repo, PYTHONPATH, py; relative paths stay the caller's
data=${1:-data/ccnews}
[ $# -gt 0 ] && shift
if [ "${SKIP_DOWNLOAD:-0}" != 1 ]; then
  "$py" "$repo/scripts/ccnews.py" download "$data/raw" ${START:+--start "$START"} ${END:+--end "$END"}
fi
"$py" "$repo/scripts/ccnews.py" export "$data/raw" "$data/jsonl"
"$repo/scripts/preprocess.sh" "$data/processed" "$data"/jsonl/ccnews.*.jsonl.gz -- \
  --bpe-codes "${CODES:-60000}" --valid-docs "${VALID_DOCS:-5000}" --test-docs "${TEST_DOCS:-5000}" \
  --seed "${SEED:-0}" "$@"
