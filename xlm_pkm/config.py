"""Every knob of a run, as dataclasses: YAML files plus dotted command-line overrides.

    cfg = load_config("configs/paper/l12_d1024_m1.yaml", ["optim.lr=1e-4", "model.memory.n_keys=256"])

The loader checks every value once: an unknown key (with the closest valid one), a wrong type, a
choice outside a `Literal[...]` or a registry (field metadata `choices`: "module:REGISTRY", looked up
when checked, so a new implementation never touches this file), a number out of range (the tables
POSITIVE, NON_NEGATIVE, PROBABILITIES, BETAS; every float must be finite) each raise a one-line
ConfigError naming the key and what is allowed. Code using a loaded Config can rely on these.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from xlm_pkm.errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration file or override is invalid; the message names the key at fault."""


@dataclass
class MemoryConfig:
    """A Product Key Memory layer (paper §3). Options beyond the paper are off by default."""

    n_keys: int = 512  # sub-keys per half: |K| = n_keys ** 2 slots (flat: n_keys ** 2 full keys)
    k_dim: int = 512  # query / key dimension (product: two halves of k_dim / 2)
    heads: int = 4  # memory heads; each has its own query and keys, the value table is shared
    knn: int = 32  # keys selected per head
    # product | flat (exhaustive search over |K| full keys, Table 4) | any class in model/memory/keys.py
    key_type: str = field(default="product", metadata={"choices": "xlm_pkm.model.memory.keys:KEY_SEARCHES"})
    # batchnorm (paper, §4.5; training statistics span the batch) | layernorm (per head, causal) | none
    query_norm: Literal["batchnorm", "layernorm", "none"] = "batchnorm"
    query_hidden: list[int] = field(default_factory=list)  # hidden sizes of the query MLP (ReLU)
    input_dropout: float = 0.0  # on the memory's input
    query_dropout: float = 0.0  # on the queries, before the key search
    value_dropout: float = 0.0  # on the values read
    gated: bool = False  # Memory+ output gating: W_o(silu(W_g x) * read) (Berges et al. 2024)
    qk_norm: bool = False  # L2-normalise queries and keys (product: each half) before scoring
    share_keys: bool = False  # product / flat keys: every head searches one set of keys (PEER, He 2024 §2)
    temperature: float = 1.0  # softmax(scores / temperature) over the selected keys; 1: the paper
    share_values: bool = False  # all memory layers of the model read one value table
    # each of W processes holds 1/W of every value row and of its optimizer state (model/memory/value_shards.py)
    shard_values: bool = False
    # auto (Triton kernels on CUDA, EmbeddingBag on CPU) | torch | triton (model/memory/value_read.py)
    value_read: Literal["auto", "torch", "triton"] = "auto"
    # the selected scores -> the read weights: softmax (the paper) | relu (Csordás et al. 2023) | identity
    # (the raw scores, UltraMem) | any function in model/memory/scores.py
    score: str = field(default="softmax", metadata={"choices": "xlm_pkm.model.memory.scores:SCORE_FUNCTIONS"})
    # what the slots hold: table (one value row per slot, the paper) | peer (PEER's single-neuron experts)
    # | any store in model/memory/value_stores.py or registered by a variant's module
    values: str = field(default="table", metadata={"choices": "xlm_pkm.model.memory.value_stores:VALUE_STORES"})
    # PEER (model/memory/peer.py)
    # σ of each expert σ(u_i·x) v_i (values=peer): the paper's "ReLU or GELU" (He 2024, Eq. 6); gelu: erf form
    peer_activation: Literal["gelu", "relu"] = "gelu"
    # UltraMem (model/memory/ultramem.py)
    tucker_rank: int = 2  # key_type=tucker: r, each sub-key's components; an r x r core mixes row and column scores
    tucker_cores: int = 1  # key_type=tucker: cores per head (multi-core scoring, > 1 needs values=expanded)
    tucker_topm: int = 0  # key_type=tucker: rows and columns kept by the core's rank-1 approximation; 0: knn
    # key_type=tucker: also keep the m lowest rows and columns (two negatives make a high score too) and their
    # m² pairs; false: the paper's top-m only
    tucker_both_signs: bool = False
    tucker_aux_coeff: float = 0.001  # key_type=tucker: α of the core's loss α/(r-1) Σ_{i>=2} max(0, λ_i - τ)²
    tucker_aux_margin: float = 0.15  # key_type=tucker: τ of that loss
    value_expansion: int = 1  # values=expanded: E virtual blocks over n_slots / E physical values
    value_dim: int = 0  # values=expanded: width of the physical values; 0: the memory's output dim


@dataclass
class EngramConfig:
    """Engram (DeepSeek-AI 2026, arXiv 2601.07372): hashed N-gram embeddings added to the residual stream at
    `layers` (model/memory/engram.py). Off while `layers` is empty."""

    layers: list[int] = field(default_factory=list)  # 1-indexed layers; the paper's 27B model: [2, 15] of 30
    max_ngram: int = 3  # N: the orders 2..N are hashed (the paper's and the reference's 3)
    heads: int = 8  # K hash heads per order, each its own table of prime size
    table_size: int = 65536  # rows of one order's tables, all K heads together (each head ~table_size / K)
    ngram_dim: int = 512  # width of one order's embedding, all K heads together (each head ngram_dim / K)
    kernel_size: int = 4  # the causal depthwise convolution's width (dilation: max_ngram)
    seed: int = 0  # the hash multipliers' seed (the reference's: seed + 10007 · layer index)


@dataclass
class SpanConfig:
    """Relative-position context attention with a stream cache (Sukhbaatar et al. 2019): the
    all_attention and span_attention sublayers (model/all_attention.py, model/adaptive_span.py)."""

    max_span: int = 8192  # S: the previous tokens a query can see; relative position table d_h x S
    adaptive: bool = True  # learn each head's span (z in [0, 1], soft mask with a ramp of R); else all S
    ramp: int = 32  # R
    loss_coeff: float = 1e-7  # span loss: loss_coeff · S · mean z per layer, summed over layers (training)
    adaptive_cache: bool = True  # cache min(S, span in use + 64) inputs (--adapt-span-cache), else S


@dataclass
class ModelConfig:
    """A causal transformer LM (paper §4.3), with memories replacing or following some FFNs."""

    vocab_size: int = 0  # 0: taken from the data's vocabulary
    dim: int = 1024  # model width (embeddings, attention, FFN input/output)
    n_layers: int = 12  # transformer layers
    n_heads: int = 16  # attention heads per layer
    ffn_dim: int = 0  # 0: 4 * dim
    dropout: float = 0.0  # on embeddings and sublayer outputs
    attention_dropout: float = 0.0  # on the attention weights
    max_len: int = 512  # learned positional embeddings
    pre_norm: bool = False  # False: post-norm, as XLM
    # the sublayer types of every layer, in order (model/blocks.py); a memory layer's "ffn" gives way
    # to the memory (mem_mode replace), or the memory follows the others (add)
    sublayers: list[str] = field(default_factory=lambda: ["attention", "ffn"],
                                 metadata={"choices": "xlm_pkm.model.blocks:SUBLAYERS"})
    n_memories: int = 0  # interspersed at regular intervals (see transformer.memory_layers)
    mem_layers: list[int] = field(default_factory=list)  # explicit 1-indexed layers (wins over n_memories)
    # replace: memory instead of the FFN | add: x + memory(x) after the FFN
    mem_mode: Literal["replace", "add"] = "replace"
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    engram: EngramConfig = field(default_factory=EngramConfig)  # token-addressed memory, beside or instead of PKM
    # transformer: XLM's LM (learned absolute positions up to max_len, embedding LayerNorm when post-norm,
    # output tied to the token embeddings, dropout on embeddings and residual branches).
    # all_attention: the all-attention paper's LM, for the all_attention / span_attention sublayers:
    # no absolute positions (relative ones in the attention, streams of any length through the cache),
    # no embedding norm, N(0, 1) embeddings, an output Linear with bias (or the tied adaptive softmax),
    # `dropout` on the input embeddings and the last hidden state only.
    family: Literal["transformer", "all_attention"] = "transformer"
    persistent_vectors: int = 0  # N key/value vectors per head in each all_attention sublayer
    # joint: one softmax over context and persistent vectors (the paper's model); split / head_split:
    # the paper's attn-split and head-split ablations (model/all_attention.py)
    persistent_mixing: Literal["joint", "split", "head_split"] = "joint"
    span: SpanConfig = field(default_factory=SpanConfig)
    # tied adaptive input + adaptive softmax over a frequency-sorted vocabulary (family all_attention):
    # cluster boundaries (ids), e.g. [20000, 40000, 200000]; empty: a full softmax
    adaptive_cutoffs: list[int] = field(default_factory=list)
    adaptive_factor: int = 4  # cluster c's embedding dimension: dim / factor^c


@dataclass
class DataConfig:
    path: str = "data/processed/sample"  # output directory of xlm_pkm.data.preprocess
    batch_size: int = 32  # sequences per rank per forward
    bptt: int = 256  # tokens per sequence
    eval_batch_size: int = 0  # 0: same as batch_size
    shuffle_blocks: bool = True  # read an epoch's bptt blocks in a seeded shuffled order (XLM); false: in order
    # N > 0: each training step's batch is one fact's first N paraphrases, padding masked, facts in order
    # (DIR/fact_batches.json of xlm_pkm.experiments.facts; data/fact_batches.py); 0: the token stream
    fact_batches: int = 0


@dataclass
class MemoryFinetuneConfig:
    """Sparse memory finetuning (memory_finetune.py): each step updates only its top_t slots by TF-IDF."""
    top_t: int = 0  # slots updated per value table and step; 0: off (every slot read is updated)
    background: str = ""  # slot counts on the pretraining data: python -m xlm_pkm.finetune.slot_counts


@dataclass
class LoraConfig:
    """Low-rank adapters (LoRA, through peft) on the linears `targets` names; only the adapters train."""

    rank: int = 0  # 0: off
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank
    # module-name globs, or the preset attention_ffn: every attention (qkv, out) and FFN (fc1, fc2) linear
    targets: list[str] = field(default_factory=lambda: ["attention_ffn"])


@dataclass
class OptimConfig:
    """Adam with the inverse square-root schedule (Vaswani et al.); memory values in their own group."""

    # adam (AdamW, the paper) | adagrad (per-tensor step clipping, the all-attention paper) | a registered one
    optimizer: str = field(default="adam", metadata={"choices": "xlm_pkm.optim.optimizers:DENSE_OPTIMIZERS"})
    lr: float = 2.5e-4  # peak learning rate of the dense parameters
    beta1: float = 0.9  # adam
    beta2: float = 0.98  # adam
    eps: float = 1e-8  # adam / adagrad epsilon
    weight_decay: float = 0.0  # adam
    # inverse_sqrt: linear warmup then lr·sqrt(warmup/step); linear_warmup: linear warmup then constant
    schedule: str = field(default="inverse_sqrt", metadata={"choices": "xlm_pkm.optim.schedule:SCHEDULES"})
    warmup_steps: int = 4000  # linear warmup from warmup_init_lr to lr
    warmup_init_lr: float = 1e-7  # lr at step 0 of the warmup
    clip_grad_norm: float = 0.0  # 0: off
    clip_scope: Literal["group", "global"] = "group"  # one norm per optimizer group (XLM), or over all
    clip_per_tensor: float = 0.0  # adagrad: each tensor's step scaled to this gradient norm (all-attention)
    accumulate: int = 1  # forward/backward passes per optimizer step
    # all | memory (keys, query networks, values) | memory_values | glob patterns over parameter names
    trainable: list[str] = field(default_factory=lambda: ["all"])
    memory_finetune: MemoryFinetuneConfig = field(default_factory=MemoryFinetuneConfig)
    # The memory values' own group, at a constant lr (paper: Adam, lr 1e-3; XLM: `adam,lr=0.001`, whose
    # betas are torch's defaults). The optimizer decides whether value gradients are sparse (optim/optimizers.py).
    values_optimizer: str = field(default="adam", metadata={"choices": "xlm_pkm.optim.optimizers:VALUE_OPTIMIZERS"})
    values_lr: float = 1e-3  # constant learning rate of the memory values
    values_beta1: float = 0.9  # adam / lazy_adam
    values_beta2: float = 0.999  # adam / lazy_adam
    values_eps: float = 1e-8  # epsilon of the values optimizer
    values_weight_decay: float = 0.0  # adam / lazy_adam only
    # UltraMem's value lr decay (optim/schedule.py): > 0: the values take the dense lr times a factor going
    # linearly from values_lr_start_factor to 1 over this many steps (values_lr unused); 0: constant values_lr
    values_lr_decay_steps: int = 0
    values_lr_start_factor: float = 10.0  # the values' lr over the dense lr at step 0 (values_lr_decay_steps > 0)
    # Engram's tables (model.engram): the values optimizer at the dense lr times this, weight decay 0 (the
    # Engram paper's setting for its embeddings: Adam, 5x the backbone's lr, no weight decay)
    engram_lr_scale: float = 5.0
    lora: LoraConfig = field(default_factory=LoraConfig)  # rank > 0: adapters only (optim.trainable must be all)


@dataclass
class WandbConfig:
    """Weights & Biases (train/wandb_log.py), beside TensorBoard: the run's scalars and config. Needs the wandb
    package: pip install 'xlm-pkm[wandb]'."""

    project: str = ""  # W&B project to log to; empty: W&B off
    name: str = ""  # the W&B run's display name; empty: exp_name/exp_id
    mode: Literal["online", "offline"] = "online"  # offline: files only (no network), uploaded later by `wandb sync`
    entity: str = ""  # W&B user or team; empty: your default entity


@dataclass
class TrainConfig:
    exp_name: str = "default"  # runs go to dump_path/exp_name/exp_id/
    exp_id: str = ""  # empty: a new id; an existing one resumes; last: the latest unfinished run of exp_name
    dump_path: str = "dumped"  # where run directories are made
    seed: int = 0  # weights, data order and dropout
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    precision: Literal["fp32", "fp16", "bf16"] = "fp32"  # fp16 (CUDA, loss scaling) and bf16: torch.amp autocast
    compile: bool = False  # torch.compile the model
    max_steps: int = 100_000  # optimizer steps of the whole run
    max_time_minutes: float = 0.0  # 0: no limit; else stop (with a checkpoint) after this long
    log_every: int = 50  # a train line every this many steps
    eval_every: int = 1000  # valid perplexity (best.pt) and checkpoint.pt every this many steps
    eval_max_batches: int = 0  # 0: the whole split
    save_every_steps: int = 0  # checkpoint.pt also every this many steps (0: at evaluations only)
    # checkpoint.pt also every this many minutes, so that a crash loses at most that much (0: at evaluations only)
    save_every_minutes: float = 15.0
    max_nonfinite: int = 10  # consecutive non-finite losses before stopping (fp32/bf16)
    num_threads: int = 0  # torch CPU threads; 0: torch's default
    collective_timeout_minutes: float = 10.0  # a collective waiting longer fails, naming the missing ranks
    # a trained model to start from (best.pt, checkpoint.pt or an exported folder): its weights only, the run
    # keeps its own step 0, optimizers and data (init_from.py); ignored when the run directory resumes
    init_from: str = ""
    init_strict: bool = True  # both models have the same tensors; false: retrofit (load the shared ones)
    wandb: WandbConfig = field(default_factory=WandbConfig)  # Weights & Biases logging (off unless a project is set)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    # modules imported before the checks (and again wherever the config is loaded: evaluate.py, export),
    # so that they can register key searches, sublayers, optimizers, schedules (registry.py)
    plugins: list[str] = field(default_factory=list)


# Value rules beyond the type, checked once by the loader (every float must also be finite).
POSITIVE = ("model.dim", "model.n_layers", "model.n_heads", "model.max_len", "model.memory.n_keys",
            "model.memory.k_dim", "model.memory.heads", "model.memory.knn", "model.memory.temperature",
            "model.memory.query_hidden", "data.batch_size", "data.bptt", "optim.lr", "optim.eps",
            "optim.accumulate", "optim.values_lr", "optim.lora.alpha", "optim.values_eps", "train.max_steps", "train.log_every",
            "train.eval_every", "train.max_nonfinite", "train.collective_timeout_minutes",
            "model.span.max_span", "model.span.ramp", "model.adaptive_cutoffs", "model.adaptive_factor",
            "model.engram.heads", "model.engram.table_size", "model.engram.ngram_dim", "model.engram.kernel_size",
            "model.engram.layers", "optim.engram_lr_scale")
NON_NEGATIVE = ("model.vocab_size", "model.ffn_dim", "model.n_memories", "data.eval_batch_size", "data.fact_batches",
                "model.persistent_vectors", "model.span.loss_coeff",
                "optim.weight_decay", "optim.warmup_steps", "optim.warmup_init_lr", "optim.clip_grad_norm",
                "optim.clip_per_tensor", "optim.lora.rank", "optim.memory_finetune.top_t",
                "optim.values_weight_decay", "train.max_time_minutes", "train.eval_max_batches",
                "train.save_every_steps", "train.save_every_minutes",
                "train.num_threads", "train.seed", "model.engram.seed")
PROBABILITIES = ("model.dropout", "model.attention_dropout", "model.memory.input_dropout",
                 "model.memory.query_dropout", "model.memory.value_dropout")  # in [0, 1)
BETAS = ("optim.beta1", "optim.beta2", "optim.values_beta1", "optim.values_beta2")  # in [0, 1)
DEVICES = r"auto|cpu|cuda(:\d+)?"  # train.device and evaluate.py --device

# Keys of earlier versions: a user's file gets an error saying what replaced them; a checkpoint's stored
# config is migrated (the value moves to the new key).
RENAMED = {
    "optim.mem_values_lr": "optim.values_lr",
    "optim.mem_values_weight_decay": "optim.values_weight_decay",
}
REPLACED = {"model.memory.sparse": ("optim.values_optimizer", {True: "lazy_adam", False: "adam"})}


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Defaults, then the YAML file at `path` (and its `base:` chain), then `key.sub=value` overrides
    (values parsed as YAML)."""
    import yaml

    raw = read_yaml(Path(path)) if path is not None else {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key.sub=value")
        try:
            parsed = yaml.safe_load(value) if value else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: not a valid YAML value ({getattr(e, 'problem', None) or e}); "
                              f"e.g. {key}=[1, 2] for a list, {key}=\"text\" for a string") from None
        _set(raw, key, parsed, f"override {item!r}")
    import_plugins(raw.get("plugins"))
    for old, new in RENAMED.items():
        if _pop(raw, old) is not None:
            raise ConfigError(f"config key {old} was renamed to {new}")
    for old, (new, values) in REPLACED.items():
        if _pop(raw, old) is not None:
            choices = ", ".join(f"{new}={v} for {old}={str(k).lower()}" for k, v in values.items())
            raise ConfigError(f"config key {old} was replaced by {new} ({choices})")
    return validate(_build(Config, raw, ""))


def read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """A config file as a dict; `base: other.yaml` (relative to the file) is read first, then updated."""
    import yaml

    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}".replace("\n", " ")) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    if "base" not in raw:
        return raw
    base = (path.parent / str(raw.pop("base"))).resolve()
    if base in seen:
        raise ConfigError(f"{path}: 'base' chain loops back to {base}")
    return _merge(read_yaml(base, (*seen, base)), raw)


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for key, value in update.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _pop(raw: dict, dotted: str):
    """Removes and returns raw[a][b][c] for "a.b.c" (None when absent)."""
    *parents, leaf = dotted.split(".")
    for p in parents:
        raw = raw.get(p)
        if not isinstance(raw, dict):
            return None
    return raw.pop(leaf, None)


def _set(raw: dict, dotted: str, value, what: str = "") -> None:
    """raw[a][b][c] = value for dotted "a.b.c", creating the sections; `what` names the setting in the error."""
    *parents, leaf = dotted.split(".")
    for p in parents:
        raw = raw.setdefault(p, {})
        if not isinstance(raw, dict):
            raise ConfigError(f"{what or dotted}: {p} is not a section")
    raw[leaf] = value


def migrate(raw: dict) -> dict:
    """A stored config of an earlier version in today's keys (the values group then reused the dense
    betas and eps, so they are carried over)."""
    import copy

    raw = copy.deepcopy(raw)
    optim = raw.get("optim", {})
    if "mem_values_lr" in optim:
        for key in ("beta1", "beta2", "eps"):
            if key in optim:
                optim.setdefault(f"values_{key}", optim[key])
    for old, new in RENAMED.items():
        value = _pop(raw, old)
        if value is not None:
            _set(raw, new, value)
    for old, (new, values) in REPLACED.items():
        value = _pop(raw, old)
        if value is not None:
            _set(raw, new, values[value])
    return raw


def load_config_dict(raw: dict, source: str = "config") -> Config:
    """A Config from a plain dict (as stored in checkpoints, migrated from earlier versions), with the
    same checks as load_config."""
    try:
        import_plugins(raw.get("plugins"))
        return validate(_build(Config, migrate(raw), ""))
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def import_plugins(modules) -> None:
    """Imports the modules a config's `plugins` names: their registrations (registry.py) then count
    as valid choices."""
    if modules is None:
        return
    if not isinstance(modules, list) or not all(isinstance(m, str) and m for m in modules):
        raise ConfigError(f"plugins: expected a list of module names, got {modules!r}")
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ConfigError(f"plugins: cannot import {module!r} ({e}); is it installed or on PYTHONPATH?") from None


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str | Path) -> None:
    """The resolved config as YAML, written to a temporary name and renamed."""
    import yaml

    from xlm_pkm.utils.atomic import write_text

    write_text(Path(path), yaml.safe_dump(to_dict(cfg), sort_keys=False))


def validate(cfg, prefix: str = ""):
    """Checks the value rules above on a built Config, or on one section of it (e.g. a MemoryConfig
    with prefix "model.memory."), whose keys are named from `prefix`; returns it."""
    for key, field_, value in _leaves(cfg, prefix):
        choices = _allowed(field_)
        names = value if isinstance(value, list) else [value]
        if choices is not None and any(name not in choices or isinstance(name, bool) for name in names):
            each = "each one of" if isinstance(value, list) else "one of"
            raise ConfigError(f"{key}: expected {each} {' | '.join(map(str, choices))}, got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}: must be a finite number, got {value}")
        if key in POSITIVE and not _all(value, lambda v: v > 0):
            raise ConfigError(f"{key}: must be > 0, got {value}")
        if key in NON_NEGATIVE and not _all(value, lambda v: v >= 0):
            raise ConfigError(f"{key}: must be >= 0, got {value}")
        if key in PROBABILITIES + BETAS and not 0 <= value < 1:
            raise ConfigError(f"{key}: must be in [0, 1), got {value}")
    if isinstance(cfg, Config) and not re.fullmatch(DEVICES, cfg.train.device):
        raise ConfigError(f"train.device: expected auto, cpu, cuda or cuda:N, got {cfg.train.device!r}")
    if isinstance(cfg, Config):
        _check_family(cfg.model, cfg.data.shuffle_blocks)
        _check_engram(cfg.model)
        _check_run_names(cfg.train)
        _check_fact_batches(cfg)
    if isinstance(cfg, Config) and cfg.optim.memory_finetune.top_t and not cfg.optim.memory_finetune.background:
        raise ConfigError("optim.memory_finetune.top_t needs optim.memory_finetune.background: the slot counts "
                          "of python -m xlm_pkm.finetune.slot_counts CHECKPOINT --data DIR --out FILE")
    return cfg


def _check_fact_batches(cfg: Config) -> None:
    """A fact batch is one optimizer step of a model without a stream cache."""
    if not cfg.data.fact_batches:
        return
    if cfg.optim.accumulate > 1:
        raise ConfigError(f"data.fact_batches: each step is one fact's batch; optim.accumulate={cfg.optim.accumulate} "
                          f"would mix facts in a step (raise data.fact_batches for more paraphrases instead)")
    if cfg.model.family == "all_attention":
        raise ConfigError("data.fact_batches: the all-attention family carries a stream cache from batch to batch, "
                          "which padded batches of separate facts do not have")


def _check_run_names(train: TrainConfig) -> None:
    """exp_name and exp_id name one folder each under dump_path: no path separator, not . or .."""
    for key, value in (("train.exp_name", train.exp_name), ("train.exp_id", train.exp_id)):
        if "/" in value or "\\" in value or value in (".", "..") or (key == "train.exp_name" and not value):
            raise ConfigError(f"{key}: must name one folder under train.dump_path (no / or \\, not . or ..), "
                              f"got {value!r}")


CONTEXT_SUBLAYERS = ("all_attention", "span_attention")  # relative positions and a stream cache


def _check_family(m: ModelConfig, shuffle_blocks: bool) -> None:
    """The all-attention family's sublayers and adaptive input/softmax go with model.family=all_attention;
    its stream cache needs the blocks in order."""
    context = [name for name in m.sublayers if name in CONTEXT_SUBLAYERS]
    if context and m.family != "all_attention":
        raise ConfigError(f"model.sublayers: {context[0]} needs model.family=all_attention (relative positions, "
                          f"stream cache), got model.family={m.family}")
    if context and shuffle_blocks:
        raise ConfigError(f"data.shuffle_blocks: {context[0]} carries its cache from one batch to the next, so the "
                          f"blocks must be read in order (data.shuffle_blocks=false)")
    if m.adaptive_cutoffs and m.family != "all_attention":
        raise ConfigError(f"model.adaptive_cutoffs: the adaptive input/softmax needs model.family=all_attention, "
                          f"got model.family={m.family}")
    if any(b <= a for a, b in zip(m.adaptive_cutoffs, m.adaptive_cutoffs[1:])):
        raise ConfigError(f"model.adaptive_cutoffs: must increase strictly, got {m.adaptive_cutoffs}")


def _check_engram(m: ModelConfig) -> None:
    """Engram's own rules: N-gram orders from 2, at least one table row per hash head, heads splitting the
    width evenly, a model whose batches start its N-gram windows afresh (model/memory/ngram_hash.py)."""
    e = m.engram
    if "engram" in m.sublayers:
        raise ConfigError("model.sublayers: engram is not listed there; model.engram.layers places it (first in each "
                          "of those layers)")
    if not e.layers:
        return
    if e.max_ngram < 2:
        raise ConfigError(f"model.engram.max_ngram: N-grams of order 2 and up are hashed, so it must be >= 2, "
                          f"got {e.max_ngram}")
    if e.table_size < e.heads:
        raise ConfigError(f"model.engram.table_size: one order's {e.heads} hash heads need at least one row "
                          f"each, got {e.table_size} rows")
    if e.ngram_dim % e.heads:
        raise ConfigError(f"model.engram.ngram_dim ({e.ngram_dim}) must be divisible by model.engram.heads "
                          f"({e.heads}): each head reads ngram_dim / heads columns")
    if any(not 1 <= layer <= m.n_layers for layer in e.layers) or len(set(e.layers)) != len(e.layers):
        raise ConfigError(f"model.engram.layers must be distinct layers in [1, {m.n_layers}], got {e.layers}")
    if m.family != "transformer":
        raise ConfigError("model.engram needs model.family=transformer: the all_attention family's streams continue "
                          "from one batch to the next, and Engram's N-gram window starts afresh at every batch")


def _all(value, test) -> bool:
    return all(map(test, value)) if isinstance(value, list) else test(value)


def _leaves(cfg, prefix: str):
    """(dotted key, field, value) of every non-section field, sections recursively."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, (f, hints[f.name]), value


def _allowed(field_: tuple) -> list | None:
    """The values a field may take: its Literal's, or the names in its registry; None if any."""
    f, tp = field_
    if "choices" in f.metadata:
        return _choices(f.metadata["choices"])
    if typing.get_origin(tp) is list:
        (tp,) = typing.get_args(tp)
    return list(typing.get_args(tp)) if typing.get_origin(tp) is Literal else None


def _choices(spec: str) -> list[str]:
    """The names registered in "module:REGISTRY"."""
    module, name = spec.split(":")
    return list(getattr(importlib.import_module(module), name))


def _build(cls, raw: dict, prefix: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            raise ConfigError(f"unknown config key {prefix}{key}{hint}")
        kwargs[key] = _coerce(hints[key], value, prefix + key)
    return cls(**kwargs)


def _coerce(tp, value, key: str):
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key + ".")
    origin = typing.get_origin(tp)
    if origin is Literal:  # which of its values: checked by validate
        if isinstance(value, (list, dict)):
            raise ConfigError(f"{key}: expected one of {' | '.join(map(str, typing.get_args(tp)))}, got {value!r}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(item_tp, v, key) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp in (int, float) and not isinstance(value, bool):
        try:  # YAML reads 1e-4 (no dot) as a string
            number = tp(value) if isinstance(value, str) else value
        except ValueError:
            number = None
        if isinstance(number, int) or (tp is float and isinstance(number, float)):
            return tp(number)
    if tp is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{key}: expected {tp.__name__}, got {value!r}")
