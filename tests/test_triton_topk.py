"""The key search's Triton top-k against torch.topk (and a brute-force sort for the order of equal scores).

Without a GPU the kernel runs under Triton's interpreter (conftest.py sets TRITON_INTERPRET=1); on CUDA
it runs compiled, and selected_scores.top_k dispatches to it.
"""

import pytest
import torch

pytest.importorskip("triton")
from xlm_pkm.model.memory import triton_topk  # noqa: E402
from xlm_pkm.model.memory.selected_scores import top_k  # noqa: E402
from xlm_pkm.model.memory.triton_topk import topk_indices  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SHAPES = [(9, 64, 8), (3, 128, 32), (9, 100, 7), (4, 16, 16), (1, 1, 1)]  # (rows, columns, k)
if DEVICE.type == "cuda":  # the search's own: n_keys 512 and knn² 1,024 (seconds each under the interpreter)
    SHAPES += [(4099, 512, 32), (1029, 1024, 32)]


@pytest.fixture(autouse=True)
def small_tiles_when_interpreted(monkeypatch):
    """Under the interpreter, tiles of 256 elements: several programs per test, and seconds, not tens."""
    if DEVICE.type == "cpu":
        monkeypatch.setattr(triton_topk, "TILE_ELEMENTS", 256)


@pytest.mark.parametrize("rows, columns, k", SHAPES)
def test_the_k_largest_columns_largest_first(rows, columns, k):
    g = torch.Generator().manual_seed(rows * columns + k)
    x = torch.randn(rows, columns, generator=g).to(DEVICE)  # (R, S): distinct values
    indices = topk_indices(x, k)
    expected = x.topk(k, dim=-1)
    assert torch.equal(indices, expected.indices)
    assert torch.equal(x.gather(-1, indices), expected.values)


def test_signs_zeros_infinities_and_ties_keep_the_float_order():
    """Negative floats, subnormals and ±inf sort as floats; equal scores go to the higher column, and 0.0
    comes before -0.0 (their bit patterns' order)."""
    x = torch.tensor([[-0.0, 0.0, -1.5, 2.0, -3e-39, 1e-40, float("-inf"), float("inf"), -1.5, 2.0]], device=DEVICE)
    assert topk_indices(x, 10).tolist() == [[7, 9, 3, 5, 1, 0, 4, 8, 2, 6]]
    assert topk_indices(x, 3).tolist() == [[7, 9, 3]]


def test_leading_axes_and_a_k_past_the_row_fail_or_fold():
    x = torch.randn(2, 3, 40, device=DEVICE)  # (..., S)
    assert torch.equal(topk_indices(x, 5), x.topk(5, dim=-1).indices)
    with pytest.raises(ValueError, match="top-41 of rows of 40"):
        topk_indices(x, 41)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="top_k uses the kernel on CUDA only")
def test_top_k_on_cuda_is_torch_topk_with_its_gradient():
    x = torch.randn(64, 4, 1024, device="cuda", requires_grad=True)
    values, indices = top_k(x, 32)
    expected = x.topk(32, dim=-1)
    assert torch.equal(indices, expected.indices) and torch.equal(values, expected.values)
    grad = torch.randn_like(values)
    assert torch.equal(torch.autograd.grad(values, x, grad)[0], torch.autograd.grad(expected.values, x, grad)[0])
