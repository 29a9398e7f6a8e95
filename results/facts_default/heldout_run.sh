#!/usr/bin/env bash
# configs/finetune/facts.yaml, unchanged but for its steps (64 x N facts), on facts files never used to choose it
# (issue 61): heldout.jsonl and the 9 files of heldout_sets.py (N = 5, 10, 20). From the repository root, after
# `make demo`:
#   bash results/facts_default/heldout_run.sh
# Each file is scored before (the demo model, facts only) and after finetuning (facts and the bundled corpus's
# valid and test perplexity); heldout_scores.jsonl holds the rows, heldout_commands.txt the commands (of a run from
# nothing: a re-run logs only what it makes again), and
# `python results/facts_default/heldout_sets.py report results/facts_default/heldout_scores.jsonl` the table.
# A run with a best.pt is not trained again, a score already written is not made again.
set -euo pipefail
COMMANDS=results/facts_default/heldout_commands.txt
# shellcheck source=setup.sh
source "$(dirname "$0")/setup.sh"  # PY, OUT, DEMO, DATA, BACKGROUND, run, count_background
DUMP=dumped/facts_default_heldout
mkdir -p "$DUMP/scores"
count_background
run "$PY" "$OUT/heldout_sets.py" write "$DUMP/files" > /dev/null
cp "$OUT/heldout.jsonl" "$DUMP/files/n5_tools.jsonl"

for file in n5_tools n5_set0 n5_set1 n5_set2 n5_set3 n5_set4 n10_set0 n10_set1 n20_set0 n20_set1; do
  n=$(grep -c . "$DUMP/files/$file.jsonl")
  steps=$((64 * n))
  [[ -e $DUMP/$file/fact_batches.json ]] || run "$PY" -m xlm_pkm.experiments.facts --from "$DUMP/files/$file.jsonl" \
      --out "$DUMP/$file" --codes "$DATA/codes" --vocab "$DATA/vocab" > /dev/null
  corpus=(); [[ $file == n5_tools ]] && corpus=(--data "$DATA")  # the demo's valid and test perplexity, once
  [[ -s $DUMP/scores/${file}_demo.jsonl ]] || run "$PY" -m xlm_pkm.experiments.continual score "$DEMO" \
      --facts "$DUMP/$file" "${corpus[@]}" --model demo --method pretrained --setting "file=$file facts=$n" \
      --out "$DUMP/scores/${file}_demo.jsonl"
  [[ -e $DUMP/runs/$file/best.pt ]] || run "$PY" train.py --config configs/finetune/facts.yaml \
      train.dump_path="$DUMP" train.exp_name=runs train.exp_id="$file" train.init_from="$DEMO" \
      data.path="$DUMP/$file" train.max_steps=$steps train.eval_every=$steps --no-test > "$DUMP/$file.log" 2>&1
  [[ -s $DUMP/scores/$file.jsonl ]] || run "$PY" -m xlm_pkm.experiments.continual score "$DUMP/runs/$file/best.pt" \
      --facts "$DUMP/$file" --data "$DATA" --model demo --method sparse_memory --setting "file=$file facts=$n" \
      --out "$DUMP/scores/$file.jsonl"
done
cat "$DUMP"/scores/*.jsonl > "$OUT/heldout_scores.jsonl"
"$PY" "$OUT/heldout_sets.py" report "$OUT/heldout_scores.jsonl"
"$PY" "$OUT/heldout_sets.py" overlap "$DEMO" "$DUMP"/files/n5_*.jsonl  # the slots the prompts share
