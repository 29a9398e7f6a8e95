"""A run's config: YAML files plus dotted command-line overrides, composed from each component's settings.

    cfg = load_config("configs/paper/l12_d1024_m1.yaml", ["optim.lr=1e-4", "model.memory.n_keys=256"])

Each section is a dataclass in its package's settings module, which imports none of the package's code (the
code imports it), and checks itself (settings.py):

    model          ModelConfig   model/model_settings.py          .span: SpanConfig, .base: BaseConfig
    model.memory   MemoryConfig  model/memory/memory_settings.py  .peer, .tucker, .expanded: the same module
    model.engram   EngramConfig  model/memory/memory_settings.py
    data           DataConfig    data/stream.py                   (it imports no other module of data/)
    optim          OptimConfig   optim/optim_settings.py          .lora, .memory_finetune: the same module (*)
    train          TrainConfig   here, with train.wandb: WandbConfig (the run itself)

A name a section chooses (model.sublayers, model.memory.key_type, optim.optimizer...) is checked against a
registry of those settings modules, which the code's modules fill when imported: this module imports them
(model.blocks, which imports the memory's parts, and optim.optimizers, which imports the schedules), and a
config's plugins register theirs (registry.py).

(*) LoRA and sparse memory finetuning run in finetune/, which loads checkpoints and so sits above this
module; their settings are part of the optimizer's section (which parameters and rows a step updates), so
they live beside OptimConfig, below this module, and finetune/ reads them from there.

The loader checks every value once: an unknown key (with the closest valid one), a wrong type, then each
field's own rule (settings.py: a Literal's or a registry's choices, > 0, >= 0, [0, 1), a finite float),
each section's rules between its fields (its `check`), and the rules between sections (Config.check). Each
raises a one-line ConfigError naming the key and what is allowed. Code using a loaded Config can rely on
these. Keys of earlier versions: RENAMED and REPLACED (a user's file gets an error naming the new key; a
stored config, in a checkpoint or a run's config.yaml, is migrated).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import re
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from xlm_pkm.data.stream import DataConfig
from xlm_pkm.errors import ConfigError
from xlm_pkm.model import blocks  # noqa: F401 (registers the sublayers; its memory imports register their parts)
from xlm_pkm.model.model_settings import CONTEXT_SUBLAYERS, ModelConfig
from xlm_pkm.model.transformer import resolve_memory_layers
from xlm_pkm.optim import optimizers  # noqa: F401 (registers the optimizers and schedules optim names)
from xlm_pkm.optim.optim_settings import OptimConfig
from xlm_pkm.runtime.precision import DEVICES
from xlm_pkm.settings import architecture_keys, check, choice_text, non_negative, positive
from xlm_pkm.utils.path_component import check_path_component

# configs/default.yaml, train.py's config when none is given: the copy installed with the package (pip install .),
# else the checkout's
PACKAGED_CONFIG = Path(__file__).resolve().parent / "configs" / "default.yaml"
CHECKOUT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"
DEFAULT_CONFIG = PACKAGED_CONFIG if PACKAGED_CONFIG.is_file() else CHECKOUT_CONFIG


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
    """The run itself: where it is written, how long it trains, when it logs, evaluates and saves: train."""

    exp_name: str = "default"  # runs go to dump_path/exp_name/exp_id/
    exp_id: str = ""  # empty: a new id; an existing one resumes; last: the latest unfinished run of exp_name
    dump_path: str = "dumped"  # where run directories are made
    seed: int = field(default=0, metadata=non_negative())  # weights, data order and dropout
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    precision: Literal["fp32", "fp16", "bf16"] = "fp32"  # fp16 (CUDA, loss scaling) and bf16: torch.amp autocast
    compile: bool = False  # torch.compile the model
    max_steps: int = field(default=100_000, metadata=positive())  # optimizer steps of the whole run
    # 0: no limit; else stop (with a checkpoint) after this long
    max_time_minutes: float = field(default=0.0, metadata=non_negative())
    log_every: int = field(default=50, metadata=positive())  # a train line every this many steps
    # valid perplexity (best.pt) and checkpoint.pt every this many steps
    eval_every: int = field(default=1000, metadata=positive())
    # N > 0: validation reads the tokens of one process's first N batches of data.eval_batch_size rows, split across
    # the ranks (~N / W batches each): the same tokens on any number of processes with the same eval batch size
    # (data/stream.py); 0: the whole split
    eval_max_batches: int = field(default=0, metadata=non_negative())
    # checkpoint.pt also every this many steps (0: at evaluations only)
    save_every_steps: int = field(default=0, metadata=non_negative())
    # checkpoint.pt also every this many minutes, so that a crash loses at most that much (0: at evaluations only)
    save_every_minutes: float = field(default=15.0, metadata=non_negative())
    # consecutive non-finite losses before stopping (fp32/bf16)
    max_nonfinite: int = field(default=10, metadata=positive())
    num_threads: int = field(default=0, metadata=non_negative())  # torch CPU threads; 0: torch's default
    # a collective waiting longer fails, naming the missing ranks
    collective_timeout_minutes: float = field(default=10.0, metadata=positive())
    # ddp: every rank holds the whole dense model (DistributedDataParallel) | fsdp: the dense model's blocks fully
    # sharded over the ranks (FSDP2, runtime/fsdp.py); memory values and Engram tables stay outside either
    parallel: Literal["ddp", "fsdp"] = "ddp"
    # fsdp: free each block's gathered weights after its forward (gathered again for the backward: less memory,
    # one more all-gather per block); false: keep them until the backward
    fsdp_reshard_after_forward: bool = True
    # a trained model to start from (best.pt, checkpoint.pt or an exported folder): its weights only, the run
    # keeps its own step 0, optimizers and data (init_from.py); ignored when the run directory resumes
    init_from: str = ""
    init_strict: bool = True  # both models have the same tensors; false: retrofit (load the shared ones)
    wandb: WandbConfig = field(default_factory=WandbConfig)  # Weights & Biases logging (off unless a project is set)

    def check(self, prefix: str) -> None:
        """A device name torch knows; exp_name and exp_id name one folder each under dump_path
        (utils/path_component.py: no path separator, not . or .., no NUL, valid UTF-8, at most 255 bytes), checked
        before anything is created; an empty exp_id asks for a new one."""
        if not re.fullmatch(DEVICES, self.device):
            raise ConfigError(f"{prefix}device: expected auto, cpu, cuda or cuda:N, got {self.device!r}")
        for key, value in (("exp_name", self.exp_name), ("exp_id", self.exp_id)):
            problem = None if key == "exp_id" and not value else check_path_component(value, f"{prefix}{key}")
            if problem:
                raise ConfigError(problem)


@dataclass
class Config:
    """A run's config: each component's section, composed (each in its package's settings module: see the module
    docstring)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    # modules imported before the checks (and again wherever the config is loaded: evaluate.py, export),
    # so that they can register key searches, sublayers, optimizers, schedules (registry.py)
    plugins: list[str] = field(default_factory=list)

    def check(self, prefix: str) -> None:
        """The rules between sections."""
        context = [name for name in self.model.sublayers if name in CONTEXT_SUBLAYERS]
        if context and self.data.shuffle_blocks:
            raise ConfigError(f"data.shuffle_blocks: {context[0]} carries its cache from one batch to the next, so "
                              f"the blocks must be read in order (data.shuffle_blocks=false)")
        if self.train.parallel == "fsdp" and self.optim.lora.rank:
            raise ConfigError("train.parallel=fsdp: LoRA's adapters (optim.lora) are not fully sharded here (best.pt "
                              "merges them from whole weights); use train.parallel=ddp")
        base = self.model.base
        if base.path and self.train.parallel == "fsdp":
            raise ConfigError("train.parallel=fsdp: a retrofit (model.base.path) trains its memories beside a frozen "
                              "base, which is not fully sharded here; use train.parallel=ddp")
        if base.trainable and self.optim.lora.rank:
            raise ConfigError(f"model.base.trainable: LoRA (optim.lora.rank={self.optim.lora.rank}) adapts a frozen "
                              f"base; train the base's weights (full finetuning) or its adapters, not both")
        if base.path and not base.gate_init and self.optim.trainable == ["memory_values"] and not self.train.init_from:
            raise ConfigError("optim.trainable=memory_values: the memories' gates stay at model.base.gate_init=0, so "
                              "no value ever reaches the output; train the gates too (optim.trainable=memory), or "
                              "start from a trained retrofit (train.init_from)")
        if self.data.fact_batches:  # a fact batch is one optimizer step of a model without a stream cache
            if self.optim.accumulate > 1:
                raise ConfigError(f"data.fact_batches: each step is one fact's batch; optim.accumulate="
                                  f"{self.optim.accumulate} would mix facts in a step (raise data.fact_batches for "
                                  f"more paraphrases instead)")
            if self.model.family == "all_attention":
                raise ConfigError("data.fact_batches: the all-attention family carries a stream cache from batch to "
                                  "batch, which padded batches of separate facts do not have")


# Keys of earlier versions: a user's file gets an error saying what replaced them; a checkpoint's stored
# config is migrated (the value moves to the new key).
RENAMED = {
    "optim.mem_values_lr": "optim.values_lr",
    "optim.mem_values_weight_decay": "optim.values_weight_decay",
    # the variants' settings moved into their own sections of model.memory, beside their code
    "model.memory.peer_activation": "model.memory.peer.activation",
    **{f"model.memory.tucker_{key}": f"model.memory.tucker.{key}"
       for key in ("rank", "cores", "topm", "both_signs", "aux_coeff", "aux_margin")},
    "model.memory.value_expansion": "model.memory.expanded.expansion",
    "model.memory.value_dim": "model.memory.expanded.value_dim",
}
REPLACED = {"model.memory.sparse": ("optim.values_optimizer", {True: "lazy_adam", False: "adam"})}


def load_config(path: str | Path | None = None, overrides: list[str] = (), start: dict | None = None) -> Config:
    """Defaults (or `start`: a stored config, as a run's config.yaml, migrated first), then the YAML file at
    `path` (and its `base:` chain), then `key.sub=value` overrides (values parsed as YAML, but those of a string
    setting, taken as written: train.exp_id=0123 is '0123', not 83)."""
    import yaml

    raw = migrate(start or {})
    if path is not None:
        raw = _merge(raw, read_yaml(Path(path)))
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key.sub=value")
        try:
            parsed = value if _is_text(key, value) else yaml.safe_load(value) if value else ""
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


def _is_text(key: str, value: str) -> bool:
    """Whether an override's value is taken as written: its setting is a string (train.exp_id, train.exp_name, a
    path...), and it is not quoted (a YAML string, '...' or "...", is unquoted as before)."""
    tp = Config
    for part in key.split("."):
        if not dataclasses.is_dataclass(tp) or part not in _type_hints(tp):
            return False  # not a key: the loader names it
        tp = _type_hints(tp)[part]
    return tp is str and not (len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"")


def _unique_keys_loader():
    """yaml.SafeLoader refusing a key given twice in one mapping (PyYAML keeps the last one without a word)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            keys = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: its keys may be given again here
                    continue
                key = self.construct_object(key_node, deep=deep)
                if key in keys:
                    raise yaml.constructor.ConstructorError(None, None, f"key {key!r} given twice",
                                                            key_node.start_mark)
                keys.add(key)
            return super().construct_mapping(node, deep)

    return UniqueKeyLoader


def read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """A config file as a dict; `base: other.yaml` (relative to the file) is read first, then updated."""
    import yaml

    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.load(f, Loader=_unique_keys_loader()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.object[e.start:e.start + 1]!r} at offset {e.start}): "
                          f"save it as UTF-8") from None
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


def _dotted(tree: dict, key: str, default):
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return default
        tree = tree[part]
    return tree


def architecture_changes(saved: dict, cfg: Config) -> list[tuple[str, object, object]]:
    """(key, saved value, value in `cfg`) of every key marked settings.architecture() that differs between a
    checkpoint's stored config (a dict in today's keys: migrate) and `cfg`; a key that an earlier version did
    not store has its default."""
    defaults = architecture_keys(Config())
    before = {key: _dotted(saved, key, default) for key, default in defaults.items()}
    after = architecture_keys(cfg)
    saved_model = ModelConfig(n_layers=_dotted(saved, "model.n_layers", cfg.model.n_layers),
                              n_memories=_dotted(saved, "model.n_memories", 0), mem_layers=before["model.mem_layers"])
    # the memories' placement: model.mem_layers, or the layers that model.n_memories spreads them over
    before["model.mem_layers"] = resolve_memory_layers(saved_model)
    after["model.mem_layers"] = resolve_memory_layers(cfg.model)
    return [(key, before[key], value) for key, value in after.items() if before[key] != value]


def refuse_architecture_change(saved: dict, cfg: Config, source) -> None:
    """ConfigError naming the first architecture key whose value differs (architecture_changes), both values and
    what to do: a run resumes only with the model it saved."""
    changes = architecture_changes(saved, cfg)
    if not changes:
        return
    key, old, new = changes[0]
    more = f" (and {', '.join(k for k, _, _ in changes[1:])})" if len(changes) > 1 else ""
    raise ConfigError(f"{source}: a checkpoint of another architecture: saved with {key}={old}, resumed with "
                      f"{key}={new}{more}; resume with {key}={old}, or start a new run from its weights with "
                      f"train.init_from={source}")


def load_config_dict(raw: dict, source: str = "config", run_config: bool = False) -> Config:
    """A Config from a plain dict (as stored in checkpoints, migrated from earlier versions), with the
    same checks as load_config. The modules its `plugins` names are imported only when it is a run directory's
    own config.yaml (`run_config`: a config file of the user's, as a resume reads it); a checkpoint's or an
    exported folder's config is data, and never imports code: its plugins must be imported already
    (require_plugins)."""
    try:
        (import_plugins if run_config else require_plugins)(raw.get("plugins"))
        return validate(_build(Config, migrate(raw), ""))
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def _plugin_list(modules) -> list[str]:
    if modules is None:
        return []
    if not isinstance(modules, list) or not all(isinstance(m, str) and m for m in modules):
        raise ConfigError(f"plugins: expected a list of module names, got {modules!r}")
    return modules


def require_plugins(modules) -> None:
    """ConfigError unless every module that a stored config's `plugins` names is imported already (by the run's
    own config, or a command's --plugins): a checkpoint or an exported folder never makes us import code."""
    missing = [m for m in _plugin_list(modules) if m not in sys.modules]
    if missing:
        raise ConfigError(f"plugins: names {', '.join(missing)}, which loading never imports (a checkpoint is data, "
                          f"its plugins would run code); if you trust them, import them yourself: --plugins "
                          f"{','.join(missing)} (evaluate.py, generate.py, export), or plugins=[...] in the run's "
                          f"config (train.init_from)")


def add_plugins_option(parser) -> None:
    """--plugins M[,M...] of a command that loads a trained model: the user's word that those modules may be
    imported (import_plugins(args.plugins)), since the checkpoint's own `plugins` never are."""
    parser.add_argument("--plugins", type=lambda text: [m for m in text.split(",") if m], metavar="MODULE[,MODULE]",
                        help="modules to import first, for a model whose config names plugins (their code runs: "
                             "a checkpoint never imports them itself)")


def import_plugins(modules) -> None:
    """Imports the modules a config's `plugins` names: their registrations (registry.py) then count
    as valid choices."""
    for module in _plugin_list(modules):
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ConfigError(f"plugins: cannot import {module!r} ({e}); is it installed or on PYTHONPATH?") from None


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def flat(tree: dict, prefix: str = "") -> dict:
    """{dotted.key: value} of each leaf of a nested dict (a config's to_dict, a config file's YAML)."""
    out = {}
    for key, value in tree.items():
        out |= flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value}
    return out


def save_config(cfg: Config, path: str | Path) -> None:
    """The resolved config as YAML, written to a temporary name and renamed."""
    import yaml

    from xlm_pkm.utils.atomic import write_text

    write_text(Path(path), yaml.safe_dump(to_dict(cfg), sort_keys=False))


def validate(cfg, prefix: str = ""):
    """Checks a built Config, or one section of it (e.g. a MemoryConfig with prefix "model.memory."), whose keys
    are named from `prefix` (settings.check: every field's rule, then each section's own); returns it."""
    return check(cfg, prefix)


def _build(cls, raw: dict, prefix: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = _type_hints(cls)
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            raise ConfigError(f"unknown config key {prefix}{key}{hint}")
        kwargs[key] = _coerce(hints[key], value, prefix + key)
    return cls(**kwargs)


@functools.cache
def _type_hints(cls) -> dict:
    """typing.get_type_hints of a settings dataclass, resolved once (every config load builds every section)."""
    return typing.get_type_hints(cls)


def _coerce(tp, value, key: str):
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key + ".")
    origin = typing.get_origin(tp)
    if origin is Literal:  # which of its values: checked by validate
        if isinstance(value, (list, dict)):
            raise ConfigError(f"{key}: expected one of {' | '.join(map(choice_text, typing.get_args(tp)))}, got "
                              f"{value!r}")
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
