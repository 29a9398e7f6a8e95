"""A large tensor read a slice at a time, so that a reduction over it (a sum, a finiteness check) never builds a
temporary of its size: torch.isfinite(t) holds |t| and a mask, vector_norm(t, dtype=float64) a float64 copy; over a
memory table of 1 GiB that was a second table, or two, at a run's peak (issue 81).

    for part in slices(table):          # views of at most CHUNK_ELEMENTS elements, along the first dimension
        total += part.abs().sum()
"""

from __future__ import annotations

from typing import Iterator

import torch

CHUNK_ELEMENTS = 1 << 20  # elements a slice holds (4 MiB of float32): its temporaries stay that small


def slices(t: torch.Tensor, elements: int = CHUNK_ELEMENTS) -> Iterator[torch.Tensor]:
    """Views of `t` along its first dimension (a 0-d tensor: itself, as 1-d), each of at most `elements` elements
    (at least one row): views whatever the strides, so nothing is copied."""
    t = t.reshape(1) if t.dim() == 0 else t
    rows = max(1, elements // max(1, t[0].numel() if len(t) else 1))
    for i in range(0, t.shape[0], rows):
        yield t[i:i + rows]
