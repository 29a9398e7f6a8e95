"""Builders shared by the trainer, evaluation and benchmarks: data streams, the model, its optimizers.

    stream = build_stream(cfg, "train", env)           # also checks that the split is readable
    model = build_model(cfg, device)                    # seeded: identical on every rank
    optimizers = build_optimizers(model, cfg)           # sets the model's value gradients sparse or not
"""

from __future__ import annotations

import torch

from xlm_pkm.config import Config, ConfigError
from xlm_pkm.data.stream import TokenStream
from xlm_pkm.model.transformer import TransformerLM
from xlm_pkm.optim.optimizers import Optimizers, value_optimizer
from xlm_pkm.runtime.distributed import DistEnv


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
