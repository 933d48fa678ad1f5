"""gemv: the one-row Triton kernel (the interpreter on CPU) against F.linear on odd shapes, strided inputs and
every dtype; the backend rules, the errors, torch.compile; on the GPU, LLaMA-1.1B's decode shapes."""

import pytest
import torch
import torch.nn.functional as F

from flash_kernels import gemv
from flash_kernels._testing import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _operands(n, k, dtype, *, bias=True, leading=(1,)):
    x = torch.randn(*leading, k, device=DEVICE).to(dtype)
    weight = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    b = torch.randn(n, device=DEVICE).to(dtype) if bias else None
    return x, weight, b


def _reference(x, weight, bias):
    """F.linear in float32, cast back: the kernel accumulates in float32 whatever the dtype."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,bias,leading", [
    (77, 123, True, (1,)),        # neither dim a multiple of the tiles
    (16, 1000, False, (1, 1)),    # one row block, K across many tiles
    (130, 32, True, ()),          # a bare vector, K one tile
])
def test_matches_linear(dtype, n, k, bias, leading):
    x, weight, b = _operands(n, k, dtype, bias=bias, leading=leading)
    out = gemv(x, weight, b, backend="triton")
    assert out.shape == (*leading, n) and out.dtype == dtype
    assert_close(out, _reference(x, weight, b), dtype, name="gemv")


def test_strided_input_and_weight_rows():
    """x a strided view; weight rows spaced wider than K (a column slice of a bigger matrix)."""
    x = torch.randn(1, 2 * 100, device=DEVICE)[..., ::2]
    weight = torch.randn(50, 160, device=DEVICE)[:, :100]
    assert not x.is_contiguous() and weight.stride(0) == 160
    assert_close(gemv(x, weight, backend="triton"), F.linear(x, weight), torch.float32)


def test_auto_is_torchs_linear_and_reference_too():
    x, weight, b = _operands(40, 24, torch.float32)
    assert torch.equal(gemv(x, weight, b), F.linear(x, weight, b))
    assert torch.equal(gemv(x, weight, b, backend="reference"), F.linear(x, weight, b))


def test_bad_inputs():
    x, weight, b = _operands(8, 16, torch.float32)
    with pytest.raises(ValueError, match="one row"):
        gemv(torch.randn(2, 16, device=DEVICE), weight, backend="triton")
    with pytest.raises(ValueError, match="does not match weight"):
        gemv(torch.randn(1, 15, device=DEVICE), weight, backend="triton")
    with pytest.raises(ValueError, match="bias shape"):
        gemv(x, weight, torch.randn(9, device=DEVICE), backend="triton")
    with pytest.raises(ValueError, match="share a dtype"):
        gemv(x.half(), weight, backend="triton")
    with pytest.raises(ValueError, match="needs gradients"):
        gemv(x, weight.clone().requires_grad_(), backend="triton")
    with pytest.raises(ValueError, match="backend"):
        gemv(x, weight, backend="cublas")


def test_compile_fullgraph():
    x, weight, b = _operands(40, 24, torch.float32)
    fn = torch.compile(lambda x: gemv(x, weight, b, backend="triton"), fullgraph=True,
                       backend="aot_eager" if DEVICE == "cpu" else "inductor")
    assert_close(fn(x), gemv(x, weight, b, backend="triton"), torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632), (32000, 2048)])
def test_gpu_llama_decode_shapes(n, k):
    """LLaMA-1.1B's batch-1 projections: qkv, o, gate/up, down and the LM head, bf16."""
    x, weight, _ = _operands(n, k, torch.bfloat16, bias=False, leading=(1, 1))
    assert_close(gemv(x, weight, backend="triton"), _reference(x, weight, None), torch.bfloat16)
