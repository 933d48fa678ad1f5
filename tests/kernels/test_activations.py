"""swiglu / geglu / gelu: Triton elementwise kernels (the interpreter on CPU) against the reference and the
torch.nn.functional equivalents, forward and backward, and torch.compile."""

import importlib

import pytest
import torch
import torch.nn.functional as F

from flash_kernels import geglu, gelu, swiglu
from flash_kernels._testing import assert_close

act = importlib.import_module("flash_kernels.activations")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [(torch.float32, 1.0), (torch.float16, 1.0), (torch.bfloat16, 1.0)]
OPS = {
    "swiglu": (lambda x, **k: swiglu(x, **k), act.swiglu_ref),
    "geglu_tanh": (lambda x, **k: geglu(x, approximate="tanh", **k), lambda x: act.geglu_ref(x, approximate="tanh")),
    "geglu_erf": (lambda x, **k: geglu(x, approximate="none", **k), lambda x: act.geglu_ref(x, approximate="none")),
    "gelu_erf": (lambda x, **k: gelu(x, **k), act.gelu_ref),
    "gelu_tanh": (lambda x, **k: gelu(x, approximate="tanh", **k), lambda x: act.gelu_ref(x, approximate="tanh")),
}


@pytest.mark.parametrize("dtype,scale", DTYPES)
@pytest.mark.parametrize("name", list(OPS))
def test_fwd_bwd(name, dtype, scale):
    fn, ref_fn = OPS[name]
    x = (3 * torch.randn(3, 17, 154, device=DEVICE, dtype=dtype)).requires_grad_()
    out, ref = fn(x, backend="triton"), ref_fn(x)
    assert_close(out, ref, dtype, scale=scale, name="out")
    g = torch.randn_like(ref)
    assert_close(torch.autograd.grad(out, x, g)[0], torch.autograd.grad(ref, x, g)[0], dtype, scale=scale, name="grad")


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_plain_gelu_flat_and_by_rows(approximate):
    """A plain GELU on contiguous memory runs as one flat row; a strided input or gradient runs row by row.
    Both layouts, with a width (150) that no block size divides, match the reference."""
    contiguous = (3 * torch.randn(5, 13, 150, device=DEVICE)).requires_grad_()
    strided = (3 * torch.randn(5, 13, 200, device=DEVICE))[..., :150].requires_grad_()
    assert not strided.is_contiguous()
    for x in (contiguous, strided):
        g = torch.randn(5, 13, 300, device=DEVICE)[..., ::2]  # a non-contiguous gradient: rows again
        for grad_out in (g.contiguous(), g):
            out, ref = gelu(x, approximate=approximate, backend="triton"), act.gelu_ref(x, approximate=approximate)
            assert_close(out, ref, torch.float32, name="out")
            assert_close(torch.autograd.grad(out, x, grad_out)[0], torch.autograd.grad(ref, x, grad_out)[0],
                         torch.float32, name="grad")


def test_matches_torch_functional():
    """Against torch.nn.functional written out on the split projection (the unfused module form)."""
    x = torch.randn(5, 7, 2 * 33, device=DEVICE)
    gate, up = x.chunk(2, dim=-1)
    assert_close(swiglu(x, backend="triton"), F.silu(gate) * up, torch.float32)
    assert_close(geglu(x, approximate="none", backend="triton"), F.gelu(gate) * up, torch.float32)
    assert_close(gelu(x, approximate="tanh", backend="triton"), torch.nn.GELU(approximate="tanh")(x), torch.float32)


def test_compile_fullgraph():
    def mlp(x, w_in, w_out):
        return F.linear(swiglu(F.linear(x, w_in), backend="triton"), w_out)

    x = torch.randn(2, 9, 32, device=DEVICE)
    w_in = torch.randn(2 * 48, 32, device=DEVICE, requires_grad=True)
    w_out = torch.randn(32, 48, device=DEVICE, requires_grad=True)
    compiled = torch.compile(mlp, fullgraph=True, backend="aot_eager" if DEVICE == "cpu" else "inductor")
    assert_close(compiled(x, w_in, w_out), mlp(x, w_in, w_out), torch.float32)
    compiled(x, w_in, w_out).sum().backward()
    assert w_in.grad is not None


def test_bad_inputs():
    with pytest.raises(ValueError, match="must be even"):
        swiglu(torch.randn(4, 7), backend="triton")
    with pytest.raises(ValueError, match="approximate"):
        gelu(torch.randn(4, 8), approximate="fast", backend="triton")
    with pytest.raises(ValueError, match="dtype"):
        gelu(torch.randn(4, 8, dtype=torch.float64), backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(OPS))
def test_gpu_llama7b_size(name):
    fn, ref_fn = OPS[name]
    x = torch.randn(8192, 2 * 11008, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out, ref = fn(x, backend="triton"), ref_fn(x)
    assert_close(out, ref, torch.bfloat16)
    g = torch.randn_like(ref)
    assert_close(torch.autograd.grad(out, x, g)[0], torch.autograd.grad(ref, x, g)[0], torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gpu_auto_plain_gelu_is_torchs(approximate):
    """Plain GELU has nothing to fuse: "auto" on CUDA is torch's own kernel (faster and cheaper to launch)."""
    x = torch.randn(1000, 3072, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(gelu(x, approximate=approximate), F.gelu(x, approximate=approximate))
