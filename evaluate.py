"""Evaluate a trained model: python evaluate.py --checkpoint PATH [--split valid|test] [--data DIR] [--json FILE]
(PATH: a run's checkpoint.pt or best.pt, or an exported folder)"""

import sys

from xlm_pkm.launch.commands import evaluate  # sets the process's defaults before torch is imported

if __name__ == "__main__":
    sys.exit(evaluate())
