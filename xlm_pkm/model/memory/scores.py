"""Score functions: the selected keys' scores -> the weights of the slots they read (memory.score).

    weights = SCORE_FUNCTIONS[cfg.score](scores, cfg.temperature)   # scores (N, heads, knn[, cores])

Each normalises (or not) over the knn axis (dim 2); a trailing axis, such as UltraMem's cores, is
kept as it is. Only the knn selected scores are seen: the other slots have weight 0.

    softmax    w = softmax(s / temperature) over the knn        Lample et al. 2019, §3.1 (the paper)
    relu       w = relu(s)                                      Csordás et al. 2023, §4 ("non-competitive":
                                                                no normalisation, a slot can get weight 0)
    identity   w = s                                            UltraMem (Huang et al. 2025, §3): the raw
                                                                scores, negative ones included
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xlm_pkm.model.memory.memory_settings import SCORE_FUNCTIONS


@SCORE_FUNCTIONS.register("softmax")
def softmax(scores: torch.Tensor, temperature: float) -> torch.Tensor:
    return F.softmax(scores / temperature, dim=2)


@SCORE_FUNCTIONS.register("relu")
def relu(scores: torch.Tensor, temperature: float) -> torch.Tensor:
    return F.relu(scores)


@SCORE_FUNCTIONS.register("identity")
def identity(scores: torch.Tensor, temperature: float) -> torch.Tensor:
    return scores
