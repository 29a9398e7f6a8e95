"""Evaluate a checkpoint: python evaluate.py --checkpoint PATH [--split valid|test] [--data DIR] [--json FILE]"""

import sys

from xlm_pkm.launch.cli import evaluate_main

if __name__ == "__main__":
    sys.exit(evaluate_main())
