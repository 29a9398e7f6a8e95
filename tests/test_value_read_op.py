"""The value read as a torch.library custom op (model.memory.read_op=custom_op) against the eager read: the same
outputs and gradients bit for bit (torch on CPU; the Triton kernels under the interpreter, compiled on a GPU), the
same under torch.compile(fullgraph=True), and no graph break from the read in a memory layer's forward."""

from pathlib import Path

import pytest
import torch

from xlm_pkm.errors import ConfigError
from xlm_pkm.model.memory import value_shards, value_stores
from xlm_pkm.model.memory.pkm import MemoryConfig, ProductKeyMemory
from xlm_pkm.model.memory.value_read import read_values, triton_usable

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
REPO = Path(__file__).resolve().parents[1]
BACKENDS = ["torch", "triton"] if triton_usable(DEVICE) else ["torch"]


def lookups(dtype, tokens=12, n_slots=40, dim=24, per_token=10):
    g = torch.Generator().manual_seed(0)
    table = torch.randn(n_slots, dim, generator=g).to(dtype)
    indices = torch.randint(0, n_slots, (tokens, per_token), generator=g)
    indices[: tokens // 2, :4] = 3  # a hot slot
    weights = torch.softmax(torch.randn(tokens, per_token, generator=g), dim=-1)  # float32, as the memory's
    grad_out = torch.randn(tokens, dim, generator=g).to(dtype)
    return [t.to(DEVICE) for t in (table, indices, weights, grad_out)]


def read(read_fn, table, indices, weights, grad_out, table_grad=True, weights_grad=True):
    """(out, the table's gradient as dense, the weights' gradient, whether the table's gradient is sparse)."""
    table, weights = table.clone().requires_grad_(table_grad), weights.clone().requires_grad_(weights_grad)
    out = read_fn(table, indices, weights)
    out.backward(grad_out)
    if table.grad is None:
        return out, None, weights.grad, None
    return out, table.grad.to_dense(), weights.grad, table.grad.is_sparse


def assert_equal(actual, expected):
    assert actual[3] == expected[3]  # the table's gradient sparse in both, or dense in both
    for a, b in zip(actual[:3], expected[:3]):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))


def reader(sparse, backend, read_op, read_backward="two_pass"):
    return lambda table, indices, weights: read_values(table, indices, weights, sparse, backend, read_backward, read_op)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_op_equals_the_eager_read_bit_for_bit(backend, sparse, dtype):
    if (backend, dtype, DEVICE.type) == ("torch", torch.bfloat16, "cuda"):
        pytest.skip("torch's EmbeddingBag has no bfloat16 per-sample-weights backward on CUDA (the Triton read's is "
                    "tested)")
    table, indices, weights, grad_out = lookups(dtype)
    expected = read(reader(sparse, backend, "eager"), table, indices, weights, grad_out)
    assert expected[3] == sparse
    assert_equal(read(reader(sparse, backend, "custom_op"), table, indices, weights, grad_out), expected)


@pytest.mark.slow
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_op_gives_only_the_gradients_asked_for(backend, sparse):
    """A frozen table (or frozen weights) gets no gradient, the other the eager read's."""
    table, indices, weights, grad_out = lookups(torch.float32)
    for table_grad, weights_grad in ((False, True), (True, False)):
        expected = read(reader(sparse, backend, "eager"), table, indices, weights, grad_out, table_grad, weights_grad)
        actual = read(reader(sparse, backend, "custom_op"), table, indices, weights, grad_out, table_grad,
                      weights_grad)
        assert (actual[1] is None) != table_grad and (actual[2] is None) != weights_grad
        assert_equal(actual, expected)


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_op_reads_an_empty_batch(backend, sparse):
    table, indices, weights, grad_out = lookups(torch.float32, tokens=0)
    assert_equal(read(reader(sparse, backend, "custom_op"), table, indices, weights, grad_out),
                 read(reader(sparse, backend, "eager"), table, indices, weights, grad_out))


@pytest.mark.slow
@pytest.mark.skipif("triton" not in BACKENDS, reason="needs Triton")
@pytest.mark.parametrize("sparse", [False, True])
def test_custom_op_runs_the_one_pass_backward(sparse):
    table, indices, weights, grad_out = lookups(torch.float32)
    expected = read(reader(sparse, "triton", "eager", "one_pass"), table, indices, weights, grad_out)
    assert_equal(read(reader(sparse, "triton", "custom_op", "one_pass"), table, indices, weights, grad_out), expected)


@pytest.mark.slow
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_whole_with_the_custom_op(backend, sparse):
    """torch.compile(fullgraph=True) of a function around the read: one graph, the eager outputs and gradients
    (aot_eager on CPU: the same kernels, bit for bit; inductor's C++ code generation would add 20 s and nothing to
    the graph's structure); inductor on a GPU, to float32 rounding (it fuses the operations around the read)."""
    table, indices, weights, grad_out = lookups(torch.float32)

    def around(table, indices, weights):  # operations before and after the read, in the same graph; the table a
        return reader(sparse, backend, "custom_op")(table, indices, weights.relu() * 1.5).tanh()  # leaf, as a model's

    expected = read(around, table, indices, weights, grad_out)
    torch._dynamo.reset()
    compiled = torch.compile(around, backend="inductor" if DEVICE.type == "cuda" else "aot_eager", fullgraph=True)
    actual = read(compiled, table, indices, weights, grad_out)
    assert actual[3] == sparse
    tolerance = 1e-5 if DEVICE.type == "cuda" else 0
    for a, b in zip(actual[:3], expected[:3]):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)


@pytest.mark.slow
@pytest.mark.parametrize("read_op", ["eager", "custom_op"])
def test_memory_forward_has_no_graph_break_from_the_read(read_op):
    """torch._dynamo.explain of a memory's forward with sparse value gradients: the eager read breaks the graph
    (the sparse gradient's size is data-dependent), the custom op does not."""
    torch.manual_seed(0)
    memory = ProductKeyMemory(16, 12, n_keys=8, k_dim=8, heads=2, knn=4, read_op=read_op).to(DEVICE)
    memory.sparse_values = True
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(memory)(torch.randn(2, 5, 16, device=DEVICE))
    from_read = [reason for reason in explanation.break_reasons
                 if any(frame.name == "read_values" for frame in reason.user_stack)]
    assert bool(from_read) == (read_op == "eager")


def test_settings_are_checked():
    with pytest.raises(ConfigError, match="model.memory.read_op: expected one of eager | custom_op"):
        ProductKeyMemory(16, 12, n_keys=8, k_dim=8, heads=2, knn=4, read_op="compiled")
    with pytest.raises(ConfigError, match="model.memory.read_backward: expected one of two_pass | one_pass"):
        ProductKeyMemory(16, 12, n_keys=8, k_dim=8, heads=2, knn=4, read_backward="three_pass")


def test_a_sharded_table_keeps_its_own_read(monkeypatch):
    """A table sharded over processes is read by its exchanging read (sharded_read.py), eager and in two passes: with
    the defaults (read_op=custom_op, read_backward=auto) it is built as before; one_pass is refused in one line."""
    from xlm_pkm.model.memory.sharded_read import sharded_read

    monkeypatch.setattr(value_stores, "current_shard", lambda dim: value_shards.ValueShard(0, 2))
    assert value_stores.TableValues(MemoryConfig(shard_values=True), 8, 8, 16).read is sharded_read
    with pytest.raises(ValueError, match="model.memory.shard_values: .* got read_backward=one_pass"):
        value_stores.TableValues(MemoryConfig(shard_values=True, read_backward="one_pass"), 8, 8, 16)


@pytest.mark.slow  # torch.compile's tracing of a whole model, four times
@pytest.mark.parametrize("sparse", [False, True], ids=["adam", "lazy_adam"])
def test_the_default_model_is_one_graph_with_the_custom_op(sparse):
    """Issue 59: configs/default.yaml's 4-layer model with its memory, forward and loss as train.py runs them, under
    torch._dynamo.explain: with read_op=custom_op one graph and no break, with dense or sparse value gradients (the
    sparse ones of lazy_adam); the eager read still breaks it with sparse gradients, and on a GPU always (12 breaks
    on the CPU before issue 59, 16 with lazy_adam: the key search's backward too, now of fixed shapes)."""
    from xlm_pkm.config import load_config
    from xlm_pkm.model.transformer import TransformerLM

    def explained(read_op: str):
        cfg = load_config(REPO / "configs" / "default.yaml", ["model.vocab_size=300",
                                                              f"model.memory.read_op={read_op}"])
        torch.manual_seed(0)
        model = TransformerLM(cfg.model).to(DEVICE).train()
        model.set_sparse_values(sparse)
        x, y = torch.randint(0, 300, (2, 2, 16), device=DEVICE)
        torch._dynamo.reset()
        return torch._dynamo.explain(lambda x, y: model(x, targets=y).mean())(x, y)

    one = explained("custom_op")
    assert (one.graph_count, one.graph_break_count) == (1, 0), one.break_reasons
    # the eager read: its sparse gradient's size, and on a GPU the Triton kernels launched outside the graph
    assert (explained("eager").graph_break_count > 0) == (sparse or DEVICE.type == "cuda")
