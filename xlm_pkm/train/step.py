"""The two halves of a training step, shared by the trainer and the training-speed benchmark.

    loss = loss_backward(model, x, y, precision, device, scaler)     # per micro-batch
    norms, scale, skipped = optimizer_update(optimizers, scaler, loss)  # skipped: a bool, or a device flag
"""

from __future__ import annotations

from typing import Callable

import torch

from xlm_pkm.optim.optimizers import Optimizers
from xlm_pkm.runtime.precision import autocast


def loss_backward(model, x: torch.Tensor, y: torch.Tensor, precision: str, device: torch.device,
                  scaler: torch.amp.GradScaler, accumulate: int = 1,
                  aux_loss: Callable[[], torch.Tensor] | None = None,
                  real: torch.Tensor | None = None) -> torch.Tensor:
    """x, y: (B, T). Forward under autocast to the float32 negative log-likelihoods, backward of the scaled
    (mean NLL + aux_loss()) / accumulate; returns the (detached) mean NLL of the micro-batch.
    aux_loss: a training-only term (the adaptive spans' loss), not part of the returned loss.
    real: (B, T) bool, the positions in the mean (fact batches: y is PAD_TARGET, below 0, elsewhere); None: all."""
    with autocast(precision, device):
        if real is None:
            nll = model(x, targets=y).mean()  # from (B, T) float32
        else:
            nll = (model(x, targets=y.clamp(min=0)) * real).sum() / real.sum().clamp(min=1)
    loss = nll if aux_loss is None else nll + aux_loss()
    scaler.scale(loss / accumulate).backward()
    return nll.detach()


def optimizer_update(optimizers: Optimizers, scaler: torch.amp.GradScaler,
                     loss: torch.Tensor) -> tuple[dict[str, torch.Tensor], float, bool | torch.Tensor]:
    """Unscale and clip every group, step unless the loss or a gradient is not finite, drop the gradients.
    Returns the gradient norms per group, the loss scale used (1 without fp16) and whether the step was
    skipped (fp16: the scaler found inf/nan and lowered its scale; else a non-finite loss or norm): a bool, or,
    when every group's optimizer skips on the device (optim.fused_dense, optim.fused_values) and without fp16, a
    () bool tensor on the device, for the caller to read once the step's work is queued."""
    norms = optimizers.unscale_and_clip(scaler)  # no sync: norms stay on the device
    scale = scaler.get_scale() if scaler.is_enabled() else 1.0  # host sync (fp16): the current scale
    if scaler.is_enabled():
        optimizers.step(scaler)  # host sync (fp16): the scaler reads its found-inf flags
        scaler.update()
        skipped = scaler.get_scale() < scale  # host sync (fp16): the new scale
    else:
        finite = torch.isfinite(loss) & torch.stack(list(norms.values())).isfinite().all()  # ()
        if optimizers.skip_on_device:  # no sync: the optimizers read the flag
            skipped = ~finite
            optimizers.step(scaler, found_inf=skipped.float())
        else:  # host sync: one flag, is the loss and every norm finite
            skipped = not bool(finite)
            if not skipped:
                optimizers.step(scaler)
    optimizers.zero_grad()
    return norms, scale, skipped
