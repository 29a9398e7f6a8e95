#!/usr/bin/env bash
# Learning new facts vs forgetting, the protocol of Lin et al. 2025 (issues 34 and 48), in one command from the
# repository root after `make data`:
#   results/continual/run.sh            (about 4.5 hours on 2 CPU cores: README.md's compute plan)
# 1. pretrain the default model with one memory (pretrain_memory.yaml) and its dense twin (n_memories=0), and for
#    the ceiling check a larger memory (pretrain_memory_large.yaml) and a longer pretraining (the memory model's
#    run resumed to 1,600 steps, pretrain_memory_long.yaml);
# 2. write 300 made-up facts per seed with the pretraining vocabulary (python -m xlm_pkm.experiments.facts): seed
#    SELECT (3) for choosing settings only, seeds 0, 1, 2 for the verdict (each its own subjects and objects);
# 3. count how often the pretraining corpus reads each memory slot, in documents of DOC_TOKENS tokens, the
#    size of one fact batch (background for sparse memory finetuning);
# 4. finetune from the pretrained weights (train.init_from) on fact batches: a step is one fact's first
#    PARAPHRASES paraphrases, the 300 facts in order, PASSES times; every method with every BatchNorm in eval mode
#    (optim.freeze_norm_stats=true), but full_bn_drift, full finetuning as first run (its query BatchNorm's
#    statistics drifting); on the SELECT facts every method over its sweep (the SWEEP table below: TF-IDF and its
#    controls, top t by count and t random slots, all values, full finetuning, LoRA; the ceiling models' value
#    rows), then on seeds 0, 1, 2 the settings chosen on the SELECT facts: each method's best (highest EM) and its
#    least forgetting at each EM level of LEVELS (the report's equal-learning comparison);
# 5. score every model (EM, forced choice and its shuffled-subject control, EM on uncommon objects and by third of
#    the stream; perplexity on the pretraining corpus's valid and held-out test splits, next-token accuracy on the
#    test split) and write report.md + learning_forgetting.png here.
# Every run's command is logged to commands.txt. A finished run is skipped and an interrupted one resumes (or
# starts over if it saved no checkpoint yet), so re-running the script finishes what is missing. Each model's scores are written to scores/ here as it is
# scored, to be committed as they come: a finetuning run whose scores are there is not run again, on any
# machine (a fresh one pretrains again first: the same command and seed give the same weights). PYTHON, DUMP, JOBS (finetuning runs at once, default 2)
# override the defaults; PRETRAIN_ARGS adds overrides to every pretraining run and FT_ARGS to every
# finetuning run and SCORE_ARGS to every score; ONLY (an extended regex) keeps the sweep lines whose "MODEL METHOD
# SETTING" it matches. A smoke test, about half an hour:
#   DUMP=/tmp/smoke PRETRAIN_ARGS="train.max_steps=30 train.eval_every=30" PASSES=1 FACTS=10 \
#   SCORE_ARGS="--max-batches 2" ONLY="^(memory|dense) (sparse_memory|sparse_random|full|full_bn_drift) (top_t=200,lr=100|lr=1e-5)$" \
#   results/continual/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
DUMP=${DUMP:-dumped/continual}
OUT=results/continual
DATA=data/processed/sample
FACTS=${FACTS:-300}
PARAPHRASES=${PARAPHRASES:-16}
PASSES=${PASSES:-2}
DOC_TOKENS=${DOC_TOKENS:-216}  # the mean fact batch: 16 paraphrases, 216 tokens (padding excluded)
JOBS=${JOBS:-2}
SELECT=3  # the facts settings are chosen on (continual_report.SELECT_SEED), never scored for the verdict
LEVELS="0.13 0.2 0.3 0.4 0.5"  # EM levels of the equal-learning comparison (continual_report.LEARNING_LEVELS)
STEPS=$((PASSES * FACTS))
SCORES=$OUT/scores  # committed: one file of scores per model scored
mkdir -p "$DUMP/done" "$DUMP/logs" "$SCORES"
: > "$OUT/commands.txt"
# shellcheck source=../lib/finetune_study.sh
source results/lib/finetune_study.sh  # run, parallel, only, chosen, sweep_then_verdict

# score_file MODEL METHOD SETTING SEED: where that model's row of scores is kept
score_file() { echo "$SCORES/$1_$2_${3//[^A-Za-z0-9.]/_}_seed$4.jsonl"; }

# score CHECKPOINT MODEL METHOD SETTING SEED: one row of scores (kept: a re-run does not score again)
score() {
  local file
  file=$(score_file "$2" "$3" "$4" "$5")
  local extra
  read -r -a extra <<< "${SCORE_ARGS:-}"
  echo "$PY -m xlm_pkm.experiments.continual score $1 --facts $DUMP/facts$5 --data $DATA --model $2 --method $3" \
    "--setting $4 --seed $5 ${SCORE_ARGS:-}" >> "$OUT/commands.txt"
  [[ -s $file ]] || "$PY" -m xlm_pkm.experiments.continual score "$1" --facts "$DUMP/facts$5" --data "$DATA" \
    --model "$2" --method "$3" --setting "$4" --seed "$5" --out "$file" "${extra[@]}" > /dev/null
}

# pretrained models: NAME -> config and the overrides its finetuning runs need to rebuild its architecture
declare -A CONFIG=([memory]=pretrain_memory [dense]=pretrain_memory [memory_large]=pretrain_memory_large
                   [memory_long]=pretrain_memory_long)
declare -A ARCH=([memory]="" [dense]="model.n_memories=0" [memory_large]="model.memory.n_keys=256 model.memory.knn=32"
                 [memory_long]="")
read -r -a PRE <<< "train.dump_path=$DUMP train.exp_id=run ${PRETRAIN_ARGS:-}"
pretrain() {  # pretrain MODEL: its run (one thread; two at once) and, with a memory, its background counts
  local model=$1
  read -r -a arch <<< "${ARCH[$model]}"
  if [[ $model == memory_long && ! -e $DUMP/pretrain_memory_long/run ]]; then  # memory's run, resumed further
    mkdir -p "$DUMP/pretrain_memory_long" && cp -r "$DUMP/pretrain_memory/run" "$DUMP/pretrain_memory_long/"
  fi
  JOBS=2 run "pretrain_$model" "$PY" train.py --config "$OUT/${CONFIG[$model]}.yaml" --no-test "${PRE[@]}" \
    train.exp_name="pretrain_$model" "${arch[@]}"
  [[ $model == dense ]] || JOBS=2 run "slot_counts_$model" "$PY" -m xlm_pkm.finetune.slot_counts \
    "$DUMP/pretrain_$model/run/best.pt" --data "$DATA" --split train --doc-tokens "$DOC_TOKENS" --documents 2000 \
    --out "$DUMP/background_$model.pt"
}
for pair in "memory dense" "memory_large memory_long"; do  # two at once; the second pair for the ceiling check
  pids=()
  for model in $pair; do pretrain "$model" & pids+=($!); done
  for pid in "${pids[@]}"; do wait "$pid"; done
done
for seed in "$SELECT" 0 1 2; do
  run "facts$seed" "$PY" -m xlm_pkm.experiments.facts --out "$DUMP/facts$seed" --n "$FACTS" --seed "$seed" \
    --codes "$DATA/codes" --vocab "$DATA/vocab"
  for model in memory dense memory_large memory_long; do
    score "$DUMP/pretrain_$model/run/best.pt" "$model" pretrained - "$seed"
  done
done

# MODEL METHOD SETTING OVERRIDES...: the sweep, run on the SELECT facts. Sparse memory finetuning and all
# values: SGD on the value rows (the paper's choice; a row's gradient is its share of a mean over a batch's
# ~216 tokens, hence the high lr); its controls (sparse_count: the top t by reads, no IDF; sparse_random: t
# random slots among those read, seeded by the run's seed) at the two settings of the first results (least
# forgetting, most learning). Full finetuning and LoRA: AdamW, weight decay 0.1 (the paper's baselines).
# BACKGROUND stands for the background counts of the model the run starts from.
BG="optim.memory_finetune.background=BACKGROUND"
SMF="optim.trainable=memory_values optim.values_optimizer=sgd"
SWEEP=$(cat <<EOF
memory sparse_memory top_t=50,lr=300 optim.trainable=memory_values optim.values_optimizer=sgd optim.values_lr=300 optim.memory_finetune.top_t=50 $BG
memory sparse_memory top_t=200,lr=300 optim.trainable=memory_values optim.values_optimizer=sgd optim.values_lr=300 optim.memory_finetune.top_t=200 $BG
memory sparse_memory top_t=1000,lr=300 optim.trainable=memory_values optim.values_optimizer=sgd optim.values_lr=300 optim.memory_finetune.top_t=1000 $BG
memory sparse_memory top_t=200,lr=100 optim.trainable=memory_values optim.values_optimizer=sgd optim.values_lr=100 optim.memory_finetune.top_t=200 $BG
memory sparse_memory top_t=200,lr=1000 optim.trainable=memory_values optim.values_optimizer=sgd optim.values_lr=1000 optim.memory_finetune.top_t=200 $BG
memory sparse_memory top_t=1000,lr=1000 optim.trainable=memory_values optim.values_optimizer=sgd optim.values_lr=1000 optim.memory_finetune.top_t=1000 $BG
memory all_values lr=100 optim.trainable=memory_values optim.values_optimizer=sgd optim.values_lr=100
memory all_values lr=300 optim.trainable=memory_values optim.values_optimizer=sgd optim.values_lr=300
memory all_values lr=1000 optim.trainable=memory_values optim.values_optimizer=sgd optim.values_lr=1000
EOF
)
for ranking in count random; do
  for setting in "200 100" "1000 1000"; do
    read -r t lr <<< "$setting"
    SWEEP+=$'\n'"memory sparse_$ranking top_t=$t,lr=$lr $SMF optim.values_lr=$lr optim.memory_finetune.top_t=$t"
    SWEEP+=" optim.memory_finetune.ranking=$ranking"
  done
done
for lr in 1e-5 3e-5 1e-4; do  # full finetuning as first run: the query BatchNorm's statistics drift
  SWEEP+=$'\n'"memory full_bn_drift lr=$lr optim.trainable=all optim.lr=$lr optim.values_lr=$lr"
  SWEEP+=" optim.weight_decay=0.1 optim.values_weight_decay=0.1 optim.freeze_norm_stats=false"
done
for model in memory dense; do
  for lr in 1e-5 3e-5 1e-4; do
    SWEEP+=$'\n'"$model full lr=$lr optim.trainable=all optim.lr=$lr optim.values_lr=$lr optim.weight_decay=0.1 optim.values_weight_decay=0.1"
  done
  for rank in 8 32; do
    for lr in 1e-4 3e-4 1e-3; do
      SWEEP+=$'\n'"$model lora_r$rank lr=$lr optim.lora.rank=$rank optim.lora.alpha=$((2 * rank)) optim.lr=$lr optim.weight_decay=0.1"
    done
  done
done

# the ceiling check: does a larger memory, or a longer pretraining, let the value rows learn the facts?
SWEEP+=$'\n'$(grep -E "^memory (all_values lr=|sparse_memory top_t=(200,lr=300|1000,lr=1000) )" <<< "$SWEEP" |
  sed -e "s/^memory /memory_large /" -e "p" -e "s/^memory_large /memory_long /")

# finetune SEED MODEL METHOD SETTING OVERRIDES...: STEPS steps of fact batches from MODEL's best.pt, one
# evaluation at the end (so best.pt is the last step), constant lr after 10 warmup steps, every BatchNorm in eval
# mode (a line's own optim.freeze_norm_stats=false comes after); then its score
finetune() {
  local seed=$1 model=$2 method=$3 setting=$4; shift 4
  local name=ft_${model}_${method}_${setting//[^A-Za-z0-9.]/_}_seed$seed
  local arch extra
  # scored before, here or on another machine: logged as done, not run again (commands.txt lists every run)
  if [[ -s $(score_file "$model" "$method" "$setting" "$seed") ]]; then touch "$DUMP/done/$name"; fi
  read -r -a arch <<< "${ARCH[$model]}"
  read -r -a extra <<< "${FT_ARGS:-}"
  run "$name" "$PY" train.py --config "$OUT/pretrain_memory.yaml" --no-test train.dump_path="$DUMP" \
    train.exp_name="$name" train.exp_id=run train.seed="$seed" \
    train.init_from="$DUMP/pretrain_$model/run/best.pt" data.path="$DUMP/facts$seed" \
    data.fact_batches="$PARAPHRASES" train.max_steps="$STEPS" train.eval_every="$STEPS" train.log_every=1 \
    optim.schedule=linear_warmup optim.warmup_steps=10 optim.freeze_norm_stats=true \
    optim.memory_finetune.seed="$seed" "${arch[@]}" "${@//BACKGROUND/$DUMP/background_$model.pt}" "${extra[@]}"
  score "$DUMP/$name/run/best.pt" "$model" "$method" "$setting" "$seed"
}

sweep_then_verdict <<< "$SWEEP"
"$PY" -m xlm_pkm.experiments.continual report "$OUT/scores.jsonl" --select-seed "$SELECT" --out "$OUT" \
  --background memory="$DUMP/background_memory.pt" --background memory_large="$DUMP/background_memory_large.pt" \
  --background memory_long="$DUMP/background_memory_long.pt"
