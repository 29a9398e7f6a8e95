"""Builders shared by the trainer, evaluation and benchmarks: data streams, the model, its optimizers.

    stream = build_stream(cfg, "train", env)           # also checks that the split is readable
    model = build_model(cfg, device)                    # seeded: identical on every rank
    optimizers = build_optimizers(model, cfg)           # sets the model's value gradients sparse or not
    model, cfg, state, data_dir = load_trained("dumped/x/y/best.pt")   # a trained model, vocabulary checked
    model, dictionary, cfg, metadata = read_exported("exported/demo")  # a folder of python -m xlm_pkm.export
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from xlm_pkm import checkpoint, value_checkpoint
from xlm_pkm.config import Config, ConfigError, load_config_dict
from xlm_pkm.data.dictionary import Dictionary
from xlm_pkm.data.stream import TokenStream
from xlm_pkm.distributed import DistEnv
from xlm_pkm.model.transformer import TransformerLM
from xlm_pkm.optim import Optimizers, value_optimizer


def build_stream(cfg: Config, split: str, env: DistEnv, data_path: str | None = None, batch_size: int = 0,
                 bptt: int = 0) -> TokenStream:
    """The split's stream for this rank: train (epochs, seeded) or valid/test (one pass)."""
    data, train = cfg.data, split == "train"
    batch_size = batch_size or (data.batch_size if train else data.eval_batch_size or data.batch_size)
    return TokenStream(data_path or data.path, split, batch_size, bptt or data.bptt, env.rank, env.world_size,
                       seed=cfg.train.seed, train=train, shuffle=data.shuffle_blocks)


def set_vocab_size(cfg: Config, vocab_size: int) -> None:
    """cfg.model.vocab_size from the data (0 in the config), or a one-line error if they disagree."""
    if cfg.model.vocab_size not in (0, vocab_size):
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} but {cfg.data.path}/vocab gives "
                          f"{vocab_size} tokens (set 0 to take it from the data)")
    cfg.model.vocab_size = vocab_size


def build_model(cfg: Config, device: torch.device) -> TransformerLM:
    """The LM of cfg.model (vocab_size set), initialised from train.seed, value gradients as the values
    optimizer wants them."""
    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
    model = TransformerLM(cfg.model).to(device)
    model.set_sparse_values(value_optimizer(cfg.optim).sparse)
    return model


def build_optimizers(model: TransformerLM, cfg: Config) -> Optimizers:
    return Optimizers(model, cfg.optim)


def load_trained(path: str | Path, data_dir: str | Path | None = None) -> tuple[TransformerLM, Config, dict, Path]:
    """(model in eval mode on the CPU, config, checkpoint dict, data dir) of a run checkpoint, after
    checking that the data dir's vocabulary (default: the run's) is the one the model was trained with."""
    state = checkpoint.load(path)
    cfg = load_config_dict(state["config"], source=str(path))
    data_dir = Path(data_dir or cfg.data.path)
    dictionary = Dictionary.load(data_dir / "vocab")
    if len(dictionary) != cfg.model.vocab_size:
        raise ValueError(f"{path}: model has a vocabulary of {cfg.model.vocab_size} tokens, "
                         f"{data_dir}/vocab has {len(dictionary)}")
    checkpoint.check_vocabulary(state, dictionary.fingerprint(), data_dir / "vocab", path)
    model = TransformerLM(cfg.model)  # sharded values: this process's shard (the whole table on one process)
    state = value_checkpoint.attach(state, Path(path), value_checkpoint.model_shard(model))
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
            raise FileNotFoundError(f"{out / name} not found: not a folder written by python -m xlm_pkm.export")
    try:
        raw = json.loads((out / CONFIG).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{out / CONFIG}: not valid JSON ({e})") from None
    cfg = load_config_dict(raw, source=str(out / CONFIG))
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
