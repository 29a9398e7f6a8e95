"""RetrofitLM: memories added to a pretrained Hugging Face causal LM (Llama family: Llama, Mistral, Qwen2, SmolLM2),
beside the MLP of chosen decoder layers, the base frozen (or adapted by LoRA: optim.lora).

    base = load_base(cfg.model.base)                   # AutoModelForCausalLM of model.base.path, float32, checked
    model = RetrofitLM(cfg.model, base)                # memories of model.memory at model.base.layers
    nll = model(x, targets=y)                          # (B, T): as TransformerLM's, for the trainer and evaluation
    logits = model(tokens, cache=model.new_cache())    # incremental decoding (transformers' DynamicCache)

    python -m xlm_pkm.model.retrofit FILE.gguf models/NAME   # a GGUF file as a plain folder: loads in seconds

In a decoder layer of the base, h = x + attention(norm1(x)), then, with u = norm2(h) (the MLP's input):

    out = h + mlp(u) + gate ⊙ memory(u)          gate: (dim,), model.base.gate_init on every channel (0)

so the memory reads the normed hidden state the MLP reads, and with the gate at 0 the model computes exactly the
base's logits at step 0 while the gate's gradient, memory(u) · dL/dout, is not 0: the gate opens at the first
step, then the memory trains through it. The memory and its gate are one MemoryBeside module, added to the
MLP's output by a forward hook on it: the base's modules, and so the names of its weights, stay as they are
(its tensors are the base's own, and `base/` of an export is a plain folder of that model). Every memory design
of model.memory works (PKM and its options, PEER, UltraMem). Engram (model.engram.layers) goes beside the MLP
too, with a gate of its own (its Y of memory/engram.py in place of memory(u), u its hidden state): the rows it
reads are hashed from the token ids once per forward (ngram_hash.py; a document starts after the base's
end-of-text token, as the tokenizer's data has it: data/tokenized.py), and in decoding the cache is transformers'
DynamicCache with the N-gram and convolution windows beside it (`windows`: attention.Windows). The Engram paper
places it before the attention; beside the MLP, as the product-key memory, is where a zero gate leaves the base
as it was. The tokenizer compression reads the tokens' decoded text (data/tokenized.surface_forms).

The base's weights are marked (is_base_weight) and never train (finetune/trainable.py), so optim.trainable=all
trains the memories and gates, and LoRA's adapters with them. A checkpoint holds what trains, not the base:
state_dict() leaves out the base's own weights, which come from model.base.path, whose files' blake2b digest the
run's config records (model.base.digest): a base whose files changed is refused with one line wherever the run
is resumed, evaluated or exported. With model.base.trainable (full finetuning) the base's weights are the model's
own: unmarked, they train as optim.trainable says, and state_dict() holds them (a checkpoint is then the whole
model; the base's files are still where they start from, and still checked). Rules between this section and the
rest of model: ModelConfig.check.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import struct
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from xlm_pkm.errors import ConfigError
from xlm_pkm.model.attention import Windows
from xlm_pkm.model.blocks import SUBLAYERS, shared_state
from xlm_pkm.model.memory.engram import Engram
from xlm_pkm.model.memory.ngram_hash import NgramHash
from xlm_pkm.model.memory.pkm import ProductKeyMemory
from xlm_pkm.model.memory.value_stores import is_memory_value
from xlm_pkm.model.memory_host import MemoryHost
from xlm_pkm.model.model_settings import BaseConfig, ModelConfig
from xlm_pkm.utils.path_kind import path_problem

BASE_WEIGHT = "is_base_weight"  # the mark of a base's own parameter: it never trains, checkpoints leave it out
FAMILIES = "Llama, Mistral, Qwen2, SmolLM2"  # the Llama family: decoder layers whose MLP a memory goes beside
# what sized() reads of the base's transformers config (a GPT-2's has no intermediate_size: not of the family)
FAMILY_SIZES = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")


def is_base_weight(p: torch.Tensor) -> bool:
    """Whether p is a frozen weight of a retrofit's base (it never trains; model.base.trainable leaves it unmarked)."""
    return getattr(p, BASE_WEIGHT, False)


def base_folder(cfg: BaseConfig, root: Path | None = None) -> Path:
    """model.base.path, relative to `root` when given (an exported folder's base/), checked to be a folder."""
    folder = Path(root or ".") / cfg.path
    problem = path_problem("folder", folder)
    if problem:
        raise FileNotFoundError(f"model.base.path: {problem} (a Hugging Face model's folder: config.json and "
                                f"safetensors weights, or a GGUF file with model.base.gguf_file)")
    return folder


def base_files(cfg: BaseConfig, root: Path | None = None) -> list[Path]:
    """The files the base is loaded from: its GGUF file, else config.json and the weights (*.safetensors, or
    PyTorch's *.bin), each checked to be a file (a symbolic link to one is)."""
    folder = base_folder(cfg, root)
    if cfg.gguf_file:
        gguf = folder / cfg.gguf_file
        problem = path_problem("file", gguf)
        if problem:
            raise FileNotFoundError(f"model.base.gguf_file: {problem} (a GGUF model file in model.base.path)")
        return [gguf]
    weights = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    if not weights or not os.path.lexists(folder / "config.json"):
        raise FileNotFoundError(f"model.base.path: {folder} holds no config.json and weights (*.safetensors); for "
                                f"a GGUF file, name it with model.base.gguf_file")
    for path in [folder / "config.json", *weights]:
        problem = path_problem("file", path)
        if problem:
            raise FileNotFoundError(f"model.base.path: {problem}")
    return [folder / "config.json", *weights]


def base_digest(cfg: BaseConfig, root: Path | None = None) -> str:
    """blake2b (16 bytes, hex) of the base's files, in order (each hashed once per process and file version)."""
    total = hashlib.blake2b(digest_size=16)
    for path in base_files(cfg, root):
        stat = path.stat()
        total.update(_file_digest(path.resolve(), stat.st_size, stat.st_mtime_ns).encode())
    return total.hexdigest()


@lru_cache(maxsize=64)
def _file_digest(path: Path, size: int, mtime_ns: int) -> str:
    """blake2b of one file's bytes (size and mtime key the cache: a rewritten file is hashed again)."""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def check_digest(cfg: BaseConfig, root: Path | None = None) -> str:
    """The base's digest; if the config records one, it must be the same (a one-line ConfigError if not)."""
    digest = base_digest(cfg, root)
    if cfg.digest and digest != cfg.digest:
        raise ConfigError(f"model.base.path: the files of {Path(root or '.') / cfg.path} changed since the run "
                          f"recorded them (blake2b {digest}, recorded model.base.digest={cfg.digest}): restore "
                          f"the base the run was trained on")
    return digest


@contextmanager
def quiet_transformers():
    """transformers' progress bars (loading and saving weights) off inside, as they were after."""
    from transformers.utils import logging

    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            logging.enable_progress_bar()


def _from_pretrained(cls, cfg: BaseConfig, root: Path | None, **kwargs):
    """cls.from_pretrained of the base's folder (its GGUF file with gguf_file), local files only."""
    folder = base_folder(cfg, root)
    if cfg.gguf_file:
        kwargs["gguf_file"] = cfg.gguf_file
    try:
        with quiet_transformers():
            return cls.from_pretrained(folder, local_files_only=True, **kwargs)
    except ImportError as e:  # reading GGUF needs the gguf package (transformers says so at length)
        if cfg.gguf_file and "gguf" in str(e).lower():
            raise ConfigError("model.base.gguf_file: reading a GGUF file needs gguf: pip install "
                              "'xlm-pkm[retrofit]'") from None
        raise
    except struct.error as e:  # transformers' GGUF reader ran out of bytes in the file's header
        if not cfg.gguf_file:
            raise
        raise ValueError(f"model.base.gguf_file: {folder / cfg.gguf_file} is truncated or damaged: its header ends "
                         f"before what it declares ({e}); download or copy it again") from None
    except (OSError, ValueError) as e:  # not a model transformers knows, a damaged file
        raise ValueError(f"model.base.path: transformers cannot load {folder}"
                         f"{' / ' + cfg.gguf_file if cfg.gguf_file else ''} ({' '.join(str(e).split())[:300]})") \
            from None
    except Exception as e:
        from safetensors import SafetensorError  # a damaged weights file that check_weights did not see

        if isinstance(e, SafetensorError):
            raise ValueError(f"model.base.path: a safetensors file of {folder} is damaged ({e}); download or copy "
                             f"the model again") from None
        if type(e) is Exception and "Tokenizer" in cls.__name__:  # the tokenizers library's errors are plain
            raise ValueError(f"model.base.path: the tokenizer of {folder}"
                             f"{' / ' + cfg.gguf_file if cfg.gguf_file else ''} cannot be read "
                             f"({' '.join(str(e).split())[:300]})") from e
        raise


def check_weights(cfg: BaseConfig, root: Path | None = None) -> None:
    """Each safetensors file of the base opens: its header is whole and its tensors' bytes all there (a truncated
    copy is named here, in one line, rather than by transformers in a traceback)."""
    from safetensors import SafetensorError, safe_open

    for path in base_files(cfg, root):
        if path.suffix == ".safetensors":
            try:
                with safe_open(path, framework="pt"):
                    pass
            except SafetensorError as e:
                raise ValueError(f"model.base.path: {path} is damaged or truncated ({e}); download or copy it "
                                 f"again") from None


def load_base_config(cfg: BaseConfig, root: Path | None = None):
    """The base's transformers config (AutoConfig; from the GGUF file's metadata with gguf_file)."""
    from transformers import AutoConfig

    return _from_pretrained(AutoConfig, cfg, root)


def load_base(cfg: BaseConfig, root: Path | None = None) -> nn.Module:
    """The base (AutoModelForCausalLM) in float32, after checking its files against model.base.digest; a GGUF
    file's weights dequantized (whatever GGUF kernels are installed), so that it is a plain model."""
    from transformers import AutoModelForCausalLM, GgufConfig

    check_digest(cfg, root)
    check_weights(cfg, root)
    dequantized = {"quantization_config": GgufConfig(dequantize=True)} if cfg.gguf_file else {}
    option = f"model.base.{'gguf_file' if cfg.gguf_file else 'path'}"
    source = base_folder(cfg, root) / cfg.gguf_file if cfg.gguf_file else base_folder(cfg, root)
    with _load_report_held() as reports:
        try:
            model, info = _from_pretrained(AutoModelForCausalLM, cfg, root, dtype=torch.float32,
                                           output_loading_info=True, **dequantized)
        except RuntimeError as e:  # raised after the report: weights of other sizes than the config's
            if not reports:
                raise
            keys = re.findall(r"^(.+?)\s*\|[^|\n]*MISMATCH", reports[-1], re.MULTILINE)
            raise ValueError(f"{option}: the weights of {source} do not have the sizes its config gives them "
                             f"({', '.join(keys[:3]) or ' '.join(str(e).split())[:200]}): a config of another model, "
                             f"or a damaged one") from None
    missing = sorted(info.get("missing_keys") or [])
    if missing:  # transformers started them at random: not the base's logits
        raise ValueError(f"{option}: {source} lacks {len(missing)} of its model's weights ({', '.join(missing[:3])}"
                         f"{', ...' if len(missing) > 3 else ''}): its files are incomplete, or of another model "
                         f"than its config's")
    for report in reports:  # only weights it does not use: harmless, said as transformers says it
        logging.getLogger("transformers.modeling_utils").warning(report)
    return model


@contextmanager
def _load_report_held():
    """Inside, transformers' load report (a table of the weights missing, unused or of other sizes, logged by
    transformers.modeling_utils) is held, not logged: load_base says what is wrong in one line. Yields the list of
    the reports held."""
    held: list[str] = []

    def hold(record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if "LOAD REPORT" in text:
            held.append(text)
            return False
        return True

    logger = logging.getLogger("transformers.modeling_utils")
    logger.addFilter(hold)
    try:
        yield held
    finally:
        logger.removeFilter(hold)


def save_gguf_as_folder(gguf: Path, out: Path) -> Path:
    """A GGUF model file as a plain transformers folder `out` (new or empty): float32 safetensors weights, config
    and tokenizer, which load in seconds where the GGUF file takes a minute or more. Errors name the file given
    (not model.base.*: this command's arguments are the two paths)."""
    from transformers import AutoTokenizer

    gguf, out = Path(gguf), Path(out)
    problem = path_problem("file", gguf)
    if problem:
        raise FileNotFoundError(f"{problem} (the GGUF model file to convert)")
    if out.is_symlink() and not out.exists():
        raise FileExistsError(f"{out} is a symbolic link to {os.readlink(out)}, which does not exist: give a new "
                              f"folder")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty folder: give a new one")
    above = next(folder for folder in out.absolute().parents if os.path.lexists(folder))  # the folders to make
    problem = path_problem("folder", above)
    if problem:  # before a GGUF file's minute of loading
        raise ValueError(f"{out}: cannot make this folder: {problem}")
    cfg = BaseConfig(path=str(gguf.parent), gguf_file=gguf.name)
    try:
        model = load_base(cfg)
        tokenizer = _from_pretrained(AutoTokenizer, cfg, None)
    except (ConfigError, ValueError, FileNotFoundError) as e:  # said of model.base.*: here, of the file given
        raise type(e)(re.sub(r"^model\.base\.(gguf_file|path): ", "", str(e))) from None
    try:
        with quiet_transformers():
            model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    except OSError as e:  # a folder above that is a file, no permission, a full disk
        raise ValueError(f"{out}: cannot write the model's folder there ({e.strerror or e})") from None
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    from xlm_pkm.errors import USER_ERRORS, fail

    prog = "python -m xlm_pkm.model.retrofit"
    parser = argparse.ArgumentParser(prog=prog, description="A GGUF model file as a folder of float32 safetensors "
                                                            "weights and its tokenizer, for model.base.path.")
    parser.add_argument("gguf", help="the .gguf file (transformers reads it with gguf and accelerate installed)")
    parser.add_argument("out", help="the folder to write (new or empty)")
    args = parser.parse_args(argv)
    try:
        out = save_gguf_as_folder(args.gguf, args.out)
    except USER_ERRORS as e:
        return fail(prog, e)
    print(f"{args.gguf} -> {out}: model.base.path={out}")
    return 0


def sized(cfg: ModelConfig, base_config) -> ModelConfig:
    """`cfg` with the sizes of the base (its transformers config): model.dim, n_layers, n_heads, ffn_dim,
    vocab_size (its embedding's rows), max_len (its positions), pre_norm; model.base.layers checked against them,
    or set (the layer L - L//4 of L). A config without those sizes (a GPT-2's) is not of the Llama family: refused."""
    missing = [name for name in FAMILY_SIZES if getattr(base_config, name, None) is None]
    if missing:
        raise ConfigError(f"model.base.path: {cfg.base.path} holds a {getattr(base_config, 'model_type', '') or '?'} "
                          f"model ({type(base_config).__name__}, with no {missing[0]}), not a Llama-family one: the "
                          f"memories go beside the MLP of the decoder layers of Llama-family models ({FAMILIES})")
    n_layers = base_config.num_hidden_layers
    bad = [layer for layer in cfg.base.layers if not 1 <= layer <= n_layers]
    if bad:
        raise ConfigError(f"model.base.layers: the base has decoder layers 1 to {n_layers}, got {cfg.base.layers}")
    bad = [layer for layer in cfg.engram.layers if not 1 <= layer <= n_layers]
    if bad:
        raise ConfigError(f"model.engram.layers: the base has decoder layers 1 to {n_layers}, got {cfg.engram.layers}")
    layers = cfg.base.layers or [n_layers - n_layers // 4]
    return dataclasses.replace(
        cfg, base=dataclasses.replace(cfg.base, layers=layers), dim=base_config.hidden_size, n_layers=n_layers,
        n_heads=base_config.num_attention_heads, ffn_dim=base_config.intermediate_size,
        vocab_size=base_config.vocab_size, max_len=getattr(base_config, "max_position_embeddings", cfg.max_len),
        pre_norm=True)


def resolved(cfg: ModelConfig) -> ModelConfig:
    """`cfg` as a run records it: the base's sizes (sized) and the digest of its files (model.base.digest; one
    already recorded is checked)."""
    digest = check_digest(cfg.base)  # first: a missing file is named
    cfg = sized(cfg, load_base_config(cfg.base))
    return dataclasses.replace(cfg, base=dataclasses.replace(cfg.base, digest=digest))


def engram_ids(base_config) -> tuple[int, int]:
    """(the end-of-text id after which Engram's N-grams start again, the id of a position outside a document): the
    base's EOS (its first, where it has several) and its pad token, or the EOS where it has none."""
    eos = base_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    pad = base_config.pad_token_id
    return eos, eos if pad is None else pad


class MemoryBeside(nn.Module):
    """A memory and its output gate beside an MLP: mlp(u) + gate ⊙ memory(u) (+ shift, model.base.shift), added by a
    forward hook on the MLP. An Engram reads engram(u, rows, windows) instead: `ngram_inputs`, which RetrofitLM sets
    before each forward of the base."""

    def __init__(self, memory: ProductKeyMemory | Engram, dim: int, gate_init: float, shift: bool = False):
        super().__init__()
        self.memory = memory
        self.gate = nn.Parameter(torch.full((dim,), float(gate_init)))  # (dim,)
        self.shift = nn.Parameter(torch.zeros(dim)) if shift else None  # (dim,)
        self.ngram_inputs: tuple = ()  # an Engram's (rows (B, T, (N-1)·K), windows or None) of this forward

    def add_to_output(self, mlp: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        """The MLP's forward hook: args[0] is its input u (B, T, dim), out its output (B, T, dim)."""
        out = out + self.gate * self.memory(args[0], *self.ngram_inputs)
        return out if self.shift is None else out + self.shift


class RetrofitLM(MemoryHost, nn.Module):
    def __init__(self, cfg: ModelConfig, base: nn.Module):
        """Memories of cfg.memory beside the MLPs of cfg.base.layers of `base` (a transformers causal LM), whose
        weights are frozen and marked is_base_weight (with cfg.base.trainable: left as the model's own weights);
        self.cfg is `cfg` with the base's sizes (sized)."""
        super().__init__()
        self.cfg = cfg = sized(cfg, base.config)
        layers = getattr(base.get_decoder(), "layers", None)
        if layers is None or not all(hasattr(layer, "mlp") for layer in layers):
            raise ConfigError(f"model.base.path: a {type(base).__name__}, whose decoder layers have no .mlp: the "
                              f"memories go beside the MLP of Llama-family models ({FAMILIES})")
        self.holds_base = cfg.base.trainable  # whether state_dict() holds the base's weights (export: base/ does)
        for p in base.parameters():
            if not cfg.base.trainable:
                p.requires_grad_(False)
                setattr(p, BASE_WEIGHT, True)
        self.base = base
        shared = shared_state(cfg, [["memory"]])  # with memory.share_values, one value store for every memory
        self.beside = nn.ModuleDict()  # product-key memories by layer
        for layer in cfg.base.layers:
            beside = MemoryBeside(SUBLAYERS["memory"](cfg, shared), cfg.dim, cfg.base.gate_init, cfg.base.shift)
            self.beside[str(layer)] = beside
            layers[layer - 1].mlp.register_forward_hook(beside.add_to_output)
        self.ngram_hash = None  # Engram's rows of every layer (the trainer and TransformerLM's callers read it)
        self.engram_beside = nn.ModuleDict()  # Engrams by layer
        if cfg.engram.layers:
            eos, pad = engram_ids(base.config)
            self.ngram_hash = NgramHash(cfg.engram, cfg.vocab_size, document_start=None, document_end=eos, pad=pad)
        for i, layer in enumerate(cfg.engram.layers):
            engram = Engram(cfg.engram, cfg.dim, self.ngram_hash.layer_rows(i))
            beside = MemoryBeside(engram, cfg.dim, cfg.base.gate_init, cfg.base.shift)
            self.engram_beside[str(layer)] = beside
            layers[layer - 1].mlp.register_forward_hook(beside.add_to_output)

    def forward(self, tokens: torch.Tensor, cache=None, targets: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, T) int64 -> logits (B, T, vocab); with targets (B, T), the float32 negative log-likelihood of
        each (B, T) instead. With a cache (new_cache()), tokens are the positions after those it holds."""
        with self.engrams_fed(tokens, cache):
            logits = self.base(input_ids=tokens, cache=cache, use_cache=cache is not None).logits  # (B, T, vocab)
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none").view(targets.shape)

    def hidden(self, tokens: torch.Tensor, cache=None) -> torch.Tensor:
        """tokens (B, T) int64 -> the last hidden states (B, T, dim), before the base's output layer."""
        with self.engrams_fed(tokens, cache):
            return self.base.get_decoder()(input_ids=tokens, cache=cache,
                                           use_cache=cache is not None).last_hidden_state

    @contextmanager
    def engrams_fed(self, tokens: torch.Tensor, cache):
        """Inside, each Engram beside has the rows of `tokens` (B, T) and the cache's windows (ngram_inputs)."""
        if self.ngram_hash is None:
            yield
            return
        windows = None
        if cache is not None:
            windows = getattr(cache, "windows", None)
            if windows is None:
                raise ValueError("a retrofit with Engram decodes with its own cache (new_cache()): this one has "
                                 "no N-gram windows")
        rows = self.ngram_hash(tokens, windows)  # (B, T, engrams, (N-1)·K)
        besides = list(self.engram_beside.values())
        for i, beside in enumerate(besides):
            beside.ngram_inputs = (rows[:, :, i], windows)
        try:
            yield
        finally:
            for beside in besides:
                beside.ngram_inputs = ()

    def new_cache(self):
        """An empty key/value cache of the base (transformers' DynamicCache) for forward(tokens, cache), with the
        windows of Engram's N-gram hash and convolution beside it (`windows`)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.base.config)
        cache.windows = Windows()
        return cache

    def memories(self) -> list[tuple[int, ProductKeyMemory]]:
        return [(int(layer), beside.memory) for layer, beside in self.beside.items()]

    def engrams(self) -> list[tuple[int, Engram]]:
        return [(int(layer), beside.memory) for layer, beside in self.engram_beside.items()]

    def besides(self) -> list[MemoryBeside]:
        """Every memory's and Engram's MemoryBeside."""
        return [*self.beside.values(), *self.engram_beside.values()]

    # ---- what a checkpoint holds -----------------------------------------------------------------
    @staticmethod
    def is_base_key(name: str) -> bool:
        """Whether a state-dict name is one of the base's own weights (under base., not a LoRA adapter's)."""
        return name.startswith("base.") and ".lora_" not in name

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The trained tensors only: memories, gates and LoRA adapters, not the base's own weights (they are
        loaded from model.base.path, whose digest the config records), unless holds_base (model.base.trainable)."""
        state = super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        if self.holds_base:
            return state
        for name in [k for k in state if k.startswith(prefix) and self.is_base_key(k[len(prefix):])]:
            del state[name]
        return state

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Loads state_dict()'s tensors; the base's own weights stay as loaded from its folder (unless holds_base:
        then they are part of what must be given)."""
        keys = super().load_state_dict(state_dict, strict=False, assign=assign)
        keys.missing_keys[:] = [k for k in keys.missing_keys if self.holds_base or not self.is_base_key(k)]
        if strict and (keys.missing_keys or keys.unexpected_keys):
            raise RuntimeError(f"RetrofitLM: missing {keys.missing_keys[:5]}, unexpected {keys.unexpected_keys[:5]}")
        return keys

    @torch.no_grad()
    def merge_adapters(self, state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
        """Adds the LoRA adapters of `state` (a checkpoint of a run with optim.lora: NAME.lora_A.default.weight
        (rank, in), NAME.lora_B.default.weight (out, rank)) into the base's linears, W += scale · B A (scale =
        alpha / rank), and returns `state` without them: this model then computes what the run's adapted one did."""
        linears = dict(self.named_modules())
        for name_a in [k for k in state if k.endswith(".lora_A.default.weight")]:
            module = name_a.removesuffix(".lora_A.default.weight")
            weight = linears[module].weight  # (out, in)
            weight += scale * (state[f"{module}.lora_B.default.weight"] @ state[name_a]).to(weight.dtype)
        return {k: v for k, v in state.items() if not re.search(r"\.lora_[AB]\.default\.weight$", k)}

    # ---- the rest of what TransformerLM offers its callers ---------------------------------------
    def stream_layers(self) -> list:
        return []  # no layer carries a stream cache between forwards

    def stream_state(self) -> list:
        return []

    def load_stream_state(self, state: list) -> None:
        if state:
            raise ValueError(f"stream state has {len(state)} caches, a retrofit has no stream layer")

    def reset_stream_state(self, training: bool | None = None) -> None:
        pass

    def has_aux_loss(self) -> bool:
        """Whether a memory's key search adds a training loss term (UltraMem's)."""
        return any(hasattr(m.keys, "aux_loss") for _, m in self.memories())

    def aux_loss(self) -> torch.Tensor:
        terms = [m.aux_loss() for _, m in self.memories()]
        return sum((t for t in terms if t is not None), torch.zeros((), device=self.base.device))

    def clamp_spans(self) -> None:
        pass  # no adaptive span

    def param_counts(self) -> dict[str, int]:
        """total = dense + memory_values (sharded tables whole); then the base's own weights, the memories' other
        parameters, their gates, their shifts and LoRA's adapters (each of these two when added): the parts of
        dense."""
        values = self.memory_value_count()
        dense = sum(p.numel() for p in self.parameters() if not is_memory_value(p))
        base = sum(p.numel() for name, p in self.base.named_parameters() if ".lora_" not in name)
        gates = sum(b.gate.numel() for b in self.besides())
        memory = sum(p.numel() for b in self.besides() for p in b.memory.parameters() if not is_memory_value(p))
        shifts = sum(b.shift.numel() for b in self.besides() if b.shift is not None)
        adapters = sum(p.numel() for p in self.base.parameters()) - base
        counts = {"total": dense + values, "dense": dense, "memory_values": values, "base": base, "memory": memory,
                  "gates": gates, "shifts": shifts, "lora_adapters": adapters}
        return {name: n for name, n in counts.items() if n or name not in ("shifts", "lora_adapters")}

    def dense_flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, as TransformerLM counts them: 6 per weight of the base (its input embedding, a
        lookup, left out unless tied to the output), 12 · seq_len · dim per layer for attention's scores and
        mixing, and the memories' (with 6 per gate weight)."""
        weights = sum(p.numel() for p in self.base.parameters())
        embedding = self.base.get_input_embeddings().weight
        if self.base.get_output_embeddings().weight is not embedding:
            weights -= embedding.numel()
        attention = 12.0 * seq_len * self.cfg.dim * self.cfg.n_layers
        return 6.0 * weights + attention + sum(6.0 * b.gate.numel() + b.memory.flops_per_token(seq_len)
                                               for b in self.besides())


if __name__ == "__main__":
    import sys

    sys.exit(main())
