"""The product-key memory layer (Lample et al. 2019), its parts and variants, and Engram's token-addressed
memory. A new memory design goes here.

    pkm.py                ProductKeyMemory: query network, key search, score function, value store (§3);
                          MemoryConfig, its settings (each variant's section beside the variant)
    keys.py               key searches by name (KEY_SEARCHES): product keys, flat keys (Table 4)
    selected_scores.py    the search's top scores, with a backward through the selected keys only
    triton_topk.py        the knn best of each row of half scores as a Triton kernel (memory.half_topk)
    scores.py             score functions by name (SCORE_FUNCTIONS): softmax, relu, identity
    value_stores.py       value stores by name (VALUE_STORES): the paper's one table
    peer.py               PEER's single-neuron experts, a value store (He 2024); PeerConfig
    ultramem.py           UltraMem's Tucker-decomposed search and expanded values (Huang et al. 2025);
                          TuckerConfig, ExpandedConfig
    engram.py             Engram: hashed N-gram rows, gated and convolved into the residual (DeepSeek-AI 2026);
                          EngramConfig
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

A variant is one module here: its settings dataclass (a section of MemoryConfig, which pkm.py imports:
so importing the layer registers the variant's parts), its registered parts, and a test.

May import: errors, settings, registry, utils.chunks, data.dictionary (the vocabulary's special tokens and BPE
marker, for token_compression.py; see model/__init__.py) (never the rest of model/: the transformer imports
the memory).
"""

from xlm_pkm.model.memory.pkm import MemoryConfig, ProductKeyMemory

__all__ = ["MemoryConfig", "ProductKeyMemory"]
