"""The model's settings (model) and the registry of its sublayers' names: the leaf of model/, which imports none of
its code (the memory's settings, model/memory/memory_settings.py, apart), so that the code imports its settings and
never the reverse.

    ModelConfig        model: a causal transformer LM (transformer.py), and the rules between its sections
    SpanConfig         model.span: the context attention of the all-attention family (adaptive_span.py)
    BaseConfig         model.base: a pretrained Hugging Face causal LM taking the memories (retrofit.py)
    SUBLAYERS          model.sublayers: the block types a layer is made of, filled by blocks.py
    CONTEXT_SUBLAYERS  those of them with relative positions and a stream cache (the all-attention family's)

model.memory and model.engram are the memory's sections (MemoryConfig, EngramConfig: memory_settings.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from xlm_pkm.errors import ConfigError
from xlm_pkm.model.memory.memory_settings import EngramConfig, MemoryConfig
from xlm_pkm.registry import Registry
from xlm_pkm.settings import architecture, non_negative, one_of, positive, probability

SUBLAYERS = Registry("block sublayer")
CONTEXT_SUBLAYERS = ("all_attention", "span_attention")  # relative positions and a stream cache (their family's)


@dataclass
class SpanConfig:
    """Relative-position context attention with a stream cache (Sukhbaatar et al. 2019): the
    all_attention and span_attention sublayers (all_attention.py, adaptive_span.py, stream_attention.py): model.span."""

    # S: the previous tokens a query can see; relative position table d_h x S
    max_span: int = field(default=8192, metadata=architecture(positive()))
    # learn each head's span (z in [0, 1], soft mask with a ramp of R); else all S
    adaptive: bool = field(default=True, metadata=architecture())
    ramp: int = field(default=32, metadata=architecture(positive()))  # R
    # span loss: loss_coeff · S · mean z per layer, summed over layers (training)
    loss_coeff: float = field(default=1e-7, metadata=non_negative())
    adaptive_cache: bool = True  # cache min(S, span in use + 64) inputs (--adapt-span-cache), else S


@dataclass
class BaseConfig:
    """A pretrained Hugging Face causal LM (Llama family) that takes the memories, beside the MLPs of `layers`:
    model.base (retrofit.py)."""

    # the base's folder (config.json and safetensors weights, or a GGUF file); empty: no base (TransformerLM)
    path: str = ""
    gguf_file: str = ""  # a GGUF file in `path` to load instead (dequantized to float32; needs pip install gguf)
    # the 1-indexed decoder layers whose MLP gets a memory beside it; empty: one, at layer L - L//4 of the base's L
    # (the paper's top memory: model/transformer.memory_layers), set when the run starts
    layers: list[int] = field(default_factory=list, metadata=architecture(positive()))
    gate_init: float = 0.0  # every memory's output gate (one per channel) starts here; 0: the base's logits at step 0
    # a learnt (dim,) vector added beside each memory (its parameter: beside.LAYER.shift), 0 at step 0: it takes the
    # part of the change that is the same for every token (a shift to the new text's domain), so the memory's
    # slots need not (results/retrofit/README.md measures it)
    shift: bool = field(default=False, metadata=architecture())
    # the base's own weights train too, as any weight (optim.trainable), and checkpoints hold them (full finetuning);
    # false: frozen, and checkpoints hold what trains beside it only
    trainable: bool = field(default=False, metadata=architecture())
    # blake2b of the base's files (base_files), recorded when the run starts; a base whose files differ is refused
    digest: str = field(default="", metadata=architecture())

    def check(self, prefix: str) -> None:
        if not self.path:
            given = [key for key in ("gguf_file", "layers", "digest", "trainable") if getattr(self, key)]
            if given:
                raise ConfigError(f"{prefix}{given[0]}: set {prefix}path (the base model's folder) first")
            return
        if len(set(self.layers)) != len(self.layers):
            raise ConfigError(f"{prefix}layers: must be distinct, got {self.layers}")


@dataclass
class ModelConfig:
    """A causal transformer LM (paper §4.3), with memories replacing or following some FFNs: model."""

    vocab_size: int = field(default=0, metadata=architecture(non_negative()))  # 0: taken from the data's vocabulary
    # model width (embeddings, attention, FFN input/output)
    dim: int = field(default=1024, metadata=architecture(positive()))
    n_layers: int = field(default=12, metadata=architecture(positive()))  # transformer layers
    n_heads: int = field(default=16, metadata=architecture(positive()))  # attention heads per layer
    ffn_dim: int = field(default=0, metadata=architecture(non_negative()))  # 0: 4 * dim
    dropout: float = field(default=0.0, metadata=probability())  # on embeddings and sublayer outputs
    attention_dropout: float = field(default=0.0, metadata=probability())  # on the attention weights
    max_len: int = field(default=512, metadata=architecture(positive()))  # learned positional embeddings
    pre_norm: bool = field(default=False, metadata=architecture())  # False: post-norm, as XLM
    # the sublayer types of every layer, in order (model/blocks.py); a memory layer's "ffn" gives way
    # to the memory (mem_mode replace), or the memory follows the others (add)
    sublayers: list[str] = field(default_factory=lambda: ["attention", "ffn"],
                                 metadata=architecture(one_of(SUBLAYERS)))
    # interspersed at regular intervals (see transformer.memory_layers)
    n_memories: int = field(default=0, metadata=non_negative())
    # explicit 1-indexed layers (wins over n_memories); as an architecture key, the layers resolved from both
    mem_layers: list[int] = field(default_factory=list, metadata=architecture())
    # replace: memory instead of the FFN | add: x + memory(x) after the FFN
    mem_mode: Literal["replace", "add"] = field(default="replace", metadata=architecture())
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    engram: EngramConfig = field(default_factory=EngramConfig)  # token-addressed memory, beside or instead of PKM
    # transformer: XLM's LM (learned absolute positions up to max_len, embedding LayerNorm when post-norm,
    # output tied to the token embeddings, dropout on embeddings and residual branches).
    # all_attention: the all-attention paper's LM, for the all_attention / span_attention sublayers:
    # no absolute positions (relative ones in the attention, streams of any length through the cache),
    # no embedding norm, N(0, 1) embeddings, an output Linear with bias (or the tied adaptive softmax),
    # `dropout` on the input embeddings and the last hidden state only.
    family: Literal["transformer", "all_attention"] = field(default="transformer", metadata=architecture())
    # N key/value vectors per head in each all_attention sublayer
    persistent_vectors: int = field(default=0, metadata=architecture(non_negative()))
    # joint: one softmax over context and persistent vectors (the paper's model); split / head_split:
    # the paper's attn-split and head-split ablations (model/all_attention.py)
    persistent_mixing: Literal["joint", "split", "head_split"] = field(default="joint", metadata=architecture())
    span: SpanConfig = field(default_factory=SpanConfig)
    # tied adaptive input + adaptive softmax over a frequency-sorted vocabulary (family all_attention):
    # cluster boundaries (ids), e.g. [20000, 40000, 200000]; empty: a full softmax
    adaptive_cutoffs: list[int] = field(default_factory=list, metadata=architecture(positive()))
    # cluster c's embedding dimension: dim / factor^c
    adaptive_factor: int = field(default=4, metadata=architecture(positive()))
    # a pretrained Hugging Face causal LM taking the memories beside its MLPs (model/retrofit.py); the sizes above
    # are then the base's, set when the run starts
    base: BaseConfig = field(default_factory=BaseConfig)

    def check(self, prefix: str) -> None:
        """The model's rules between its sections: the all-attention family's sublayers and adaptive
        input/softmax go with family=all_attention; Engram's place (model.engram.layers, not sublayers) in
        a transformer whose batches start its N-gram windows afresh."""
        context = [name for name in self.sublayers if name in CONTEXT_SUBLAYERS]
        if context and self.family != "all_attention":
            raise ConfigError(f"{prefix}sublayers: {context[0]} needs {prefix}family=all_attention (relative "
                              f"positions, stream cache), got {prefix}family={self.family}")
        if self.adaptive_cutoffs and self.family != "all_attention":
            raise ConfigError(f"{prefix}adaptive_cutoffs: the adaptive input/softmax needs {prefix}family="
                              f"all_attention, got {prefix}family={self.family}")
        if any(b <= a for a, b in zip(self.adaptive_cutoffs, self.adaptive_cutoffs[1:])):
            raise ConfigError(f"{prefix}adaptive_cutoffs: must increase strictly, got {self.adaptive_cutoffs}")
        if self.base.path:
            self._check_retrofit(prefix)
        e = self.engram
        if "engram" in self.sublayers:
            raise ConfigError(f"{prefix}sublayers: engram is not listed there; {prefix}engram.layers places it "
                              f"(first in each of those layers)")
        if not e.layers:
            return
        n_layers = "the base's layers" if self.base.path else self.n_layers  # a retrofit's: retrofit.sized checks
        if (not self.base.path and any(not 1 <= layer <= self.n_layers for layer in e.layers)) or \
                len(set(e.layers)) != len(e.layers):
            raise ConfigError(f"{prefix}engram.layers must be distinct layers in [1, {n_layers}], got {e.layers}")
        if self.family != "transformer":
            raise ConfigError(f"{prefix}engram needs {prefix}family=transformer: the all_attention family's streams "
                              f"continue from one batch to the next, and Engram's N-gram window starts afresh at "
                              f"every batch")

    def _check_retrofit(self, prefix: str) -> None:
        """A retrofit (model.base) places its memories beside the base's MLPs: none of this model's own layout."""
        own = [(key, value) for key, value in (("n_memories", self.n_memories), ("mem_layers", self.mem_layers),
                                               ("adaptive_cutoffs", self.adaptive_cutoffs))
               if value]
        if own:
            key, value = own[0]
            raise ConfigError(f"{prefix}{key}={value}: a retrofit ({prefix}base.path) places its memories at "
                              f"{prefix}base.layers (Engram: {prefix}engram.layers), beside the base's MLPs")
        if self.family != "transformer":
            raise ConfigError(f"{prefix}family={self.family}: a retrofit ({prefix}base.path) is the base's network")
