"""(batch, bptt) blocks of a split's token stream, for language-model training and evaluation.

The split's shards (checked against meta.json by `check_split`), concatenated in order, form one
token stream of N tokens: documents in input order, each starting with `<s>`. For an epoch starting
at `offset`, the stream is cut into S = world_size * batch_size contiguous streams of
L = (N - offset - 1) // S predicted tokens; stream s covers tokens [offset + s*L, offset + (s+1)*L]
(consecutive streams share one token, so every token after the first is predicted exactly once).
Rank r reads streams r*B .. r*B + B - 1, so ranks are disjoint. Block j of an epoch is x = tokens
[j*bptt, (j+1)*bptt) of each of the rank's streams and y = x shifted by one. The
N - offset - 1 - S*L < S tokens that do not split evenly are dropped (the end of the split).

* train=True: epochs forever; numpy.random.default_rng([seed, e]) draws epoch e's offset in
  [0, bptt) (block boundaries change between epochs), then the order in which its full blocks are
  read (a permutation, as XLM's stream reader shuffles its bptt blocks; shuffle=False keeps them in
  order, so each stream is read contiguously across batches, for models that carry a cache). All
  ranks share the order, so they stay disjoint, and every block of an epoch is read once.
* train=False: one pass from offset 0, blocks in order; the last block may be shorter (t <= bptt).
  Each new `iter()` starts a new pass (or continues a pass restored by `load_state_dict`).
  `rewind(max_batches)` cuts the passes that follow to the tokens one process reads in its first
  `max_batches` batches, whatever the number of processes: the B = batch_size windows of that process
  (stream s from s·L1, L1 = (N - 1) // B, its first min(max_batches·bptt, L1) predicted tokens), each
  cut into W consecutive pieces of that length // W, rank r reading piece r of every window. On one
  process these are the batches of an uncut pass's first max_batches; on W they are the same tokens
  when W divides the window's length (else up to W - 1 fewer per window), in ~max_batches / W batches
  per rank, a piece's first tokens with less context before them than one process gives them.

A shard's checksum is verified the first time it is read (shard.py).

`state_dict()` is {epoch, step, ...} as plain ints; all ranks advance in lockstep, so one rank's
state resumes every rank. The iterator updates the state before yielding a batch: a state saved
after consuming k batches resumes at batch k + 1. The epoch's offset and block order do not depend on
the ranks, only on S: a run saved by W processes resumes on W' with the same S (data.batch_size = S / W')
at the same global position, each of its ranks reading S / W' of the same S streams.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from xlm_pkm.settings import non_negative, positive

from .dictionary import Dictionary
from .meta import check_split, load_meta
from .shard import Shard, ShardError, read_shard

OPEN_SHARDS = 64  # memory maps kept open at once


# The settings a data position depends on, by their name in TokenStream.state_dict
POSITION_SETTINGS = {"seed": "train.seed", "batch_size": "data.batch_size", "bptt": "data.bptt",
                     "shuffle": "data.shuffle_blocks"}


@dataclass
class DataConfig:
    """The run's token streams (TokenStream below, or fact_batches.FactBatches): data."""

    path: str = "data/processed/sample"  # output directory of xlm_pkm.data.preprocess
    batch_size: int = field(default=32, metadata=positive())  # sequences per rank per forward
    bptt: int = field(default=256, metadata=positive())  # tokens per sequence
    eval_batch_size: int = field(default=0, metadata=non_negative())  # 0: same as batch_size
    shuffle_blocks: bool = True  # read an epoch's bptt blocks in a seeded shuffled order (XLM); false: in order
    # N > 0: each training step's batch is one fact's first N paraphrases, padding masked, facts in order
    # (DIR/fact_batches.json of xlm_pkm.experiments.facts; data/fact_batches.py); 0: the token stream
    fact_batches: int = field(default=0, metadata=non_negative())


class TokenStream:
    def __init__(self, data_dir: str | Path, split: str, batch_size: int, bptt: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, train: bool = True, shuffle: bool = True):
        data_dir = Path(data_dir)
        if not 0 <= rank < world_size or batch_size < 1 or bptt < 1:
            raise ValueError(f"invalid stream: rank {rank} of world_size {world_size}, batch_size {batch_size}, "
                             f"bptt {bptt}")
        shards = check_split(data_dir, split)
        self.unit = load_meta(data_dir).get("unit", "token")  # "byte" for character-level data
        self.dictionary = Dictionary.load(data_dir / "vocab")
        self.paths = [path for path, _ in shards]
        sizes = [n for _, n in shards]
        self._verified: set[int] = set()
        self.shard_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.total = int(self.shard_starts[-1])
        self.data_dir, self.split, self.batch_size, self.bptt = data_dir, split, batch_size, bptt
        self.rank, self.world_size, self.seed, self.train = rank, world_size, seed, train
        self.shuffle = train and shuffle
        self.epoch = self.step = 0
        self.max_batches = 0  # evaluation: passes cut to one process's first max_batches batches (rewind)
        self._open: OrderedDict[int, Shard] = OrderedDict()
        min_steps = self._steps(self._stream_len(bptt - 1 if train else 0))
        if min_steps < 1:
            raise ShardError(f"split {split!r} of {data_dir} has {self.total} tokens: too few for "
                             f"{world_size} x {batch_size} streams of bptt {bptt}")

    def _epoch(self, epoch: int) -> tuple[int, np.ndarray]:
        """(offset, order in which the epoch's blocks are read). Training: one generator draws the offset
        in [0, bptt), then the order (shuffled unless shuffle=False, for models that carry a cache from one
        block to the next). Evaluation: offset 0, blocks in order."""
        rng = np.random.default_rng([self.seed, epoch])
        offset = int(rng.integers(self.bptt)) if self.train else 0
        n_blocks = self._steps(self._layout(offset)[1])
        return offset, rng.permutation(n_blocks) if self.shuffle else np.arange(n_blocks)

    def _offset(self, epoch: int) -> int:
        return self._epoch(epoch)[0]

    def _stream_len(self, offset: int) -> int:
        return (self.total - offset - 1) // (self.world_size * self.batch_size)

    def _layout(self, offset: int) -> tuple[np.ndarray, int]:
        """(the first token of each of this rank's batch_size streams, their length in predicted tokens): the
        epoch's S = world_size x batch_size streams, or a cut evaluation pass's pieces (module docstring)."""
        rows = np.arange(self.batch_size)
        if self.max_batches:
            one = (self.total - 1) // self.batch_size  # a stream's length on one process
            length = min(self.max_batches * self.bptt, one) // self.world_size
            return rows * one + self.rank * length, length
        length = self._stream_len(offset)
        return offset + (self.rank * self.batch_size + rows) * length, length

    def _steps(self, stream_len: int) -> int:
        return stream_len // self.bptt if self.train else -(-stream_len // self.bptt)

    @property
    def n_tokens(self) -> int:
        """Tokens this rank predicts in the current epoch (train) or in the pass (eval)."""
        return self.batch_size * self._layout(self._offset(self.epoch))[1]

    def __len__(self) -> int:
        """Batches in the current epoch (train) or in the pass (eval)."""
        return self._steps(self._layout(self._offset(self.epoch))[1])

    def _shard(self, i: int) -> Shard:
        if i not in self._open:
            self._open[i] = read_shard(self.paths[i], self.dictionary.fingerprint(), verify=i not in self._verified)
            self._verified.add(i)
            if len(self._open) > OPEN_SHARDS:
                self._open.popitem(last=False)
        self._open.move_to_end(i)
        return self._open[i]

    def _read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the split, across shard boundaries."""
        pieces = []
        while length > 0:
            i = int(np.searchsorted(self.shard_starts, start, side="right")) - 1
            local = start - int(self.shard_starts[i])
            piece = self._shard(i).tokens[local: local + length]
            pieces.append(piece)
            start, length = start + len(piece), length - len(piece)
        return np.concatenate(pieces).astype(np.int64)

    def __iter__(self):
        while True:
            offset, order = self._epoch(self.epoch)
            first, stream_len = self._layout(offset)
            while self.step < len(order):
                t0 = int(order[self.step]) * self.bptt
                t = min(self.bptt, stream_len - t0)
                block = np.stack([self._read(int(s) + t0, t + 1) for s in first])
                self.step += 1
                yield torch.from_numpy(np.ascontiguousarray(block[:, :-1])), torch.from_numpy(block[:, 1:].copy())
            self.step = 0
            if not self.train:
                return
            self.epoch += 1

    def rewind(self, max_batches: int = 0) -> None:
        """Back to the first batch of the first epoch: the next iteration reads an evaluation pass from its
        start, also after one cut short; whole, or (max_batches > 0, train=False) cut to one process's first
        max_batches batches, split across the ranks (module docstring)."""
        if max_batches and self.train:
            raise ValueError("a training stream is not cut: max_batches is for evaluation passes")
        self.epoch = self.step = 0
        self.max_batches = max_batches
        if max_batches and self._layout(0)[1] < 1:
            raise ShardError(f"split {self.split!r} of {self.data_dir} has {self.total} tokens: too few for "
                             f"{self.batch_size} streams of at least {self.world_size} tokens each")

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step": self.step, "seed": self.seed, "batch_size": self.batch_size,
                "bptt": self.bptt, "world_size": self.world_size, "total_tokens": self.total,
                "shuffle": int(self.shuffle)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continues at `state`, saved by this rank or, on another number of processes, by any rank: the position
        (epoch, step) is global, and so are the streams when world_size x batch_size is the same (each rank then
        reads other rows of the same blocks: no token is read twice or skipped)."""
        saved_world = state.get("world_size", self.world_size)
        if saved_world != self.world_size:
            streams = saved_world * state["batch_size"]
            if streams != self.world_size * self.batch_size:
                fits = (f"data.batch_size={streams // self.world_size}" if streams % self.world_size == 0 else
                        f"a number of processes that divides {streams}")
                raise ValueError(f"the run was saved by {saved_world} process(es) x data.batch_size="
                                 f"{state['batch_size']} = {streams} streams, resumed by {self.world_size} x "
                                 f"{self.batch_size}: its data position carries over to the same streams only; "
                                 f"resume with {fits}")
            state = {**state, "world_size": self.world_size, "batch_size": self.batch_size}
        for key in ("seed", "batch_size", "bptt", "world_size", "total_tokens", "shuffle"):
            if key in state and state[key] != self.state_dict()[key]:
                saved, now = state[key], self.state_dict()[key]
                if key in POSITION_SETTINGS:  # the same data, another setting
                    setting = POSITION_SETTINGS[key]
                    saved, now = (bool(saved), bool(now)) if key == "shuffle" else (saved, now)
                    raise ValueError(f"the run was saved with {setting}={saved}, resumed with {setting}={now}: its "
                                     f"data position does not carry over to another; resume with {setting}={saved}, "
                                     f"or start a new run from its weights with train.init_from=CHECKPOINT")
                raise ValueError(f"the checkpoint's data position does not match {self.data_dir} ({self.split}): its "
                                 f"{key} is {saved}, this data's {now}; resume on the data the run was trained on "
                                 f"(data.path in its config.yaml), or start a new run from its weights with "
                                 f"train.init_from=CHECKPOINT")
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
