"""Train a transformer LM with product key memories: python train.py [--config FILE] [key.sub=value ...]"""

import sys

from xlm_pkm.launch.cli import train_main

if __name__ == "__main__":
    sys.exit(train_main())
