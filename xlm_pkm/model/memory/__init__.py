"""The product-key memory layer (Lample et al. 2019), its parts and variants, and Engram's token-addressed
memory. A new memory design goes here.

    memory_settings.py    the settings, imported by the code and importing none of it: MemoryConfig
                          (model.memory) with each variant's section (PeerConfig, TuckerConfig, ExpandedConfig),
                          EngramConfig (model.engram); the registries of the parts' names (KEY_SEARCHES,
                          SCORE_FUNCTIONS, VALUE_STORES), filled by the modules that implement the parts
    pkm.py                ProductKeyMemory: query network, key search, score function, value store (§3); it
                          imports every part and variant below, so importing the layer registers them all
    keys.py               key searches by name (KEY_SEARCHES): product keys, flat keys (Table 4)
    selected_scores.py    the search's top scores, with a backward through the selected keys only
    triton_topk.py        the knn best of each row of half scores as a Triton kernel (memory.half_topk)
    scores.py             score functions by name (SCORE_FUNCTIONS): softmax, relu, identity
    value_stores.py       value stores by name (VALUE_STORES): the paper's one table
    peer.py               PEER's single-neuron experts, a value store (He 2024)
    ultramem.py           UltraMem's Tucker-decomposed search and expanded values (Huang et al. 2025)
    engram.py             Engram: hashed N-gram rows, gated and convolved into the residual (DeepSeek-AI 2026)
    ngram_hash.py         Engram's multi-head N-gram hash: every Engram layer's rows, once per forward
    token_compression.py  Engram's canonical token ids (NFKC, lower-case, fastBPE's @@ dropped)
    value_read.py         out[n] = Σ w · values[idx]: dense or row-sparse table gradient
    triton_value_read.py  the same read as Triton kernels (GPUs; Triton's interpreter on CPU)
    slot_groups.py        lookups grouped by slot, shared by both value-read backends
    value_shards.py       the value table sharded across ranks by embedding dimension
    sharded_read.py       the read of a sharded table (lookups all-gathered, local columns)
    stats.py              usage and KL of the slot weights (§4.2)
    dtypes.py             search, softmax and sums in at least float32

    from xlm_pkm.model.memory import MemoryConfig, ProductKeyMemory   # the layer alone: needs only torch

A variant is one module here with its registered parts (pkm.py imports it: so importing the layer registers
them), its settings dataclass in memory_settings.py (a section of MemoryConfig), and a test.

May import: errors, settings, registry, utils.chunks, data.dictionary (the vocabulary's special tokens and BPE
marker, for token_compression.py; see model/__init__.py) (never the rest of model/: the transformer imports
the memory).
"""

from xlm_pkm.model.memory.memory_settings import MemoryConfig
from xlm_pkm.model.memory.pkm import ProductKeyMemory

__all__ = ["MemoryConfig", "ProductKeyMemory"]
