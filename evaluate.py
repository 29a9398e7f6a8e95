"""Evaluate a checkpoint: python evaluate.py --checkpoint PATH [--split valid|test] [--data DIR] [--json FILE]"""

import sys

from xlm_pkm.launch.commands import evaluate  # sets the process's defaults before torch is imported

if __name__ == "__main__":
    sys.exit(evaluate())
