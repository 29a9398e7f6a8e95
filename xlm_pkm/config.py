"""Every knob of a run, as dataclasses: YAML files plus dotted command-line overrides.

    cfg = load_config("configs/paper/l12_d1024_m1.yaml", ["optim.lr=1e-4", "model.memory.n_keys=256"])

An unknown key or a value of the wrong type raises ConfigError naming it (and the closest valid key).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml


class ConfigError(ValueError):
    """A configuration file or override is invalid; the message names the key at fault."""


@dataclass
class MemoryConfig:
    """A Product Key Memory layer (paper §3). Options beyond the paper are off by default."""

    n_keys: int = 512  # sub-keys per half: |K| = n_keys ** 2 slots (flat: n_keys ** 2 full keys)
    k_dim: int = 512  # query / key dimension (product: two halves of k_dim / 2)
    heads: int = 4  # memory heads; each has its own query and keys, the value table is shared
    knn: int = 32  # keys selected per head
    # product | flat (exhaustive search over |K| full keys, Table 4) | any class in model/keys.py
    key_type: str = field(default="product", metadata={"choices": "xlm_pkm.model.keys:KEY_SEARCHES"})
    # batchnorm (paper, §4.5; training statistics span the batch) | layernorm (per head, causal) | none
    query_norm: typing.Literal["batchnorm", "layernorm", "none"] = "batchnorm"
    query_hidden: list[int] = field(default_factory=list)  # hidden sizes of the query MLP (ReLU)
    input_dropout: float = 0.0
    query_dropout: float = 0.0
    value_dropout: float = 0.0
    gated: bool = False  # Memory+ output gating: W_o(silu(W_g x) * read) (Berges et al. 2024)
    qk_norm: bool = False  # L2-normalise queries and keys (product: each half) before scoring
    temperature: float = 1.0  # softmax(scores / temperature) over the selected keys; 1: the paper
    share_values: bool = False  # all memory layers of the model read one value table
    # auto (Triton kernels on CUDA, EmbeddingBag on CPU) | torch | triton (model/value_read.py)
    value_read: typing.Literal["auto", "torch", "triton"] = "auto"


@dataclass
class ModelConfig:
    """A causal transformer LM (paper §4.3), with memories replacing or following some FFNs."""

    vocab_size: int = 0  # 0: taken from the data's vocabulary
    dim: int = 1024
    n_layers: int = 12
    n_heads: int = 16
    ffn_dim: int = 0  # 0: 4 * dim
    dropout: float = 0.0
    attention_dropout: float = 0.0
    max_len: int = 512  # learned positional embeddings
    pre_norm: bool = False  # False: post-norm, as XLM
    # the sublayer types of every layer, in order (model/blocks.py); a memory layer's "ffn" gives way
    # to the memory (mem_mode replace), or the memory follows the others (add)
    sublayers: list[str] = field(default_factory=lambda: ["attention", "ffn"],
                                 metadata={"choices": "xlm_pkm.model.blocks:SUBLAYERS"})
    n_memories: int = 0  # interspersed at regular intervals (see transformer.memory_layers)
    mem_layers: list[int] = field(default_factory=list)  # explicit 1-indexed layers (wins over n_memories)
    # replace: memory instead of the FFN | add: x + memory(x) after the FFN
    mem_mode: typing.Literal["replace", "add"] = "replace"
    memory: MemoryConfig = field(default_factory=MemoryConfig)


@dataclass
class DataConfig:
    path: str = "data/processed/sample"  # output directory of xlm_pkm.data.preprocess
    batch_size: int = 32  # sequences per rank per forward
    bptt: int = 256  # tokens per sequence
    eval_batch_size: int = 0  # 0: same as batch_size


@dataclass
class OptimConfig:
    """Adam with the inverse square-root schedule (Vaswani et al.); memory values in their own group."""

    lr: float = 2.5e-4
    beta1: float = 0.9
    beta2: float = 0.98
    eps: float = 1e-8
    weight_decay: float = 0.0
    schedule: str = "inverse_sqrt"  # inverse_sqrt | constant
    warmup_steps: int = 4000
    warmup_init_lr: float = 1e-7
    clip_grad_norm: float = 0.0  # per parameter group; 0: off
    accumulate: int = 1  # forward/backward passes per optimizer step
    mem_values_lr: float = 1e-3  # constant Adam lr of the memory values
    mem_values_weight_decay: float = 0.0


@dataclass
class TrainConfig:
    exp_name: str = "default"
    exp_id: str = ""  # empty: a new id; an existing one resumes
    dump_path: str = "dumped"
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    precision: str = "fp32"  # fp32 | fp16 | bf16
    compile: bool = False
    max_steps: int = 100_000
    max_time_minutes: float = 0.0  # 0: no limit; else stop (with a checkpoint) after this long
    log_every: int = 50
    eval_every: int = 1000
    eval_max_batches: int = 0  # 0: the whole split
    max_nonfinite: int = 10  # consecutive non-finite losses before stopping (fp32/bf16)
    num_threads: int = 0  # torch CPU threads; 0: torch's default


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Defaults, then the YAML file at `path` (and its `base:` chain), then `key.sub=value` overrides
    (values parsed as YAML)."""
    raw = read_yaml(Path(path)) if path is not None else {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key.sub=value")
        node = raw
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p} is not a section")
        node[leaf] = yaml.safe_load(value) if value else ""
    return _build(Config, raw, "")


def read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """A config file as a dict; `base: other.yaml` (relative to the file) is read first, then updated."""
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


def load_config_dict(raw: dict, source: str = "config") -> Config:
    """A Config from a plain dict (as stored in checkpoints), with the same checks as load_config."""
    try:
        return _build(Config, raw, "")
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


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
