"""Choosing the next token from a model's logits: greedy, or sampling with temperature, top-k, top-p.

    sampling = Sampling(temperature=0.8, top_k=40, top_p=0.95)
    next_ids = sample(logits, sampling, torch.Generator().manual_seed(0))   # (B, V) -> (B,)

Sampling draws one uniform number per row from the generator (on the CPU, in float64) and inverts
the cumulative distribution of the allowed tokens, so a token outside the top-k / top-p set (zero
probability) is never drawn, and the draw depends only on the seed and the probabilities, not on the
device or the number of forwards that produced them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0  # > 0; logits are divided by it
    top_k: int = 0  # keep the k most likely tokens (0: all)
    top_p: float = 1.0  # then the smallest set of most likely tokens holding at least this probability
    greedy: bool = False  # the most likely token (the other fields are ignored)

    def __post_init__(self):
        if not self.temperature > 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"sampling needs temperature > 0, top_k >= 0 and 0 < top_p <= 1 "
                             f"(got temperature={self.temperature}, top_k={self.top_k}, top_p={self.top_p})")


def allowed_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """logits (B, V) -> (B, V) float64 probabilities of softmax(logits / temperature) restricted to the
    top-k, then top-p set (renormalised), zero elsewhere."""
    probs = torch.softmax(logits.double() / sampling.temperature, dim=-1)  # (B, V)
    if 0 < sampling.top_k < probs.shape[-1]:
        top = probs.topk(sampling.top_k, dim=-1).indices  # (B, k)
        probs = torch.zeros_like(probs).scatter_(-1, top, probs.gather(-1, top))
        probs = probs / probs.sum(-1, keepdim=True)
    if sampling.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)  # (B, V)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # (B, V) probability of the more likely tokens
        sorted_probs = sorted_probs.masked_fill(mass_before >= sampling.top_p, 0.0)  # the first always stays
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> torch.Tensor:
    """logits (B, V) -> (B,) int64 token ids on the logits' device; `generator` is a CPU generator."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    cdf = allowed_probs(logits.cpu(), sampling).cumsum(-1)  # (B, V) float64
    u = 1.0 - torch.rand(cdf.shape[0], 1, dtype=torch.float64, generator=generator)  # (B, 1) in (0, 1]
    ids = torch.searchsorted(cdf, u * cdf[:, -1:])  # (B, 1) first token whose cumulative mass reaches u
    return ids.squeeze(1).to(logits.device)
