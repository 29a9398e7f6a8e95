"""A model trained here as a Hugging Face transformers model: the code an exported folder runs (export.py
copies this file there as modeling_xlm_pkm.py, beside the model's own modules (hf_code.py), so that it needs
torch, transformers and safetensors only).

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)   # eval mode
    logits = model(input_ids).logits                   # (B, T, vocab): TransformerLM's logits
    ids = model.generate(input_ids, max_new_tokens=20, do_sample=False)   # with its own key/value cache

The folder's config.json is the run's resolved config (model, data, optim, train) plus the keys transformers
reads (model_type, auto_map, vocab_size, the special tokens' ids); model.safetensors holds TransformerLM's
tensors under their own names, a value table shared by several memories once (safetensors' rule for shared
tensors: save_model / load_model). from_pretrained therefore loads them itself, with safetensors'
load_model, rather than through transformers' loader. Decoding keeps the model's KVCache (attention keys
and values, Engram's N-gram windows) between steps: generate() feeds only the new tokens, as generate.py
does. A batch must not be padded on the left (an attention mask with zeros is refused): every row is read
from its first position, as in training. Loaded in bf16 or fp16 (from_pretrained's dtype), the memory and Engram
layers stay in float32, as under training's autocast: their input is cast to float32 and their output back; their
tables stay as stored (float32, or bfloat16: model.memory.value_dtype), neither rounded nor copied. An edited
config.json is refused: its `model` section must have the hash the weights' metadata records, and their shapes.

A retrofit (model.base: model/retrofit.py) is RetrofitLM: its base is the folder's base/ (a plain transformers
folder, loaded by AutoModelForCausalLM), its memories and gates model.safetensors; its cache is the base's own
(transformers' DynamicCache).
"""

from __future__ import annotations

import dataclasses
import os
import typing

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DynamicCache, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import cached_file

from xlm_pkm.model.attention import KVCache
from xlm_pkm.model.memory.value_stores import is_memory_value
from xlm_pkm.model.retrofit import RetrofitLM
from xlm_pkm.model.transformer import ModelConfig, TransformerLM, model_config_digest

MODEL_TYPE = "xlm_pkm"
WEIGHTS = "model.safetensors"
# the output's field for the cache: "cache" in transformers >= 5.24, "past_key_values" before
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def build_dataclass(cls, raw: dict):
    """An instance of the (nested) config dataclass `cls` from its dict, as written by the run (already
    checked by the run that saved it)."""
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: build_dataclass(hints[f.name], raw[f.name]) if dataclasses.is_dataclass(hints[f.name])
                  else raw[f.name] for f in dataclasses.fields(cls) if f.name in raw})


def check_model_config(model: dict, weights: str) -> None:
    """ValueError unless the config's `model` section is the one the weights were exported with (the digest in
    their metadata, when recorded): an edited n_heads keeps every shape, and would run the weights cut another way."""
    from safetensors import safe_open

    with safe_open(weights, "pt") as f:
        digest = (f.metadata() or {}).get("model_config_digest")
    if digest is not None and model_config_digest(model) != digest:
        raise ValueError(f"config.json: its model section is not the one {weights} was exported with (it was edited); "
                         f"restore it, or export the run's checkpoint again")


def cast_outside_memories(lm: TransformerLM | RetrofitLM, dtype: torch.dtype) -> None:
    """lm's floating parameters and buffers cast to `dtype`, but those of its memory and Engram layers, left as they
    are: float32, and their tables as stored (a float32 one not rounded to `dtype`, a bfloat16 one not copied)."""
    kept = {id(m) for _, layer in (*lm.memories(), *lm.engrams()) for m in layer.modules()}
    for module in (m for m in lm.modules() if id(m) not in kept):
        for p in module.parameters(recurse=False):
            if p.is_floating_point():
                p.data = p.data.to(dtype)
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_floating_point():
                setattr(module, name, buffer.to(dtype))


class Float32Memory:
    """Forward hooks that run one memory (or Engram) layer in its own dtype (float32, that of its dense parameters:
    its tables may be bfloat16) inside a model cast to a lower one: its input cast to the layer's dtype, its output
    back to the input's (the layer's numeric rule: model/memory/dtypes.py). In a float32 model they change nothing."""

    def __init__(self, memory: torch.nn.Module):
        self.dtype = None  # the input's dtype, that of the rest of the model
        memory.register_forward_pre_hook(self.enter)
        memory.register_forward_hook(self.leave)

    def enter(self, memory: torch.nn.Module, args: tuple) -> tuple:
        x, *rest = args  # (B, T, dim)
        self.dtype = x.dtype
        return (x.to(next(p for p in memory.parameters() if not is_memory_value(p)).dtype), *rest)

    def leave(self, memory: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return output.to(self.dtype)


class XlmPkmConfig(PretrainedConfig):
    """The run's resolved config: `model` (ModelConfig as a dict) builds the network; data, optim and train
    are kept as the run recorded them."""

    model_type = MODEL_TYPE

    def __init__(self, model: dict | None = None, **kwargs):
        self.model = model or {}
        super().__init__(**kwargs)


class XlmPkmForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = XlmPkmConfig
    base_model_prefix = "lm"
    main_input_name = "input_ids"

    def __init__(self, config: XlmPkmConfig, lm: TransformerLM | RetrofitLM | None = None):
        super().__init__(config)
        self.lm = lm if lm is not None else TransformerLM(build_dataclass(ModelConfig, config.model))
        for _, layer in (*self.lm.memories(), *self.lm.engrams()):
            Float32Memory(layer)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # generate() keeps the model's own KVCache (prepare_inputs_for_generation)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, config: XlmPkmConfig | None = None,
                        dtype=None, torch_dtype=None, device_map=None, **kwargs):
        """The exported model in eval mode, its weights read by safetensors.torch.load_model (shared value
        tables); dtype ("auto": float32, as trained) and device_map (one device) as transformers' own."""
        from safetensors.torch import load_model

        hub = {k: kwargs[k] for k in ("cache_dir", "force_download", "local_files_only", "token", "revision",
                                      "subfolder") if k in kwargs}
        if config is None:
            config = XlmPkmConfig.from_pretrained(pretrained_model_name_or_path, **hub)
        weights = cached_file(os.fspath(pretrained_model_name_or_path), WEIGHTS, **hub)
        check_model_config(config.model, weights)
        model_cfg = build_dataclass(ModelConfig, config.model)
        if model_cfg.base.path:  # a retrofit: its base is the folder's base/
            base = AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, dtype=torch.float32,
                                                        **{**hub, "subfolder": model_cfg.base.path})
            model = cls(config, RetrofitLM(model_cfg, base))
        else:
            model = cls(config)
        try:
            load_model(model.lm, weights)
        except RuntimeError as e:  # a shape or a name that config.json's model does not have
            raise ValueError(f"{weights}: weights of another architecture than config.json "
                             f"({' '.join(str(e).split())[:300]})") from None
        dtype = dtype if dtype is not None else torch_dtype
        if dtype not in (None, "auto"):  # the memory and Engram layers float32 (Float32Memory), as trained
            cast_outside_memories(model.lm, getattr(torch, dtype) if isinstance(dtype, str) else dtype)
        if isinstance(device_map, (str, torch.device)) and str(device_map) != "auto":
            model.to(device_map)
        elif device_map == "auto" and torch.cuda.is_available():
            model.to("cuda")
        return model.eval()

    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, use_cache: bool | None = None, **kwargs) -> CausalLMOutputWithPast:
        """input_ids (B, T): the T positions after the cache's (a KVCache returned by an earlier call, or a new
        one with use_cache); labels (B, T) as transformers' causal LMs take them (shifted here; -100 ignored)."""
        cache = cache if cache is not None else kwargs.get("past_key_values")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("xlm_pkm models read every row from its first position: pad batches on the right "
                             "and leave the padding out of the loss (an attention mask with zeros is not supported)")
        if not self._owns(cache) or _cached(cache) == 0:  # a new sequence
            self.lm.reset_stream_state(training=False)  # all-attention layers: no stream carried from another
        if not self._owns(cache):  # a cache only when asked (generate() asks)
            cache = self.lm.new_cache() if use_cache else None
        logits = self.lm(input_ids, cache)  # (B, T, vocab)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache})

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, cache: KVCache | None = None,
                                      use_cache: bool | None = None, **kwargs) -> dict:
        """The tokens the cache has not seen yet (all of them on the first step, or without a cache)."""
        cache = cache if cache is not None else kwargs.get("past_key_values")
        if self._owns(cache) and _cached(cache):
            input_ids = input_ids[:, _cached(cache):]
        return {"input_ids": input_ids, "cache": cache, "use_cache": use_cache}

    def _owns(self, cache) -> bool:
        """Whether `cache` is of the model's own kind (a KVCache; a retrofit's, transformers' DynamicCache with the
        windows RetrofitLM.new_cache adds)."""
        if isinstance(self.lm, RetrofitLM):
            return isinstance(cache, DynamicCache) and hasattr(cache, "windows")
        return isinstance(cache, KVCache)


def _cached(cache: KVCache | DynamicCache) -> int:
    """The positions a cache holds."""
    return cache.offset if isinstance(cache, KVCache) else cache.get_seq_length()
