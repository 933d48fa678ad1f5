"""swiglu / geglu / gelu: Triton elementwise kernels (the interpreter on CPU) against the reference and the
torch.nn.functional equivalents, forward and backward, and torch.compile."""

import importlib

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

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


@triton.jit
def _erf_kernel(X, Y, N, LIBDEVICE: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < N
    x = tl.load(X + offsets, mask=mask)
    tl.store(Y + offsets, tl.math.erf(x) if LIBDEVICE else act._erf(x), mask=mask)


def _erf_of(x: torch.Tensor, *, libdevice: bool = False) -> torch.Tensor:
    y = torch.empty_like(x)
    _erf_kernel[(triton.cdiv(x.numel(), 4096),)](x, y, x.numel(), LIBDEVICE=libdevice, BLOCK=4096)
    return y


def _erf_inputs() -> torch.Tensor:
    """Every finite bfloat16 value (what a GELU of a bf16 pre-activation sees), then a dense grid over the range
    where erf is not yet +-1, as float32."""
    every_bf16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    every_bf16 = every_bf16[torch.isfinite(every_bf16)]
    return torch.cat([every_bf16, torch.linspace(-6, 6, 120_001)]).to(DEVICE)


# Under the interpreter, numpy warns for x * x of the huge inputs in the lanes that take the other form.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_branchless_erf_is_within_two_ulp():
    """The kernels' erf (libdevice's polynomials, selected per element instead of branched on) against float64
    erf: within 2 float32 ulp everywhere (CUDA documents erff's maximum error as 2 ulp; Triton 3.8's
    interpreter gives 1.012 ulp at x = 1.0141, earlier versions stayed under 1), exact at 0 and +-inf, NaN for
    NaN. A wrong coefficient or a swapped branch shows as many ulps."""
    x = _erf_inputs()
    exact = torch.special.erf(x.double())
    magnitude = exact.float().abs()
    ulp = (torch.nextafter(magnitude, torch.tensor(float("inf"), device=DEVICE)) - magnitude).double()
    # Triton's interpreter computes exp2 exactly; the GPU's ex2.approx adds up to 2 ulp of its own.
    assert ((_erf_of(x).double() - exact).abs() / ulp).max() <= (2.0 if DEVICE == "cpu" else 3.0)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan")], device=DEVICE)
    out = _erf_of(special)
    assert out[:4].tolist() == [0.0, 0.0, 1.0, -1.0] and out[4].isnan()


@pytest.mark.gpu
def test_gpu_branchless_erf_matches_libdevice():
    """Every normal input (libdevice flushes denormal ones to zero, ours keeps them: see activations._erf):
    bit for bit in the small-|x| polynomial, within one ulp in the exp2 form, and no less accurate than
    libdevice against float64 (a wrong coefficient or a swapped branch shows as many ulps)."""
    x = torch.cat([_erf_inputs(), torch.randn(1_000_000, device="cuda") * 3])
    x = x[(x.abs() >= torch.finfo(torch.float32).tiny) | (x == 0)]
    ours, libdevice = _erf_of(x), _erf_of(x, libdevice=True)
    small = x.abs() < 1.0
    assert torch.equal(ours[small], libdevice[small])
    assert (ours.view(torch.int32) - libdevice.view(torch.int32)).abs().max() <= 1
    exact = torch.special.erf(x.double())
    magnitude = exact.float().abs()
    ulp = (torch.nextafter(magnitude, torch.tensor(float("inf"), device="cuda")) - magnitude).double()
    assert ((ours.double() - exact).abs() / ulp).max() <= ((libdevice.double() - exact).abs() / ulp).max() + 0.01


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
