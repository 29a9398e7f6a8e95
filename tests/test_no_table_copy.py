"""No copy of a memory table at a run's peaks (issue 81): the reductions a run makes over every weight (the
non-finite check before a checkpoint, the mean |value| an evaluation logs) read a table a slice at a time
(utils/chunks.py). torch's profiler records each operator's allocations: none may be of a table's size (isfinite
built |t| and a mask of it, vector_norm(dtype=float64) a float64 copy: 2 GiB of a 1 GiB table)."""

import torch
from torch.profiler import ProfilerActivity, profile

from xlm_pkm.checkpoint.files import all_finite, first_non_finite
from xlm_pkm.model.memory.stats import abs_sum
from xlm_pkm.utils.chunks import CHUNK_ELEMENTS, slices

TABLE = (8 * CHUNK_ELEMENTS // 256, 256)  # 8 slices' worth: 32 MiB of float32


def largest_allocation(fn) -> int:
    """The bytes of the largest allocation an operator made while fn ran."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events()), default=0)


def test_slices_are_views_that_cover_the_tensor_once():
    t = torch.randn(1000, 37)
    for tensor in (t, t.t(), t[:, 5], torch.tensor(3.0), torch.empty(0, 4)):
        parts = list(slices(tensor, elements=100))
        assert all(p.data_ptr() == 0 or p.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
                   for p in parts)  # views of the same storage
        assert all(p.numel() <= max(100, tensor[0].numel() if tensor.dim() else 1) for p in parts)
        joined = torch.cat([p.reshape(-1, *tensor.shape[1:]) for p in parts]) if parts else tensor
        assert torch.equal(joined.reshape(tensor.shape), tensor)


def test_the_non_finite_check_and_the_mean_value_read_a_table_without_a_copy():
    table = torch.randn(TABLE)
    size = table.numel() * table.element_size()
    assert largest_allocation(lambda: torch.isfinite(table).all()) >= size  # what a whole-table call costs
    assert largest_allocation(lambda: all_finite(table)) <= size / 4
    assert largest_allocation(lambda: abs_sum([table])) <= size / 2  # float64 slices: twice a float32 one
    assert largest_allocation(lambda: first_non_finite({"model": {"table": table}})) <= size / 4
    torch.testing.assert_close(abs_sum([table])[0], table.double().abs().sum())  # the same figures
    table[-1, -1] = float("nan")
    assert not all_finite(table) and first_non_finite({"model": {"table": table}}) == "model.table"


def test_a_bfloat16_table_is_drawn_without_a_float32_table():
    """value_dtype=bfloat16: the float32 init's numbers rounded to nearest, drawn a chunk of rows at a time into
    the bfloat16 table (it drew the whole float32 table, then converted it: 6 bytes a value at start-up)."""
    from xlm_pkm.config import load_config
    from xlm_pkm.model.memory.value_stores import TableValues

    rows, dim = TABLE
    tables = {}
    for dtype in ("float32", "bfloat16"):
        cfg = load_config(None, [f"model.memory.value_dtype={dtype}"]).model.memory
        torch.manual_seed(0)
        tables[dtype] = TableValues(cfg, dim, dim, rows).weight.detach()
        torch.manual_seed(0)
        largest = largest_allocation(lambda cfg=cfg: TableValues(cfg, dim, dim, rows))
        assert largest <= rows * dim * tables[dtype].element_size()  # the table itself, and small chunks
    assert tables["bfloat16"].dtype == torch.bfloat16
    assert torch.equal(tables["bfloat16"], tables["float32"].bfloat16())
    assert largest < rows * dim * 4  # no float32 table beside the bfloat16 one


def test_a_bfloat16_table_is_read_without_a_float32_table():
    """The read sums in float32 the rows it reads; it asked for the table's float32 dtype by converting the whole
    table (at_least_float32(table).dtype: a float32 copy at every read, 4 bytes a value, in training and
    evaluation alike)."""
    from xlm_pkm.model.memory.value_read import read_values

    rows, dim = TABLE
    table = torch.randn(TABLE).bfloat16().requires_grad_()
    indices, weights = torch.randint(0, rows, (64, 16)), torch.rand(64, 16)
    for read_op in ("eager", "custom_op"):
        largest = largest_allocation(lambda read_op=read_op: read_values(table, indices, weights, True,
                                                                         read_op=read_op).sum().backward())
        assert largest < rows * dim * 2  # not even a bfloat16 copy
