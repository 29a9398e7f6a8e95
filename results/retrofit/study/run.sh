#!/usr/bin/env bash
# Issue 60's continual study on a real model: new facts taught to SmolLM2-135M-Instruct with a retrofitted memory,
# against what it forgets, the protocol of Lin et al. 2025 as results/continual/run.sh runs it at tiny scale.
# From the repository root, after CONFIG=configs/retrofit_fixed_routing.yaml NAME=fixed_routing
# results/retrofit/run_memory.sh (its run dumped/retrofit/fixed_routing is the start: a memory whose routing did not
# collapse, results/retrofit/README.md):
#   results/retrofit/study/run.sh
# 1. write FACTS made-up facts per seed with the base's tokenizer (python -m xlm_pkm.experiments.facts
#    --tokenizer): seed SELECT (3) for choosing settings only, seeds 0, 1, 2 for the verdict;
# 2. count how often the general corpus (data/processed/sample-smollm2, train split) reads each memory slot, in
#    documents of DOC_TOKENS tokens, about one fact batch (the background of sparse memory finetuning);
# 3. score the start on every seed's facts (the prior: EM, forced choice, shuffled-subject control) and on the
#    corpus's held-out text;
# 4. finetune from the start on fact batches (a step is one fact's first PARAPHRASES paraphrases, the facts in
#    order, PASSES times): sparse memory finetuning (TF-IDF top t of the slots a batch reads; SGD on those value
#    rows), all memory values (SGD), full finetuning (every weight of the base, the memory and its gate: AdamW,
#    weight decay 0.1, model.base.trainable) and LoRA (rank 8 adapters on the base's linears alone: AdamW,
#    weight decay 0.1); on the SELECT facts over the SWEEP below, then on seeds 0, 1, 2 the settings chosen there
#    (each method's best EM and its least forgetting at each EM level of LEVELS, forgetting read on the valid
#    split: Δ valid ppl, never the test split the verdict reads);
# 5. score every run (learning on the facts; forgetting as perplexity on the corpus's valid and held-out test
#    text and next-token accuracy, and as the share of KNOWLEDGE's world-knowledge questions the start answered
#    that it still answers: data/knowledge/) and write report.md here: the verdict is its common-EM tables at
#    COMMON_LEVELS (each method against sparse memory, and against full finetuning: Lin et al.'s ordering).
# A finished run is skipped and an interrupted one resumes (or starts over if it saved no checkpoint yet); each run's scores are written to scores/ here as it
# is scored (commit them as they come: a run whose scores are there is not run again). PYTHON, DUMP, JOBS (runs
# at once, default 1: a run uses both cores), FACTS, PARAPHRASES, PASSES, FT_ARGS (added to every finetuning run),
# SCORE_ARGS (to every score) and ONLY (an extended regex over the sweep's "MODEL METHOD SETTING") override the
# defaults. A smoke test on a tiny model is tests/test_retrofit_study.py's.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=${PYTHON:-.venv/bin/python}
DUMP=${DUMP:-dumped/retrofit_study}
OUT=${STUDY_OUT:-results/retrofit/study}
START=${START:-dumped/retrofit/fixed_routing/best.pt}  # results/retrofit/run_memory.sh's run
START_ARGS=${START_ARGS:-model.base.shift=true}  # where the start's model differs from configs/retrofit.yaml's
BASE=${BASE:-models/smollm2}  # the start's base: its tokenizer writes the facts
DATA=${DATA:-data/processed/sample-smollm2}
KNOWLEDGE=${KNOWLEDGE:-data/knowledge/world.jsonl}  # what the base knew: kept where it answered right
FACTS=${FACTS:-100}
PARAPHRASES=${PARAPHRASES:-8}
PASSES=${PASSES:-10}
DOC_TOKENS=${DOC_TOKENS:-128}  # about one fact batch of 8 paraphrases
# forgetting on the first 8 batches of 16 x 256 tokens of the valid and test splits (32,768 tokens each, the same
# windows for every checkpoint): about 1.5 min a split on 2 cores, where the whole test split (143,712) takes 7
SCORE_ARGS=${SCORE_ARGS:---max-batches 8}
JOBS=${JOBS:-1}
SELECT=3  # the facts settings are chosen on (continual_report.SELECT_SEED), never scored for the verdict
LEVELS=${LEVELS:-"0.2 0.4 0.6 0.8"}  # EM levels of the equal-learning comparison
# EM levels of the verdict, forgetting interpolated per seed on each sweep (declared on 2026-11-29, seed 0 scored:
# inside every sweep's EM range on seeds 0 and 3, sparse memory's lowest 40-44%, LoRA's highest 84%)
COMMON_LEVELS=${COMMON_LEVELS:-"0.5 0.75"}
STEPS=$((PASSES * FACTS))
SCORES=$OUT/scores
# dumped/ is not committed: a fresh clone makes the start again (about 25 minutes on 2 idle cores; git diff then shows
# whether its figures in results/retrofit/fixed_routing equal the committed ones, README.md says how closely they did)
[[ -f $START ]] || { echo "no $START: make it with CONFIG=configs/retrofit_fixed_routing.yaml NAME=fixed_routing" \
  "STEPS=250 results/retrofit/run_memory.sh (or set START)"; exit 1; }
mkdir -p "$DUMP/done" "$DUMP/logs" "$SCORES"
: > "$OUT/commands.txt"
# shellcheck source=../../lib/finetune_study.sh
source results/lib/finetune_study.sh  # run, parallel, only, chosen, sweep_then_verdict

score_file() { echo "$SCORES/$1_$2_${3//[^A-Za-z0-9.]/_}_seed$4.jsonl"; }  # MODEL METHOD SETTING SEED

# score CHECKPOINT METHOD SETTING SEED: one row of scores (kept: a re-run does not score again)
score() {
  local file extra since=$SECONDS
  file=$(score_file memory "$2" "$3" "$4")
  read -r -a extra <<< "$SCORE_ARGS"
  echo "$PY -m xlm_pkm.experiments.continual score $1 --facts $DUMP/facts$4 --data $DATA --model memory" \
    "--method $2 --setting $3 --seed $4 --knowledge $KNOWLEDGE $SCORE_ARGS" >> "$OUT/commands.txt"
  [[ -s $file ]] && return
  "$PY" -m xlm_pkm.experiments.continual score "$1" --facts "$DUMP/facts$4" --data "$DATA" --model memory \
    --method "$2" --setting "$3" --seed "$4" --knowledge "$KNOWLEDGE" --out "$file" "${extra[@]}" > /dev/null
  took "score_$(basename "$file" .jsonl)" "$since" "${OMP_NUM_THREADS:-torch default}"  # beside JOBS - 1 other runs
}

run background "$PY" -m xlm_pkm.finetune.slot_counts "$START" --data "$DATA" --split train \
  --doc-tokens "$DOC_TOKENS" --documents 2000 --out "$DUMP/background.pt"
for seed in "$SELECT" 0 1 2; do
  run "facts$seed" "$PY" -m xlm_pkm.experiments.facts --out "$DUMP/facts$seed" --n "$FACTS" --seed "$seed" \
    --tokenizer "$BASE"
  score "$START" pretrained - "$seed"
done

# MODEL METHOD SETTING OVERRIDES...: the sweep on the SELECT facts (MODEL is always memory: the one start).
# SGD on value rows for the memory methods (the paper's choice), AdamW with weight decay 0.1 for the others.
SMF="optim.trainable=memory_values optim.values_optimizer=sgd optim.memory_finetune.background=$DUMP/background.pt"
# The memory methods' SGD lr: 1000 learnt nothing at t=100 (EM 1% as before; the facts' training loss fell 0.37
# nats in 10 passes), so the grid starts at 10,000 (t=1000 and all values at lr 1000 were not run); 100,000 gave
# both memory methods their best EM (t=1000: 87%, all values: 94%), at the grid's edge, so it goes on to 300,000
SWEEP="memory sparse_memory top_t=100,lr=1000 $SMF optim.values_lr=1000 optim.memory_finetune.top_t=100"$'\n'
for lr in 10000 30000 100000 300000; do
  for t in 100 1000; do
    SWEEP+="memory sparse_memory top_t=$t,lr=$lr $SMF optim.values_lr=$lr optim.memory_finetune.top_t=$t"$'\n'
  done
  SWEEP+="memory all_values lr=$lr optim.trainable=memory_values optim.values_optimizer=sgd optim.values_lr=$lr"$'\n'
done
# Full finetuning at lr 1e-5 reached EM 86% (the grid's lower edge; every EM level lies below it), so the grid goes
# down to 1e-6: the equal-learning comparison needs each method's settings on both sides of the levels
for lr in 1e-6 3e-6 1e-5 3e-5 1e-4; do
  SWEEP+="memory full lr=$lr model.base.trainable=true optim.trainable=all optim.lr=$lr optim.values_lr=$lr"
  SWEEP+=" optim.weight_decay=0.1 optim.values_weight_decay=0.1"$'\n'
done
# LoRA at lr 1e-4, the lowest of its planned grid, reached EM 45% (above the levels 0.2 and 0.4), so 1e-5 and 3e-5
# were added after its scores, before any LoRA verdict run (last in the loop: a resumed study ends the first grid first)
for lr in 1e-4 3e-4 1e-3 1e-5 3e-5; do
  SWEEP+="memory lora_r8 lr=$lr optim.lora.rank=8 optim.lora.alpha=16 optim.trainable=[\"*.lora_A.*\",\"*.lora_B.*\"]"
  SWEEP+=" optim.lr=$lr optim.weight_decay=0.1"$'\n'
done

# finetune SEED MODEL METHOD SETTING OVERRIDES...: STEPS steps of fact batches from START, one evaluation at the
# end (best.pt is the last step), constant lr after 10 warmup steps; then its score
finetune() {
  local seed=$1 method=$3 setting=$4; shift 4
  local name=ft_${method}_${setting//[^A-Za-z0-9.]/_}_seed$seed extra start_args
  if [[ -s $(score_file memory "$method" "$setting" "$seed") ]]; then touch "$DUMP/done/$name"; fi
  read -r -a extra <<< "${FT_ARGS:-}"
  read -r -a start_args <<< "$START_ARGS"
  run "$name" "$PY" train.py --config configs/finetune/retrofit_facts.yaml --no-test train.dump_path="$DUMP" \
    train.exp_name="$name" train.exp_id=run train.seed="$seed" train.init_from="$START" "${start_args[@]}" \
    data.path="$DUMP/facts$seed" data.fact_batches="$PARAPHRASES" train.max_steps="$STEPS" \
    train.eval_every="$STEPS" train.log_every=10 optim.schedule=linear_warmup optim.warmup_steps=10 \
    optim.memory_finetune.seed="$seed" "$@" "${extra[@]}"
  score "$DUMP/$name/run/best.pt" "$method" "$setting" "$seed"
}

sweep_then_verdict <<< "$SWEEP"
"$PY" -m xlm_pkm.experiments.continual report "$OUT/scores.jsonl" --select-seed "$SELECT" --out "$OUT" \
  --background memory="$DUMP/background.pt" --levels $LEVELS --common-levels $COMMON_LEVELS --also-reference full
