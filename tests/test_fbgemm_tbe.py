"""FBGEMM's table-batched embeddings (TBE, fbgemm-gpu-cpu==1.8.0 of requirements-bench.txt) compute what our value
read and row-wise Adagrad compute: the same weighted sums and weights' gradient, and after each update the same rows
and row accumulators, to float32 rounding. Also the facts of its CPU path that issue 81's decision rests on
(docs/sparse-and-sharded-values.md): its table and state are parameters of its own module that never get a
gradient, its fp16 rows round to nearest on the CPU whatever stochastic_rounding says, and it has no CPU bf16 read.
Skipped where fbgemm_gpu is not installed (CI installs requirements-test.txt only); benchmarks/fbgemm_tbe.py times
both sides."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

try:
    import fbgemm_gpu  # noqa: F401
except Exception:  # ImportError, or an OSError where its build does not match the installed torch
    pytest.skip("fbgemm_gpu is not installed (a benchmark-only dependency: requirements-bench.txt)",
                allow_module_level=True)

from xlm_pkm.model.memory.value_read import read_values
from xlm_pkm.optim.rowwise_adagrad import RowwiseAdagrad

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from fbgemm_tbe import lookups, our_table, tbe_read, tbe_table  # noqa: E402

ROWS, DIM, N, HEADS, KNN = 60, 16, 24, 2, 4
pytestmark = pytest.mark.filterwarnings("ignore:(?s).*Failed to import:DeprecationWarning")  # its GPU-only (SSD) ops


def test_tbe_reads_and_updates_rows_as_our_read_and_rowwise_adagrad():
    """Two steps from the same float32 table, lookups that repeat slots within and across tokens (their rows
    summed before the update): outputs, the weights' gradients, the rows and G[r] equal to float32 rounding."""
    torch.manual_seed(0)
    table = torch.randn(ROWS, DIM) / DIM**0.5
    ours = our_table(table, torch.float32)
    optimizer = RowwiseAdagrad([ours], lr=0.05, eps=1e-8)
    tbe = tbe_table(table, "fp32", lr=0.05, eps=1e-8)
    for step in range(2):
        indices, weights = lookups(N, HEADS, KNN, ROWS // 3, seed=step)  # a third of the rows: repeats
        grad_out = torch.randn(N, DIM)
        w_ours, w_tbe = weights.detach().clone().requires_grad_(), weights.detach().clone().requires_grad_()
        ours.grad = None
        out_ours = read_values(ours, indices, w_ours, sparse=True)
        out_tbe = tbe_read(tbe, indices, w_tbe)
        torch.testing.assert_close(out_tbe, out_ours, rtol=1e-5, atol=1e-6)
        out_ours.backward(grad_out)
        optimizer.step()
        out_tbe.backward(grad_out)  # TBE's update
        torch.testing.assert_close(w_tbe.grad, w_ours.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(tbe.split_embedding_weights()[0], ours.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(tbe.split_optimizer_states()[0][0], optimizer.state[ours]["row_sum"],
                                   rtol=1e-5, atol=1e-7)
    assert not torch.equal(ours.detach(), table)  # the rows read moved
    assert torch.equal(ours.detach()[ROWS // 3:], table[ROWS // 3:])  # the others did not, on either side
    assert torch.equal(tbe.split_embedding_weights()[0][ROWS // 3:], table[ROWS // 3:])


def test_its_table_and_row_state_are_its_own_parameters_and_never_get_a_gradient():
    """The update happens inside backward: no gradient for a clip norm, a loss-scale check or accumulation to see,
    and the row state is a flat parameter of the module, not an optimizer's state."""
    tbe = tbe_table(torch.zeros(ROWS, DIM), "fp32")
    indices, weights = lookups(N, HEADS, KNN, ROWS)
    tbe_read(tbe, indices, weights).sum().backward()
    params = dict(tbe.named_parameters())
    assert {"weights_host", "momentum1_host"} <= set(params)
    assert params["weights_host"].shape == (ROWS * DIM,) and params["momentum1_host"].shape == (ROWS,)
    assert all(p.grad is None for p in params.values())


def test_its_cpu_fp16_rows_round_to_nearest():
    """Rows of ones, each updated by lr = 2e-4, below half an fp16 step under 1 (2^-12): rounded stochastically
    about 40% of the values would move; on the CPU none does, stochastic_rounding=True or not."""
    tbe = tbe_table(torch.ones(ROWS, DIM), "fp16", lr=2e-4)
    tbe_read(tbe, torch.arange(ROWS)[:, None], torch.ones(ROWS, 1)).backward(torch.ones(ROWS, DIM))  # G = 1
    assert torch.equal(tbe.split_embedding_weights()[0].float(), torch.ones(ROWS, DIM))


def test_it_has_no_cpu_read_of_bf16_rows():
    tbe = tbe_table(torch.zeros(ROWS, DIM), "bf16")
    with pytest.raises(NotImplementedError, match="BFloat16"):
        tbe_read(tbe, torch.arange(4)[:, None], torch.ones(4, 1))


@pytest.mark.slow
def test_the_benchmark_writes_both_sides_and_its_check(tmp_path):
    out = tmp_path / "tbe.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "fbgemm_tbe.py"), "--n-keys", "8", "--dim", "16",
                    "--batch", "2", "--seq", "4", "--min-time", "0.01", "--rounds", "1", "--threads", "1",
                    "--out", str(out)], check=True, capture_output=True, text=True, timeout=300)
    result = json.loads(out.read_text())
    assert {(r["mode"], r["side"], r["rows"]) for r in result["rows"]} >= {
        ("train_step", "ours", "float32"), ("train_step", "tbe", "float32"), ("train_step", "tbe", "fp16")}
    assert all(r["tokens_per_s"] > 0 for r in result["rows"])
    (check,) = result["check"]
    assert check["output"] < 1e-5 and check["table_after_one_update"] < 1e-5 < check["largest_row_change"]
    assert result["tbe_bf16_rows_on_cpu"].startswith("NotImplementedError")
