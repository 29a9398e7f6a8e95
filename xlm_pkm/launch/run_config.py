"""The config train.py runs. A run that resumes (train.exp_id=ID or `last`, its directory holding a checkpoint.pt)
starts from its own config.yaml: the --config file, when one is given, then the command line's overrides apply on
top, so that resuming needs only the run's id. A new run starts from the --config file (default:
configs/default.yaml) and the overrides.

The run is found from the command line's train.dump_path, train.exp_name and train.exp_id (read from the --config
file and overrides over the defaults): those three are not taken from the stored config."""

from __future__ import annotations

from pathlib import Path

from xlm_pkm.config import DEFAULT_CONFIG, Config, load_config, read_yaml
from xlm_pkm.errors import ConfigError
from xlm_pkm.train.run_dir import latest_checkpoint


def stored_config(cfg: Config) -> Path | None:
    """config.yaml of the run that `cfg` resumes, if it resumes one that has both a checkpoint and a config."""
    train = cfg.train
    if train.exp_id == "last":
        latest = latest_checkpoint(train.dump_path, train.exp_name)
        run_dir = latest.parent if latest is not None else None
    else:
        run_dir = Path(train.dump_path) / train.exp_name / train.exp_id if train.exp_id else None
    if run_dir is None or not (run_dir / "checkpoint.pt").exists() or not (run_dir / "config.yaml").is_file():
        return None
    return run_dir / "config.yaml"


def launch_config(config_file: str | None, overrides: list[str]) -> Config:
    """The run's config: see the module's docstring. `config_file` is None when the command line gives none."""
    cfg = load_config(config_file or DEFAULT_CONFIG, overrides)
    stored = stored_config(cfg)
    if stored is None:
        return cfg
    try:
        start = read_yaml(stored)
    except ConfigError as e:  # not YAML, not a mapping, not UTF-8: a hand edit gone wrong
        raise ConfigError(f"{e}; the run resumes from this file: fix it, or move it away to resume with the command "
                          f"line's config (checked against the checkpoint's)") from None
    return load_config(config_file, overrides, start=start)
