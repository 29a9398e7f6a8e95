#!/usr/bin/env bash
# English CC-News (the paper's corpus) -> Moses + 60k fastBPE codes -> binary shards.
# Usage: scripts/get-ccnews.sh [DATA_DIR]     (default data/ccnews; output in DATA_DIR/processed)
# SOURCE=news-please (the default), the paper's corpus rebuilt from Common Crawl:
#   1. download: news-please extracts the articles of the Common Crawl CC-NEWS WARC files into
#      DATA_DIR/raw/*.jsonl (needs internet, `pip install news-please`, and disk: ~1 TB of WARC
#      passes through, deleted after extraction). START/END=YYYY-MM-DD restrict the WARC dates.
#   2. export: English articles with text, each URL once -> DATA_DIR/jsonl/ccnews.NNNN.jsonl.gz
# SOURCE=hub, the Hugging Face hub's CC-News: HF_DATASET (default vblagoje/cc_news, 708,241 English
#   articles of 2017-2019, far fewer than the paper's ~40M; its `text` field, the body without the
#   title), streamed by the preprocessing (--hf-dataset): needs internet and pip install 'xlm-pkm[hf]'.
# Then 3. preprocess: 5,000 valid and 5,000 test articles held out (seeded, by article), 60k codes.
# Environment: SOURCE (news-please), SKIP_DOWNLOAD=1 reuses DATA_DIR/raw; CODES (60000), VALID_DOCS /
# TEST_DOCS (5000), SEED (0), WORKERS (all cores), PYTHON; extra arguments after DATA_DIR go to the
# preprocessing (e.g. --slurm-partition learnfair to spread the chunks over SLURM array jobs).
set -euo pipefail
source "$(dirname "$0")/common.sh"  # repo, PYTHONPATH, py; relative paths stay the caller's
data=${1:-data/ccnews}
[ $# -gt 0 ] && shift
case "${SOURCE:-news-please}" in
  news-please)
    if [ "${SKIP_DOWNLOAD:-0}" != 1 ]; then
      "$py" "$repo/scripts/ccnews.py" download "$data/raw" ${START:+--start "$START"} ${END:+--end "$END"}
    fi
    "$py" "$repo/scripts/ccnews.py" export "$data/raw" "$data/jsonl"
    source_args=("$data"/jsonl/ccnews.*.jsonl.gz --) ;;
  hub)
    source_args=(-- --hf-dataset "${HF_DATASET:-vblagoje/cc_news}" --hf-split train --text-field text) ;;
  *)
    echo "$0: SOURCE=$SOURCE: expected news-please or hub" >&2
    exit 2 ;;
esac
"$repo/scripts/preprocess.sh" "$data/processed" "${source_args[@]}" \
  --bpe-codes "${CODES:-60000}" --valid-docs "${VALID_DOCS:-5000}" --test-docs "${TEST_DOCS:-5000}" \
  --seed "${SEED:-0}" "$@"
