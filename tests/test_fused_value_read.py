"""The fused Triton value read against a float64 dense re-computation and the PyTorch path; its one-pass
backward (read_backward=one_pass) against both and against the two-pass kernels.

Without a GPU the kernels run under Triton's interpreter (conftest.py sets TRITON_INTERPRET=1), on
CUDA they run compiled; the same assertions hold for both.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from xlm_pkm.model.memory import pkm as memory_module
from xlm_pkm.model.memory.pkm import ProductKeyMemory
from xlm_pkm.model.memory.value_read import read_values, resolve_backend

pytest.importorskip("triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # relative to the values' scale


def lookups(n_slots, dim, tokens, per_token, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(n_slots, dim, generator=g).to(dtype)
    indices = torch.randint(0, n_slots, (tokens, per_token), generator=g)
    indices[: tokens // 2, :5] = 3  # a hot slot: read by half the tokens, several times per token
    weights = torch.softmax(torch.randn(tokens, per_token, generator=g), dim=-1)  # float32, as the memory's
    grad_out = torch.randn(tokens, dim, generator=g).to(dtype)
    return [t.to(DEVICE) for t in (table, indices, weights, grad_out)]


def dense_reference(table, indices, weights, grad_out):
    """out, d table, d weights of out = Σ_l w · table[idx], computed densely in float64."""
    table, weights, grad_out = table.double(), weights.double(), grad_out.double()
    rows = table[indices]  # (N, L, D)
    out = (weights.unsqueeze(-1) * rows).sum(1)  # (N, D)
    grad_weights = torch.einsum("nld,nd->nl", rows, grad_out)
    per_lookup = weights.unsqueeze(-1) * grad_out.unsqueeze(1)  # (N, L, D)
    grad_table = torch.zeros_like(table).index_add_(0, indices.reshape(-1), per_lookup.reshape(-1, table.shape[1]))
    return out, grad_table, grad_weights


def fused(table, indices, weights, grad_out, sparse, read_backward="two_pass"):
    table, weights = table.clone().requires_grad_(), weights.clone().requires_grad_()
    out = read_values(table, indices, weights, sparse, backend="triton", read_backward=read_backward)
    out.backward(grad_out)
    return out, table.grad, weights.grad


def assert_close_scaled(actual, expected, dtype):
    """|actual - expected| <= tolerance · max|expected|, elementwise, in float64."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual.double(), expected, rtol=0, atol=TOLERANCE[dtype] * scale)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sparse", [False, True])
def test_fused_read_matches_dense_recomputation(dtype, sparse):
    # 40 lookups per token and 260 columns: two blocks of each, the last ones partial
    table, indices, weights, grad_out = lookups(n_slots=300, dim=260, tokens=12, per_token=40, dtype=dtype)
    out, grad_table, grad_weights = fused(table, indices, weights, grad_out, sparse)
    ref_out, ref_table, ref_weights = dense_reference(table, indices, weights, grad_out)
    wide = torch.promote_types(dtype, torch.float32)  # a 16-bit table is read in float32 (issue 81); autograd
    # casts its gradient to the table's dtype unless the parameter asks for float32 (grad_dtype, as value_dtype does)
    assert out.dtype == wide and grad_table.dtype == dtype and grad_weights.dtype == torch.float32
    assert_close_scaled(out, ref_out, dtype)
    assert_close_scaled(grad_weights, ref_weights, dtype)
    assert grad_table.is_sparse == sparse
    if sparse:  # one row per distinct slot read, in slot order
        assert torch.equal(grad_table._indices()[0], torch.unique(indices))
        grad_table = grad_table.to_dense()
    assert_close_scaled(grad_table, ref_table, dtype)


@pytest.mark.slow
def test_fused_read_all_lookups_on_one_slot():
    """A collapsed memory: every lookup hits one slot, whose gradient row sums all of them."""
    table, indices, weights, grad_out = lookups(n_slots=50, dim=8, tokens=30, per_token=12, dtype=torch.float32)
    indices.fill_(7)
    out, grad_table, grad_weights = fused(table, indices, weights, grad_out, sparse=True)
    ref_out, ref_table, ref_weights = dense_reference(table, indices, weights, grad_out)
    assert grad_table._indices().tolist() == [[7]]
    for actual, expected in ((out, ref_out), (grad_table.to_dense(), ref_table), (grad_weights, ref_weights)):
        assert_close_scaled(actual, expected, torch.float32)


@pytest.mark.slow
def test_fused_read_is_deterministic_and_matches_the_torch_path():
    table, indices, weights, grad_out = lookups(n_slots=200, dim=16, tokens=32, per_token=8, dtype=torch.float32)
    first, second = (fused(table, indices, weights, grad_out, sparse=True) for _ in range(2))
    for a, b in zip(first, second):
        assert torch.equal(a.to_dense() if a.is_sparse else a, b.to_dense() if b.is_sparse else b)
    t, w = table.clone().requires_grad_(), weights.clone().requires_grad_()
    out = read_values(t, indices, w, sparse=True, backend="torch")
    out.backward(grad_out)
    torch.testing.assert_close(first[0], out)
    torch.testing.assert_close(first[1].to_dense(), t.grad.to_dense())
    torch.testing.assert_close(first[2], w.grad)


def test_fused_read_of_an_empty_batch():
    table, indices, weights, grad_out = lookups(n_slots=20, dim=4, tokens=0, per_token=4, dtype=torch.float32)
    out, grad_table, grad_weights = fused(table, indices, weights, grad_out, sparse=True)
    assert out.shape == (0, 4) and grad_weights.shape == (0, 4) and grad_table._nnz() == 0


def assert_backward_matches(table, indices, weights, grad_out, sparse):
    """read_backward=one_pass against the float64 re-computation and the two-pass kernels: its weights' gradient
    (float32 sums in both) to float32 rounding, its table gradient to the rounding of the table's dtype."""
    dtype = table.dtype
    out, grad_table, grad_weights = fused(table, indices, weights, grad_out, sparse, "one_pass")
    two_out, two_table, two_weights = fused(table, indices, weights, grad_out, sparse, "two_pass")
    ref_out, ref_table, ref_weights = dense_reference(table, indices, weights, grad_out)
    assert grad_table.dtype == dtype and grad_weights.dtype == torch.float32 and grad_table.is_sparse == sparse
    if sparse:  # one row per distinct slot read, in slot order, as two_pass's
        assert torch.equal(grad_table._indices(), two_table._indices())
        grad_table, two_table = grad_table.to_dense(), two_table.to_dense()
    assert torch.equal(out, two_out)  # the same forward
    assert_close_scaled(grad_weights, ref_weights, dtype)
    assert_close_scaled(grad_table, ref_table, dtype)
    assert_close_scaled(grad_weights, two_weights.double(), torch.float32)
    assert_close_scaled(grad_table, two_table.double(), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sparse", [False, True])
def test_one_pass_backward_matches_dense_recomputation_and_two_passes(dtype, sparse):
    # slot 3 read by most lookups (36 of 48 at least), 70 columns; unread slots get zero rows in the dense gradient
    table, indices, weights, grad_out = lookups(n_slots=40, dim=70, tokens=8, per_token=6, dtype=dtype)
    indices[:, :4] = 3
    assert_backward_matches(table, indices, weights, grad_out, sparse)


@pytest.mark.slow
@pytest.mark.parametrize("sparse", [False, True])
def test_one_pass_backward_with_tiles_smaller_than_a_row_and_a_run(monkeypatch, sparse):
    """2 lookups x 16 columns a tile: a hot slot's run (19 of 24 lookups) spans 10 tiles of lookups, each row 3 of
    columns (the last partial), so each weight's gradient is summed over three turns; every lookup on one slot too."""
    from xlm_pkm.model.memory import triton_value_read

    monkeypatch.setattr(triton_value_read, "_grad_blocks", lambda rows, D, most_rows=32: (2, 16))
    table, indices, weights, grad_out = lookups(n_slots=30, dim=40, tokens=6, per_token=4, dtype=torch.float32)
    indices[:, :2] = 3
    assert_backward_matches(table, indices, weights, grad_out, sparse)
    assert_backward_matches(table, indices.fill_(7), weights, grad_out, sparse)


def test_one_pass_backward_of_an_empty_batch():
    table, indices, weights, grad_out = lookups(n_slots=20, dim=4, tokens=0, per_token=4, dtype=torch.float32)
    _, grad_table, grad_weights = fused(table, indices, weights, grad_out, False, "one_pass")
    assert grad_weights.shape == (0, 4) and torch.equal(grad_table, torch.zeros_like(table))
    _, grad_table, grad_weights = fused(table, indices, weights, grad_out, True, "one_pass")
    assert grad_weights.shape == (0, 4) and grad_table._nnz() == 0


def test_one_pass_backward_is_a_triton_option(monkeypatch):
    """With the torch read (value_read=torch, or auto on CPU) one_pass is refused in one line naming both keys."""
    with pytest.raises(ValueError, match="model.memory.read_backward=one_pass .* model.memory.value_read=torch"):
        resolve_backend("torch", torch.device("cpu"), "one_pass")
    memory = ProductKeyMemory(16, 12, n_keys=8, k_dim=8, heads=2, knn=4, read_backward="one_pass")
    assert memory.read_backend is None
    with pytest.raises(ValueError, match="model.memory.read_backward=one_pass .* model.memory.value_read=auto"):
        memory(torch.randn(4, 16))
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # what triton_usable reads (a GPU machine's Triton compiles for CUDA)
    assert resolve_backend("triton", torch.device("cpu"), "one_pass") == "triton"  # under the interpreter


@pytest.mark.parametrize("read_backward", ["two_pass", "one_pass"])
def test_memory_layer_with_fused_read_matches_torch_read(read_backward):
    x = torch.randn(3, 5, 16, device=DEVICE)
    results = {}
    for backend in ("torch", "triton"):
        torch.manual_seed(0)
        memory = ProductKeyMemory(16, 12, n_keys=8, k_dim=8, heads=2, knn=4, value_read=backend,
                                  read_backward=read_backward if backend == "triton" else "two_pass").to(DEVICE)
        memory.sparse_values = True
        assert memory.read_backend == backend
        y = memory(x)
        (y**2).sum().backward()
        results[backend] = (y, memory.values.weight.grad.to_dense(), memory.keys.weight.grad,
                            memory.query_net[0].weight.grad)
    for a, b in zip(results["torch"], results["triton"]):
        torch.testing.assert_close(b, a)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_inference_values_read_a_bfloat16_copy_made_again_when_the_table_changes(backend):
    """model.memory.inference_values=bfloat16: with gradients the read is the default's bit for bit; without, it
    reads the table rounded to bfloat16 (summed in float32 by both reads: the torch read sums its distinct rows read
    in float32, value_read.float32_rows), and a change of the table (in place, as an optimizer step) is read at the
    next forward."""
    torch.manual_seed(0)
    memory = ProductKeyMemory(16, 12, n_keys=8, k_dim=8, heads=2, knn=4, value_read=backend).to(DEVICE).eval()
    copying = ProductKeyMemory(16, 12, n_keys=8, k_dim=8, heads=2, knn=4, value_read=backend,
                               inference_values="bfloat16").to(DEVICE).eval()
    copying.load_state_dict(memory.state_dict())
    x = torch.randn(3, 5, 16, device=DEVICE)
    assert torch.equal(copying(x), memory(x))  # gradients on: the table itself
    for _ in range(2):  # before and after a change of the table
        weights, indices = memory.lookup(x)  # (3, 5, heads, knn) each
        rounded = memory.values.weight.detach().bfloat16().double()
        expected = torch.einsum("nk,nkd->nd", weights.reshape(15, -1).double(), rounded[indices.reshape(15, -1)])
        with torch.no_grad():
            out = copying(x).reshape(15, -1)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6 * float(expected.abs().max()))
        with torch.no_grad():  # an optimizer's step, in place, on both
            for m in (memory, copying):
                m.values.weight.index_add_(0, torch.arange(8, device=DEVICE), torch.ones(8, 12, device=DEVICE))


@pytest.mark.slow
def test_compiled_memory_layer_runs_the_kernels_eagerly(monkeypatch):
    """Dynamo traces around the kernels (they run eagerly) and never resolves the backend in the forward.
    On CPU the graphs are handed to aot_eager: what is checked is their structure, and inductor's C++
    code generation (20 s on a cold cache) would add nothing to it; on a GPU, inductor."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    memory = ProductKeyMemory(16, 12, n_keys=8, k_dim=8, heads=2, knn=4, value_read="triton").to(DEVICE).eval()
    x = torch.randn(2, 5, 16, device=DEVICE)
    with torch.no_grad():
        expected = memory(x)
        for name in ("choose_backend", "resolve_backend"):  # chosen at build/move time, not in the forward
            monkeypatch.setattr(memory_module, name, None)
        counters.clear()
        backend = "inductor" if DEVICE.type == "cuda" else "aot_eager"
        torch.testing.assert_close(torch.compile(memory, backend=backend)(x), expected)
        assert counters["frames"]["ok"] >= 1  # compiled, around the kernels


def test_backend_choice(monkeypatch):
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_backend("torch", torch.device("cpu")) == "torch"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="value_read=triton needs Triton and a CUDA device"):
        resolve_backend("triton", torch.device("cpu"))


def test_backend_is_chosen_when_the_layer_is_built_or_moved(monkeypatch):
    """value_read=triton built where Triton cannot run: forward says why; moved (here: the interpreter
    turned on, then .float()), the layer chooses again and runs the kernels."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    memory = ProductKeyMemory(16, 12, n_keys=8, k_dim=8, heads=2, knn=4, value_read="triton")
    assert memory.read_backend is None
    with pytest.raises(ValueError, match="value_read=triton needs Triton and a CUDA device"):
        memory(torch.randn(4, 16))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert memory.float().read_backend == "triton"
    assert ProductKeyMemory(16, 12, n_keys=8, k_dim=8, heads=2, knn=4).read_backend == "torch"  # auto on CPU


@pytest.mark.slow  # Triton's compiler, in a subprocess
def test_kernels_compile_for_gpus_without_register_spills():
    """Each kernel compiles to a cubin for Hopper (sm_90, every dtype) and Ampere (sm_80) at the paper's
    shapes, and uses no local memory: no registers spilled. A subprocess, as the interpreter may be on here."""
    targets = ["90:fp32", "90:fp16", "90:bf16", "80:bf16"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "compile_kernels.py"), *targets],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    usage = json.loads(proc.stdout)
    assert sorted(usage) == sorted(targets)
    for target, kernels in usage.items():
        assert sorted(kernels) == ["_one_pass_grad_kernel@1", "_one_pass_grad_kernel@32", "_read_kernel",
                                   "_table_grad_kernel@1", "_table_grad_kernel@32", "_weights_grad_kernel"]
        for kernel, line in kernels.items():
            assert re.search(r"\bLOCAL:0\b", line) and re.search(r"\bSTACK:0\b", line), (target, kernel, line)
