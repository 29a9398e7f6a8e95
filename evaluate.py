"""Evaluate a trained model: python evaluate.py --checkpoint PATH [--split valid|test] [--data DIR] [--json FILE]
(PATH: a run's checkpoint.pt or best.pt, or an exported folder)"""

import sys

from xlm_pkm.launch.cli import evaluate_main

if __name__ == "__main__":
    sys.exit(evaluate_main())
