"""Optimizers by name, the all-attention paper's Adagrad, schedules and the clipping scopes, against
torch's own implementations."""

import pytest
import torch

from xlm_pkm.config import ConfigError, OptimConfig, load_config
from xlm_pkm.optim.adagrad import ClippedAdagrad
from xlm_pkm.optim.optimizers import DENSE_OPTIMIZERS, VALUE_OPTIMIZERS, Optimizers
from xlm_pkm.optim.schedule import scheduled_lr


def params_with_grads(seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(5, 3, generator=g)), torch.nn.Parameter(torch.randn(4, generator=g))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * scale
    return params


def test_clipped_adagrad_without_clip_is_torch_adagrad():
    ours, ref = params_with_grads(), params_with_grads()
    opt, torch_opt = ClippedAdagrad(ours, lr=0.07, eps=1e-10), torch.optim.Adagrad(ref, lr=0.07, eps=1e-10)
    for step in range(3):
        for p, q in zip(ours, ref):
            q.grad = p.grad = torch.full_like(p, 0.1 * (step + 1)) + p.detach().sin()
        opt.step()
        torch_opt.step()
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q)


def test_clipped_adagrad_scales_each_step_but_accumulates_the_raw_gradient():
    ours, ref = params_with_grads(scale=10.0), params_with_grads(scale=10.0)  # norms far above the clip
    before = [p.detach().clone() for p in ref]
    ClippedAdagrad(ours, lr=0.07, eps=1e-10, clip=0.03).step()
    torch_opt = torch.optim.Adagrad(ref, lr=0.07, eps=1e-10)
    torch_opt.step()  # the unclipped step, and the accumulator of the raw gradient
    for p, q, p0 in zip(ours, ref, before):
        c = min(1.0, 0.03 / float(q.grad.norm()))
        torch.testing.assert_close(p - p0, c * (q - p0))


@pytest.mark.parametrize("schedule, expected", [("inverse_sqrt", [0.5, 1.0, 0.5]), ("linear_warmup", [0.5, 1.0, 1.0]),
                                                ("constant", [1.0, 1.0, 1.0])])
def test_schedules(schedule, expected):
    cfg = OptimConfig(lr=1.0, warmup_steps=4, warmup_init_lr=0.0, schedule=schedule)
    assert [scheduled_lr(step, cfg) for step in (2, 4, 16)] == expected


class TwoGroups(torch.nn.Module):
    """A dense weight and a 'memory value' table, as the LM exposes them."""

    def __init__(self):
        super().__init__()
        self.dense, self.table = params_with_grads(1)
        self.table.is_memory_value = True

    def memory_value_parameters(self):
        return [self.table]


@pytest.mark.parametrize("scope", ["group", "global"])
def test_clip_scopes_scale_by_the_norm_of_the_group_or_of_all(scope):
    model = TwoGroups()
    expected = [model.dense.grad.clone(), model.table.grad.clone()]
    norms = Optimizers(model, OptimConfig(clip_grad_norm=0.5, clip_scope=scope)).unscale_and_clip(
        torch.amp.GradScaler("cpu", enabled=False))
    for grads in ([expected[0]], [expected[1]]) if scope == "group" else (expected,):
        total = float(torch.cat([g.flatten() for g in grads]).norm())  # the reference norm
        for g in grads:
            g.mul_(min(1.0, 0.5 / (total + 1e-6)))
    torch.testing.assert_close(model.dense.grad, expected[0])
    torch.testing.assert_close(model.table.grad, expected[1])
    assert ("global" in norms) == (scope == "global")


def test_optimizers_by_name_and_their_checks():
    assert {"adam", "adagrad"} <= set(DENSE_OPTIMIZERS) and {"adam", "lazy_adam", "adagrad", "sgd"} <= set(VALUE_OPTIMIZERS)
    cfg = load_config(None, ["optim.optimizer=adagrad", "optim.clip_per_tensor=0.03", "optim.schedule=linear_warmup"])
    assert isinstance(Optimizers(TwoGroups(), cfg.optim).groups[0].optimizer, ClippedAdagrad)
    with pytest.raises(ConfigError, match="optim.optimizer: expected one of adam | adagrad"):
        load_config(None, ["optim.optimizer=lamb"])
    with pytest.raises(ConfigError, match="optim.clip_per_tensor is Adagrad's"):
        Optimizers(TwoGroups(), OptimConfig(clip_per_tensor=0.03))
    with pytest.raises(ConfigError, match="optim.values_weight_decay: sgd"):
        Optimizers(TwoGroups(), OptimConfig(values_optimizer="sgd", values_weight_decay=0.1))
