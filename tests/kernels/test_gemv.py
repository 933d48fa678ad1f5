"""gemv: the one-row Triton kernel (the interpreter on CPU) against F.linear on odd shapes, strided inputs and
every dtype; its RMSNorm and SwiGLU prologues and residual epilogue against the unfused path they replace; the
backend rules, the errors, torch.compile; on the GPU, LLaMA-1.1B's decode shapes."""

import importlib

import pytest
import torch
import torch.nn.functional as F

from flash_kernels import gemv, rms_norm
from flash_kernels import swiglu as swiglu_kernel
from flash_kernels._testing import assert_close, assert_rounded_alike

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 0.1  # against a mean square of about 1: a wrong or ignored eps shows


def _operands(n, k, dtype, *, bias=True, leading=(1,), width=None):
    x = torch.randn(*leading, width or k, device=DEVICE).to(dtype)
    weight = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    b = torch.randn(n, device=DEVICE).to(dtype) if bias else None
    return x, weight, b


def _fused_operands(n, k, dtype, fusion, *, bias, leading=(1,)):
    """x, weight, bias and gemv's fusion keywords. fusion names what it fuses: "residual", "norm", "swiglu"
    (the prologue), "gated" (the SwiGLU epilogue: 2n packed weight rows) or a "+" of them; "plain" fuses
    nothing. "centered" makes the norm Gemma's (its weight around 0, scaling by 1 + weight)."""
    rows = 2 * n if "gated" in fusion else n
    x, weight, b = _operands(rows, k, dtype, bias=bias, leading=leading,
                             width=2 * k if "swiglu" in fusion else k)  # [gate; up]
    extra = {"swiglu_output": True} if "gated" in fusion else {}
    if "residual" in fusion:
        extra["residual"] = torch.randn(*leading, n, device=DEVICE).to(dtype)
    if "norm" in fusion:
        centered = "centered" in fusion
        extra.update(norm_weight=((0 if centered else 1) + 0.1 * torch.randn(k, device=DEVICE)).to(dtype), norm_eps=EPS)
        if centered:
            extra["norm_zero_centered"] = True
    if "swiglu" in fusion:
        extra["swiglu"] = True
    return x, weight, b, extra


def _unfused(x, weight, bias=None, *, residual=None, norm_weight=None, norm_eps=None, norm_zero_centered=False,
             swiglu=False, swiglu_output=False):
    """The unfused decode path in float32, rounded to x's dtype wherever it stores a tensor: the normed row or
    the SwiGLU product, the projection (and its SwiGLU), the new residual stream."""
    stored = lambda t: t.to(x.dtype).float()  # noqa: E731
    h = x.float()
    if norm_weight is not None:
        scale = norm_weight.float() + (1.0 if norm_zero_centered else 0.0)
        h = stored(h * torch.rsqrt(h.square().mean(-1, keepdim=True) + norm_eps) * scale)
    if swiglu:
        gate, up = h.chunk(2, dim=-1)
        h = stored(F.silu(gate) * up)
    y = stored(F.linear(h, weight.float(), None if bias is None else bias.float()))
    if swiglu_output:
        gate, up = y.chunk(2, dim=-1)
        y = stored(F.silu(gate) * up)
    if residual is not None:
        y = stored(y + residual.float())
    return y.to(x.dtype)


def _unfused_kernels(x, weight, bias=None, *, residual=None, norm_weight=None, norm_eps=None,
                     norm_zero_centered=False, swiglu=False, swiglu_output=False):
    """The unfused decode path through our own kernels: the norm or SwiGLU kernel, gemv, then the residual
    stream as the fused add+norm kernel stores it."""
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps=norm_eps, zero_centered_weight=norm_zero_centered, backend="triton")
    if swiglu:
        x = swiglu_kernel(x, backend="triton")
    y = gemv(x, weight, bias, backend="triton")
    if swiglu_output:
        y = swiglu_kernel(y, backend="triton")
    if residual is not None:
        any_weight = torch.randn(y.shape[-1], device=y.device).to(y.dtype)  # only the stream is used
        y = rms_norm(y, any_weight, residual=residual, prenorm=True, backend="triton")[1]
    return y


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
    assert_close(out, _unfused(x, weight, b), dtype, name="gemv")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fusion,bias", [
    ("residual", False), ("residual", True), ("norm", False), ("norm+residual", True), ("swiglu+residual", False),
    ("swiglu+residual", True), ("gated", False), ("norm+gated", True), ("gated+residual", True),
    ("norm+centered+residual", True),
])
def test_fused(dtype, fusion, bias):
    """N = 77, K = 123: neither a multiple of the tiles (the interpreter's 16 x 32)."""
    x, weight, b, extra = _fused_operands(77, 123, dtype, fusion, bias=bias)
    out = gemv(x, weight, b, **extra, backend="triton")
    ref = gemv(x, weight, b, **extra, backend="reference")
    assert out.shape == (1, 77) and out.dtype == dtype
    oracle = _unfused(x, weight, b, **extra)
    assert_close(out, oracle, dtype, name="triton")
    assert_close(out, ref, dtype, name="triton vs reference")
    # The same rounding as the unfused kernels (the interpreter truncates float32 -> bfloat16 where a GPU rounds
    # to nearest, so on the CPU the kernels are compared with each other), and the reference as the float32 path.
    assert_rounded_alike(out, _unfused_kernels(x, weight, b, **extra), dtype, name="triton")
    if DEVICE == "cpu":  # cuBLAS's half-precision F.linear may reduce in reduced precision
        assert_rounded_alike(ref, oracle, dtype, name="reference")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fusion,leading", [
    ("plain", (2,)), ("plain", (16, 1)), ("residual", (5, 1)), ("norm+gated", (3,)), ("swiglu+residual", (16,)),
    ("norm+residual", (2, 2)), ("norm+centered+gated", (3,)),
])
def test_few_rows(dtype, fusion, leading):
    """2-16 rows (a decode step's batch): the tensor-core kernel, bias on, N = 77 and K = 123 across several
    tiles (the interpreter's 16 x 32), with each prologue and epilogue; rows are independent, so each must
    equal the one-row kernel's result for it up to summation order."""
    x, weight, b, extra = _fused_operands(77, 123, dtype, fusion, bias=True, leading=leading)
    out = gemv(x, weight, b, **extra, backend="triton")
    assert out.shape == (*leading, 77) and out.dtype == dtype
    assert_close(out, _unfused(x, weight, b, **extra), dtype, name="few rows")
    assert_rounded_alike(out, _unfused_kernels(x, weight, b, **extra), dtype, name="few rows vs kernels")
    prefetched = gemv(x, weight, b, **extra, static_weight=True, backend="triton")
    assert_close(prefetched, out, dtype, name="prefetched vs plain")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fusion", ["plain", "norm+residual", "swiglu+residual", "norm+gated"])
@pytest.mark.parametrize("k", [123, 1500])  # within the prefetched columns (1024 at the interpreter's 16 rows),
def test_static_weight_prefetch(dtype, fusion, k):  # and past them, where the K loop takes over
    """static_weight=True: each program reads the first columns of its weight rows up front, then the rest in
    the loop; the same result as the plain kernel, with every prologue and the residual epilogue."""
    x, weight, b, extra = _fused_operands(77, k, dtype, fusion, bias=True)
    out = gemv(x, weight, b, **extra, static_weight=True, backend="triton")
    assert_close(out, gemv(x, weight, b, **extra, backend="triton"), dtype, name="prefetched vs plain")
    assert_close(out, _unfused(x, weight, b, **extra), dtype, name="prefetched")


@pytest.mark.parametrize("rows", [1, 3])
def test_strided_inputs_and_weight_rows(rows):
    """x, bias and residual strided views; weight rows spaced wider than K (a column slice of a bigger matrix)."""
    x = torch.randn(rows, 2 * 100, device=DEVICE)[..., ::2]
    weight = torch.randn(50, 160, device=DEVICE)[:, :100]
    bias = torch.randn(2 * 50, device=DEVICE)[::2]
    residual = torch.randn(rows, 2 * 50, device=DEVICE)[:, ::2]
    assert not x.is_contiguous() and weight.stride(0) == 160 and bias.stride(0) == residual.stride(1) == 2
    out = gemv(x, weight, bias, residual=residual, backend="triton")
    assert_close(out, F.linear(x, weight, bias) + residual, torch.float32)


def test_auto_is_the_reference():
    x, weight, b = _operands(40, 24, torch.float32)
    assert torch.equal(gemv(x, weight, b), F.linear(x, weight, b))
    assert torch.equal(gemv(x, weight, b, backend="reference"), F.linear(x, weight, b))
    x, weight, b, extra = _fused_operands(40, 24, torch.bfloat16, "norm+residual", bias=True)
    assert torch.equal(gemv(x, weight, b, **extra, backend="auto"), gemv(x, weight, b, **extra, backend="reference"))


def test_bad_inputs():
    x, weight, _ = _operands(8, 16, torch.float32)
    nw, r = torch.randn(16, device=DEVICE), torch.randn(1, 8, device=DEVICE)
    with pytest.raises(ValueError, match="at most 16 rows"):
        gemv(torch.randn(17, 16, device=DEVICE), weight, backend="triton")
    with pytest.raises(ValueError, match="does not match weight"):
        gemv(torch.randn(1, 15, device=DEVICE), weight, backend="triton")
    with pytest.raises(ValueError, match="2-D"):
        gemv(x, weight[0], backend="triton")
    with pytest.raises(ValueError, match="bias shape"):
        gemv(x, weight, torch.randn(9, device=DEVICE), backend="triton")
    with pytest.raises(ValueError, match="share a dtype"):
        gemv(x.half(), weight, backend="triton")
    with pytest.raises(ValueError, match="needs gradients"):
        gemv(x, weight.clone().requires_grad_(), backend="triton")
    with pytest.raises(ValueError, match="backend"):
        gemv(x, weight, backend="cublas")
    # the residual epilogue
    with pytest.raises(ValueError, match="residual shape"):
        gemv(x, weight, residual=torch.randn(1, 9, device=DEVICE), backend="triton")
    with pytest.raises(ValueError, match="residual shape"):
        gemv(x, weight, residual=torch.randn(8, device=DEVICE), backend="triton")  # x (1, 16): out is (1, 8)
    with pytest.raises(ValueError, match="residual .*share a dtype"):
        gemv(x, weight, residual=r.half(), backend="triton")
    with pytest.raises(ValueError, match="needs gradients"):
        gemv(x, weight, residual=r.clone().requires_grad_(), backend="triton")
    # the prologues
    with pytest.raises(ValueError, match="norm_weight .* and swiglu=True .* exclude each other"):
        gemv(torch.randn(1, 32, device=DEVICE), weight, norm_weight=nw, norm_eps=EPS, swiglu=True)
    with pytest.raises(ValueError, match="both norm_weight and norm_eps"):
        gemv(x, weight, norm_weight=nw)
    with pytest.raises(ValueError, match="both norm_weight and norm_eps"):
        gemv(x, weight, norm_eps=EPS)
    with pytest.raises(ValueError, match="norm_zero_centered=True .* pass norm_weight"):
        gemv(x, weight, norm_zero_centered=True)
    with pytest.raises(ValueError, match="norm_weight shape"):
        gemv(x, weight, norm_weight=torch.randn(8, device=DEVICE), norm_eps=EPS)
    with pytest.raises(ValueError, match="norm_weight .*share a dtype"):
        gemv(x, weight, norm_weight=nw.bfloat16(), norm_eps=EPS)
    with pytest.raises(ValueError, match="packed"):
        gemv(x, weight, swiglu=True)  # x must hold [gate; up], 2 * 16
    # the SwiGLU epilogue: packed [gate; up] rows, so an even count, and bias and residual sized to match
    with pytest.raises(ValueError, match="even number of rows"):
        gemv(x, weight[:7], swiglu_output=True, backend="triton")
    with pytest.raises(ValueError, match="bias shape"):
        gemv(x, weight, torch.randn(4, device=DEVICE), swiglu_output=True, backend="triton")
    with pytest.raises(ValueError, match="residual shape"):
        gemv(x, weight, residual=r, swiglu_output=True, backend="triton")  # out is (1, 4)


@pytest.mark.parametrize("fusion", ["plain", "norm+residual"])
def test_compile_fullgraph(fusion):
    x, weight, b, extra = _fused_operands(40, 24, torch.float32, fusion, bias=True)
    fn = torch.compile(lambda x: gemv(x, weight, b, **extra, backend="triton"), fullgraph=True,
                       backend="aot_eager" if DEVICE == "cpu" else "inductor")
    assert_close(fn(x), gemv(x, weight, b, **extra, backend="triton"), torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632), (32000, 2048)])
def test_gpu_llama_decode_shapes(n, k):
    """LLaMA-1.1B's batch-1 projections: qkv, o, gate/up, down and the LM head, bf16."""
    x, weight, _ = _operands(n, k, torch.bfloat16, bias=False, leading=(1, 1))
    assert_close(gemv(x, weight, backend="triton"), _unfused(x, weight), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,fusion", [
    (2560, 2048, "norm"), (2048, 2048, "residual"), (11264, 2048, "norm"), (2048, 5632, "swiglu+residual"),
    (5632, 2048, "norm+gated"),  # gate/up's 11264 packed rows, norm2 before and SwiGLU after
])
def test_gpu_llama_fused(n, k, fusion):
    """LLaMA-1.1B's layer, bf16: qkv and gate/up after the norm, o and down into the residual stream."""
    x, weight, _, extra = _fused_operands(n, k, torch.bfloat16, fusion, bias=False)
    out = gemv(x, weight, **extra, backend="triton")
    oracle = _unfused(x, weight, **extra)
    assert_close(out, oracle, torch.bfloat16)
    assert_rounded_alike(out, oracle, torch.bfloat16, name="triton vs float32")
    assert_rounded_alike(out, _unfused_kernels(x, weight, **extra), torch.bfloat16, name="triton vs kernels")


def test_chain_tile_rule(monkeypatch):
    """Chained calls (static_weight) take the long-row tile for long rows or too few outputs, else CHAIN_TILE."""
    gemv_module = importlib.import_module("flash_kernels.gemv")
    monkeypatch.setattr(gemv_module, "sm_count", lambda index: 132)  # an H100
    cuda = torch.device("cuda", 0)
    assert gemv_module._chain_tile(5632, 2048, cuda) == gemv_module.CHAIN_TILE  # LLaMA-1.1B's gate/up
    assert gemv_module._chain_tile(2048, 2048, cuda) == gemv_module.CHAIN_TILE  # its o: 256 programs of 8 rows
    assert gemv_module._chain_tile(2048, 5632, cuda) == gemv_module.CHAIN_TILE_LONG_ROWS  # its down: long rows
    assert gemv_module._chain_tile(768, 3072, cuda) == gemv_module.CHAIN_TILE_LONG_ROWS  # GPT-2's fc2: 96 programs


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,fusion", [
    (2560, 2048, "norm"), (2048, 2048, "residual"), (5632, 2048, "norm+gated"), (2048, 5632, "residual"),
    (32000, 2048, "plain"),  # LLaMA-1.1B's chained layer and LM head
    (768, 3072, "residual"), (768, 768, "plain"), (2304, 768, "plain"),  # GPT-2's fc2 + add, o, qkv
])
def test_gpu_chain_tiles(n, k, fusion):
    """static_weight=True at batch 1 launches the rule's tiles (both of them), with their weight prefetch, bf16."""
    x, weight, _, extra = _fused_operands(n, k, torch.bfloat16, fusion, bias=False)
    out = gemv(x, weight, **extra, static_weight=True, backend="triton")
    assert_close(out, _unfused(x, weight, **extra), torch.bfloat16)
    assert_rounded_alike(out, _unfused_kernels(x, weight, **extra), torch.bfloat16, name="triton vs kernels")


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,fusion", [
    (2304, 768, "plain"), (768, 3072, "residual"), (3072, 768, "plain"),  # GPT-2's qkv, fc2 + add, fc1
    (2560, 2048, "norm"), (5632, 2048, "norm+gated"), (2048, 5632, "residual"),  # LLaMA-1.1B's
])
def test_gpu_batch16_decode_shapes(n, k, fusion):
    """A batch-16 decode step's projections, bf16, through the tensor-core kernel."""
    x, weight, _, extra = _fused_operands(n, k, torch.bfloat16, fusion, bias=False, leading=(16, 1))
    out = gemv(x, weight, **extra, static_weight=True, backend="triton")
    assert_close(out, _unfused(x, weight, **extra), torch.bfloat16)
    assert_rounded_alike(out, _unfused_kernels(x, weight, **extra), torch.bfloat16, name="triton vs kernels")
