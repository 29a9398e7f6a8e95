"""Memory usage statistics of the paper (§4.2): how evenly a memory's slots are read.

Over an evaluation set, each slot i accumulates z'_i = Σ_x |w(x)_i| (the summed weight it received:
softmax, or the magnitude of a ReLU / raw score) and c_i (how many times it was read with a weight
≠ 0). With z = z' / ||z'||_1:

    usage = 100 · #{i : z_i ≠ 0} / |K|           (% of slots ever read)
    kl    = log|K| + Σ_i z_i log z_i             (KL(z ‖ uniform), nats; 0 = perfectly even)

The same two numbers are reported for the counts c (`usage_count`, `kl_count`), and `slots_p` is
the smallest number of slots holding p% of the weight mass (p = 50, 90, 99).

Beside them, the scale of a memory's weights and outputs, to tell an initialisation's effect from a design's
(OutputNorms, abs_sum): the mean |w| of its value tables and of its projections (UltraMem's), and the mean L2
norm of its output vectors over the evaluated positions, mean_x ‖m(x)‖₂. Each is kept as a (sum, count) pair
in float64, so that the processes' pairs add up to the whole's mean (a value shard's columns, or a copy).
"""

from __future__ import annotations

import math

import torch

from xlm_pkm.utils.chunks import slices


class SlotStats:
    """Per-slot summed weight and hit count, accumulated on the device of the reads (no host sync).

    The tensors are plain attributes, not module buffers: they stay out of `state_dict()` and out
    of DDP's buffer broadcast, and are allocated on the first `add`.
    """

    def __init__(self, n_slots: int):
        self.n_slots = n_slots
        self.reset()

    def reset(self) -> None:
        self.weights: torch.Tensor | None = None  # (n_slots,) float64
        self.counts: torch.Tensor | None = None  # (n_slots,) float64
        self.positions: torch.Tensor | None = None  # (N,) bool: the positions whose reads count; None: all

    def add(self, indices: torch.Tensor, weights: torch.Tensor) -> None:
        """indices, weights: (N, ...) selected slots and their weights. A slot counts by the magnitude of
        its weight, and a selection with weight 0 (a ReLU score) is not a read; with `positions` set, only
        the reads of those positions count (padding left out)."""
        if self.positions is not None:
            indices, weights = indices[self.positions], weights[self.positions]
        if self.weights is None:
            self.weights = torch.zeros(self.n_slots, dtype=torch.float64, device=indices.device)
            self.counts = torch.zeros(self.n_slots, dtype=torch.float64, device=indices.device)
        weights = weights.detach().double().abs().reshape(-1)
        self.weights.index_add_(0, indices.reshape(-1), weights)
        self.counts.index_add_(0, indices.reshape(-1), (weights != 0).double())

    def summary(self) -> dict[str, float]:
        """usage, kl, usage_count, kl_count, slots_50, slots_90, slots_99 (see the module docstring)."""
        if self.weights is None:
            keys = ("usage", "kl", "usage_count", "kl_count", "slots_50", "slots_90", "slots_99")
            return dict.fromkeys(keys, float("nan"))  # nothing read yet
        usage, kl = usage_and_kl(self.weights)
        usage_count, kl_count = usage_and_kl(self.counts)
        out = {"usage": usage, "kl": kl, "usage_count": usage_count, "kl_count": kl_count}
        out.update({f"slots_{p}": slots_holding(self.weights, p / 100) for p in (50, 90, 99)})
        return out


def usage_and_kl(mass: torch.Tensor) -> tuple[float, float]:
    """(% of slots with non-zero mass, KL(mass / Σ mass ‖ uniform) in nats)."""
    z = mass / mass.sum()
    used = z > 0
    kl = math.log(mass.numel()) + (z[used] * z[used].log()).sum()
    return 100.0 * used.double().mean().item(), kl.item()


def slots_holding(mass: torch.Tensor, fraction: float) -> int:
    """The smallest number of slots whose mass adds up to at least `fraction` of the total."""
    cumulative = mass.sort(descending=True).values.cumsum(0)  # (n_slots,)
    target = torch.tensor(fraction, dtype=cumulative.dtype, device=cumulative.device) * cumulative[-1]
    return min(int(torch.searchsorted(cumulative, target * (1 - 1e-12)).item()) + 1, mass.numel())


class OutputNorms:
    """Σ_x ‖m(x)‖₂ over the output vectors a memory produced while its statistics were on, and their number:
    `sums` (2,) float64 on the outputs' device (no host sync), allocated at the first add; not module state."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.sums: torch.Tensor | None = None

    def add(self, out: torch.Tensor) -> None:
        """out: (N, output_dim) a memory's outputs, one per position."""
        norms = torch.linalg.vector_norm(out.detach(), dim=-1, dtype=torch.float64)  # (N,)
        if self.sums is None:
            self.sums = torch.zeros(2, dtype=torch.float64, device=out.device)
        self.sums[0] += norms.sum()
        self.sums[1] += norms.numel()


def abs_sum(params: list[torch.Tensor]) -> torch.Tensor:
    """(2,) float64: Σ|w| over every element of `params` (at least one), and their number; a slice at a time
    (utils/chunks.py): the float64 sum of a whole table built a float64 copy of it, twice its float32 size."""
    total = sum(torch.linalg.vector_norm(part, 1, dtype=torch.float64) for p in params for part in slices(p.detach()))
    return torch.stack([total, total.new_tensor(float(sum(p.numel() for p in params)))])
