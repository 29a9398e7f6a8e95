"""Sample text from a trained model: python generate.py --checkpoint PATH ["prompt"] [--top-p 0.9] [--seed 0] ..."""

import sys

from xlm_pkm.launch.commands import generate  # sets the process's defaults before torch is imported

if __name__ == "__main__":
    sys.exit(generate())
