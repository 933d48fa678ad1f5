"""linear_act: the persistent TMA GEMM + bias + activation kernel (the interpreter on CPU) against the unfused
path on odd shapes, every activation and half dtype, strided and misaligned inputs; its rounding points; the
backend rules, the errors, torch.compile; on the GPU, BERT's and ViT's first MLP projection."""

import pytest
import torch
import torch.nn.functional as F

from flash_kernels import gelu, linear_act
from flash_kernels._testing import assert_close, assert_rounded_alike
from flash_kernels.linear_act import ACTIVATIONS, AUTO_MIN_ROWS, linear_act_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float16, torch.bfloat16]


def _operands(m, k, n, dtype, *, bias=True, leading=()):
    x = torch.randn(*leading, m, k, device=DEVICE).to(dtype)
    weight = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    b = torch.randn(n, device=DEVICE).to(dtype) if bias else None
    return x, weight, b


def _unfused(x, weight, bias, activation):
    """The GEMM in float32, stored in the dtype (as cuBLAS stores it), then the activation in float32, stored."""
    pre = F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    return ACTIVATIONS[activation][1](pre.float()).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("m,k,n,bias,leading", [
    (77, 120, 72, True, ()),      # no dim a multiple of the tiles: TMA reads zeros past K and clips the store;
                                  # 9 tiles for the interpreter's 4 programs, so each program takes several
    (40, 64, 96, True, (3,)),     # a batch dim; K a multiple of BLOCK_K
    (5, 200, 40, False, ()),      # fewer rows than a tile, no bias
])
def test_matches_unfused(dtype, activation, m, k, n, bias, leading):
    x, weight, b = _operands(m, k, n, dtype, bias=bias, leading=leading)
    out = linear_act(x, weight, b, activation=activation, backend="triton")
    assert out.shape == (*leading, m, n) and out.dtype == dtype
    oracle = _unfused(x, weight, b, activation)
    assert_close(out, oracle, dtype, name="linear_act")
    if dtype == torch.float16 or DEVICE == "cuda":  # Triton's interpreter truncates to bf16 where GPUs round
        assert_rounded_alike(out, oracle, dtype, name="linear_act")


def test_strided_and_misaligned_inputs():
    """TMA reads rows 16-byte aligned in place (x and weight column slices with aligned row strides); rows
    spaced unaligned, a shifted base or a transpose are copied first."""
    weight = (torch.randn(48, 80, device=DEVICE) / 8).half()[:, :64]
    assert weight.stride(0) == 80
    wide = torch.randn(30, 100, device=DEVICE).half()
    for x in (wide[:, :64],      # row stride 100 elements: 200 bytes, unaligned
              wide[:, 8:72],     # row stride unaligned, base 16 bytes in
              wide[:, 1:65],     # base 2 bytes in
              torch.randn(30, 104, device=DEVICE).half()[:, 8:72],  # aligned rows and base: read in place
              torch.randn(64, 30, device=DEVICE).half().t()):       # a transpose
        assert_close(linear_act(x, weight, backend="triton"), _unfused(x, weight, None, "gelu"), torch.float16)


def test_dims_tma_cannot_move_fall_back_or_raise():
    """K or N not a multiple of 8 (rows not 16-byte aligned): "auto" takes the unfused path, "triton" says why."""
    x, weight, b = _operands(9, 12, 24, torch.float16)
    assert torch.equal(linear_act(x, weight, b, backend="auto"), gelu(F.linear(x, weight, b)))
    with pytest.raises(ValueError, match="multiples of 8"):
        linear_act(x, weight, b, backend="triton")
    x, weight, b = _operands(9, 16, 20, torch.float16)
    with pytest.raises(ValueError, match="multiples of 8"):
        linear_act(x, weight, b, backend="triton")


def test_auto_is_the_unfused_path_for_few_rows_or_off_cuda():
    """Below AUTO_MIN_ROWS rows (where the kernel's host cost is not hidden, module docstring) and off CUDA,
    "auto" is cuBLAS's GEMM then our activation (flash_kernels.gelu, itself the reference off CUDA);
    "reference" is torch's activation."""
    x, weight, b = _operands(9, 16, 24, torch.float16)
    assert torch.equal(linear_act(x, weight, b, backend="auto"), gelu(F.linear(x, weight, b)))
    assert torch.equal(linear_act(x, weight, b, activation="gelu_tanh", backend="auto"),
                       gelu(F.linear(x, weight, b), approximate="tanh"))
    assert torch.equal(linear_act(x, weight, b, backend="reference"), F.gelu(F.linear(x, weight, b)))
    for backend in ("auto", "reference"):
        assert torch.equal(linear_act(x, weight, b, activation="relu", backend=backend), F.relu(F.linear(x, weight, b)))
    assert torch.equal(linear_act_ref(x, weight, b, activation="gelu_tanh"),
                       F.gelu(F.linear(x, weight, b), approximate="tanh"))


def test_bad_inputs():
    x, weight, b = _operands(4, 16, 8, torch.float16)
    with pytest.raises(ValueError, match="activation='swish'"):
        linear_act(x, weight, b, activation="swish")
    with pytest.raises(ValueError, match="does not match weight"):
        linear_act(x[:, :15], weight, backend="triton")
    with pytest.raises(ValueError, match="bias shape"):
        linear_act(x, weight, b[:7], backend="triton")
    with pytest.raises(ValueError, match="share a dtype"):
        linear_act(x.float(), weight, backend="triton")
    with pytest.raises(ValueError, match="needs gradients"):
        linear_act(x, weight.clone().requires_grad_(), backend="triton")
    with pytest.raises(ValueError, match="float32"):
        linear_act(x.float(), weight.float(), backend="triton")
    assert linear_act(x[:0], weight, backend="triton").shape == (0, 8)  # nothing to launch: the empty result


def test_compile_fullgraph():
    x, weight, b = _operands(9, 32, 24, torch.float16)
    fn = torch.compile(lambda x: linear_act(x, weight, b, backend="triton"), fullgraph=True,
                       backend="aot_eager" if DEVICE == "cpu" else "inductor")
    assert_close(fn(x), linear_act(x, weight, b, backend="triton"), torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(16384, 768, 3072), (12608, 768, 3072), (9011, 1024, 4096)])
def test_gpu_encoder_shapes(m, k, n):
    """BERT-base (16k tokens), ViT-B/16 (64 images x 197 tokens) and BERT-large (an odd packed count), bf16."""
    x, weight, b = _operands(m, k, n, torch.bfloat16)
    out = linear_act(x, weight, b, backend="triton")
    oracle = _unfused(x, weight, b, "gelu")
    assert_close(out, oracle, torch.bfloat16, name="linear_act")
    assert_rounded_alike(out, oracle, torch.bfloat16, name="linear_act")
    # From AUTO_MIN_ROWS rows "auto" is the kernel; below, the unfused path.
    assert m >= AUTO_MIN_ROWS and torch.equal(linear_act(x, weight, b, backend="auto"), out)
    few = x[: AUTO_MIN_ROWS - 1]
    assert torch.equal(linear_act(few, weight, b, backend="auto"), gelu(F.linear(few, weight, b)))


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(9011, 1024, 4096), (1000, 256, 520)])
def test_gpu_every_config_matches_the_unfused_path(m, k, n):
    """Each autotune candidate forced in turn, not just the one the autotuner picks on this GPU: the tile loop is
    flattened into the K loop (``tl.range(..., flatten=True)``), a transformation that miscompiled a nested
    attention loop under Triton 3.6 on an H100 while the interpreter ran it right, so every compiled variant is
    checked against the unfused path. (1000, 256, 520): a grid of a few
    tiles only, and N not a multiple of any BLOCK_N."""
    import importlib

    module = importlib.import_module("flash_kernels.linear_act")
    kernel = module._linear_act_kernel  # its autotune configs: no public call picks one
    x, weight, b = _operands(m, k, n, torch.bfloat16)
    oracle = _unfused(x, weight, b, "gelu")
    linear_act(x, weight, b, backend="triton")  # the autotuner's own pick, which fills the key
    keys = list(kernel.chosen)
    try:
        for config in kernel.autotuner.configs:
            for key in keys:
                kernel.chosen[key] = (config.all_kwargs(), config.pre_hook)
            out = linear_act(x, weight, b, backend="triton")
            label = f"linear_act {config.all_kwargs()}"
            assert_close(out, oracle, torch.bfloat16, name=label)
            assert_rounded_alike(out, oracle, torch.bfloat16, name=label)
    finally:
        for key in keys:
            del kernel.chosen[key]
