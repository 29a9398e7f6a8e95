"""A context-attention sublayer that remembers its stream: AllAttention plus the cache it reads.

    layer = StreamAttention(AllAttention(...))
    y = layer(x)              # x (B, M, D): the next block of the B streams -> (B, M, D)
    state = layer.past        # (B, C, D) this layer's last inputs, detached (None before the first block)
    layer.past = None         # a new stream: the next block starts from a zero cache

Each forward attends over [past; x] and then keeps the last cache_length() rows of [past; x]
(all_attention.py). A stream's first block sees a zero cache of cache_length() rows, as the
authors' trainer starts. The batch (streams) must stay the same between blocks: a different batch
size raises. Training and evaluation streams differ, so the layer keeps one past per mode: `past`
is the current mode's, and switching from training to evaluation (model.eval()) starts the
evaluation streams from a zero cache while the training streams' past waits for model.train();
reset(training=False) does it without a switch (evaluation.evaluate, at every pass).
"""

from __future__ import annotations

import torch
from torch import nn

from xlm_pkm.model.all_attention import AllAttention


class StreamAttention(nn.Module):
    def __init__(self, attention: AllAttention):
        super().__init__()
        self.attention = attention
        self.pasts: dict[bool, torch.Tensor | None] = {}  # by self.training: (B, C, D)
        self.reset()

    @property
    def past(self) -> torch.Tensor | None:
        return self.pasts[self.training]

    @past.setter
    def past(self, value: torch.Tensor | None) -> None:
        self.pasts[self.training] = value

    def reset(self, training: bool | None = None) -> None:
        """New streams in one mode (training or evaluation) or, by default, both: the next block of
        each starts from a zero cache."""
        for mode in (True, False) if training is None else (training,):
            self.pasts[mode] = None

    def train(self, mode: bool = True) -> "StreamAttention":
        if self.training and not mode:
            self.pasts[False] = None  # an evaluation pass reads new streams
        return super().train(mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, _, D = x.shape
        window = self.attention.window()  # the span read once per block: with an adaptive span, a host sync
        length = self.attention.cache_length(window)
        past = self.past
        if past is None:
            past = x.new_zeros(B, length, D)
        elif past.shape[0] != B:
            raise ValueError(f"the attention cache holds {past.shape[0]} streams, this batch has {B}: "
                             f"reset or load the stream state of these streams first")
        y = self.attention(x, past, window)
        self.past = self.attention.next_cache(past, x, length)
        return y

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token of a block of seq_len tokens, at the current span:
        6 per weight of the query and output projections and of the persistent vectors (their scores
        and mixing), keys and values recomputed for the cache too (× (C + M) / M), and per query
        12 · L · dim for the context scores and mixing plus 6 · L · dim for the position scores
        (L = the window in use, also the cache length C read: forward trims the cache to L)."""
        a = self.attention
        dim = a.n_heads * a.head_dim
        window = a.window()
        persistent = 2 * a.n_persistent * dim
        return (6.0 * (2 * dim * dim + persistent) + 6.0 * 2 * dim * dim * (window + seq_len) / seq_len
                + 18.0 * window * dim)
