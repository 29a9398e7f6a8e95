"""Train a transformer LM with product key memories: python train.py [--config FILE] [key.sub=value ...]"""

import sys

from xlm_pkm.launch.commands import train  # sets the process's defaults before torch is imported

if __name__ == "__main__":
    sys.exit(train())
