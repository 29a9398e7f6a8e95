"""Sparse memory finetuning (Lin et al. 2025, *Continual Learning via Sparse Memory Finetuning*): each
optimizer step updates only the t memory slots most specific to its batch (`optim.memory_finetune.top_t`).

A slot's specificity is TF-IDF, the batch being the document. For each value table, at each step:

    tf_i  = c_i / sum_j c_j              c_i: reads of slot i by the step's batch (every token, head and
                                         selected key; all micro-batches and ranks)
    idf_i = log((D + 1) / (d_i + 1))     D: background documents, d_i: how many of them read slot i
    score_i = tf_i * idf_i

and the top_t slots by score keep their value-table gradient rows, among the slots the step read whose
score is above 0: a slot read by every background document (idf 0) is never updated, nor are ties at 0
broken by slot index (fewer than top_t slots may be updated; the train log gives slots_updated). Two
controls (`optim.memory_finetune.ranking`) keep everything else and change the ranking only:

    count    the top_t slots by c_i (tf without idf, no background); equal counts keep the lower index first
    random   top_t slots drawn uniformly, without replacement, among those read (c_i > 0), from a generator
             seeded by sha256(seed, step, table): the same draws on every rank, on a re-run and on resume

The
other rows' gradients are dropped before clipping and the update, so with a sparse values optimizer (sgd,
adagrad, lazy_adam: only rows with a gradient move) every other row stays bit-identical. With fact batches
(data.fact_batches) the padding's reads are not counted.
The background (`optim.memory_finetune.background`) is written once by `python -m xlm_pkm.finetune.slot_counts`
from the model the run starts from: its documents are pieces of the pretraining data of `doc_tokens` tokens
each (by default shaped as the training batches, data.batch_size x data.bptt; best sized like one finetuning
batch, so that a document and a batch are comparable units). It records that length and a fingerprint of
the model, checked when a run starts (not on resume: the keys may have trained since).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from xlm_pkm.checkpoint.files import save_atomic
from xlm_pkm.errors import ConfigError
from xlm_pkm.model.memory.pkm import ProductKeyMemory
from xlm_pkm.model.memory.stats import SlotStats
from xlm_pkm.model.memory.value_stores import is_memory_value
from xlm_pkm.optim.optim_settings import MemoryFinetuneConfig
from xlm_pkm.runtime.distributed import DistEnv, all_reduce_sum

KIND = "xlm_pkm slot counts"  # marks a background file


@dataclass
class Background:
    doc_freq: dict[str, torch.Tensor]  # value table name -> (n_slots,) int64: documents that read each slot
    reads: dict[str, torch.Tensor]  # value table name -> (n_slots,) int64: all reads of each slot
    documents: int  # D
    tokens: int
    fingerprint: str  # model_fingerprint() of the model counted
    doc_tokens: int  # tokens per document

    def to_file(self, path: str | Path, source: str) -> None:
        """Written whole or not at all (a failed write is one line naming `path`)."""
        save_atomic({"kind": KIND, "source": source, **self.__dict__}, path)

    @classmethod
    def holds_counts(cls, path: str | Path) -> bool:
        """Whether `path` is a file of slot counts (so that slot_counts --out may replace it): from_file reads it."""
        try:
            cls.from_file(path)
        except (OSError, ValueError, KeyError):  # missing, unreadable or foreign: not ours
            return False
        return True

    def merged(self, other: Background) -> Background:
        """Both counts as one background: the same model, documents of the same length."""
        for key, what in (("fingerprint", "model"), ("doc_tokens", "document length")):
            if getattr(self, key) != getattr(other, key):
                raise ValueError(f"slot counts of another {what} ({key} {getattr(other, key)}, these "
                                 f"{getattr(self, key)}) do not mix: count again with the same model and --doc-tokens")
        if self.doc_freq.keys() != other.doc_freq.keys():
            raise ValueError(f"slot counts of other value tables ({sorted(other.doc_freq)}) do not mix")
        return Background({k: v + other.doc_freq[k] for k, v in self.doc_freq.items()},
                          {k: v + other.reads[k] for k, v in self.reads.items()}, self.documents + other.documents,
                          self.tokens + other.tokens, self.fingerprint, self.doc_tokens)

    def read_share(self) -> dict[str, dict[str, float]]:
        """Per value table: the mean share of its slots one document reads, and the share that every document
        reads (idf 0: never updated)."""
        return {name: {"per_document": float(f.sum()) / (self.documents * len(f)),
                       "by_every_document": float((f == self.documents).double().mean())}
                for name, f in self.doc_freq.items()}

    @classmethod
    def from_file(cls, path: str | Path) -> Background:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"optim.memory_finetune.background: {path} does not exist (write it with "
                                    f"python -m xlm_pkm.finetune.slot_counts CHECKPOINT --data DIR --out {path})")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ValueError(f"optim.memory_finetune.background: {path} is not readable ({type(e).__name__})") from None
        if not isinstance(state, dict) or state.get("kind") != KIND:
            raise ValueError(f"optim.memory_finetune.background: {path} is not a file of "
                             "python -m xlm_pkm.finetune.slot_counts")
        doc_tokens = state.get("doc_tokens", state["tokens"] // max(state["documents"], 1))  # earlier files: batches
        return cls(**{k: state[k] for k in ("doc_freq", "reads", "documents", "tokens", "fingerprint")},
                   doc_tokens=doc_tokens)


def model_fingerprint(model: nn.Module) -> str:
    """A hash of every tensor of the model but its value tables: what decides which slots a text reads."""
    values = {name for name, p in model.named_parameters(remove_duplicate=False) if is_memory_value(p)}
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        if name not in values:
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def value_tables(model: nn.Module) -> dict[str, tuple[nn.Parameter, list[ProductKeyMemory]]]:
    """Value table name (its first state-dict name) -> (the table, the memories that read it)."""
    names = {id(p): name for name, p in model.named_parameters() if is_memory_value(p)}
    tables: dict[str, tuple[nn.Parameter, list[ProductKeyMemory]]] = {}
    for module in model.modules():
        if isinstance(module, ProductKeyMemory):
            for weight in module.values.tables():  # PEER: two tables read by the same slots
                tables.setdefault(names[id(weight)], (weight, []))[1].append(module)
    return tables


def table_reads(memories: list[ProductKeyMemory], stats: str) -> torch.Tensor | None:
    """(n_slots,) float64 reads summed over the memories sharing a table, from their SlotStats `stats`
    attribute (slot_stats: evaluation, step_reads: training); None if none has read yet."""
    counts = [getattr(m, stats).counts for m in memories if getattr(m, stats).counts is not None]
    return torch.stack(counts).sum(0) if counts else None


def tf_idf(reads: torch.Tensor, doc_freq: torch.Tensor, documents: int) -> torch.Tensor:
    """reads, doc_freq: (n_slots,) -> (n_slots,) float64 TF-IDF of each slot (module docstring)."""
    tf = reads.double() / reads.sum().clamp(min=1)
    idf = torch.log((documents + 1) / (doc_freq.double().to(reads.device) + 1))
    return tf * idf


def top_slots(reads: torch.Tensor, doc_freq: torch.Tensor, documents: int, t: int) -> torch.Tensor:
    """The (at most t) slots with the highest TF-IDF among those scoring above 0 (read, and not by every
    background document): (n,) int64. Equal positive scores keep the lower index first."""
    scores = tf_idf(reads, doc_freq, documents)
    candidates = (scores > 0).nonzero().squeeze(1)  # ascending slot order: a stable sort keeps it among ties
    order = torch.sort(scores[candidates], descending=True, stable=True).indices[:t]
    return candidates[order]


def top_by_count(reads: torch.Tensor, t: int) -> torch.Tensor:
    """The (at most t) most read slots among those read: (n,) int64; equal counts keep the lower index first."""
    candidates = (reads > 0).nonzero().squeeze(1)
    return candidates[torch.sort(reads[candidates], descending=True, stable=True).indices[:t]]


def random_slots(reads: torch.Tensor, t: int, seed: int, step: int, table: str) -> torch.Tensor:
    """t slots (all if fewer were read) drawn without replacement among those read: (n,) int64, from a
    generator seeded by (seed, step, table) alone."""
    key = hashlib.sha256(f"{seed}/{step}/{table}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") >> 1)
    candidates = (reads > 0).nonzero().squeeze(1)
    return candidates[torch.randperm(len(candidates), generator=generator)[:t].to(candidates.device)]


def keep_rows_(param: nn.Parameter, rows: torch.Tensor) -> None:
    """Drops every row of param's sparse gradient but `rows`."""
    grad = param.grad.coalesce()
    keep = torch.zeros(param.shape[0], dtype=torch.bool, device=grad.device)
    keep[rows] = True
    kept = keep[grad.indices()[0]]
    param.grad = torch.sparse_coo_tensor(grad.indices()[:, kept], grad.values()[kept], grad.shape,
                                         is_coalesced=True, check_invariants=False)  # a subset of coalesced rows


class SparseMemoryFinetuning:
    """Records each step's slot reads and keeps the value gradients of the step's top_t slots only."""

    def __init__(self, model: nn.Module, cfg: MemoryFinetuneConfig, sparse_values: bool, env: DistEnv,
                 check_fingerprint: bool = True):
        self.tables = value_tables(model)
        if not self.tables:
            raise ConfigError("optim.memory_finetune.top_t: the model has no memory")
        if not sparse_values:
            raise ConfigError("optim.memory_finetune.top_t needs a values optimizer on sparse rows "
                              "(optim.values_optimizer=sgd, adagrad, rowwise_adagrad or lazy_adam)")
        if not all(p.requires_grad for p, _ in self.tables.values()):
            raise ConfigError("optim.memory_finetune.top_t: the memory values do not train (optim.trainable)")
        self.cfg, self.env, self.step = cfg, env, 0
        self.background = None if cfg.ranking != "tfidf" else self._background(model, check_fingerprint)
        for _, memories in self.tables.values():
            for m in memories:
                m.step_reads = SlotStats(m.n_slots)

    def _background(self, model: nn.Module, check_fingerprint: bool) -> Background:
        """cfg.background, checked against the model (its fingerprint, unless resuming) and its value tables."""
        path = self.cfg.background
        background = Background.from_file(path)
        if check_fingerprint and background.fingerprint != model_fingerprint(model):
            raise ValueError(f"optim.memory_finetune.background: {path} was counted on another model "
                             f"than this run's (fingerprint {background.fingerprint}, this model's "
                             f"{model_fingerprint(model)}): count it from the checkpoint the run starts from")
        sizes = {name: p.shape[0] for name, (p, _) in self.tables.items()}
        theirs = {name: len(f) for name, f in background.doc_freq.items()}
        if sizes != theirs:
            raise ValueError(f"optim.memory_finetune.background: {path} counts value tables {theirs}, "
                             f"this model has {sizes}")
        return background

    def describe(self) -> str:
        """One line for the run's log: the rule and the background it ranks against."""
        t = self.cfg.top_t
        if self.background is None:
            rule = (f"the {t} most read slots" if self.cfg.ranking == "count" else
                    f"{t} random slots (seed {self.cfg.seed}) among those read")
            return f"sparse memory finetuning (control, no background): {rule}, per value table and step"
        shares = "; ".join(f"{name}: a document reads {100 * share['per_document']:.1f}% of the slots, every "
                           f"document {100 * share['by_every_document']:.1f}% (never updated)"
                           for name, share in self.background.read_share().items())
        return (f"sparse memory finetuning: the top {t} slots by TF-IDF per value table and step, "
                f"against {self.background.documents:,} background documents of {self.background.doc_tokens} "
                f"tokens; {shares}")

    def select(self, table: str, reads: torch.Tensor) -> torch.Tensor:
        """The slots of `table` this step updates, by cfg.ranking, from its reads (n_slots,)."""
        t = self.cfg.top_t
        if self.cfg.ranking == "count":
            return top_by_count(reads, t)
        if self.cfg.ranking == "random":
            return random_slots(reads, t, self.cfg.seed, self.step, table)
        return top_slots(reads, self.background.doc_freq[table], self.background.documents, t)

    def begin_step(self, step: int) -> None:
        """Optimizer step `step` (from 1) begins: its reads start from zero."""
        self.step = step
        for _, memories in self.tables.values():
            for m in memories:
                m.step_reads.reset()

    def count_only(self, positions: torch.Tensor | None) -> None:
        """positions: (B, T) bool of the next micro-batch, the positions whose reads count (fact batches:
        not the padding), or None: all of them."""
        for _, memories in self.tables.values():
            for m in memories:
                m.step_reads.positions = None if positions is None else positions.reshape(-1)

    def restrict_gradients(self) -> dict[str, int]:
        """Keeps each table's gradient rows of its top_t slots this step (reads summed over ranks: every
        rank selects the same); returns the step's slots_read and slots_updated, summed over tables."""
        read = updated = 0
        for name, (param, memories) in self.tables.items():
            reads = table_reads(memories, "step_reads")
            if reads is None or param.grad is None:
                continue
            reads = all_reduce_sum(reads, self.env)
            rows = memories[0].values.table_rows(self.select(name, reads))  # UltraMem's expanded rows are not slots
            keep_rows_(param, rows)
            read += int((reads > 0).sum())
            updated += int(param.grad.indices().shape[1])
        return {"slots_read": read, "slots_updated": updated}
