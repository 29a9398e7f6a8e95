"""MemoryHost: what a language model holding memory layers offers the trainer, evaluation and finetuning, from
its `memories()` and `engrams()`, whatever the network around them (TransformerLM, RetrofitLM).

    class MyLM(MemoryHost, nn.Module):
        def memories(self): return [(layer, memory), ...]      # 1-indexed layers, in layer order
    model.set_sparse_values(True)           # value gradients as the values optimizer wants them
    model.set_memory_stats(True)            # evaluation: per-slot statistics from zero
    model.set_token_compression(words)      # Engram's canonical token ids (a host with an ngram_hash)
    model.memory_value_parameters()         # the values optimizer's group
"""

from __future__ import annotations

from torch import nn

from xlm_pkm.model.memory.engram import Engram
from xlm_pkm.model.memory.pkm import ProductKeyMemory
from xlm_pkm.model.memory.token_compression import compress_vocabulary
from xlm_pkm.model.memory.value_shards import ValueShard
from xlm_pkm.model.memory.value_stores import is_memory_value


class MemoryHost:
    """Methods of an nn.Module that holds memory layers, found through memories() and engrams()."""

    def memories(self) -> list[tuple[int, ProductKeyMemory]]:
        """[(1-indexed layer, memory)] in layer order."""
        raise NotImplementedError

    def engrams(self) -> list[tuple[int, Engram]]:
        """[(1-indexed layer, Engram)] in layer order."""
        return []

    def set_token_compression(self, words: list[str]) -> None:
        """Engram's canonical ids from the vocabulary `words` (token_compression.py), stored in the model's
        N-gram hash `ngram_hash` (saved with it); nothing without Engram layers."""
        if self.ngram_hash is not None:
            self.ngram_hash.set_compression(compress_vocabulary(words))

    def memory_value_parameters(self) -> list[nn.Parameter]:
        """The value tables' parameters (marked is_memory_value), each once (also when shared); every other
        parameter is dense."""
        return [p for p in self.parameters() if is_memory_value(p)]

    def memory_value_count(self) -> int:
        """The elements of the value tables, a sharded one counted whole (all ranks' columns)."""
        return sum(p.numel() * getattr(p, "value_shard", ValueShard(0, 1)).world
                   for p in self.memory_value_parameters())

    def set_sparse_values(self, flag: bool) -> None:
        """Sparse value-table gradients (one row per slot read; for LazyAdam) in every memory and Engram
        table, or dense."""
        for _, m in self.memories():
            m.sparse_values = flag
        for _, e in self.engrams():
            e.sparse = flag

    def set_memory_stats(self, enabled: bool) -> None:
        """Turn per-slot statistics of every memory and Engram table on (from zero) or off (kept for reading);
        eval mode only."""
        for _, m in [*self.memories(), *self.engrams()]:
            m.track_stats = enabled
            if enabled:
                m.reset_stats()
