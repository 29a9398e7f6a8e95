#!/usr/bin/env bash
# WikiText-103 -> word-level shards as the all-attention authors read it (adaptive-span get_data.sh
# + data.py): wiki.{train,valid,test}.tokens, whitespace tokens, an end-of-line token, vocabulary
# from train sorted by frequency (xlm_pkm.data.words).
# Usage: scripts/get-wikitext103.sh [DATA_DIR]   (default data/wikitext103; shards in DATA_DIR/processed)
# Environment: WT103_URL (default https://wikitext.smerity.com/wikitext-103-v1.zip; the authors' script
# used https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-v1.zip), PYTHON.
set -euo pipefail
source "$(dirname "$0")/common.sh"  # repo, PYTHONPATH, py; relative paths stay the caller's
data=${1:-data/wikitext103}
mkdir -p "$data"
if [ ! -f "$data/wikitext-103/wiki.train.tokens" ]; then
  fetch_zip "${WT103_URL:-https://wikitext.smerity.com/wikitext-103-v1.zip}" "$data/wikitext-103-v1.zip" "$data"
fi
src=$data/wikitext-103
"$py" -m xlm_pkm.data.words --train "$src/wiki.train.tokens" --valid "$src/wiki.valid.tokens" \
  --test "$src/wiki.test.tokens" --output "$data/processed"
