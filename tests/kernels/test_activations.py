"""swiglu / geglu / gelu: Triton elementwise kernels (the interpreter on CPU) against the reference and the
torch.nn.functional equivalents, forward and backward, and torch.compile."""

import importlib

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from flash_kernels import activation_backward as fk_activation_backward
from flash_kernels import geglu, gelu, swiglu
from flash_kernels import linear_act as fk_linear_act
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
        swiglu(torch.randn(4, 7, device=DEVICE), backend="triton")
    with pytest.raises(ValueError, match="approximate"):
        gelu(torch.randn(4, 8, device=DEVICE), approximate="fast", backend="triton")
    with pytest.raises(ValueError, match="dtype"):  # on a GPU machine, a CUDA tensor: else the device is the problem
        gelu(torch.randn(4, 8, dtype=torch.float64, device=DEVICE), backend="triton")


# The normal CDF is a device function that several kernels share; no public op returns it alone, so a kernel of
# the test's own calls it, over every bf16 input and in both of its exp2 forms.
@triton.jit
def _cdf_kernel(X, Y, N, BLOCK: tl.constexpr, PTX: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < N
    x = tl.load(X + offsets, mask=mask)
    tl.store(Y + offsets, act._cdf_from_tail(x, act._normal_tail(x, PTX)), mask=mask)


def _cdf_of(x: torch.Tensor, ptx: bool) -> torch.Tensor:
    y = torch.empty_like(x)
    _cdf_kernel[(triton.cdiv(x.numel(), 4096),)](x, y, x.numel(), BLOCK=4096, PTX=ptx)
    return y


def _cdf_inputs() -> torch.Tensor:
    """Every finite bfloat16 value (what a GELU of a bf16 pre-activation sees), then a dense grid over the range
    where the CDF is neither 0 nor 1 in float32, as float32."""
    every_bf16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    every_bf16 = every_bf16[torch.isfinite(every_bf16)]
    return torch.cat([every_bf16, torch.linspace(-14, 9, 230_001)]).to(DEVICE)


# Under the interpreter, numpy warns for z * z of the huge inputs.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("ptx", [False, pytest.param(True, marks=pytest.mark.gpu)], ids=["portable", "ptx"])
def test_gelu_cdf_relative_accuracy(ptx):
    """The kernels' normal CDF (2^P(|x|) for the lower tail, see activations._normal_tail) against float64,
    relative to the value, so the negative tail counts as much as the middle: within 1e-5 for |x| < 4 and
    2e-5 down to x = -9 (the fit measured 7e-6 and 1.4e-5 in float32), and within a factor 1.5 down to where
    the CDF leaves float32's normal range (about -13; the GELU is below 1e-18 past -9); exact 0 and 1 at -inf
    and inf, NaN for NaN. A wrong coefficient shows as 1e-3 or more. The exact GELU's bf16 outputs down to
    -9 then round as the float64 GELU's do for all but about one input in 1000 (0.09% measured; torch's
    float32 GELU: 13%, from its cancellation below -4). Both forms:
    the portable one (the interpreter's) and the one with the PTX exp2 (the GPU's, see _ptx_math.ENABLED)."""
    x = _cdf_inputs()
    exact = 0.5 * torch.special.erfc(-x.double() / 2**0.5)
    ours = _cdf_of(x, ptx)
    rel = (ours.double() - exact).abs() / exact.clamp_min(torch.finfo(torch.float32).tiny)
    normal = exact > torch.finfo(torch.float32).tiny  # a subnormal CDF has no relative precision to keep
    assert rel[normal & (x.abs() < 4)].max() < 1e-5
    assert rel[normal & (x >= -9)].max() < 2e-5
    assert rel[normal].max() < 0.5
    gelu_exact = x.double() * exact
    assert ((x * ours).bfloat16() != gelu_exact.bfloat16())[x >= -9].float().mean() < 2e-3
    special = _cdf_of(torch.tensor([-float("inf"), float("inf"), float("nan")], device=DEVICE), ptx)
    assert special[:2].tolist() == [0.0, 1.0] and special[2].isnan()


@pytest.mark.parametrize("ptx", [False, pytest.param(True, marks=pytest.mark.gpu)], ids=["portable", "ptx"])
def test_exact_gelu_relative_accuracy(ptx, monkeypatch):
    """The exact GELU kernel, max(x, 0) - |x| * Phi(-|x|) (activations._act_and_grad), on float32 inputs
    against float64, relative to the value: within 2e-5 from x = -9 up (the tail's own bound carries over,
    since Phi(-|x|) <= 1/2 leaves the subtraction nothing to cancel), 0 at x = 0. Both forms of the exp2."""
    monkeypatch.setattr(act._ptx_math, "ENABLED", ptx)
    x = _cdf_inputs()
    x = x[x.isfinite() & (x >= -9)]
    ours = gelu(x, backend="triton").double()
    exact = x.double() * 0.5 * torch.special.erfc(-x.double() / 2**0.5)
    nonzero = exact != 0
    assert ((ours - exact).abs() / exact.abs())[nonzero].max() < 2e-5
    assert (ours[~nonzero] == 0).all()


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
def test_gpu_auto_plain_gelu_is_ours(approximate):
    """"auto" on CUDA is our kernel (faster than torch's), and so is linear_act's unfused "auto" path."""
    x = torch.randn(1000, 3072, device="cuda", dtype=torch.bfloat16)
    ours = gelu(x, approximate=approximate, backend="triton")
    assert torch.equal(gelu(x, approximate=approximate), ours)
    assert_close(ours, F.gelu(x.float(), approximate=approximate).bfloat16(), torch.bfloat16)
    w = torch.randn(64, 3072, device="cuda", dtype=torch.bfloat16)
    y = F.linear(w, w)
    assert torch.equal(fk_linear_act(w, w, activation="gelu" if approximate == "none" else "gelu_tanh"),
                       gelu(y, approximate=approximate, backend="triton"))


GRAD_CASES = {  # name -> (activation_backward's arguments, the forward op whose gradient it is)
    "swiglu": (dict(activation="silu", gated=True), act.swiglu_ref),
    "geglu_tanh": (dict(activation="gelu_tanh", gated=True), lambda x: act.geglu_ref(x, approximate="tanh")),
    "geglu_erf": (dict(activation="gelu", gated=True), lambda x: act.geglu_ref(x, approximate="none")),
    "silu": (dict(activation="silu", gated=False), lambda x: F.silu(x.float()).to(x.dtype)),
    "gelu_erf": (dict(activation="gelu", gated=False), act.gelu_ref),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("name", list(GRAD_CASES))
def test_activation_backward_gives_the_gradient_and_the_output(name, backend, dtype):
    """One pass gives what a forward and autograd's backward give: the output and the input's gradient, on an
    odd width (no block divides 2 x 77) and a strided output gradient."""
    kwargs, forward = GRAD_CASES[name]
    width = 154 if kwargs["gated"] else 77
    x = (3 * torch.randn(3, 11, width, device=DEVICE, dtype=dtype)).requires_grad_()
    want_out = forward(x)
    dout = torch.randn(3, 11, 2 * want_out.shape[-1], device=DEVICE, dtype=dtype)[..., ::2]
    (want_dx,) = torch.autograd.grad(want_out, x, dout)
    dx, out = fk_activation_backward(x.detach(), dout, backend=backend, **kwargs)
    assert dx.shape == x.shape and out.shape == want_out.shape and dx.dtype == out.dtype == dtype
    assert_close(out, want_out, dtype, name="out")
    assert_close(dx, want_dx, dtype, name="dx")


def test_activation_backward_refuses_what_it_cannot_take():
    x = torch.randn(4, 10, device=DEVICE)
    with pytest.raises(ValueError, match="activation='relu'"):
        fk_activation_backward(x, torch.randn(4, 5, device=DEVICE), activation="relu", gated=True)
    with pytest.raises(ValueError, match=r"dout has shape \(4, 10\), expected \(4, 5\)"):
        fk_activation_backward(x, torch.randn(4, 10, device=DEVICE), activation="silu", gated=True)
    with pytest.raises(ValueError, match="must be even"):
        fk_activation_backward(torch.randn(4, 9, device=DEVICE), torch.randn(4, 4, device=DEVICE), activation="silu",
                               gated=True)


@pytest.mark.parametrize("name", list(OPS))
def test_float64_reference_keeps_float64_precision(name):
    fn, _ = OPS[name]
    x = torch.randn(3, 10, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda t: fn(t, backend="reference"), (x,))


def test_activation_backward_reference_keeps_float64_precision():
    x, dout = torch.randn(3, 10, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    dx, out = fk_activation_backward(x, dout, activation="silu", gated=True, backend="reference")
    xr = x.clone().requires_grad_()
    want = swiglu(xr, backend="reference")
    (want_dx,) = torch.autograd.grad(want, xr, dout)
    assert (out - want).abs().max() < 1e-12 and (dx - want_dx).abs().max() < 1e-12
