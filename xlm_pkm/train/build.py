"""Builders shared by the trainer, evaluation and benchmarks: data streams, the model, its optimizers.

    stream = build_stream(cfg, "train", env)           # also checks that the split is readable
    cfg = resolved_config(cfg, stream.dictionary, exp_id, env.world_size)   # a new Config: the given one is kept
    model = build_model(cfg, device)                    # from train.seed: identical on every rank
                                                        # (with model.base: the base loaded, memories drawn)
    model = build_model(cfg, device, shard=shard)       # fsdp: each rank's shards only, the same weights
    optimizers = build_optimizers(model, cfg)           # sets the model's value gradients sparse or not
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Callable

import torch

from xlm_pkm.config import Config
from xlm_pkm.data.dictionary import Dictionary
from xlm_pkm.data.fact_batches import FactBatches
from xlm_pkm.data.stream import TokenStream
from xlm_pkm.data.tokenized import load_tokenizer, tokenizer_dictionary
from xlm_pkm.errors import ConfigError
from xlm_pkm.model import retrofit
from xlm_pkm.model.transformer import ModelConfig, TransformerLM, resolve_memory_layers
from xlm_pkm.optim.optimizers import Optimizers, value_optimizer
from xlm_pkm.runtime.distributed import DistEnv
from xlm_pkm.runtime.hardware import available_memory
from xlm_pkm.train.memory_estimate import estimate


def build_stream(cfg: Config, split: str, env: DistEnv, data_path: str | None = None, batch_size: int = 0,
                 bptt: int = 0) -> TokenStream | FactBatches:
    """The split's stream for this rank: train (epochs, seeded; with data.fact_batches, one fact's
    paraphrases per batch) or valid/test (one pass)."""
    data, train = cfg.data, split == "train"
    if train and data.fact_batches:
        return FactBatches(data_path or data.path, data.fact_batches, env.rank, env.world_size)
    batch_size = batch_size or (data.batch_size if train else data.eval_batch_size or data.batch_size)
    return TokenStream(data_path or data.path, split, batch_size, bptt or data.bptt, env.rank, env.world_size,
                       seed=cfg.train.seed, train=train, shuffle=data.shuffle_blocks)


def resolved_config(cfg: Config, dictionary: Dictionary | int, exp_id: str, world_size: int = 1) -> Config:
    """A copy of `cfg` with what a run resolves before building anything: model.vocab_size from the data's
    `dictionary` (or its size; 0 in the config; a one-line error if they disagree), train.exp_id (the run
    directory's) and model.memory.shard_values=auto for a run on `world_size` processes (shard_values_choice).
    A retrofit (model.base) takes the base's sizes and the digest of its files (retrofit.resolved), after checking
    that the data was made by the base's tokenizer (given the dictionary)."""
    if cfg.model.base.path:
        model = resolved_base(cfg, dictionary)
    else:
        vocab_size = dictionary if isinstance(dictionary, int) else len(dictionary)
        if cfg.model.vocab_size not in (0, vocab_size):
            raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} but {cfg.data.path}/vocab gives "
                              f"{vocab_size} tokens (set 0 to take it from the data)")
        model = dataclasses.replace(cfg.model, vocab_size=vocab_size)
    if model.memory.shard_values == "auto":
        shard, _ = shard_values_choice(cfg, world_size)
        model = dataclasses.replace(model, memory=dataclasses.replace(model.memory, shard_values=shard))
    return dataclasses.replace(cfg, model=model, train=dataclasses.replace(cfg.train, exp_id=exp_id))


def shard_values_choice(cfg: Config, world_size: int) -> tuple[bool, str]:
    """What model.memory.shard_values=auto resolves to on `world_size` processes, and why in words: true under
    train.parallel=fsdp on several processes when the model has memories whose value tables can be sharded by
    column (the table store, its width model.dim divisible by the world size, its optimizer keeping no state per
    row, read by the sharded read: not read_backward=one_pass nor inference_values=bfloat16); false otherwise, as
    before."""
    memory, dim, W = cfg.model.memory, cfg.model.dim, world_size
    if cfg.train.parallel != "fsdp" or W == 1:
        return False, f"train.parallel={cfg.train.parallel} on {W} process(es): only fsdp on several shards them"
    if cfg.model.base.path or not resolve_memory_layers(cfg.model):
        return False, "no memory layer of this model's own"
    if memory.values != "table":
        return False, f"model.memory.values={memory.values} keeps its tables whole"
    if dim % W:
        return False, f"the value width model.dim={dim} does not divide by {W} processes"
    if memory.value_dtype != "float32":
        return False, f"model.memory.value_dtype={memory.value_dtype} keeps whole rows (their stochastic rounding)"
    if value_optimizer(cfg.optim).row_state_size:
        return False, f"optim.values_optimizer={cfg.optim.values_optimizer} keeps one state per whole value row"
    if memory.read_backward == "one_pass" or memory.inference_values != "table":
        return False, (f"read_backward={memory.read_backward} and inference_values={memory.inference_values} "
                       f"read a whole table")
    return True, f"train.parallel=fsdp on {W} processes, the value width {dim} divides by {W}"


def resolved_base(cfg: Config, dictionary: Dictionary | int) -> ModelConfig:
    """The ModelConfig of a retrofit (retrofit.resolved), its data checked: the base's tokenizer's (when given the
    dictionary: the same fingerprint), at most as many tokens as the base's embedding has rows, data.bptt within
    its positions."""
    base = cfg.model.base
    if isinstance(dictionary, Dictionary):
        tokenizer = load_tokenizer(base.path, base.gguf_file or None, option="model.base.path")
        own = tokenizer_dictionary(tokenizer).fingerprint()
        if dictionary.fingerprint() != own:
            raise ConfigError(f"data.path: {cfg.data.path} was not made with the tokenizer of model.base.path="
                              f"{base.path} (vocabulary {dictionary.fingerprint()}, the base's {own}): preprocess "
                              f"it with python -m xlm_pkm.data.preprocess --tokenizer {base.path}")
    model = retrofit.resolved(cfg.model)
    if model.engram.layers and isinstance(dictionary, Dictionary):
        eos, _ = retrofit.engram_ids(retrofit.load_base_config(base))
        if dictionary.eos != eos:
            raise ConfigError(f"model.engram.layers: the N-grams start again after the base's end-of-text token "
                              f"(id {eos}, its config's eos_token_id), but {cfg.data.path} ends its documents with "
                              f"id {dictionary.eos} (its tokenizer's EOS): make the two agree")
    vocab_size = dictionary if isinstance(dictionary, int) else len(dictionary)
    if cfg.model.vocab_size not in (0, model.vocab_size) or vocab_size > model.vocab_size:
        raise ConfigError(f"model.vocab_size: the base's embedding has {model.vocab_size} rows, for the "
                          f"{vocab_size} tokens of {cfg.data.path}/vocab (model.vocab_size={cfg.model.vocab_size}: "
                          f"set 0, the base's)")
    if cfg.data.bptt > model.max_len:
        raise ConfigError(f"data.bptt={cfg.data.bptt} is longer than the base's {model.max_len} positions: lower "
                          f"data.bptt")
    return model


class InitialWeights:
    """The random stream of a run's initial weights, identical on every rank: torch's generators (the CPU's,
    and `device`'s) seeded with train.seed on first use, continued at each later one (the model, then LoRA
    adapters), and set back to what they were on leaving, so that only the trainer seeds the global stream
    that training draws from (dropout).

        weights = InitialWeights(cfg.train.seed, device)
        with weights.drawing():
            model = TransformerLM(cfg.model).to(device)
    """

    def __init__(self, seed: int, device: torch.device):
        self.seed = seed
        self.cuda = [] if device.type != "cuda" else [torch.cuda.current_device() if device.index is None
                                                      else device.index]  # the CUDA generator drawn from too
        self.states: list[torch.Tensor] | None = None  # where the stream stopped: the CPU's, then the CUDA one's

    @contextmanager
    def drawing(self):
        with torch.random.fork_rng(devices=self.cuda):
            if self.states is None:
                torch.random.default_generator.manual_seed(self.seed)
                for i in self.cuda:
                    with torch.cuda.device(i):
                        torch.cuda.manual_seed(self.seed)
            else:
                torch.set_rng_state(self.states[0])
                for i, state in zip(self.cuda, self.states[1:]):
                    torch.cuda.set_rng_state(state, i)
            yield
            self.states = [torch.get_rng_state(), *(torch.cuda.get_rng_state(i) for i in self.cuda)]


def check_memory_fits(cfg: Config, device: torch.device, world_size: int = 1, whole: bool = True) -> None:
    """Refuses in one line, before anything is allocated, a run whose weights, gradients and optimizer states
    on one rank exceed the device's available memory: train/memory_estimate.estimate's figures for them
    (what training holds whatever the batch: a lower bound of its peak), or the build's peak if larger. A model
    built `whole` before train.parallel=fsdp shards it (train.init_from loads whole weights into it): its whole
    weights, if larger."""
    available = available_memory(device)
    if available is None:
        return
    available, source = available
    rank = estimate(cfg, world_size, cfg.train.parallel, device.type)
    need = max(rank.parameters + rank.gradients + rank.optimizer, rank.built)
    if whole and cfg.train.parallel == "fsdp" and world_size > 1:
        need = max(need, estimate(cfg, world_size, "ddp", device.type).parameters)
    if need > available:
        memory, elements = cfg.model.memory, rank.elements
        share = elements["memory values"] / sum(elements.values())
        fsdp = "" if cfg.train.parallel == "fsdp" else "the dense model sharded across GPUs (train.parallel=fsdp), or "
        advice = (f"fewer slots (model.memory.n_keys={memory.n_keys} gives {memory.n_keys ** 2:,} per memory), or "
                  f"values sharded across GPUs (model.memory.shard_values)" if share > 0.5 else
                  f"{fsdp}a smaller model (model.dim={cfg.model.dim}, model.n_layers={cfg.model.n_layers}, "
                  f"model.vocab_size={cfg.model.vocab_size}: the memory values are {100 * share:.0f}% of its "
                  f"parameters)")
        raise ConfigError(f"the model needs at least {need / 2**30:,.1f} GiB for its weights, gradients and "
                          f"optimizer state ({sum(elements.values()):,} parameters, {elements['memory values']:,} "
                          f"of them memory values), more than the {available / 2**30:,.1f} GiB {source}: {advice}")


def build_model(cfg: Config, device: torch.device, weights: InitialWeights | None = None,
                world_size: int = 1, shard: Callable[[TransformerLM], object] | None = None
                ) -> TransformerLM | retrofit.RetrofitLM:
    """The LM of cfg.model (vocab_size set), initialised from `weights` (by default its own stream from
    train.seed), value gradients as the values optimizer wants them; refused first if it cannot fit on one
    of `world_size` ranks (check_memory_fits). With `shard` (train.parallel=fsdp: shard(model) makes its FSDP
    units), the model is never whole on this rank: built on the meta device, sharded, then each rank's shards
    drawn as the full build draws them (runtime/fsdp.build_sharded: the same weights). A retrofit (model.base,
    resolved) loads its base, then draws its memories (its memory estimate is not made: train/memory_estimate.py
    counts TransformerLM's parts). The global random stream is left as it was."""
    base = retrofit.load_base(cfg.model.base) if cfg.model.base.path else None
    if base is None:
        check_memory_fits(cfg, device, world_size, whole=shard is None)
    weights = weights or InitialWeights(cfg.train.seed, device)
    if shard is not None and base is None:
        from xlm_pkm.runtime.fsdp import build_sharded  # FSDP's import: only its runs pay it

        model = build_sharded(lambda built=None: TransformerLM(cfg.model, built), shard, device, weights.drawing)
    else:
        with weights.drawing():
            model = (TransformerLM(cfg.model) if base is None else retrofit.RetrofitLM(cfg.model, base)).to(device)
    model.set_sparse_values(value_optimizer(cfg.optim).sparse)
    return model


def build_optimizers(model: TransformerLM, cfg: Config) -> Optimizers:
    return Optimizers(model, cfg.optim)
