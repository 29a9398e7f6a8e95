"""Optimizers by name, the all-attention paper's Adagrad, schedules and the clipping scopes, against
torch's own implementations."""

import pytest
import torch

from xlm_pkm.config import load_config
from xlm_pkm.errors import ConfigError
from xlm_pkm.optim.adagrad import ClippedAdagrad
from xlm_pkm.optim.optimizers import DENSE_OPTIMIZERS, VALUE_OPTIMIZERS, OptimConfig, Optimizers
from xlm_pkm.optim.schedule import scheduled_lr
from xlm_pkm.train.memory_estimate import estimate


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
    assert {"adam", "adagrad"} <= set(DENSE_OPTIMIZERS)
    assert {"adam", "lazy_adam", "adagrad", "sgd"} <= set(VALUE_OPTIMIZERS)
    cfg = load_config(None, ["optim.optimizer=adagrad", "optim.clip_per_tensor=0.03", "optim.schedule=linear_warmup"])
    assert isinstance(Optimizers(TwoGroups(), cfg.optim).groups[0].optimizer, ClippedAdagrad)
    with pytest.raises(ConfigError, match="optim.optimizer: expected one of adam | adagrad"):
        load_config(None, ["optim.optimizer=lamb"])
    with pytest.raises(ConfigError, match="optim.clip_per_tensor is Adagrad's"):
        Optimizers(TwoGroups(), OptimConfig(clip_per_tensor=0.03))
    with pytest.raises(ConfigError, match="optim.values_weight_decay: sgd"):
        Optimizers(TwoGroups(), OptimConfig(values_optimizer="sgd", values_weight_decay=0.1))


def test_a_plugin_optimizer_declares_its_state_and_the_memory_check_counts_it(monkeypatch):
    """Registering an optimizer declares its state per parameter element; the check before training
    (train/build.check_memory_fits) reads it there, so a plugin's is counted like adam's."""
    from xlm_pkm.optim.optimizers import DenseOptimizer
    from xlm_pkm.train import build

    with pytest.raises(TypeError, match=r"^dense optimizer 'bare': register a DenseOptimizer, got "):
        DENSE_OPTIMIZERS.register("bare")(lambda params, cfg: torch.optim.SGD(params, lr=cfg.lr))
    with pytest.raises(TypeError):
        DenseOptimizer(lambda params, cfg: torch.optim.SGD(params, lr=cfg.lr))  # no state_size: not registrable
    monkeypatch.setitem(DENSE_OPTIMIZERS, "five_moments", DenseOptimizer(
        lambda params, cfg: torch.optim.SGD(params, lr=cfg.lr), state_size=5))
    small = ["model.vocab_size=40", "model.dim=16", "model.n_layers=2", "model.n_heads=2", "model.n_memories=1",
             "model.memory.n_keys=8", "model.memory.k_dim=8", "model.memory.heads=2", "model.memory.knn=2"]
    with torch.device("meta"):
        model = build.TransformerLM(load_config(None, small).model)
    values = sum(p.numel() for p in model.memory_value_parameters())
    dense = sum(p.numel() for p in model.parameters()) - values

    def held(overrides, world_size=1, parallel="ddp"):  # what the check compares: weights, gradients, states
        rank = estimate(load_config(None, overrides), world_size, parallel, "cpu")
        return rank.parameters + rank.gradients + rank.optimizer

    five = [*small, "optim.optimizer=five_moments"]
    assert held(five) - held(small) == 4 * dense * (5 - 2)  # adam's 2 states per dense element, the plugin's 5
    monkeypatch.setattr(build, "available_memory", lambda device: (held(small), "test"))
    build.check_memory_fits(load_config(None, small), torch.device("cpu"))  # fits exactly
    with pytest.raises(ConfigError, match=r"^the model needs at least .* GiB for its weights, gradients and "):
        build.check_memory_fits(load_config(None, five), torch.device("cpu"))
    monkeypatch.setattr(build, "available_memory", lambda device: (held(five), "test"))
    build.check_memory_fits(load_config(None, five), torch.device("cpu"))
    # fsdp: each of W ranks holds 1/W of the dense weights, gradients and states, after the whole weights once
    fsdp = [*five, "train.parallel=fsdp"]
    monkeypatch.setattr(build, "available_memory", lambda device: (held(fsdp, 4, "fsdp"), "test"))
    build.check_memory_fits(load_config(None, fsdp), torch.device("cpu"), world_size=4)  # fits exactly
    with pytest.raises(ConfigError, match="more than the"):
        build.check_memory_fits(load_config(None, fsdp), torch.device("cpu"), world_size=2)
    whole = estimate(load_config(None, small), 1, "ddp", "cpu").parameters  # every weight and buffer, float32
    assert whole >= 4 * (values + dense) > held(fsdp, 64, "fsdp")
    monkeypatch.setattr(build, "available_memory", lambda device: (whole - 1, "test"))
    with pytest.raises(ConfigError, match="more than the"):  # the whole weights, built before sharding (init_from)
        build.check_memory_fits(load_config(None, fsdp), torch.device("cpu"), world_size=64)
    # built on the meta device, its shards drawn: the parts outside the blocks and one block whole at most
    build.check_memory_fits(load_config(None, fsdp), torch.device("cpu"), world_size=64, whole=False)
