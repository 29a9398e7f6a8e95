"""Fused optimizer steps (optim.fused_values: optim/fused_rows.py, its Triton kernels optim/triton_rows.py run under
TRITON_INTERPRET=1 without a GPU; optim.fused_dense: torch's fused AdamW) against today's optimizers and clipping:
the same parameters and moments to float32 rounding with repeated rows, weight decay and clipping; nothing changed
by a skipped step; checkpoints taken over both ways; a tiny training run with the same losses; on a GPU, no host
sync in the step (run there: `.venv/bin/python -m pytest -q tests/test_fused_optim.py`)."""

import io
import math

import pytest
import torch
from torch import nn

from xlm_pkm.errors import ConfigError
from xlm_pkm.optim import fused_rows
from xlm_pkm.optim.optimizers import VALUE_OPTIMIZERS, OptimConfig, Optimizers, ValueOptimizer
from xlm_pkm.train.step import optimizer_update

N_ROWS, DIM, READ = 40, 20, 12  # DIM not a power of two: the kernels' column masks count
KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where the Triton kernels run
NO_SCALER = torch.amp.GradScaler("cpu", enabled=False)


@pytest.fixture(params=["cpu", "triton"])
def device(request, monkeypatch) -> torch.device:
    """Where the fused optimizers update rows: the CPU functions, or the Triton kernels (on the GPU if there is
    one, else on CPU tensors under Triton's interpreter)."""
    if request.param == "cpu":
        return torch.device("cpu")
    monkeypatch.setattr(fused_rows, "_use_triton", lambda p: True)
    return KERNEL_DEVICE


class DenseAndTable(nn.Module):
    """A dense weight and a memory value table, as the LM exposes them to Optimizers."""

    def __init__(self, device: torch.device):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.dense = nn.Parameter(torch.randn(5, 3, generator=g).to(device))
        self.table = nn.Parameter(torch.randn(N_ROWS, DIM, generator=g).to(device))
        self.table.is_memory_value = True

    def memory_value_parameters(self):
        return [self.table]


def gradients(steps: int, repeated: bool, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step: (the dense weight's gradient, the table's sparse gradient (N_ROWS, DIM)): READ rows in random order,
    read by two micro-batches when `repeated` (an uncoalesced gradient whose rows repeat), by one otherwise."""
    g, out = torch.Generator().manual_seed(seed), []
    for _ in range(steps):
        rows = torch.cat([torch.randperm(N_ROWS, generator=g)[:READ] for _ in range(2 if repeated else 1)])
        values = torch.randn(rows.numel(), DIM, generator=g)
        table = torch.sparse_coo_tensor(rows[None], values, (N_ROWS, DIM), check_invariants=True)
        out.append((torch.randn(5, 3, generator=g), table))
    return out


def train(model: DenseAndTable, optimizers: Optimizers, steps, loss: float = 2.0, sparse: bool = True) -> list:
    """optimizer_update on each step's gradients; returns what it returned for each."""
    out = []
    for dense_grad, table_grad in steps:
        model.dense.grad = dense_grad.to(model.dense.device, copy=True)  # clipping scales gradients in place
        model.table.grad = (table_grad if sparse else table_grad.to_dense()).to(model.table.device, copy=True)
        out.append(optimizer_update(optimizers, NO_SCALER, torch.tensor(loss, device=model.table.device)))
    return out


def values_state(optimizers: Optimizers) -> dict:
    """The values group's table state (step as a float) and table, on the CPU."""
    group = next(g for g in optimizers.groups if g.name == "values")
    table = group.params[0]
    state = {k: float(v) if k == "step" else v.cpu() for k, v in group.optimizer.state[table].items()}
    return {**state, "table": table.detach().cpu()}


def assert_states_close(ours: dict, reference: dict) -> None:
    assert ours.keys() == reference.keys()
    for key in reference:
        torch.testing.assert_close(ours[key], reference[key], msg=key)


@pytest.mark.parametrize("repeated", [False, True])
@pytest.mark.parametrize("clip", [1.0, 1e3])  # binds (the table's norm is about 20), or not
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_fused_lazy_adam_equals_lazy_adam_after_clipping(device, repeated, clip, weight_decay):
    cfg = dict(values_optimizer="lazy_adam", values_lr=1e-2, values_beta2=0.98, values_weight_decay=weight_decay,
               clip_grad_norm=clip)
    steps = gradients(4, repeated)
    reference, fused = DenseAndTable(torch.device("cpu")), DenseAndTable(device)
    today = Optimizers(reference, OptimConfig(**cfg))
    ours = Optimizers(fused, OptimConfig(**cfg, fused_values=True, fused_dense=True))
    assert ours.skip_on_device and not today.skip_on_device
    for expected, got in zip(train(reference, today, steps), train(fused, ours, steps)):
        torch.testing.assert_close({k: v.cpu() for k, v in got[0].items()}, expected[0])  # the pre-clip norms
        assert torch.is_tensor(got[2]) and not got[2] and expected[2] is False  # skipped: a device flag
    assert_states_close(values_state(ours), values_state(today))
    torch.testing.assert_close(fused.dense.detach().cpu(), reference.dense.detach())
    assert fused.table._version >= len(steps)  # written in place: seen as changed (autograd, inference copies)


@pytest.mark.parametrize("repeated", [False, True])
@pytest.mark.parametrize("clip", [1.0, 1e3])
def test_fused_sparse_adagrad_equals_torch_adagrad_after_clipping(device, repeated, clip):
    cfg = dict(values_optimizer="adagrad", values_lr=0.05, clip_grad_norm=clip)
    steps = gradients(4, repeated)
    reference, fused = DenseAndTable(torch.device("cpu")), DenseAndTable(device)
    today = Optimizers(reference, OptimConfig(**cfg))
    ours = Optimizers(fused, OptimConfig(**cfg, fused_values=True))
    assert isinstance(ours.groups[1].optimizer, fused_rows.FusedSparseAdagrad)
    train(reference, today, steps)
    train(fused, ours, steps)
    assert_states_close(values_state(ours), values_state(today))


def test_row_runs_group_repeated_rows_in_their_order():
    from xlm_pkm.utils.sparse_grads import row_runs

    sorted_rows, order, run_end = row_runs(torch.tensor([3, 1, 3, 0, 1]))
    assert sorted_rows.tolist() == [0, 1, 1, 3, 3] and order.tolist() == [3, 1, 4, 0, 2]
    assert run_end.tolist() == [1, 3, 2, 5, 4]  # positions 2 and 4 begin no run: empty


def test_summed_rows_norm_equals_the_norm_of_the_coalesced_gradient():
    from xlm_pkm.optim.triton_rows import summed_rows_norm

    for _, grad in gradients(3, repeated=True):
        expected = grad.coalesce()._values().norm()
        torch.testing.assert_close(summed_rows_norm(grad.to(KERNEL_DEVICE)).cpu(), expected)
    empty = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long), torch.zeros(0, DIM), (N_ROWS, DIM))
    assert float(summed_rows_norm(empty.to(KERNEL_DEVICE))) == 0.0


@pytest.mark.parametrize("values_optimizer", ["lazy_adam", "adagrad", "adam", "rowwise_adagrad", "sgd"])
@pytest.mark.parametrize("bad", ["loss", "gradient"])
@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the interpreter's masked-off lanes: inf / inf
def test_a_non_finite_step_changes_nothing_on_the_device(device, values_optimizer, bad):
    model = DenseAndTable(device)
    optimizers = Optimizers(model, OptimConfig(values_optimizer=values_optimizer, fused_values=True, fused_dense=True,
                                               clip_grad_norm=1.0))
    dense = values_optimizer == "adam"  # the values' AdamW takes the table's gradient dense
    train(model, optimizers, gradients(2, repeated=True), sparse=not dense)
    before = {g.name: ({k: v.clone() for k, v in g.optimizer.state[p].items()}, p.detach().clone())
              for g in optimizers.groups for p in g.params}
    dense_grad, table_grad = gradients(1, repeated=True, seed=2)[0]
    if bad == "gradient":
        table_grad._values()[3, 5] = math.inf
    [(_, _, skipped)] = train(model, optimizers, [(dense_grad, table_grad)], loss=math.nan if bad == "loss" else 2.0,
                              sparse=not dense)
    assert torch.is_tensor(skipped) and skipped
    for g in optimizers.groups:
        state, param = before[g.name]
        assert torch.equal(g.params[0].detach(), param), g.name
        for key, value in g.optimizer.state[g.params[0]].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(state[key])), (g.name, key)


@pytest.mark.parametrize("scope", ["group", "global"])
def test_fused_adamw_equals_adamw_with_the_clip_in_its_step(scope):
    cfg = dict(clip_grad_norm=1.0, clip_scope=scope, weight_decay=0.01, values_weight_decay=0.1)
    steps = gradients(4, repeated=True)
    reference, fused = DenseAndTable(torch.device("cpu")), DenseAndTable(torch.device("cpu"))
    today = Optimizers(reference, OptimConfig(**cfg))
    ours = Optimizers(fused, OptimConfig(**cfg, fused_dense=True, fused_values=True))  # values: adam, fused too
    assert all(g.optimizer.param_groups[0]["fused"] for g in ours.groups) and ours.skip_on_device
    for expected, got in zip(train(reference, today, steps, sparse=False), train(fused, ours, steps, sparse=False)):
        torch.testing.assert_close(got[0], expected[0])
    for p, q in zip(fused.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)


def test_under_fp16_loss_scaling_the_scaler_skips_the_fused_steps_as_it_skips_the_unfused_ones():
    """GradScaler gives fused optimizers its found_inf (and keeps the grad_scale of the clip): the same steps, an
    overflow skipped and the scale lowered."""
    runs = []
    for fused in (False, True):
        model = DenseAndTable(torch.device("cpu"))
        optimizers = Optimizers(model, OptimConfig(values_optimizer="lazy_adam", clip_grad_norm=1.0,
                                                   fused_values=fused, fused_dense=fused))
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        scaler.scale(torch.ones(()))  # its scale tensor, as loss_backward's scaled backward makes it
        out = []
        for step, (dense_grad, table_grad) in enumerate(gradients(3, repeated=True)):
            model.dense.grad, model.table.grad = dense_grad * 4, table_grad * 4
            if step == 1:
                model.dense.grad[0, 0] = math.inf
            out.append(optimizer_update(optimizers, scaler, torch.tensor(2.0))[1:])
        runs.append((out, values_state(optimizers), model.dense.detach()))
    (out, state, dense), (fused_out, fused_state, fused_dense) = runs
    assert fused_out == out == [(4.0, False), (4.0, True), (2.0, False)]
    assert_states_close(fused_state, state)
    torch.testing.assert_close(fused_dense, dense)


def test_only_fused_dense_keeps_the_host_check():
    """The values' LazyAdam cannot skip on the device: the step's flag is read on the host, as today."""
    model = DenseAndTable(torch.device("cpu"))
    optimizers = Optimizers(model, OptimConfig(values_optimizer="lazy_adam", fused_dense=True))
    assert not optimizers.skip_on_device
    [(_, _, skipped)] = train(model, optimizers, gradients(1, repeated=False), loss=math.nan)
    assert skipped is True


def _saved(optimizers: Optimizers) -> bytes:
    """Optimizers.state_dict() as a checkpoint carries it (torch.load it for each run: a loaded state's tensors
    become the optimizer's, which steps them in place)."""
    buffer = io.BytesIO()
    torch.save(optimizers.state_dict(), buffer)
    return buffer.getvalue()


def _implementations(optimizers: Optimizers) -> list:
    """Each group's optimizer class, and for torch's AdamW whether it is fused (a setting of its param_groups)."""
    return [(type(g.optimizer), g.optimizer.param_groups[0]["fused"] if isinstance(g.optimizer, torch.optim.AdamW)
             else None) for g in optimizers.groups]


@pytest.mark.parametrize("saved, resumed", [
    ({"values_optimizer": "lazy_adam"}, {"values_optimizer": "lazy_adam", "fused_values": True, "fused_dense": True}),
    ({"values_optimizer": "lazy_adam", "fused_values": True, "fused_dense": True}, {"values_optimizer": "lazy_adam"}),
    ({"values_optimizer": "adam"}, {"values_optimizer": "lazy_adam", "fused_values": True}),
    ({"values_optimizer": "adam", "fused_values": True}, {"values_optimizer": "lazy_adam"}),
    ({"values_optimizer": "adagrad"}, {"values_optimizer": "adagrad", "fused_values": True}),
    ({"values_optimizer": "adagrad", "fused_values": True}, {"values_optimizer": "adagrad"}),
    ({"values_optimizer": "sgd"}, {"values_optimizer": "sgd", "fused_values": True}),
    ({"values_optimizer": "sgd", "fused_values": True}, {"values_optimizer": "sgd"}),
])
def test_checkpoints_resume_between_fused_and_unfused_steps(device, saved, resumed):
    """A state saved by one, resumed by the other, continues as the unfused optimizers continue from it, with the
    implementation the resuming run chose (torch's AdamW would take the saved one's `fused`)."""
    steps = gradients(4, repeated=True)
    first = DenseAndTable(device)
    optimizers = Optimizers(first, OptimConfig(**saved))
    train(first, optimizers, steps[:2], sparse=saved["values_optimizer"] != "adam")
    checkpoint, weights = _saved(optimizers), {k: v.detach().clone() for k, v in first.named_parameters()}
    runs = {}
    for name, cfg in (("resumed", resumed), ("unfused", {"values_optimizer": resumed["values_optimizer"]})):
        model = DenseAndTable(device)
        with torch.no_grad():
            for key, param in model.named_parameters():
                param.copy_(weights[key])
        optimizers = Optimizers(model, OptimConfig(**cfg))
        built = _implementations(optimizers)
        optimizers.load_state_dict(torch.load(io.BytesIO(checkpoint), weights_only=False),
                                   saved_config={"optim": saved})
        assert _implementations(optimizers) == built
        train(model, optimizers, steps[2:])
        runs[name] = {**values_state(optimizers), "dense": model.dense.detach().cpu()}
    if resumed["values_optimizer"] == "sgd":  # torch's SGD keeps no state; the fused one counts its steps
        for run in runs.values():
            run.pop("step", None)
    else:
        assert runs["resumed"]["step"] == 4
    assert_states_close(runs["resumed"], runs["unfused"])


def test_fused_settings_need_an_optimizer_with_a_fused_step(monkeypatch):
    """Every built-in values optimizer has one; a plugin's may not."""
    monkeypatch.setitem(VALUE_OPTIMIZERS, "plain_sgd", ValueOptimizer(
        lambda params, cfg: torch.optim.SGD(params, lr=cfg.values_lr), sparse=True, state_size=0, weight_decay=False))
    model = DenseAndTable(torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"^optim.fused_values: optim.values_optimizer=plain_sgd has no fused step "
                                          r"\(those with one: adam, lazy_adam, adagrad, rowwise_adagrad, sgd\)$"):
        Optimizers(model, OptimConfig(values_optimizer="plain_sgd", fused_values=True))
    with pytest.raises(ConfigError, match=r"^optim.fused_dense: optim.optimizer=adagrad has no fused step"):
        Optimizers(model, OptimConfig(optimizer="adagrad", fused_dense=True))


@pytest.mark.slow
def test_a_tiny_run_with_fused_steps_has_the_losses_of_the_unfused_one(reference_run, tiny_run, train_losses, tmp_path):
    settings = ("optim.values_optimizer=lazy_adam", "optim.clip_grad_norm=0.5")
    expected = train_losses(reference_run(*settings).run_dir)
    trainer = tiny_run(tmp_path, "train.exp_id=fused", *settings, "optim.fused_values=true", "optim.fused_dense=true")
    losses = train_losses(trainer.run_dir)
    assert trainer.optimizers.skip_on_device and trainer.state.skipped_steps == 0
    assert isinstance(trainer.optimizers.groups[1].optimizer, fused_rows.FusedLazyAdam)
    assert sorted(losses) == sorted(expected)
    for step, loss in expected.items():
        assert math.isclose(losses[step], loss, rel_tol=1e-5), (step, losses[step], loss)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_fused_step_makes_no_host_sync_on_a_gpu():
    """Clipping norms, the finite check, the values' LazyAdam on an uncoalesced gradient and the dense fused AdamW:
    torch's sync debug mode raises on any host sync in optimizer_update."""
    model = DenseAndTable(torch.device("cuda"))
    optimizers = Optimizers(model, OptimConfig(values_optimizer="lazy_adam", fused_values=True, fused_dense=True,
                                               clip_grad_norm=1.0))
    first, second = gradients(2, repeated=True)
    train(model, optimizers, [first])  # the state allocated and the kernels compiled
    model.dense.grad, model.table.grad = second[0].cuda(), second[1].cuda()
    loss = torch.tensor(2.0, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _, _, skipped = optimizer_update(optimizers, NO_SCALER, loss)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.is_tensor(skipped) and not skipped
