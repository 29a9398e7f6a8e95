"""Row-wise Adagrad (optim.values_optimizer=rowwise_adagrad: optim/rowwise_adagrad.py, its one-pass update
fused_rows.FusedRowwiseAdagrad, the Triton kernel under TRITON_INTERPRET=1 without a GPU) against a naive loop over
the rows; the fused steps against the plain ones, SGD's too; a run cut and resumed equals the uninterrupted one
bit for bit; one-line refusals where it cannot apply."""

import io

import pytest
import torch
from test_fused_optim import DenseAndTable, gradients, train, values_state

from xlm_pkm.config import load_config
from xlm_pkm.errors import ConfigError
from xlm_pkm.model.memory.value_shards import ValueShard
from xlm_pkm.optim import fused_rows, lazy_adam
from xlm_pkm.optim.optimizers import OptimConfig, Optimizers
from xlm_pkm.optim.rowwise_adagrad import RowwiseAdagrad
from xlm_pkm.train.build import shard_values_choice

N_ROWS, DIM = 40, 20
KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(params=["cpu", "triton"])
def device(request, monkeypatch) -> torch.device:
    """Where the fused optimizers update rows: the CPU functions, or the Triton kernels (test_fused_optim.py's)."""
    if request.param == "cpu":
        return torch.device("cpu")
    monkeypatch.setattr(fused_rows, "_use_triton", lambda p: True)
    return KERNEL_DEVICE


def naive_rowwise_adagrad(table: torch.Tensor, grads: list[torch.Tensor], lr: float, eps: float):
    """The update written out row by row in float64 from each step's dense gradient: for every row with a
    gradient, G[r] += mean(g_r²), w[r] -= lr · g_r / (sqrt(G[r]) + eps); the others untouched."""
    w, G = table.double().clone(), torch.zeros(table.shape[0], dtype=torch.float64)
    for grad in grads:
        dense = grad.to_dense().double()  # repeated rows summed
        touched = set(grad.coalesce().indices()[0].tolist())
        for r in range(w.shape[0]):
            if r in touched:
                G[r] += sum(float(x) ** 2 for x in dense[r]) / dense.shape[1]
                w[r] -= lr * dense[r] / (G[r].sqrt() + eps)
    return w, G


@pytest.mark.parametrize("chunk_bytes", [2**20, 3 * DIM * 4])  # a step's rows in one chunk, or 3 rows a chunk
def test_rowwise_adagrad_equals_the_naive_loop_and_unread_rows_do_not_move(chunk_bytes, monkeypatch):
    monkeypatch.setattr(lazy_adam, "CHUNK_BYTES", chunk_bytes)
    table = torch.nn.Parameter(torch.randn(N_ROWS, DIM, generator=torch.Generator().manual_seed(0)))
    initial = table.detach().clone()
    optimizer = RowwiseAdagrad([table], lr=0.05, eps=1e-10)
    steps = [grad for _, grad in gradients(4, repeated=True)]
    for grad in steps:
        before = table.detach().clone()
        table.grad = grad
        optimizer.step()
        unread = torch.ones(N_ROWS, dtype=torch.bool)
        unread[grad.coalesce().indices()[0]] = False
        assert torch.equal(table.detach()[unread], before[unread])
    expected, G = naive_rowwise_adagrad(initial, steps, lr=0.05, eps=1e-10)
    state = optimizer.state[table]
    assert state.keys() == {"step", "row_sum"} and float(state["step"]) == len(steps)
    assert state["row_sum"].shape == (N_ROWS,) and state["row_sum"].dtype == torch.float32  # one number a row
    torch.testing.assert_close(state["row_sum"].double(), G, rtol=1e-6, atol=0)
    torch.testing.assert_close(table.detach().double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("values_optimizer", ["rowwise_adagrad", "sgd"])
@pytest.mark.parametrize("repeated", [False, True])
@pytest.mark.parametrize("clip", [1.0, 1e3])  # binds (the table's norm is about 20), or not
def test_the_fused_step_equals_the_plain_one_after_clipping(device, values_optimizer, repeated, clip):
    cfg = dict(values_optimizer=values_optimizer, values_lr=0.05, clip_grad_norm=clip)
    steps = gradients(4, repeated)
    plain, fused = DenseAndTable(torch.device("cpu")), DenseAndTable(device)
    today = Optimizers(plain, OptimConfig(**cfg))
    ours = Optimizers(fused, OptimConfig(**cfg, fused_values=True))
    assert ours.groups[1].skips_on_device and not today.groups[1].skips_on_device
    train(plain, today, steps)
    train(fused, ours, steps)
    reference, got = values_state(today), values_state(ours)
    if values_optimizer == "sgd":  # torch's SGD keeps no state; the fused one its step (a bfloat16 table's rounding)
        assert (got.keys(), reference.keys(), got["step"]) == ({"step", "table"}, {"table"}, len(steps))
    for key in reference:
        torch.testing.assert_close(got[key], reference[key], msg=key)


def test_a_non_finite_step_changes_nothing(device):
    model = DenseAndTable(device)
    optimizers = Optimizers(model, OptimConfig(values_optimizer="rowwise_adagrad", fused_values=True, fused_dense=True))
    train(model, optimizers, gradients(2, repeated=True))
    before = {k: v.clone() if torch.is_tensor(v) else v for k, v in values_state(optimizers).items()}
    [(_, _, skipped)] = train(model, optimizers, gradients(1, repeated=True, seed=2), loss=float("nan"))
    assert torch.is_tensor(skipped) and skipped
    after = values_state(optimizers)
    assert all(torch.equal(torch.as_tensor(after[k]), torch.as_tensor(before[k])) for k in before)


@pytest.mark.parametrize("saved, resumed", [(False, True), (True, False)])
def test_a_state_saved_fused_or_not_resumes_the_other_way_loaded_as_data(saved, resumed):
    """Optimizers' state round-trips through torch.load(weights_only=True): tensors and numbers only."""
    steps = gradients(4, repeated=True)
    first = DenseAndTable(torch.device("cpu"))
    optimizers = Optimizers(first, OptimConfig(values_optimizer="rowwise_adagrad", fused_values=saved))
    train(first, optimizers, steps[:2])
    buffer = io.BytesIO()
    torch.save(optimizers.state_dict(), buffer)
    runs = {}
    for name, fused in (("resumed", resumed), ("uninterrupted", saved)):
        model = DenseAndTable(torch.device("cpu"))
        with torch.no_grad():
            model.table.copy_(first.table)
            model.dense.copy_(first.dense)
        optimizers = Optimizers(model, OptimConfig(values_optimizer="rowwise_adagrad", fused_values=fused))
        optimizers.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True),
                                   saved_config={"optim": {"values_optimizer": "rowwise_adagrad"}})
        train(model, optimizers, steps[2:])
        runs[name] = values_state(optimizers)
    assert runs["resumed"]["step"] == 4
    for key in runs["uninterrupted"]:
        assert torch.equal(torch.as_tensor(runs["resumed"][key]), torch.as_tensor(runs["uninterrupted"][key])), key


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.slow
def test_a_run_cut_and_resumed_equals_the_uninterrupted_one(fused, tiny_run, reference_run, train_losses, tmp_path):
    extra = ("optim.values_optimizer=rowwise_adagrad", "optim.values_lr=0.1", f"optim.fused_values={fused}")
    full = reference_run(*extra)
    tiny_run(tmp_path, "train.exp_id=cut", "train.max_steps=3", *extra)
    resumed = tiny_run(tmp_path, "train.exp_id=cut", *extra)
    assert train_losses(resumed.run_dir) == train_losses(full.run_dir)  # bit-identical, float32 CPU
    for name, p in full.model.state_dict().items():
        assert torch.equal(p, resumed.model.state_dict()[name]), name
    group = resumed.optimizers.groups[1]
    assert isinstance(group.optimizer, fused_rows.FusedRowwiseAdagrad if fused else RowwiseAdagrad)
    state, reference = (next(iter(g.optimizer.state.values())) for g in (group, full.optimizers.groups[1]))
    assert state["row_sum"].shape == (group.params[0].shape[0],) and torch.equal(state["row_sum"], reference["row_sum"])


def test_a_dense_gradient_or_a_table_split_by_column_is_refused_in_one_line():
    table = torch.nn.Parameter(torch.randn(N_ROWS, DIM))
    table.grad = torch.randn(N_ROWS, DIM)
    with pytest.raises(ValueError, match=r"^RowwiseAdagrad updates the rows of a \(rows, dim\) table from a sparse "
                                         r"gradient .*got a dense gradient of shape \(40, 20\)$"):
        RowwiseAdagrad([table]).step()
    model = DenseAndTable(torch.device("cpu"))
    model.table.value_shard = ValueShard(0, 2)
    with pytest.raises(ConfigError, match=r"^optim.values_optimizer=rowwise_adagrad keeps one state per value row, "
                                          r".*model.memory.shard_values=false, or another values optimizer$"):
        Optimizers(model, OptimConfig(values_optimizer="rowwise_adagrad"))
    cfg = load_config(None, ["train.parallel=fsdp", "model.mem_layers=[1]", "optim.values_optimizer=rowwise_adagrad"])
    assert shard_values_choice(cfg, 2) == (False, "optim.values_optimizer=rowwise_adagrad keeps one state per whole "
                                                  "value row")
    with pytest.raises(ConfigError, match=r"^optim.values_weight_decay: rowwise_adagrad on sparse rows does not"):
        Optimizers(model, OptimConfig(values_optimizer="rowwise_adagrad", values_weight_decay=0.1))
