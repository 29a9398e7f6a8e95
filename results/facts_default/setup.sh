# Sourced by run.sh and heldout_run.sh (after COMMANDS names their command log): the repository root as the working
# directory, the paths both use, run (log a command, then run it) and count_background (the slot counts
# configs/finetune/facts.yaml names, counted from the demo model when they are not there).
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PY=${PYTHON:-.venv/bin/python}
OUT=results/facts_default
DEMO=dumped/default/demo/best.pt
DATA=data/processed/sample
BACKGROUND=dumped/default/demo/slot_counts_48.pt  # the file configs/finetune/facts.yaml names
[[ -f $DEMO ]] || { echo "no $DEMO: run make demo first"; exit 1; }
: > "$COMMANDS"

run() { echo "$*" >> "$COMMANDS"; echo "== $*"; "$@"; }

count_background() {
  [[ -e $BACKGROUND ]] || run "$PY" -m xlm_pkm.finetune.slot_counts "$DEMO" --data "$DATA" --split train \
      --doc-tokens 48 --documents 2000 --out "$BACKGROUND"
}
