"""bfloat16 value tables (model.memory.value_dtype, model.engram.table_dtype): stochastic rounding
(optim/stochastic_rounding.py) unbiased and keeping tiny updates, the same bits in the Triton kernels (run under
TRITON_INTERPRET=1 without a GPU); the layer's read of a bfloat16 table equal to the float32 read of the same
numbers; a run cut and resumed equal to the uninterrupted one bit for bit; one-line refusals where it cannot apply."""

import pytest
import torch
from test_fused_optim import DenseAndTable, gradients, train, values_state
from test_memory_estimate import ENGRAM, tiny_config

from xlm_pkm.config import load_config
from xlm_pkm.errors import ConfigError
from xlm_pkm.model.memory.engram import Engram, EngramConfig
from xlm_pkm.model.memory.pkm import ProductKeyMemory
from xlm_pkm.optim import fused_rows
from xlm_pkm.optim.optimizers import OptimConfig, Optimizers
from xlm_pkm.optim.stochastic_rounding import random_bits, round_bfloat16, stream
from xlm_pkm.train.build import shard_values_choice
from xlm_pkm.train.memory_estimate import estimate

KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ROW_OPTIMIZERS = ["lazy_adam", "adagrad", "rowwise_adagrad", "sgd"]


@pytest.fixture(params=["cpu", "triton"])
def device(request, monkeypatch) -> torch.device:
    """Where the fused optimizers update rows: the CPU functions, or the Triton kernels (test_fused_optim.py's)."""
    if request.param == "cpu":
        return torch.device("cpu")
    monkeypatch.setattr(fused_rows, "_use_triton", lambda p: True)
    return KERNEL_DEVICE


def bfloat16_table(model: DenseAndTable) -> DenseAndTable:
    """model with its table stored in bfloat16 (its numbers rounded to nearest), its gradient float32, as
    model.memory.value_dtype=bfloat16 makes it."""
    table = torch.nn.Parameter(model.table.detach().bfloat16())
    table.is_memory_value, table.grad_dtype = True, torch.float32
    model.table = table
    return model


def bfloat16_step(x: torch.Tensor) -> torch.Tensor:
    """The distance from |x| to the next bfloat16 of larger magnitude (x a bfloat16 in float32)."""
    return (x.abs().bfloat16().view(torch.int16) + 1).view(torch.bfloat16).float() - x.abs()


def test_stochastic_rounding_is_exact_on_average_and_keeps_bfloat16_numbers():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 64, generator=g) * torch.logspace(-6, 3, 64)  # (1, 64) float32, many exponents
    down = (x.view(torch.int32) & ~0xFFFF).view(torch.float32)  # truncated to bfloat16: x's magnitude rounded down
    step = bfloat16_step(down)  # (1, 64)
    n = 4096
    draws = torch.stack([round_bfloat16(x, random_bits(stream(0, 0), t, torch.zeros(1, dtype=torch.long), 64))
                         for t in range(n)]).double()  # (n, 1, 64)
    assert set(draws.sub(down).abs().unique().tolist()) <= set(step.double().flatten().tolist()) | {0.0}
    # each draw is x's lower or upper neighbour; their mean is x within 1/16 of a bfloat16 step (the mean of n draws
    # errs by at most step / (2 sqrt(n)) = step / 128 in standard deviation: 8 of them)
    assert (draws.mean(0) - x.double()).abs().le(step / 16).all()
    nearest = x.bfloat16().double()  # rounding to nearest errs up to half a step, here often over a quarter
    assert ((nearest - x.double()).abs() > step / 4).sum() > 10
    representable = x.bfloat16().float()
    assert torch.equal(round_bfloat16(representable, torch.full((1, 64), 0xFFFF, dtype=torch.int32)).float(),
                       representable)  # a bfloat16 number never moves, whatever the bits
    assert torch.equal(round_bfloat16(torch.tensor([[float("inf"), -float("inf")]]),
                                      torch.full((1, 2), 0xFFFF, dtype=torch.int32)).float(),
                       torch.tensor([[float("inf"), -float("inf")]]))


def test_the_random_bits_are_a_function_of_seed_table_step_row_and_column():
    rows = torch.tensor([3, 7, 3])
    bits = random_bits(stream(0, 0), 5, rows, 4)  # (3, 4)
    assert bits.dtype == torch.int32 and bool(((bits >= 0) & (bits < 2**16)).all())
    assert torch.equal(bits[0], bits[2]) and not torch.equal(bits[0], bits[1])  # the same row, the same bits
    assert torch.equal(bits, random_bits(stream(0, 0), torch.tensor(5.0), rows, 4))  # a float step counts as its int
    for other in (random_bits(stream(1, 0), 5, rows, 4), random_bits(stream(0, 1), 5, rows, 4),
                  random_bits(stream(0, 0), 6, rows, 4)):
        assert not torch.equal(bits, other)


@pytest.mark.parametrize("values_optimizer, lr", [("sgd", 1e-4), ("rowwise_adagrad", 1e-3)])
def test_a_row_receiving_tiny_updates_drifts_as_its_float32_twin(values_optimizer, lr):
    """Values at 1, whose bfloat16 step is 2^-8 below: sgd moves them by 1e-4 a step, rowwise adagrad by
    1e-3 / sqrt(t). Rounded to nearest the table never moves; rounded stochastically it drifts as the float32 table
    does (the mean of its 800 values, each a walk of 300 steps, within 5% of the float32 drift: 4 standard
    deviations). optim.values_rounding=nearest is that table that never moves."""
    tables = {}
    for dtype in ("float32", "bfloat16", "nearest"):
        model = DenseAndTable(torch.device("cpu"))
        with torch.no_grad():
            model.table.fill_(1.0)
        if dtype != "float32":
            bfloat16_table(model)
        rounding = "nearest" if dtype == "nearest" else "stochastic"
        optimizer = Optimizers(model, OptimConfig(values_optimizer=values_optimizer, values_lr=lr, fused_values=True,
                                                  values_rounding=rounding)).groups[1].optimizer
        rows, dim = model.table.shape
        for _ in range(300):
            model.table.grad = torch.sparse_coo_tensor(torch.arange(rows)[None], torch.ones(rows, dim), (rows, dim),
                                                       check_invariants=True)
            optimizer.step()
        tables[dtype] = model.table.detach().double()
    drift = 1.0 - tables["float32"].mean()
    assert drift > 0.02
    assert abs((1.0 - tables["bfloat16"].mean()) - drift) < 0.05 * drift
    assert torch.equal(tables["nearest"], torch.ones_like(tables["nearest"]))  # never moved


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("values_optimizer", ROW_OPTIMIZERS)
@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the interpreter's masked-off lanes
def test_the_fused_rounding_equals_the_plain_one(device, values_optimizer, rounding):
    """The Triton kernels draw the CPU functions' bits (fused == plain to one bfloat16 step, where the float32
    arithmetic before the rounding differs), and the unfused optimizers round as the fused ones on the CPU; to
    nearest (optim.values_rounding=nearest) likewise."""
    cfg = dict(values_optimizer=values_optimizer, values_lr=0.05, clip_grad_norm=1.0, values_rounding=rounding)
    steps = gradients(4, repeated=True)
    plain = bfloat16_table(DenseAndTable(torch.device("cpu")))
    fused = bfloat16_table(DenseAndTable(device))
    today = Optimizers(plain, OptimConfig(**cfg, fused_values=values_optimizer in ("adagrad", "sgd")))
    ours = Optimizers(fused, OptimConfig(**cfg, fused_values=True))
    train(plain, today, steps)
    train(fused, ours, steps)
    reference, got = values_state(today), values_state(ours)
    initial = DenseAndTable(torch.device("cpu")).table.detach().bfloat16()
    assert got["table"].dtype == torch.bfloat16 and not torch.equal(got["table"], initial)
    assert all(v.dtype == torch.float32 for k, v in got.items() if k not in ("table", "step"))  # float32 state
    for key in reference:
        if key == "table":
            diff = (got[key].float() - reference[key].float()).abs()
            assert bool((diff <= bfloat16_step(reference[key].float())).all()), key
            assert (diff > 0).float().mean() < 0.01, key  # almost every element the same bits
        else:
            torch.testing.assert_close(got[key], reference[key], msg=key)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("read_op", ["eager", "custom_op"])
@pytest.mark.parametrize("sparse", [True, False])
def test_the_layer_reads_a_bfloat16_table_as_the_float32_table_of_its_numbers(backend, read_op, sparse):
    """Output and every gradient (the table's float32, sparse or dense) within float32 rounding of the float32
    layer's whose table holds the same (bfloat16) numbers: the sums are float32 either way."""
    torch.manual_seed(0)
    layers = {}
    for dtype in ("bfloat16", "float32"):
        layers[dtype] = ProductKeyMemory(16, 12, n_keys=8, k_dim=8, heads=2, knn=4, value_dtype=dtype,
                                         value_read=backend, read_op=read_op).to(KERNEL_DEVICE)
        layers[dtype].sparse_values = sparse
    layers["float32"].load_state_dict(layers["bfloat16"].state_dict())  # the bfloat16 numbers, in float32
    x = torch.randn(3, 5, 16, device=KERNEL_DEVICE)
    out = {}
    for dtype, layer in layers.items():
        y = layer(x)
        y.square().sum().backward()
        grad = layer.values.weight.grad
        out[dtype] = (y, grad.to_dense() if sparse else grad, layer.query_net[0].weight.grad)
        assert y.dtype == torch.float32 and grad.dtype == torch.float32 and grad.is_sparse == sparse
    assert layers["bfloat16"].values.weight.dtype == torch.bfloat16
    for ours, reference in zip(out["bfloat16"], out["float32"]):
        torch.testing.assert_close(ours, reference)


@pytest.mark.parametrize("sparse", [True, False])
def test_engram_reads_a_bfloat16_table_as_the_float32_table_of_its_numbers(sparse):
    torch.manual_seed(0)
    layers = {dtype: Engram(EngramConfig(layers=[1], heads=2, table_size=64, ngram_dim=8, table_dtype=dtype), 16, 40)
              for dtype in ("bfloat16", "float32")}
    layers["float32"].load_state_dict(layers["bfloat16"].state_dict())
    h, rows = torch.randn(2, 6, 16), torch.randint(0, 40, (2, 6, 4))
    out = {}
    for dtype, layer in layers.items():
        layer.sparse = sparse
        y = layer(h, rows)
        y.square().sum().backward()
        out[dtype] = (y, layer.table.grad.coalesce().to_dense() if sparse else layer.table.grad, layer.key.weight.grad)
    assert layers["bfloat16"].table.dtype == torch.bfloat16 and out["bfloat16"][1].dtype == torch.float32
    for ours, reference in zip(out["bfloat16"], out["float32"]):
        torch.testing.assert_close(ours, reference)


@pytest.mark.parametrize("values_optimizer, fused", [("rowwise_adagrad", False), ("lazy_adam", True)])
@pytest.mark.slow
def test_a_run_cut_and_resumed_rounds_as_the_uninterrupted_one(values_optimizer, fused, tiny_run, reference_run,
                                                                train_losses, tmp_path):
    extra = ("model.memory.value_dtype=bfloat16", f"optim.values_optimizer={values_optimizer}", "optim.values_lr=0.1",
             f"optim.fused_values={fused}")
    full = reference_run(*extra)
    tiny_run(tmp_path, "train.exp_id=cut", "train.max_steps=3", *extra)
    resumed = tiny_run(tmp_path, "train.exp_id=cut", *extra)
    assert train_losses(resumed.run_dir) == train_losses(full.run_dir)  # bit-identical, float32 CPU
    for name, p in full.model.state_dict().items():
        assert torch.equal(p, resumed.model.state_dict()[name]), name
    (table,) = resumed.model.memory_value_parameters()
    state = resumed.optimizers.groups[1].optimizer.state[table]
    reference = next(iter(full.optimizers.groups[1].optimizer.state.values()))
    assert table.dtype == torch.bfloat16
    for key, value in state.items():  # the float32 state loaded as saved, not cast to the table's dtype
        assert value.dtype == torch.float32 and torch.equal(value, reference[key].to(value.device)), key


def test_what_cannot_take_bfloat16_tables_is_refused_in_one_line():
    model = bfloat16_table(DenseAndTable(torch.device("cpu")))
    for cfg in (OptimConfig(), OptimConfig(values_optimizer="sgd"), OptimConfig(values_optimizer="adagrad")):
        with pytest.raises(ConfigError, match=rf"^model.memory.value_dtype=bfloat16: optim.values_optimizer="
                                              rf"{cfg.values_optimizer} \(optim.fused_values=false\) rounds a bfloat16 "
                                              rf"table's updates to nearest, .*\(stochastic rounding\)$"):
            Optimizers(model, cfg)
    with pytest.raises(ConfigError, match=r"^model.memory.value_dtype=bfloat16: model.memory.values=peer keeps "
                                          r"float32 tables \(values=table stores bfloat16 ones\)$"):
        ProductKeyMemory(16, 12, n_keys=8, k_dim=8, heads=2, knn=4, values="peer", value_dtype="bfloat16")
    cfg = load_config(None, ["train.parallel=fsdp", "model.mem_layers=[1]", "model.memory.value_dtype=bfloat16"])
    assert shard_values_choice(cfg, 2) == (False, "model.memory.value_dtype=bfloat16 keeps whole rows (their "
                                                  "stochastic rounding)")
    engram = bfloat16_table(DenseAndTable(torch.device("cpu")))
    engram.table.engram_table = True
    with pytest.raises(ConfigError, match=r"^model.engram.table_dtype=bfloat16: optim.values_optimizer=adam "):
        Optimizers(engram, OptimConfig())


def test_the_memory_estimate_counts_two_bytes_a_bfloat16_value_and_one_row_state_a_row():
    """train.py --dry-run's figure: the tables' weights halve; their float32 gradient rows do not change, nor their
    state per element; rowwise_adagrad's state is one float32 a row."""
    common = (*ENGRAM, "optim.values_optimizer=rowwise_adagrad")
    whole, half = (estimate(tiny_config(*common, *extra)) for extra in (
        (), ("model.memory.value_dtype=bfloat16", "model.engram.table_dtype=bfloat16")))
    values, engram = whole.elements["memory values"], whole.elements["Engram"]
    assert whole.parameters - half.parameters == 2 * (values + engram)
    assert (half.gradients, half.optimizer) == (whole.gradients, whole.optimizer)
    rows = values // 32 + engram // 2  # the value table's rows are 32 wide (model.dim), Engram's 16 / 8 heads
    assert whole.optimizer - estimate(tiny_config(*ENGRAM, "optim.values_optimizer=sgd")).optimizer == 4 * rows
