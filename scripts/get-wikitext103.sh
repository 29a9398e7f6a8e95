#!/usr/bin/env bash
# WikiText-103 -> word-level shards as the all-attention authors read it (adaptive-span get_data.sh
# + data.py): wiki.{train,valid,test}.tokens, whitespace tokens, an end-of-line token, vocabulary
# from train sorted by frequency (xlm_pkm.data.words).
# Usage: scripts/get-wikitext103.sh [DATA_DIR]   (default data/wikitext103; shards in DATA_DIR/processed)
# Environment: WT103_URL (default https://wikitext.smerity.com/wikitext-103-v1.zip; the authors' script
# used https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-v1.zip), PYTHON.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)  # relative paths stay relative to the caller's directory
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
data=${1:-data/wikitext103}
py=${PYTHON:-$([ -x "$repo/.venv/bin/python" ] && echo "$repo/.venv/bin/python" || echo python3)}
mkdir -p "$data"
if [ ! -f "$data/wikitext-103/wiki.train.tokens" ]; then
  curl -fL --retry 3 -o "$data/wikitext-103-v1.zip.tmp" "${WT103_URL:-https://wikitext.smerity.com/wikitext-103-v1.zip}"
  mv "$data/wikitext-103-v1.zip.tmp" "$data/wikitext-103-v1.zip"
  unzip -o -q "$data/wikitext-103-v1.zip" -d "$data"
fi
src=$data/wikitext-103
"$py" -m xlm_pkm.data.words --train "$src/wiki.train.tokens" --valid "$src/wiki.valid.tokens" \
  --test "$src/wiki.test.tokens" --output "$data/processed"
