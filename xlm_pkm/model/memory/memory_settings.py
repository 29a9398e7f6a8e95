"""The memory's settings (model.memory, model.engram) and the registries their names are chosen from: the leaf of
model/memory/, which imports none of its code, so that the code imports its settings and never the reverse.

    MemoryConfig     model.memory: the product-key memory layer (pkm.py), with the variants' sections:
      PeerConfig       .peer: PEER's experts (peer.py)
      TuckerConfig     .tucker: UltraMem's Tucker-decomposed key search (ultramem.py)
      ExpandedConfig   .expanded: UltraMem's expanded values (ultramem.py)
    EngramConfig     model.engram: Engram's hashed N-gram memory (engram.py, ngram_hash.py)
    KEY_SEARCHES     model.memory.key_type: filled by keys.py (product, flat) and ultramem.py (tucker)
    SCORE_FUNCTIONS  model.memory.score: filled by scores.py (softmax, relu, identity)
    VALUE_STORES     model.memory.values: filled by value_stores.py (table), peer.py (peer), ultramem.py (expanded)

Each registry is filled by the modules named beside it, when they are imported: pkm.py imports every one of them,
so importing the layer (or this package) registers every design; a plugin registers as they do (registry.py). A
new design's section is a dataclass here and a field of MemoryConfig; its parts register from its own module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from xlm_pkm.errors import ConfigError
from xlm_pkm.registry import Registry
from xlm_pkm.settings import architecture, execution, non_negative, one_of, positive, probability

KEY_SEARCHES = Registry("memory key type")
SCORE_FUNCTIONS = Registry("memory score function")
VALUE_STORES = Registry("memory value store")


@dataclass
class PeerConfig:
    """PEER's experts (values=peer, PeerExperts in peer.py): model.memory.peer."""

    # σ of each expert σ(u_i·x) v_i: the paper's "ReLU or GELU" (He 2024, Eq. 6); gelu: erf form
    activation: Literal["gelu", "relu"] = field(default="gelu", metadata=architecture())


@dataclass
class TuckerConfig:
    """UltraMem's key search (key_type=tucker, TuckerKeys in ultramem.py): model.memory.tucker."""

    # r, each sub-key's components; an r x r core mixes row and column scores
    rank: int = field(default=2, metadata=architecture())
    # cores per head (multi-core scoring, > 1 needs values=expanded)
    cores: int = field(default=1, metadata=architecture())
    # rows and columns kept by the core's rank-1 approximation; 0: knn
    topm: int = field(default=0, metadata=architecture())
    # also keep the m lowest rows and columns (two negatives make a high score too) and their m² pairs; false:
    # the paper's top-m only
    both_signs: bool = field(default=False, metadata=architecture())
    aux_coeff: float = 0.001  # α of the core's loss α/(r-1) Σ_{i>=2} max(0, λ_i - τ)²
    aux_margin: float = 0.15  # τ of that loss


@dataclass
class ExpandedConfig:
    """UltraMem's implicit value expansion (values=expanded, ExpandedValues in ultramem.py): model.memory.expanded."""

    expansion: int = field(default=1, metadata=architecture())  # E virtual blocks over n_slots / E physical values
    # width of the physical values; 0: the memory's output dim
    value_dim: int = field(default=0, metadata=architecture())
    # fan_in: values and projections N(0, 1/D_v) (as before this key) | released: UltraMem's released code,
    # values N(0, 0.02²) and projections N(0, 1/(E·D_v)) (module docstring)
    init: Literal["fan_in", "released"] = "fan_in"


@dataclass
class MemoryConfig:
    """A Product Key Memory layer (paper §3): model.memory. Options beyond the paper are off by default."""

    # sub-keys per half: |K| = n_keys ** 2 slots (flat: n_keys ** 2 full keys)
    n_keys: int = field(default=512, metadata=architecture(positive()))
    # query / key dimension (product: two halves of k_dim / 2)
    k_dim: int = field(default=512, metadata=architecture(positive()))
    # memory heads; each has its own query and keys, the value table is shared
    heads: int = field(default=4, metadata=architecture(positive()))
    knn: int = field(default=32, metadata=architecture(positive()))  # keys selected per head
    # product | flat (exhaustive search over |K| full keys, Table 4) | any class in model/memory/keys.py
    key_type: str = field(default="product", metadata=architecture(one_of(KEY_SEARCHES)))
    # batchnorm (paper, §4.5; training statistics span the batch) | layernorm (per head, causal) | none
    query_norm: Literal["batchnorm", "layernorm", "none"] = field(default="batchnorm", metadata=architecture())
    # hidden sizes of the query MLP (ReLU)
    query_hidden: list[int] = field(default_factory=list, metadata=architecture(positive()))
    input_dropout: float = field(default=0.0, metadata=probability())  # on the memory's input
    query_dropout: float = field(default=0.0, metadata=probability())  # on the queries, before the key search
    value_dropout: float = field(default=0.0, metadata=probability())  # on the values read
    # Memory+ output gating: W_o(silu(W_g x) * read) (Berges et al. 2024)
    gated: bool = field(default=False, metadata=architecture())
    # L2-normalise queries and keys (product: each half) before scoring
    qk_norm: bool = field(default=False, metadata=architecture())
    # LayerNorm queries and keys (product, tucker: each half and sub-key) before scoring, learned gains, no bias
    # (UltraMem's query/key LN, keys.py)
    qk_layernorm: bool = field(default=False, metadata=architecture())
    # product keys: the pairs of the halves' knn best scored, all knn² | winnable: only those that can be among the
    # knn best, (a+1)(b+1) <= knn for ranks a, b (keys.py; the same slots)
    pair_candidates: Literal["all", "winnable"] = field(default="all", metadata=execution())
    # the products that choose the keys (product: half scores, flat: scores) in float32 | tf32 (CUDA) | bfloat16,
    # the chosen keys' scores then recomputed in float32 (selected_scores.py)
    score_precision: Literal["float32", "tf32", "bfloat16"] = "float32"
    # product keys: each half's knn best sub-keys by torch.topk | triton (a selection kernel, triton_topk.py) | auto
    # (triton on CUDA where Triton is installed, torch elsewhere: a 4.7 ms shorter step on an H200, issue 59)
    half_topk: Literal["auto", "torch", "triton"] = field(default="auto", metadata=execution())
    # product / flat keys: every head searches one set of keys (PEER, He 2024 §2)
    share_keys: bool = field(default=False, metadata=architecture())
    # softmax(scores / temperature) over the selected keys; 1: the paper
    temperature: float = field(default=1.0, metadata=architecture(positive()))
    # all memory layers of the model read one value table
    share_values: bool = field(default=False, metadata=architecture())
    # each of W processes holds 1/W of every value row and of its optimizer state (model/memory/value_shards.py);
    # auto: true under train.parallel=fsdp on W > 1 processes where the tables can be (the table store, its width
    # divisible by W), else false, resolved when a run starts (train/build.resolved_config; unresolved: false)
    shard_values: Literal["auto", True, False] = field(default="auto", metadata=execution())
    # auto (Triton kernels on CUDA, EmbeddingBag on CPU) | torch | triton (model/memory/value_read.py)
    value_read: Literal["auto", "torch", "triton"] = field(default="auto", metadata=execution())
    # the Triton read's backward: two_pass (a kernel for each gradient) | one_pass (one kernel, each row read once)
    # | auto (one_pass where the read is Triton's, two_pass with torch's: 6% faster steps on an H200, issue 59)
    read_backward: Literal["auto", "two_pass", "one_pass"] = field(default="auto", metadata=execution())
    # the table read as: custom_op (one node of a compiled graph: 11% faster compiled steps on an H200, issue 59) |
    # eager (torch.compile breaks its graph around it; the same computation)
    read_op: Literal["custom_op", "eager"] = field(default="custom_op", metadata=execution())
    # the table read without gradients (evaluation, generation): table (as stored) | bfloat16 (a bfloat16 copy,
    # made again when the table changes: half the bytes a read moves; value_stores.py)
    inference_values: Literal["table", "bfloat16"] = "table"
    # the value table as stored: float32 | bfloat16 (2 bytes a value; read and summed in float32, its gradient rows
    # float32, its optimizer's row updates computed in float32 and rounded stochastically: optim/stochastic_rounding.py;
    # the table store only; value_stores.py)
    value_dtype: Literal["float32", "bfloat16"] = field(default="float32", metadata=architecture())
    # the selected scores -> the read weights: softmax (the paper) | relu (Csordás et al. 2023) | identity
    # (the raw scores, UltraMem) | any function in model/memory/scores.py
    score: str = field(default="softmax", metadata=architecture(one_of(SCORE_FUNCTIONS)))
    # what the slots hold: table (one value row per slot, the paper) | peer (PEER's single-neuron experts)
    # | any store in model/memory/value_stores.py or registered by a variant's module
    values: str = field(default="table", metadata=architecture(one_of(VALUE_STORES)))
    # the variants' own sections (above; their code: peer.py, ultramem.py)
    peer: PeerConfig = field(default_factory=PeerConfig)  # values=peer (peer.py)
    tucker: TuckerConfig = field(default_factory=TuckerConfig)  # key_type=tucker (ultramem.py)
    expanded: ExpandedConfig = field(default_factory=ExpandedConfig)  # values=expanded (ultramem.py)


@dataclass
class EngramConfig:
    """Engram (DeepSeek-AI 2026, arXiv 2601.07372): hashed N-gram embeddings added to the residual stream at
    `layers` (engram.py; the hash: ngram_hash.py): model.engram. Off while `layers` is empty."""

    # 1-indexed layers; the paper's 27B model: [2, 15] of 30 (a retrofit's: the base's decoder layers, beside the MLP)
    layers: list[int] = field(default_factory=list, metadata=architecture(positive()))
    # N: the orders 2..N are hashed (the paper's and the reference's 3)
    max_ngram: int = field(default=3, metadata=architecture())
    # K hash heads per order, each its own table of prime size
    heads: int = field(default=8, metadata=architecture(positive()))
    # rows of one order's tables, all K heads together (each head ~table_size / K)
    table_size: int = field(default=65536, metadata=architecture(positive()))
    # width of one order's embedding, all K heads together (each head ngram_dim / K)
    ngram_dim: int = field(default=512, metadata=architecture(positive()))
    # the causal depthwise convolution's width (dilation: max_ngram)
    kernel_size: int = field(default=4, metadata=architecture(positive()))
    # the hash multipliers' seed (the reference's: seed + 10007 · layer index)
    seed: int = field(default=0, metadata=architecture(non_negative()))
    # the tables as stored: float32 | bfloat16 (2 bytes a value; read in float32, gradient rows float32, updates
    # rounded stochastically: optim/stochastic_rounding.py), as model.memory.value_dtype for the memory's values
    table_dtype: Literal["float32", "bfloat16"] = field(default="float32", metadata=architecture())

    def check(self, prefix: str) -> None:
        """Engram's own rules, when on: N-gram orders from 2, at least one table row per hash head, heads
        splitting the width evenly (the model's rules on where it goes: model_settings.ModelConfig.check)."""
        if not self.layers:
            return
        if self.max_ngram < 2:
            raise ConfigError(f"{prefix}max_ngram: N-grams of order 2 and up are hashed, so it must be >= 2, "
                              f"got {self.max_ngram}")
        if self.table_size < self.heads:
            raise ConfigError(f"{prefix}table_size: one order's {self.heads} hash heads need at least one row "
                              f"each, got {self.table_size} rows")
        if self.ngram_dim % self.heads:
            raise ConfigError(f"{prefix}ngram_dim ({self.ngram_dim}) must be divisible by {prefix}heads "
                              f"({self.heads}): each head reads ngram_dim / heads columns")
