"""A trained model, loaded whole and checked: from a run checkpoint or from an exported folder.

    model, cfg, state, data_dir = load_trained("dumped/x/y/best.pt")   # vocabulary checked against the data
    model, dictionary, cfg, metadata = read_exported("exported/demo")  # a folder of python -m xlm_pkm.inference.export
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from xlm_pkm.checkpoint import files as checkpoint
from xlm_pkm.checkpoint import sharded_values
from xlm_pkm.config import Config, load_config_dict
from xlm_pkm.data.dictionary import Dictionary
from xlm_pkm.model.transformer import TransformerLM
from xlm_pkm.runtime.distributed import DistEnv


def load_trained(path: str | Path, data_dir: str | Path | None = None,
                 env: DistEnv | None = None) -> tuple[TransformerLM, Config, dict, Path]:
    """(model in eval mode on the CPU, config, checkpoint dict, data dir) of a run checkpoint, after
    checking that the data dir's vocabulary (default: the run's) is the one the model was trained with.
    Given the `env` of several processes, it is collective: each rank loads its value columns, and if one
    rank cannot (its value shard file missing or damaged) every rank raises (sharded_values.on_every_rank)."""
    return sharded_values.on_every_rank(lambda: _load_trained(path, data_dir), env or DistEnv(), path)


def _load_trained(path: str | Path, data_dir: str | Path | None) -> tuple[TransformerLM, Config, dict, Path]:
    state = checkpoint.load(path)
    cfg = load_config_dict(state["config"], source=str(path))
    data_dir = Path(data_dir or cfg.data.path)
    dictionary = Dictionary.load(data_dir / "vocab")
    if len(dictionary) != cfg.model.vocab_size:
        raise ValueError(f"{path}: model has a vocabulary of {cfg.model.vocab_size} tokens, "
                         f"{data_dir}/vocab has {len(dictionary)}")
    checkpoint.check_vocabulary(state, dictionary.fingerprint(), data_dir / "vocab", path)
    model = TransformerLM(cfg.model)  # sharded values: this process's shard (the whole table on one process)
    state = sharded_values.attach(state, Path(path), sharded_values.model_shard(model))
    checkpoint.load_model_state(model, state["model"], path)
    return model.eval(), cfg, state, data_dir


WEIGHTS, CONFIG = "model.safetensors", "config.json"  # an exported folder's weights and config


def read_exported(out_dir: str | Path) -> tuple[TransformerLM, Dictionary, Config, dict[str, str]]:
    """(model, dictionary, config, the weights' metadata: step, vocab_fingerprint, unit...) of an exported
    folder."""
    from safetensors import safe_open
    from safetensors.torch import load_model as load_weights

    out = Path(out_dir)
    for name in (WEIGHTS, CONFIG, "vocab"):
        if not (out / name).is_file():
            raise FileNotFoundError(f"{out / name} not found: not a folder written by python -m xlm_pkm.inference.export")
    try:
        raw = json.loads((out / CONFIG).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{out / CONFIG}: not valid JSON ({e})") from None
    run_keys = {f.name for f in dataclasses.fields(Config)}  # not the keys transformers reads (inference/hf_config.py)
    cfg = load_config_dict({k: v for k, v in raw.items() if k in run_keys}, source=str(out / CONFIG))
    dictionary = Dictionary.load(out / "vocab")
    try:
        with safe_open(str(out / WEIGHTS), "pt") as f:
            metadata = f.metadata() or {}
    except Exception as e:  # a truncated or foreign file
        raise ValueError(f"{out / WEIGHTS}: not a readable safetensors file ({e})") from None
    checkpoint.check_vocabulary({"vocab_fingerprint": metadata.get("vocab_fingerprint")}, dictionary.fingerprint(),
                                out / "vocab", out / WEIGHTS)
    model = TransformerLM(cfg.model)
    try:
        load_weights(model, str(out / WEIGHTS))
    except RuntimeError as e:
        raise ValueError(f"{out / WEIGHTS}: weights of another architecture than {out / CONFIG} "
                         f"({' '.join(str(e).split())[:300]})") from None
    return model.eval(), dictionary, cfg, metadata
