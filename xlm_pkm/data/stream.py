"""Contiguous (batch, bptt) blocks of a split's token stream, for language-model training and evaluation.

The split's shards, concatenated in order, form one token stream of N tokens: documents in input
order, each starting with `<s>`, never shuffled. For an epoch starting at `offset`, the stream is cut
into S = world_size * batch_size contiguous streams of L = (N - offset - 1) // S predicted tokens;
stream s covers tokens [offset + s*L, offset + (s+1)*L] (consecutive streams share one token, so
every token after the first is predicted exactly once). Rank r reads streams r*B .. r*B + B - 1, so
ranks are disjoint. Each step yields x = the next bptt tokens of each stream and y = x shifted by one.
The N - offset - 1 - S*L < S tokens that do not split evenly are dropped (the end of the split).

* train=True: epochs forever; epoch e starts at a random offset in [0, bptt) drawn from
  numpy.random.default_rng([seed, e]), so block boundaries change between epochs; only full blocks.
* train=False: one pass from offset 0; the last block may be shorter (t <= bptt). Each new `iter()`
  starts a new pass (or continues a pass restored by `load_state_dict`).

`state_dict()` is {epoch, step, ...} as plain ints; all ranks advance in lockstep, so one rank's
state resumes every rank. The iterator updates the state before yielding a batch: a state saved
after consuming k batches resumes at batch k + 1.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from .dictionary import Dictionary
from .shard import Shard, ShardError, read_header, read_shard, shard_paths

OPEN_SHARDS = 64  # memory maps kept open at once


class TokenStream:
    def __init__(self, data_dir: str | Path, split: str, batch_size: int, bptt: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, train: bool = True):
        data_dir = Path(data_dir)
        if not data_dir.is_dir():
            raise ShardError(f"data directory not found: {data_dir} (run xlm_pkm.data.preprocess)")
        if not 0 <= rank < world_size or batch_size < 1 or bptt < 1:
            raise ValueError(f"invalid stream: rank {rank} of world_size {world_size}, batch_size {batch_size}, bptt {bptt}")
        self.dictionary = Dictionary.load(data_dir / "vocab")
        self.paths = shard_paths(data_dir, split)
        if not self.paths:
            raise ShardError(f"no shards for split {split!r} in {data_dir} (expected {data_dir}/{split}.000.bin)")
        fingerprint = self.dictionary.fingerprint()
        sizes = [read_header(p, fingerprint)[1] for p in self.paths]
        self.shard_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.total = int(self.shard_starts[-1])
        self.split, self.batch_size, self.bptt = split, batch_size, bptt
        self.rank, self.world_size, self.seed, self.train = rank, world_size, seed, train
        self.epoch = self.step = 0
        self._open: OrderedDict[int, Shard] = OrderedDict()
        min_steps = self._steps(self._stream_len(bptt - 1 if train else 0))
        if min_steps < 1:
            raise ShardError(f"split {split!r} of {data_dir} has {self.total} tokens: too few for "
                             f"{world_size} x {batch_size} streams of bptt {bptt}")

    def _offset(self, epoch: int) -> int:
        return int(np.random.default_rng([self.seed, epoch]).integers(self.bptt)) if self.train else 0

    def _stream_len(self, offset: int) -> int:
        return (self.total - offset - 1) // (self.world_size * self.batch_size)

    def _steps(self, stream_len: int) -> int:
        return stream_len // self.bptt if self.train else -(-stream_len // self.bptt)

    @property
    def n_tokens(self) -> int:
        """Tokens this rank predicts in the current epoch (train) or in the pass (eval)."""
        return self.batch_size * self._stream_len(self._offset(self.epoch))

    def __len__(self) -> int:
        """Batches in the current epoch (train) or in the pass (eval)."""
        return self._steps(self._stream_len(self._offset(self.epoch)))

    def _shard(self, i: int) -> Shard:
        if i not in self._open:
            self._open[i] = read_shard(self.paths[i], self.dictionary.fingerprint())
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
            offset = self._offset(self.epoch)
            stream_len = self._stream_len(offset)
            first = offset + (self.rank * self.batch_size + np.arange(self.batch_size)) * stream_len
            while self.step < self._steps(stream_len):
                t0 = self.step * self.bptt
                t = min(self.bptt, stream_len - t0)
                block = np.stack([self._read(int(s) + t0, t + 1) for s in first])
                self.step += 1
                yield torch.from_numpy(np.ascontiguousarray(block[:, :-1])), torch.from_numpy(block[:, 1:].copy())
            self.step = 0
            if not self.train:
                return
            self.epoch += 1

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step": self.step, "seed": self.seed, "batch_size": self.batch_size,
                "bptt": self.bptt, "world_size": self.world_size, "total_tokens": self.total}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in ("seed", "batch_size", "bptt", "world_size", "total_tokens"):
            if state.get(key) != self.state_dict()[key]:
                raise ValueError(f"stream state does not match this stream: {key} is {state.get(key)}, expected {self.state_dict()[key]}")
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
