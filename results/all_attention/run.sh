#!/usr/bin/env bash
# The all-attention runs on the bundled corpus (CPU), as committed in results/all_attention/.
# Run from the repository root after `make data` and the byte-level preprocessing below.
set -euo pipefail
PY=${PY:-.venv/bin/python}
$PY -m xlm_pkm.data.bytes --input data/sample/python-docs.jsonl.xz --output data/processed/sample_bytes \
    --split fractions --held-out-fraction 0.01
# BPE level: all-attention vs a transformer of equal parameter count, same data, steps and optimizer
$PY train.py --config configs/all_attention/sample_bpe.yaml train.exp_id=r1 train.num_threads=1 &
$PY train.py --config configs/all_attention/sample_bpe_transformer.yaml train.exp_id=r1 train.num_threads=1 &
wait
# Character level: bpc
$PY train.py --config configs/all_attention/sample_chars.yaml train.exp_id=r1 train.num_threads=2
