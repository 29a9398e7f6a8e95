"""Adaptive attention span (Sukhbaatar et al. 2019, ACL): each head learns how far back it looks.

    span = AdaptiveSpan(n_heads=8, max_span=8192, ramp=32, loss_coeff=1e-7)
    weights = weights * span.mask(L)      # (H, L) soft mask over offsets x = 0..L-1
    loss = nll + span.span_loss()         # training only, summed over layers
    optimizer.step(); span.clamp_()       # keep z in [0, 1] after every update

Head h has a ratio z_h in [0, 1] (init 0); its span is z_h·S tokens. For the offset x of a context
token (x = 0: the token immediately before the query) the mask is

    m(x) = clamp((R + z_h·S − x) / R, 0, 1)

1 up to z_h·S, then a linear ramp of length R down to 0, so z_h gets a gradient from the ramp.
Keys at offsets ≥ max_h ceil(z_h·S) + R have mask 0 in every head: `span_in_use()` is that bound
rounded up to a multiple of 64 (capped at S), the keys an attention layer must keep, and
`cache_length()` = min(S, span_in_use + 64) the hidden states a layer caches for the next block.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from xlm_pkm.model.model_settings import SpanConfig as SpanConfig  # its settings, here too

TRIM_MULTIPLE = 64  # spans in use and caches grow and shrink in steps of this many tokens


class AdaptiveSpan(nn.Module):
    def __init__(self, n_heads: int, max_span: int, ramp: int, loss_coeff: float):
        super().__init__()
        if max_span <= 0 or ramp <= 0:
            raise ValueError(f"adaptive span needs max_span > 0 and ramp > 0, got {max_span} and {ramp}")
        self.max_span, self.ramp, self.loss_coeff = max_span, ramp, loss_coeff
        self.z = nn.Parameter(torch.zeros(n_heads))  # (H,) span ratios: span = z·S tokens

    def mask(self, length: int) -> torch.Tensor:
        """(H, length) soft mask for offsets 0..length-1 (differentiable in z)."""
        x = torch.arange(length, device=self.z.device, dtype=self.z.dtype)  # (L,)
        return ((self.ramp + self.z[:, None] * self.max_span - x) / self.ramp).clamp(0, 1)

    @torch.no_grad()
    def clamp_(self) -> None:
        """Keep z in [0, 1]; call after every optimizer update."""
        self.z.clamp_(0, 1)

    def span_loss(self) -> torch.Tensor:
        """coeff × S × mean_h z_h: coeff × the heads' average span in tokens (a scalar)."""
        return self.loss_coeff * self.max_span * self.z.mean()

    def span_in_use(self) -> int:
        """Offsets any head can still see: ceil(max z·S) + R, up to a multiple of 64, at most S."""
        z_max = min(max(float(self.z.detach().max()), 0.0), 1.0)
        reach = math.ceil(z_max * self.max_span) + self.ramp
        return min(self.max_span, -(-reach // TRIM_MULTIPLE) * TRIM_MULTIPLE)

    def cache_length(self, span_in_use: int | None = None) -> int:
        """Hidden states to keep for the next block: min(S, span in use + 64); span_in_use: when already
        read (each read is a host sync)."""
        return min(self.max_span, (self.span_in_use() if span_in_use is None else span_in_use) + TRIM_MULTIPLE)
