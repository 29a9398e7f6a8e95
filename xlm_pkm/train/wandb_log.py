"""Weights & Biases (`train.wandb`), beside TensorBoard: the scalars of metrics.jsonl at their steps, under
TensorBoard's tags (train/loss, valid/memories/layer2/usage...), and the resolved config (config.yaml's).

    python train.py train.wandb.project=pkm [train.wandb.mode=offline]

The W&B run's id is kept in the run directory's `wandb_id.txt`, written when the run is created: a run
resumed from its checkpoint continues the same W&B run. W&B's files go to `$WANDB_DIR/wandb/` when that is
set, else to the run directory's `wandb/`. wandb is optional (pip install 'xlm-pkm[wandb]') and imported
only when train.wandb.project is set; without it the run stops at its start with one line.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from xlm_pkm.config import WandbConfig
from xlm_pkm.errors import ConfigError, UserError
from xlm_pkm.utils.atomic import write_text

ID_FILE = "wandb_id.txt"
MISSING_WANDB = "train.wandb: needs the wandb package: pip install 'xlm-pkm[wandb]'"


class WandbError(UserError, RuntimeError):
    """W&B did not start the run (not logged in, no network, an unknown entity...)."""


def import_wandb():
    """The wandb module, or the one-line ConfigError saying how to install it."""
    try:
        import wandb
    except ImportError:
        raise ConfigError(MISSING_WANDB) from None
    return wandb


class WandbLog:
    """One W&B run per run directory, opened on rank 0 by RunLogger."""

    def __init__(self, run_dir: Path, cfg: WandbConfig, config: dict, resumed: bool):
        """Opens the W&B run of `run_dir`: the one named in its wandb_id.txt when `resumed`, else a new one
        (whose id replaces any in the file); `config` is its resolved config."""
        wandb = import_wandb()
        id_path = run_dir / ID_FILE
        run_id = id_path.read_text().strip() if resumed and id_path.is_file() else ""
        if not run_id:
            run_id = secrets.token_hex(4)  # 8 characters, as W&B's own ids
            write_text(id_path, run_id + "\n")
        train = config["train"]
        try:
            self.run = wandb.init(project=cfg.project, entity=cfg.entity or None, mode=cfg.mode, id=run_id,
                                  name=cfg.name or f"{train['exp_name']}/{train['exp_id']}", config=config,
                                  dir=os.environ.get("WANDB_DIR") or str(run_dir), resume="allow" if resumed else None)
        except wandb.errors.Error as e:
            raise WandbError(f"train.wandb: W&B did not start ({' '.join(str(e).split())}); to log without a "
                             f"connection, set train.wandb.mode=offline (then `wandb sync`)") from None

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()
