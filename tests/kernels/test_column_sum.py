"""column_sum (a Linear layer's bias gradient): the Triton kernels (the interpreter on CPU) against the
float32 reference, on odd shapes, strided views, every dtype, more row blocks than programs, and compile."""

import importlib

import pytest
import torch

from flash_kernels import column_sum
from flash_kernels._testing import assert_close

cs = importlib.import_module("flash_kernels.column_sum")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (3, 17, 77), (113, 200), (300, 5)])
def test_matches_reference(shape, dtype):
    x = torch.randn(shape, device=DEVICE).to(dtype)
    out = column_sum(x, backend="triton")
    assert out.dtype == dtype and out.shape == (shape[-1],)
    ref = x.double().reshape(-1, shape[-1]).sum(0)
    assert_close(out, ref.to(dtype), dtype, name="sum")
    # float32 output from low-precision input: the float32 accumulation, rounded once
    assert_close(column_sum(x, dtype=torch.float32, backend="triton"), ref.float(), torch.float32, name="sum fp32")


def test_many_row_programs_and_strided_rows(monkeypatch):
    """More rows than one program takes (several row programs, each several tiles), on a strided view."""
    monkeypatch.setattr(cs, "_BLOCK_M", 4)
    monkeypatch.setattr(cs, "num_programs", lambda device, per_sm=4: 6)
    base = torch.randn(203, 70, device=DEVICE)
    x = base[:, 3:64]  # row stride 70, last stride 1: read in place
    torch.testing.assert_close(column_sum(x, backend="triton"), x.sum(0), rtol=1e-5, atol=1e-4)


def test_partial_sums_over_many_row_blocks():
    """The second pass, shared with the norm backward: k buffers of partials, more rows than one block."""
    partials = torch.randn(3, 77, 50, device=DEVICE)
    torch.testing.assert_close(torch.stack(cs.sum_partials(partials)), partials.sum(1), rtol=1e-5, atol=1e-5)


def test_empty_rows_give_zeros():
    out = column_sum(torch.empty(0, 9, device=DEVICE, dtype=torch.bfloat16), dtype=torch.float32, backend="triton")
    assert out.dtype == torch.float32 and torch.equal(out, torch.zeros(9, device=DEVICE))


def test_gradient_and_compile():
    x = torch.randn(6, 11, device=DEVICE, requires_grad=True)
    g = torch.randn(11, device=DEVICE)
    (dx,) = torch.autograd.grad(column_sum(x, backend="triton"), x, g)
    torch.testing.assert_close(dx, g.expand(6, 11))
    compiled = torch.compile(lambda t: column_sum(t, backend="triton") * 2, fullgraph=True,
                             backend="aot_eager" if DEVICE == "cpu" else "inductor")
    torch.testing.assert_close(compiled(x), 2 * x.sum(0), rtol=1e-5, atol=1e-5)


def test_bad_inputs():
    with pytest.raises(ValueError, match="scalar"):
        column_sum(torch.tensor(1.0, device=DEVICE), backend="triton")
    with pytest.raises(ValueError, match="dtype"):
        column_sum(torch.randn(4, 8, dtype=torch.float64, device=DEVICE), backend="triton")
