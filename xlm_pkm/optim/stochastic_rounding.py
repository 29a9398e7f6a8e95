"""Stochastic rounding of a bfloat16 table's updated rows (model.memory.value_dtype, model.engram.table_dtype):
every value optimizer's row update goes through `add_rows_` (lazy_adam.py, rowwise_adagrad.py, fused_rows.py's CPU
functions; triton_rows.py's kernels compute the same bits on a GPU).

A bfloat16 keeps 8 bits of mantissa: an update smaller than half the step between two bfloat16 numbers is lost by
rounding to nearest, and a row that receives many of them never moves. Rounded stochastically it moves up with the
probability of the fraction of a step the exact value went past, so that the rounded value equals the exact one
on average (Gupta et al. 2015, "Deep learning with limited numerical precision"). The row's new value is computed
in float32, x = p[r] + alpha · delta[r], then, with u = 16 random bits (0 <= u < 2^16),

    bits(x) + u, its high 16 bits kept                  (bits: the float32's, as an integer; sign-magnitude, so
                                                          the magnitude rounds up or down, symmetric in the sign)

which rounds x up (in magnitude) with probability (x's 16 low bits) / 2^16 and down otherwise: E[round(x)] = x.

The random bits are a counter-based stream, a hash of (seed, table, step, row, column), not a generator's state:
a resumed run draws the bits the uninterrupted run drew at the same step, whatever was saved, on any device and in
any order of the rows. The hash is two rounds of multiply-xorshift (`mix`, constants of Wellons' hash prospector,
both below 2^31 so that a product of two 32-bit numbers fits an int64 in torch):

    stream = mix(mix(seed) ^ table)                      table: the parameter's index in its optimizer
    u      = mix(mix(mix(stream ^ step) ^ row) ^ column) >> 16
"""

from __future__ import annotations

import torch

MASK = 0xFFFFFFFF  # 32 bits
MULTIPLIERS = (0x21F0AAAD, 0x735A2D97)


def mix(x):
    """The 32-bit hash (module docstring) of x, an int or an int64 tensor, in [0, 2^32) -> the same type."""
    x = x ^ (x >> 16)
    x = (x * MULTIPLIERS[0]) & MASK
    x = x ^ (x >> 15)
    x = (x * MULTIPLIERS[1]) & MASK
    return x ^ (x >> 15)


def stream(seed: int | None, table: int) -> int | None:
    """The random stream of the table at index `table` of an optimizer whose rounding seed is `seed` (None: the
    optimizer rounds to nearest, optim.values_rounding=nearest, and so does the table)."""
    return None if seed is None else mix(mix(seed & MASK) ^ (table & MASK))


def random_bits(key: int, step, rows: torch.Tensor, dim: int) -> torch.Tensor:
    """key: stream(); step: an int or a () tensor (the optimizer's step count); rows (C,) int64 -> (C, dim) int32, 16
    random bits per element of those rows (module docstring)."""
    step = torch.as_tensor(step, device=rows.device).to(torch.int64) & MASK  # ()
    per_row = mix(mix(key ^ step) ^ (rows & MASK))  # (C,)
    columns = torch.arange(dim, device=rows.device)  # (dim,)
    return (mix(per_row[:, None] ^ columns) >> 16).to(torch.int32)  # (C, dim)


def round_bfloat16(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """x float32, bits int32 in [0, 2^16) of x's shape -> x rounded to bfloat16, up (in magnitude) where bits is
    below x's 16 low bits (module docstring). The integer sum cannot overflow but for a NaN: finite and infinite
    values round to finite and infinite ones."""
    return ((x.view(torch.int32) + bits) >> 16).to(torch.int16).view(torch.bfloat16)


def state_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype of an optimizer's state for p: p's, but float32 for a bfloat16 table."""
    return torch.promote_types(p.dtype, torch.float32)


class Float32State:
    """A torch optimizer's mixin (first among its bases) for optimizers that keep a bfloat16 table's state in
    float32 (state_dtype): torch's load_state_dict casts every state tensor but the step to its parameter's dtype,
    which would round a resumed run's state to bfloat16; these are loaded again as saved."""

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        saved = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for i, p in zip(saved, params):
            for key, value in state_dict["state"].get(i, {}).items():
                if torch.is_tensor(value) and value.dtype == state_dtype(p) != self.state[p][key].dtype:
                    self.state[p][key] = value.to(p.device)


def rounds(p: torch.Tensor) -> bool:
    """Whether p's rows are rounded stochastically (a bfloat16 table), rather than added to in place."""
    return p.dtype == torch.bfloat16


def add_rows_(p: torch.Tensor, rows: torch.Tensor, delta: torch.Tensor, alpha: float, key: int | None, step) -> None:
    """p[rows] += alpha · delta, rows (C,) distinct, delta (C, dim): in place on a float32 table (index_add_); on a
    bfloat16 one, computed in float32 and rounded stochastically with the bits of (key, step, row, column), or to
    nearest (even) when key is None (optim.values_rounding=nearest: the comparison that shows what the bits buy)."""
    if not rounds(p):
        p.index_add_(0, rows, delta, alpha=alpha)
        return
    exact = p.index_select(0, rows).float().add_(delta, alpha=alpha)  # (C, dim)
    if key is None:
        p.index_copy_(0, rows, exact.to(torch.bfloat16))
    else:
        p.index_copy_(0, rows, round_bfloat16(exact, random_bits(key, step, rows, p.shape[1])))


def table_streams(optimizer: torch.optim.Optimizer, seed: int) -> dict:
    """{parameter: its stream}, each of the optimizer's parameters by its index over its param groups."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {p: stream(seed, i) for i, p in enumerate(params)}
