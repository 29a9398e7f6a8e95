# Shared by the finetuning studies (results/continual/run.sh, results/retrofit/study/run.sh); sourced, not run.
# The sourcing script sets PY, DUMP (where runs go: $DUMP/done marks the finished, $DUMP/logs their output), OUT
# (where commands.txt and times.tsv are written), JOBS (runs at once), SCORES (a folder of one JSONL file of scores
# a run), SELECT (the seed whose facts settings are chosen on), LEVELS (EM levels), and defines
# finetune SEED MODEL METHOD SETTING OVERRIDES... (one finetuning run and its score).

# took NAME SINCE THREADS: appends NAME, the seconds since SINCE (a $SECONDS), THREADS and the UTC time to
# $OUT/times.tsv, committed with the scores (dumped/ and its logs are not): how long a study took over its sessions
took() {
  [[ -s $OUT/times.tsv ]] || printf 'name\tseconds\tthreads\tended\n' > "$OUT/times.tsv"
  printf '%s\t%d\t%s\t%s\n' "$1" $((SECONDS - $2)) "$3" "$(date -u +%FT%TZ)" >> "$OUT/times.tsv"
}

# run NAME COMMAND...: logs the command, runs it unless NAME finished before (its output in $DUMP/logs), on
# 2 / JOBS threads, and times it (took). A training run ($DUMP/NAME/run) stopped before its first checkpoint.pt
# starts over: it saved nothing to resume from, and train.py refuses to write over its logs
run() {
  local name=$1 since=$SECONDS threads=$((2 / JOBS > 0 ? 2 / JOBS : 1)); shift
  echo "$*" >> "$OUT/commands.txt"
  if [[ -e $DUMP/done/$name ]]; then echo "== $name: done before"; return; fi
  if [[ -d $DUMP/$name/run && ! -e $DUMP/$name/run/checkpoint.pt ]]; then rm -r "${DUMP:?}/$name/run"; fi
  echo "== $name"
  OMP_NUM_THREADS=$threads "$@" > "$DUMP/logs/$name.log" 2>&1 || {
    echo "$name failed: see $DUMP/logs/$name.log"; tail -n 5 "$DUMP/logs/$name.log"; return 1; }
  touch "$DUMP/done/$name"
  took "$name" "$since" "$threads"
}

# parallel SEED < LINES: finetune every "MODEL METHOD SETTING OVERRIDES..." line, JOBS at a time; fails if one did
parallel() {
  local seed=$1 line pids=() failed=0
  while read -r line; do
    [[ -z $line ]] && continue
    while (( $(jobs -rp | wc -l) >= JOBS )); do sleep 1; done
    # shellcheck disable=SC2086  # the line's words are the arguments
    (set -f; finetune "$seed" $line) &  # a line's patterns (optim.trainable=["*.lora_A.*"]) are not globbed
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done  # each job's own status, also when it ended first
  return $failed
}

# only < SWEEP: the lines whose "MODEL METHOD SETTING" the extended regex ONLY matches (all without it)
only() {
  local model method setting overrides
  while read -r model method setting overrides; do
    [[ "$model $method $setting" =~ ${ONLY:-.} ]] && echo "$model $method $setting $overrides"
  done || true
}

# chosen SCORES SELECT LEVELS < SWEEP: the sweep's lines of each (model, method)'s settings chosen on the SELECT
# facts' scores: its best (highest EM), and its least forgetting at each EM level of LEVELS (the equal-learning
# comparison), forgetting read as Δ valid ppl, never on the test split the verdict reads (continual_report.SELECTION)
chosen() {
  local scores=$1 select=$2 levels=$3 sweep level model method setting
  sweep=$(cat)
  { "$PY" -m xlm_pkm.experiments.continual best "$scores" --seed "$select"
    for level in $levels; do
      "$PY" -m xlm_pkm.experiments.continual best "$scores" --seed "$select" --at-em "$level"
    done; } | sort -u |
  while read -r model method setting; do grep -F "$model $method $setting " <<< "$sweep" || true; done
}

# sweep_then_verdict < SWEEP: the protocol of both studies: the sweep's lines (those ONLY keeps) on the SELECT
# facts, then the settings chosen there (LEVELS) on seeds 0, 1, 2; $OUT/scores.jsonl gathers $SCORES/*.jsonl
sweep_then_verdict() {
  local sweep verdict seed
  sweep=$(only)
  parallel "$SELECT" <<< "$sweep"
  cat "$SCORES"/*.jsonl > "$OUT/scores.jsonl"
  verdict=$(chosen "$OUT/scores.jsonl" "$SELECT" "$LEVELS" <<< "$sweep")
  for seed in 0 1 2; do parallel "$seed" <<< "$verdict"; done
  cat "$SCORES"/*.jsonl > "$OUT/scores.jsonl"
}
