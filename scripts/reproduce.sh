#!/usr/bin/env bash
# Run every cell of one of the paper's tables or figures; see `python -m xlm_pkm.experiments.reproduce --help`.
#   scripts/reproduce.sh TABLE [--scale paper|small|tiny] [--slurm --partition P ...] [--dry-run]
#   TABLE: table1 | figure4 | table2 | table3 | table4 | figure6
# Then: .venv/bin/python -m xlm_pkm.experiments.report dumped/reproduce/*/<scale> --out <dir>
set -euo pipefail
source "$(dirname "$0")/common.sh"  # repo, PYTHONPATH, py; relative paths stay the caller's
exec "$py" -m xlm_pkm.experiments.reproduce "$@"
