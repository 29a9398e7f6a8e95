"""The sparse value optimizers with their row update in one pass (optim.fused_values): LazyAdam's, Adagrad's,
row-wise Adagrad's and SGD's.

Per row r of a step's sparse gradient, rows in any order and repeated or not:

    g = (Σ of the gradient's entries for r) / grad_scale
    lazy_adam:        m[r], v[r], p[r] updated as in lazy_adam.py, at the step t
    adagrad:          s[r] += g²;   p[r] -= lr · g / (sqrt(s[r]) + eps)
    rowwise_adagrad:  G[r] += mean(g²);   p[r] -= lr · g / (sqrt(G[r]) + eps)   (rowwise_adagrad.py)
    sgd:              p[r] -= lr · g

and nothing at all (step count included) when the flag found_inf is set. On a GPU that is one Triton kernel
(triton_rows.py) with no host sync: the repeated rows summed in it, the clip scale and the flag read on the
device, the step count (for the bias corrections) a float32 tensor there. On the CPU, the kernels' reference, the
gradient is coalesced and each chunk of its rows updated by today's code (lazy_adam.update_rows; Adagrad's three
lines below; rowwise_adagrad.update_rows; SGD's one), the scale applied to the chunk.

grad_scale and found_inf are attributes set on the optimizer before its step, as torch's GradScaler sets them
on its fused optimizers (`_step_supports_amp_scaling`), which is how torch's fused AdamW (optim.fused_dense) takes
them too: Optimizers sets grad_scale to 1 / the group's clip scale and found_inf from train/step.py's finite
check, or GradScaler (fp16) its own. Without them, the scale is 1 and the step is taken.

The state is the unfused optimizer's: LazyAdam's (exp_avg, exp_avg_sq: those of torch's AdamW), torch's
Adagrad's (sum), RowwiseAdagrad's (row_sum) and torch's SGD's (none), with the step a float32 tensor on the
parameter's device (as torch's fused AdamW keeps it; SGD's counted here, torch's keeps none: a state of torch's
starts it at 0); a state saved with the step as an int (LazyAdam) or a CPU tensor (torch's optimizers) is taken
over at the first step.

A bfloat16 table (model.memory.value_dtype) keeps float32 state, and its rows' new values, computed in float32,
are rounded stochastically with the bits of (rounding_seed, the table's index, the step t, row, column)
(stochastic_rounding.py; the kernels compute the same bits).
"""

from __future__ import annotations

import torch

from xlm_pkm.optim import rowwise_adagrad
from xlm_pkm.optim.lazy_adam import LazyAdam, row_chunks, update_rows
from xlm_pkm.optim.rowwise_adagrad import RowwiseAdagrad
from xlm_pkm.optim.stochastic_rounding import Float32State, add_rows_, state_dtype, table_streams
from xlm_pkm.utils.sparse_grads import coalesced


def _use_triton(p: torch.Tensor) -> bool:
    """Whether p's rows are updated by the Triton kernels (on a GPU) or by the CPU functions below."""
    return p.is_cuda


def _counted_step(state: dict, p: torch.Tensor, found_inf: torch.Tensor | None) -> torch.Tensor:
    """state["step"], a float32 tensor on p's device (an int or a CPU tensor is taken over), plus 1 unless
    found_inf is set: the step t of this update."""
    step = state["step"]
    if not (torch.is_tensor(step) and step.device == p.device and step.dtype == torch.float32):
        state["step"] = step = torch.as_tensor(step, dtype=torch.float32).to(p.device)  # after a resume, once
    return step.add_(1) if found_inf is None else step.add_(1 - found_inf)


def _device_flags(p: torch.Tensor, grad_scale: torch.Tensor | None,
                  found_inf: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """grad_scale and found_inf for the kernels: () float32 tensors on p's device (1 and 0 when not given)."""
    ones = torch.ones((), dtype=torch.float32, device=p.device)
    return (ones if grad_scale is None else grad_scale.float(),
            ones.new_zeros(()) if found_inf is None else found_inf.float())


def _sparse_grad(p: torch.Tensor, name: str) -> torch.Tensor:
    if not p.grad.is_sparse:
        raise ValueError(f"{name} with optim.fused_values takes sparse gradients")
    return p.grad


def _scaled_chunks(p: torch.Tensor, grad: torch.Tensor, grad_scale: torch.Tensor | None):
    """The CPU functions' input: grad coalesced, as (rows (C,), g (C, dim) / grad_scale) chunks."""
    grad = coalesced(grad)
    for rows, g in row_chunks(p, grad.indices()[0], grad.values()):
        yield rows, g if grad_scale is None else g / grad_scale


class OnePassRows:
    """The step every one-pass optimizer below shares (a mixin, first among its bases): per parameter with a
    gradient, its state, the step t counted (unless found_inf), then its rows updated by the Triton kernel on a GPU
    (`_kernel`) or chunk by chunk by the CPU function (`_rows`); `name` for the sparse-gradient error."""

    _step_supports_amp_scaling = True  # takes grad_scale and found_inf (torch's GradScaler's fused-optimizer path)
    name: str

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        streams = table_streams(self, self.rounding_seed)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad, state = _sparse_grad(p, self.name), self._state(p)
                step = _counted_step(state, p, found_inf)  # ()
                if _use_triton(p):
                    self._kernel(p, state, grad, _device_flags(p, grad_scale, found_inf), step, streams[p], group)
                elif found_inf is None or not found_inf:
                    for rows, g in _scaled_chunks(p, grad, grad_scale):
                        self._rows(p, state, rows, g, group, step, streams[p])
        return loss


class FusedLazyAdam(OnePassRows, LazyAdam):
    """LazyAdam (lazy_adam.py) with its row update in one pass; grad_scale and found_inf as the module says."""

    name = "LazyAdam"

    def _state(self, p):
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, dtype=state_dtype(p))
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=state_dtype(p))
        return state

    def _kernel(self, p, state, grad, flags, step, key, group):
        from xlm_pkm.optim import triton_rows

        (beta1, beta2), t = group["betas"], step.double()
        bias = torch.stack([(1 - beta2**t).sqrt(), (1 - beta1**t).reciprocal()]).float()  # (2,)
        triton_rows.lazy_adam_rows_(p, state["exp_avg"], state["exp_avg_sq"], grad, *flags, bias, step, key,
                                    betas=(beta1, beta2), **{k: group[k] for k in ("lr", "eps", "weight_decay")})

    def _rows(self, p, state, rows, g, group, step, key):
        update_rows(p, state, rows, g, group, float(step), key)


class FusedSparseAdagrad(OnePassRows, Float32State, torch.optim.Adagrad):
    """torch's Adagrad on sparse gradients, as VALUE_OPTIMIZERS' adagrad builds it (no lr decay, no weight decay,
    a zero initial sum), with its row update in one pass; grad_scale and found_inf as the module says."""

    name = "Adagrad"

    def __init__(self, params, lr: float = 1e-2, eps: float = 1e-10, rounding_seed: int | None = 0):
        super().__init__(params, lr=lr, eps=eps)
        self.rounding_seed = rounding_seed
        for p, state in self.state.items():  # torch's Adagrad makes its sums here, of p's dtype
            state["sum"] = state["sum"].to(state_dtype(p))

    def _state(self, p):
        return self.state[p]

    def _kernel(self, p, state, grad, flags, step, key, group):
        from xlm_pkm.optim import triton_rows

        triton_rows.adagrad_rows_(p, state["sum"], grad, *flags, step, key, lr=group["lr"], eps=group["eps"])

    def _rows(self, p, state, rows, g, group, step, key):
        s = state["sum"].index_select(0, rows).addcmul_(g, g)  # (C, dim)
        state["sum"].index_copy_(0, rows, s)
        add_rows_(p, rows, g / s.sqrt_().add_(group["eps"]), -group["lr"], key, step)


class FusedRowwiseAdagrad(OnePassRows, RowwiseAdagrad):
    """RowwiseAdagrad (rowwise_adagrad.py) with its row update in one pass; grad_scale and found_inf as the module
    says."""

    name = "RowwiseAdagrad"

    def _state(self, p):
        return rowwise_adagrad.init_state(self.state[p], p)

    def _kernel(self, p, state, grad, flags, step, key, group):
        from xlm_pkm.optim import triton_rows

        triton_rows.rowwise_adagrad_rows_(p, state["row_sum"], grad, *flags, step, key, lr=group["lr"],
                                          eps=group["eps"])

    def _rows(self, p, state, rows, g, group, step, key):
        rowwise_adagrad.update_rows(p, state, rows, g, group, key)


class FusedSparseSGD(OnePassRows, torch.optim.SGD):
    """torch's SGD on sparse gradients, as VALUE_OPTIMIZERS' sgd builds it (no momentum, no weight decay), with its
    row update in one pass; grad_scale and found_inf as the module says."""

    name = "SGD"

    def __init__(self, params, lr: float = 1e-3, rounding_seed: int | None = 0):
        super().__init__(params, lr=lr)
        self.rounding_seed = rounding_seed

    def _state(self, p):
        state = self.state[p]
        state.setdefault("step", 0)
        return state

    def _kernel(self, p, state, grad, flags, step, key, group):
        from xlm_pkm.optim import triton_rows

        triton_rows.sgd_rows_(p, grad, *flags, step, key, lr=group["lr"])

    def _rows(self, p, state, rows, g, group, step, key):
        add_rows_(p, rows, g, -group["lr"], key, step)
