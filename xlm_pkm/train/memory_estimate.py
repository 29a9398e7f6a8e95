"""The memory a training run needs per rank, from its config alone, before it is queued: the figure
`python train.py --config X --dry-run [--world-size W]` prints, so that a user picks W and the mode.

    est = estimate(cfg, world_size=8, parallel="ddp")   # cfg resolved: model.vocab_size set
    print(est)                                          # the table, in MiB / GiB
    est.total                                           # bytes per rank

The model is built on the meta device (shapes only, nothing allocated) and its parameters grouped as
dense, memory value tables and Engram tables. P is a group's parameter elements, W the world size;
bytes per rank:

    parameters     4·P: float32 weights whatever train.precision (autocast keeps them float32), but 2·P of a
                   bfloat16 value or Engram table (model.memory.value_dtype, model.engram.table_dtype: its gradient
                   rows and optimizer state stay float32, below), and the buffers (BatchNorm statistics, Engram's
                   hash tables)
    gradients      4·P of every trainable dense parameter; a value or Engram table with a dense gradient
                   (optim.values_optimizer=adam): 4·P; with a sparse one (lazy_adam, adagrad, sgd): one row per
                   distinct row read in a step, min(lookups, rows) rows of 4·width + 8 bytes (values, index),
                   lookups = tokens · heads · knn of every memory reading the table (Engram: tokens · orders ·
                   hash heads) · optim.accumulate · W on W > 1 (the rows of every rank, once exchanged)
    optimizer      4·state_size·P of each group's trainable parameters, state_size as the optimizer's
                   registration declares it (optim/optimizers.py: adam and lazy_adam 2, adagrad 1, sgd and
                   rowwise_adagrad 0), and 4·row_state_size·R of a values optimizer over its tables' R rows
                   (rowwise_adagrad 1: 4/width bytes per element)
    sharding       a value table with model.memory.shard_values holds 1/W of its columns, and so 1/W of its
                   weights, gradient and optimizer state (model/memory/value_shards.py); Engram tables are
                   replicated. parallel="fsdp": every dense parameter is cut in W pieces along its first
                   dimension, ceil(rows / W) rows each (FSDP2's Shard(0), padded), with its gradient and
                   optimizer state; the value and Engram tables stay outside FSDP, as above
    communication  ddp on W > 1: DDP's gradient buckets, a copy of every gradient it all-reduces (the trainable
                   dense parameters, and replicated value tables with dense gradients): 4·P.
                   fsdp: the units gathered whole at once, b·P_unit (b = 4, or 2 when FSDP's mixed precision
                   gathers them in bf16/fp16): the largest unit (a block; or the rest: embeddings, norms, output),
                   or with train.fsdp_reshard_after_forward=false every unit, each kept gathered from its forward
                   to its backward; and the largest unit's gradient whole before its reduce-scatter, 4·P_unit.
                   Either, on W > 1: a replicated table's sparse gradient averaged over the ranks (runtime/
                   distributed.all_reduce_sparse_grad_): every rank's rows gathered, then concatenated, 2·W·R
                   rows, and the merged gradient divided by W, a second copy of it (R: a rank's rows, the
                   gradient's formula above without the factor W)
    activations    of one micro-batch (below)
    step           the optimizer step's own temporaries, once the activations are freed: torch's AdamW steps
                   one tensor at a time off CUDA (sqrt(v), then its quotient: 2 copies of the largest tensor,
                   8·max |p|) and a whole group at once on CUDA (foreach: a copy of its second moments, 4·P);
                   ClippedAdagrad 8·max |p| (the scaled gradient, sqrt of the sum); the sparse optimizers'
                   row-sized ones are left out. The larger of the two groups' steps (they run one after the other)
    total          parameters + gradients + optimizer + communication + max(activations, step): the gradients
                   grow while the activations are freed in the backward, so adding both errs high there; or the
                   build's peak if larger: the weights whole (ddp), or under fsdp this rank's shards, and the parts
                   outside the blocks and one block whole, as runtime/fsdp.build_sharded draws them

Activations: what the forward of one micro-batch saves for its backward, and the largest transient of
the step added to all of it (the saved tensors of the layers before a transient are fewer, so this
errs high). N = data.batch_size · data.bptt tokens, B = data.batch_size, T = data.bptt, D = model.dim,
F = the FFN's width, V = the vocabulary, h = attention heads; a = 4 bytes in fp32, 2 under bf16/fp16
autocast (matmul inputs and outputs); the residual stream, the norms, the memory's search and read and the
loss stay float32 (4 bytes). Memory heads H, knn K, k_dim k, query MLP widths h_i.

    embeddings           8N (token ids) + 4N(D + 2) post-norm's embedding LayerNorm (input, mean, rstd)
                         + 4ND with model.dropout (its mask)
    every sublayer       4N(D + 2) its LayerNorm + aND with model.dropout (the residual branch's mask)
    attention, fused     5aND + 4Nh: input, q|k|v, output, log-sum-exp (torch's SDPA kernels keep
                         no T×T matrix)
    attention, math      5aND + 3aBhT²: scores, dropout mask, dropped scores: torch's CPU kernel takes no
                         dropout, so with model.attention_dropout > 0 on the CPU the math path runs
    ffn                  aN(D + 2F): input, hidden before and after the GELU
    memory               aND + aNΣh_i (query MLP input and hidden layers) + 4NHk (the queries, float32)
                         + 4NHk (batchnorm or layernorm: its input) + 8NH (layernorm's mean, rstd)
                         + 4NHk (qk_norm) + 4ND (input_dropout) + 4NHk (query_dropout)
                         + 24NHK (product keys: both halves' indices and the pairs'; flat keys' are the slots)
                         + share_keys (product): 4·H·|keys| (the shared keys copied for every head)
                         + tucker keys: 4NH·2·n_keys·r (component scores) + NHGmr·(20 + 4C) (the m kept rows'
                         and columns' indices and scores, C cores, G = 2 with both_signs) + 4NHC·Gm² (the
                         candidates' grid) + 8NHK
                         + 4NHK (the read weights) + 8NHK + 24N (the value read's slots and bags);
                         shard_values on W > 1: 12·W·NHK instead of 8NHK (every rank's lookups, gathered)
                         + peer values: 12NHK (expert inputs, activations, weighted) + 4ND under autocast
                         expanded values (UltraMem's, E blocks, C cores, L = HK, D_v wide), instead of the
                         table's read: 12NECL (bags' slots, weights) + NEL (E > 1: block masks) + 24NEC
                         + 4NED_v + 4·|proj| (with a projection: the pooled values, the projections' copy)
                         + gated (Memory+): N·D·(3a + 4), + aND under autocast (the gate's input, cast)
                         + value_dropout: 4ND
    engram               aNE (the rows read, E = orders · ngram_dim) + 8N·orders·heads (their ids)
                         + N·D·(2a + 32) (the key and value projections' outputs; eight float32 (B, T, D)
                         tensors: the three RMSNorms' inputs and normalised inputs, the gated value, the
                         convolution's output) + aD·B·(T + (kernel - 1)·max_ngram) (the convolution's
                         causally padded input) + 28N (the gate's per-token scalars)
    final LayerNorm      4N(D + 2) (pre-norm)
    output and loss      aND (the last hidden state) + 4NV (the float32 log-probabilities) + 8N (targets)
    autocast copies      2 bytes per weight of every linear layer and of the tied output embedding: the
                         half-precision copies the backward keeps (bf16/fp16 only; none under fsdp, whose units
                         are gathered in half precision: communication)
    transient (largest)  the loss's backward: NV·(8 + 2 under autocast) (the log-probabilities' gradient
                         and the logits', float32, and their half copy); or a memory's key search:
                         4N·2H·n_keys (product keys' half scores), 4N·H·n_keys² (flat keys' scores)

Left out: the allocator's fragmentation and caching, library workspaces (cuBLAS, oneDNN), CUDA's own
context, the backward's gradient temporaries (a layer's worth), torch.compile's changes to what is saved;
activations are counted as for full training even where optim.trainable freezes the layers below (an upper
bound). A sublayer, output, key search or value store without a formula here (the all-attention family's
context attentions, the adaptive softmax, a plugin's), or an optimizer without a step rule, is named in
`omitted`, and not counted. The formulas are checked against the tensors a real
forward saves (tests/test_memory_estimate.py), the total against the peak resident memory of training on
the CPU (benchmarks/memory_estimate.py; docs/training.md, "How much memory per rank").
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from xlm_pkm.config import Config
from xlm_pkm.errors import ConfigError
from xlm_pkm.finetune import lora
from xlm_pkm.finetune.trainable import freeze
from xlm_pkm.model.attention import SelfAttention
from xlm_pkm.model.blocks import FeedForward
from xlm_pkm.model.memory.engram import Engram
from xlm_pkm.model.memory.keys import FlatKeys, ProductKeys
from xlm_pkm.model.memory.peer import PeerExperts
from xlm_pkm.model.memory.pkm import ProductKeyMemory
from xlm_pkm.model.memory.ultramem import ExpandedValues, TuckerKeys
from xlm_pkm.model.memory.value_stores import TableValues
from xlm_pkm.model.transformer import TransformerLM
from xlm_pkm.optim.optimizers import DENSE_OPTIMIZERS, value_optimizer

PARALLEL_MODES = ("ddp", "fsdp")
FLOAT = 4  # bytes of a float32: weights, gradients, optimizer states, the residual stream
INDEX = 8  # bytes of an int64 index


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank of a training run (see the module docstring for what each holds)."""

    world_size: int
    parallel: str
    precision: str
    batch_size: int  # sequences per rank per forward
    bptt: int
    parameters: int
    built: int  # the peak while a rank builds the model: its weights whole (ddp); fsdp: its shards, and whole the
    # parts outside the blocks and the largest block, drawn one at a time (runtime/fsdp.build_sharded)
    gradients: int
    optimizer: int
    communication: int  # DDP's gradient buckets or FSDP's gathered unit, and sparse gradients' exchange
    activations: dict[str, int]  # by part: embeddings, attention, ffn, memory, engram, output, ...; transient
    step_temporaries: int  # the optimizer step's own, once the activations are freed
    elements: dict[str, int]  # parameter elements of the whole model: dense, memory values, Engram tables
    omitted: tuple[str, ...] = field(default=())  # what has no formula here, in words

    @property
    def activation_bytes(self) -> int:
        return sum(self.activations.values())

    @property
    def total(self) -> int:
        """The peak: the weights, gradients, optimizer state and buffers, and the larger of the activations
        (forward and backward) and the optimizer step's temporaries (after the backward); or the build's, if larger."""
        held = self.parameters + self.gradients + self.optimizer + self.communication
        return max(held + max(self.activation_bytes, self.step_temporaries), self.built)

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "activation_bytes": self.activation_bytes, "total": self.total}

    def lines(self) -> list[str]:
        """The readable table: one line per kind, the activations by part, the total."""
        rows = [("parameters", self.parameters), ("gradients", self.gradients), ("optimizer state", self.optimizer),
                ("communication buffers", self.communication), ("activations", self.activation_bytes)]
        rows += [(f"  {part}", size) for part, size in self.activations.items() if size]
        rows += [("optimizer step temporaries", self.step_temporaries), ("the build's peak", self.built)]
        counts = ", ".join(f"{name} {n:,}" for name, n in self.elements.items() if n)
        head = (f"memory per rank: {self.parallel}, world size {self.world_size}, {self.precision}, batch "
                f"{self.batch_size} x bptt {self.bptt} per rank ({counts} parameters in the model)")
        lines = [head] + [f"  {name:<30} {_size(size):>12}" for name, size in rows]
        lines.append(f"  {'total':<30} {_size(self.total):>12}  (activations or step temporaries: the larger; or the "
                     f"build's peak)")
        lines += [f"  not counted: {what}" for what in self.omitted]
        return lines

    def summary(self) -> str:
        """The total and its parts in one line (train.log's)."""
        parts = [("parameters", self.parameters), ("gradients", self.gradients), ("optimizer state", self.optimizer),
                 ("communication buffers", self.communication), ("activations", self.activation_bytes),
                 ("optimizer step temporaries", self.step_temporaries)]
        parts.append(("the build's peak", self.built))
        omitted = f"; not counted: {', '.join(self.omitted)}" if self.omitted else ""
        return (f"memory per rank, estimated: {_size(self.total)} ({', '.join(f'{k} {_size(v)}' for k, v in parts)}; "
                f"{self.parallel}, world size {self.world_size}, {self.precision}, batch {self.batch_size} x bptt "
                f"{self.bptt} per rank; train/memory_estimate.py, as train.py --dry-run prints it{omitted})")

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _size(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def meta_model(cfg: Config) -> TransformerLM:
    """cfg's model on the meta device (shapes only), its parameters frozen as optim.trainable or optim.lora
    say, as the trainer sets them."""
    with torch.device("meta"):
        model = TransformerLM(cfg.model)
        if lora.uses_lora(cfg.optim):
            lora.add_adapters(model, cfg.optim)
        else:
            freeze(model, cfg.optim.trainable, cfg.optim.freeze_norm_stats)
    return model


def estimate(cfg: Config, world_size: int = 1, parallel: str = "ddp", device_type: str | None = None
             ) -> MemoryEstimate:
    """Bytes per rank of training `cfg` (model.vocab_size set) on `world_size` processes in `parallel` mode
    (ddp | fsdp). device_type (cpu | cuda; default: train.device's, auto being this machine's) decides whether
    attention runs torch's fused kernel and how torch's Adam steps (module docstring)."""
    if parallel not in PARALLEL_MODES:
        raise ConfigError(f"parallel mode {parallel!r}: expected one of {' | '.join(PARALLEL_MODES)}")
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    if cfg.model.memory.shard_values is True and cfg.model.dim % world_size:
        raise ConfigError(f"model.memory.shard_values: the value dimension {cfg.model.dim} does not split into "
                          f"{world_size} equal slices (one per process); use a world size dividing it")
    device_type = device_type or _device_type(cfg.train.device)
    model = meta_model(cfg)
    W, fsdp = world_size, parallel == "fsdp" and world_size > 1  # one process: the plain model
    tables = model.memory_value_parameters()
    table_ids = {id(p) for p in tables}
    groups = _optimizer_groups(cfg, model, W, fsdp)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    parameters = sum(p.element_size() * _rank_elements(p, W, fsdp and id(p) not in table_ids)
                     for p in model.parameters())
    built = parameters
    if fsdp:
        units = _fsdp_units(model, table_ids)  # the blocks', then the root's
        built += FLOAT * (max(units[:-1], default=0) + units[-1])
        gathered = max(units) if cfg.train.fsdp_reshard_after_forward else sum(units)
        communication = (FLOAT if cfg.train.precision == "fp32" else 2) * gathered + FLOAT * max(units)
    else:  # DDP all-reduces every trainable gradient but the sparse or sharded tables'
        communication = FLOAT * sum(sum(g.elements) for g in groups if g.in_ddp) if W > 1 else 0
    communication += sum(g.exchange for g in groups)
    activations, omitted = activation_bytes(cfg, model, W, device_type, fsdp)
    step = [_step_temporaries(g, device_type) for g in groups]
    omitted += [f"the step temporaries of optimizer {g.optimizer} ({g.name})" for g, t in zip(groups, step)
                if t is None]
    engram = sum(p.numel() for p in tables if getattr(p, "engram_table", False))
    whole_values = sum(p.numel() * (p.value_shard.world if hasattr(p, "value_shard") else 1) for p in tables)
    return MemoryEstimate(
        world_size=W, parallel=parallel, precision=cfg.train.precision, batch_size=cfg.data.batch_size,
        bptt=cfg.data.bptt, parameters=parameters + buffers, built=built + buffers,
        gradients=sum(g.gradients for g in groups),
        optimizer=sum(FLOAT * (g.state_size * sum(g.elements) + g.row_state_size * g.rows) for g in groups),
        communication=communication,
        activations=activations, step_temporaries=max([t or 0 for t in step], default=0),
        elements={"dense": sum(p.numel() for p in model.parameters() if id(p) not in table_ids),
                  "memory values": whole_values - engram, "Engram": engram},
        omitted=tuple(omitted))


def _rank_elements(p: nn.Parameter, world_size: int, fsdp: bool) -> int:
    """The elements of `p` this rank holds: a sharded value table's 1/W of its columns (built here on one
    process, with every column); with FSDP (a dense parameter), ceil(rows / W) rows of its first dimension."""
    shard = getattr(p, "value_shard", None)
    if shard is not None:
        return p.shape[0] * (p.shape[1] * shard.world // world_size)
    if fsdp and p.dim():
        return math.ceil(p.shape[0] / world_size) * (p.numel() // p.shape[0])
    return p.numel()


@dataclass(frozen=True)
class _Group:
    """An optimizer group as this rank holds it (optim/optimizers.Optimizers' groups)."""

    name: str  # dense | values | engram
    optimizer: str  # its name in DENSE_OPTIMIZERS or VALUE_OPTIMIZERS
    state_size: int
    elements: list[int]  # this rank's elements of each trainable tensor
    gradients: int  # bytes
    sparse: bool  # row-sparse gradients
    in_ddp: bool  # DDP all-reduces its gradients (dense ones of replicated tensors)
    exchange: int = 0  # bytes of the sparse gradients' all-gather (replicated tables on W > 1)
    row_state_size: int = 0  # a values optimizer's state values per table row (ValueOptimizer.row_state_size)
    rows: int = 0  # the rows of its tables


def _optimizer_groups(cfg: Config, model: TransformerLM, world_size: int, fsdp: bool) -> list[_Group]:
    """The trainable parameters by optimizer group, with their gradients' bytes (module docstring)."""
    tables = model.memory_value_parameters()
    table_ids = {id(p) for p in tables}
    dense = [_rank_elements(p, world_size, fsdp) for p in model.parameters()
             if p.requires_grad and id(p) not in table_ids]
    groups = [_Group("dense", cfg.optim.optimizer, DENSE_OPTIMIZERS[cfg.optim.optimizer].state_size, dense,
                     FLOAT * sum(dense), False, True)] if dense else []
    values = value_optimizer(cfg.optim)
    reads = _lookups_per_token(model, cfg.model.engram.heads)
    tokens = cfg.data.batch_size * cfg.data.bptt * cfg.optim.accumulate
    for name in ("values", "engram"):
        trained = [p for p in tables if p.requires_grad and getattr(p, "engram_table", False) == (name == "engram")]
        if not trained:
            continue
        elements = [_rank_elements(p, world_size, False) for p in trained]
        replicated = not any(hasattr(p, "value_shard") for p in trained)
        gradients = FLOAT * sum(elements)
        exchange = 0
        if values.sparse:  # the rows read, every rank's once exchanged; a row: its values and its index
            row = [FLOAT * n // p.shape[0] + INDEX for p, n in zip(trained, elements)]
            mine = [min(tokens * reads[id(p)], p.shape[0]) for p in trained]  # rows of this rank's tokens
            merged = [min(tokens * reads[id(p)] * world_size, p.shape[0]) for p in trained]
            gradients = sum(r * u for r, u in zip(row, merged))
            if replicated and world_size > 1:  # gathered and concatenated, then the merged rows divided by W
                exchange = sum(r * (2 * world_size * n + u) for r, n, u in zip(row, mine, merged))
        groups.append(_Group(name, cfg.optim.values_optimizer, values.state_size, elements, gradients,
                             values.sparse, replicated and not values.sparse, exchange, values.row_state_size,
                             sum(p.shape[0] for p in trained)))
    return groups


def _step_temporaries(group: _Group, device_type: str) -> int | None:
    """Bytes the optimizer step of `group` allocates for itself (module docstring); None: no rule for it."""
    if group.sparse:
        return 0  # row-sized: left out
    if group.optimizer == "adam":  # torch's AdamW: foreach on CUDA, one tensor at a time elsewhere
        return FLOAT * (sum(group.elements) if device_type == "cuda" else 2 * max(group.elements))
    if group.optimizer == "adagrad" and group.name == "dense":  # ClippedAdagrad: the scaled gradient, sqrt(sum)
        return 2 * FLOAT * max(group.elements)
    return None


def _lookups_per_token(model: TransformerLM, engram_heads: int) -> Counter:
    """id(table) -> the rows each token reads from it, over every memory or Engram layer that reads it."""
    reads = Counter()
    for _, m in model.memories():
        for p in m.values.tables():
            reads[id(p)] += m.heads * m.knn
    for _, e in model.engrams():
        reads[id(e.table)] += (e.dilation - 1) * engram_heads  # dilation: max_ngram; orders 2..max_ngram
    return reads


def _fsdp_units(model: TransformerLM, table_ids: set[int]) -> list[int]:
    """Dense parameter elements of each FSDP unit: every block, and the rest of the model (the root)."""
    in_blocks = {id(p) for p in model.blocks.parameters()}
    units = [sum(p.numel() for p in block.parameters() if id(p) not in table_ids) for block in model.blocks]
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_blocks and id(p) not in table_ids)
    return [*units, root]


def _device_type(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device.split(":")[0]


def activation_bytes(cfg: Config, model: TransformerLM, world_size: int = 1, device_type: str | None = None,
                     fsdp: bool = False) -> tuple[dict[str, int], list[str]]:
    """The activations of one micro-batch by part (the module docstring's formulas), and what has no formula;
    `fsdp`: no autocast weight copies (FSDP gathers the weights in half precision)."""
    c = cfg.model
    B, T = cfg.data.batch_size, cfg.data.bptt
    N, D, V = B * T, c.dim, c.vocab_size
    a = FLOAT if cfg.train.precision == "fp32" else 2
    half = a == 2
    cpu = (device_type or _device_type(cfg.train.device)) == "cpu"
    xlm = c.family == "transformer"
    parts = Counter()
    omitted = []
    norm = FLOAT * N * (D + 2)  # a LayerNorm's input, mean and rstd
    parts["embeddings and norms"] += INDEX * N + (norm if xlm and not c.pre_norm else 0)
    parts["embeddings and norms"] += FLOAT * N * D if c.dropout else 0
    transients = [0]
    for names, block in zip(model.plan, model.blocks):
        for name, f in zip(names, block.sublayers):
            parts["embeddings and norms"] += norm + (a * N * D if c.dropout and xlm else 0)
            if isinstance(f, SelfAttention):
                if c.attention_dropout and cpu:
                    parts["attention"] += 5 * a * N * D + 3 * a * B * f.n_heads * T * T
                else:
                    parts["attention"] += 5 * a * N * D + FLOAT * N * f.n_heads
            elif isinstance(f, FeedForward):
                parts["ffn"] += a * N * (D + 2 * f.fc1.out_features)
            elif isinstance(f, ProductKeyMemory):
                saved, transient, unknown = _memory_bytes(f, N, D, a, world_size)
                parts["memory"] += saved
                transients.append(transient)
                omitted += unknown
            elif isinstance(f, Engram):
                parts["engram"] += _engram_bytes(f, cfg, N, D, a)
            else:
                omitted.append(f"the activations of sublayer {name} (no formula)")
    if c.pre_norm:
        parts["embeddings and norms"] += norm
    if c.adaptive_cutoffs:
        omitted.append("the adaptive softmax's activations (no formula)")
    else:
        parts["output and loss"] += a * N * D + FLOAT * N * V + INDEX * N
        transients.append(N * V * (2 * FLOAT + (2 if half else 0)))
    if half and not fsdp:
        linears = sum(mod.weight.numel() for mod in model.modules() if isinstance(mod, nn.Linear))
        tied = model.tok_emb.weight.numel() if model.output is None else 0
        parts["autocast weight copies"] += 2 * (linears + tied)
    parts["transient (largest)"] = max(transients)
    return dict(parts), sorted(set(omitted))


def _memory_bytes(f: ProductKeyMemory, N: int, D: int, a: int, world_size: int) -> tuple[int, int, list[str]]:
    """(saved, transient, omitted) of one memory layer: its query network, key search and value store
    (module docstring)."""
    cfg, H, K, k = f.cfg, f.heads, f.knn, f.cfg.k_dim
    omitted = []
    saved = a * N * D + a * N * sum(cfg.query_hidden) + FLOAT * N * H * k
    if cfg.query_norm != "none":
        saved += FLOAT * N * H * k + (2 * FLOAT * N * H if cfg.query_norm == "layernorm" else 0)
    saved += FLOAT * N * H * k if cfg.qk_norm else 0
    saved += FLOAT * N * D if cfg.input_dropout else 0
    saved += FLOAT * N * H * k if cfg.query_dropout else 0
    saved += FLOAT * N * H * K  # the read weights
    transient = 0
    keys = f.keys
    if isinstance(keys, ProductKeys):
        saved += 3 * INDEX * N * H * K + (FLOAT * H * keys.weight.numel() if cfg.share_keys else 0)  # + keys copied
        transient = FLOAT * N * 2 * H * keys.n_keys
    elif isinstance(keys, FlatKeys):  # its indices are the slots the value read saves
        transient = FLOAT * N * H * f.n_slots
    elif isinstance(keys, TuckerKeys):
        G, m, r, C = 2 if keys.both_signs else 1, keys.topm, keys.rank, keys.cores
        saved += (FLOAT * N * H * 2 * keys.n_keys * r + (2 * INDEX + FLOAT + C * FLOAT) * N * H * G * m * r
                  + FLOAT * N * H * C * G * m * m + INDEX * N * H * K)
    else:
        omitted.append(f"the key search's own activations (memory.key_type={cfg.key_type})")
    store = f.values
    if isinstance(store, ExpandedValues):
        E, C, L = store.expansion, store.cores, H * K
        saved += (INDEX + FLOAT) * N * E * C * L + (N * E * L if E > 1 else 0) + 3 * INDEX * N * E * C
        if store.proj is not None:  # the pooled values, and the projections' copy their einsum keeps
            saved += FLOAT * N * E * store.value_dim + FLOAT * store.proj.numel()
    elif isinstance(store, (TableValues, PeerExperts)):
        sharded = hasattr(getattr(store, "weight", None), "value_shard") and world_size > 1
        saved += (INDEX + FLOAT) * world_size * N * H * K if sharded else INDEX * N * H * K
        saved += 3 * INDEX * N
        if isinstance(store, PeerExperts):
            saved += 3 * FLOAT * N * H * K + (FLOAT * N * D if a == 2 else 0)
    else:
        omitted.append(f"the value store's own activations (memory.values={cfg.values})")
    saved += N * D * (3 * a + FLOAT + (a if a == 2 else 0)) if cfg.gated else 0  # + the gate's input, cast
    saved += FLOAT * N * D if cfg.value_dropout else 0
    return saved, transient, omitted


def _engram_bytes(e: Engram, cfg: Config, N: int, D: int, a: int) -> int:
    """What one Engram layer saves (module docstring)."""
    eng = cfg.model.engram
    orders = eng.max_ngram - 1
    window = a * D * cfg.data.batch_size * (cfg.data.bptt + (e.kernel_size - 1) * e.dilation)
    rows = a * N * orders * eng.ngram_dim + INDEX * N * orders * eng.heads
    return rows + N * D * (2 * a + 8 * FLOAT) + window + 7 * FLOAT * N
