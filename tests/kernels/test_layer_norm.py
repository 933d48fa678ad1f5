"""layer_norm / rms_norm / their dual variants: Triton kernels (the interpreter on CPU) against the reference,
including exact dropout replay through the returned keep mask, every gradient, the wide-row loop path and
torch.compile."""

import importlib

import pytest
import torch
import torch.nn.functional as F

from flash_kernels import layer_norm, layer_norm_dual, rms_norm, rms_norm_dual
from flash_kernels._testing import assert_close
from flash_kernels.layer_norm_ref import layer_norm_dual_ref, layer_norm_ref

ln = importlib.import_module("flash_kernels.layer_norm")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# dtype and its tolerance scale for gradients (they go through one more reduction than the output).
DTYPES = [(torch.float32, 2.0), (torch.float16, 2.0), (torch.bfloat16, 2.0)]


def _inputs(shape, dtype, *, residual, rowscale, dual, bias=True, residual_dtype=None):
    n = shape[-1]
    x = torch.randn(shape, dtype=dtype, device=DEVICE, requires_grad=True)
    r = torch.randn(shape, dtype=residual_dtype or dtype, device=DEVICE, requires_grad=True) if residual else None
    params = [torch.randn(n, device=DEVICE, requires_grad=True) for _ in range(4 if dual else 2)]
    if not bias:
        params[1::2] = [None] * len(params[1::2])
    rs = torch.rand(shape[:-1], device=DEVICE) + 0.5 if rowscale else None
    return x, r, params, rs


def _check(is_rms, dtype, grad_scale, shape=(3, 5, 77), *, dual=False, dropout_p=0.0, residual=False,
           rowscale=False, prenorm=False, residual_in_fp32=False, zero_centered_weight=False, bias=True, out_dtype=None):
    x, r, params, rs = _inputs(shape, dtype, residual=residual, rowscale=rowscale, dual=dual, bias=bias)
    kw = dict(residual=r, dropout_p=dropout_p, rowscale=rs, prenorm=prenorm, residual_in_fp32=residual_in_fp32,
              zero_centered_weight=zero_centered_weight, out_dtype=out_dtype)
    if dual:
        fn = rms_norm_dual if is_rms else layer_norm_dual
        ref_fn = layer_norm_dual_ref
    else:
        fn = rms_norm if is_rms else layer_norm
        ref_fn = layer_norm_ref
    *out, mask = fn(x, *params, **kw, return_dropout_mask=True, backend="triton")
    ref = ref_fn(x, *params, **kw, dropout_mask=mask, is_rms_norm=is_rms)
    ref = list(ref) if isinstance(ref, tuple) else [ref]
    assert len(out) == len(ref)
    if dropout_p:
        keep = mask.float().mean().item()
        assert abs(keep - (1 - dropout_p)) < 0.1, f"keep fraction {keep} far from {1 - dropout_p}"
    for o, rf in zip(out, ref):
        assert o.dtype == rf.dtype
        assert_close(o, rf, o.dtype if o.dtype != torch.float32 else dtype, name="output")
    grads_out = [torch.randn_like(o) for o in out]
    inputs = [t for t in [x, r, *params] if t is not None]
    got = torch.autograd.grad(out, inputs, grads_out)
    want = torch.autograd.grad(ref, inputs, grads_out)
    for name, g, w in zip(["x", "residual", "w", "b", "w1", "b1"], got, want):
        assert_close(g, w, dtype, scale=grad_scale, name=f"grad {name}")


@pytest.mark.parametrize("dtype,grad_scale", DTYPES)
@pytest.mark.parametrize("is_rms", [False, True])
def test_plain(is_rms, dtype, grad_scale):
    _check(is_rms, dtype, grad_scale, shape=(3, 123, 77))


@pytest.mark.parametrize("dtype,grad_scale", DTYPES)
@pytest.mark.parametrize("is_rms", [False, True])
def test_dropout_residual_rowscale_prenorm(is_rms, dtype, grad_scale):
    _check(is_rms, dtype, grad_scale, dropout_p=0.2, residual=True, rowscale=True, prenorm=True)


@pytest.mark.parametrize("is_rms", [False, True])
def test_residual_in_fp32_zero_centered_out_dtype(is_rms):
    _check(is_rms, torch.bfloat16, 2.0, residual=True, prenorm=True, residual_in_fp32=True,
           zero_centered_weight=True, out_dtype=torch.float32, bias=False)


@pytest.mark.parametrize("is_rms", [False, True])
def test_dual(is_rms):
    _check(is_rms, torch.float32, 2.0, dual=True, dropout_p=0.1, residual=True, prenorm=True)


@pytest.mark.parametrize("is_rms", [False, True])
def test_wide_rows_loop_path(is_rms, monkeypatch):
    """Rows wider than the single-block limit loop over column blocks (the path of rows up to 64k)."""
    # Tile limits, not settings: the column loop of 64k-wide rows, reached at a width the interpreter runs fast.
    monkeypatch.setattr(ln, "_MAX_FUSED_FWD", 32)
    monkeypatch.setattr(ln, "_MAX_FUSED_BWD", 32)
    monkeypatch.setattr(ln, "_LOOP_BLOCK", 32)
    _check(is_rms, torch.float32, 2.0, shape=(4, 77), dual=True, dropout_p=0.1, residual=True, rowscale=True,
           prenorm=True)


def test_dropout_is_random_and_replayable():
    x = torch.randn(4, 64, device=DEVICE)
    w = torch.ones(64, device=DEVICE)
    _, m1 = layer_norm(x, w, dropout_p=0.5, return_dropout_mask=True, backend="triton")
    _, m2 = layer_norm(x, w, dropout_p=0.5, return_dropout_mask=True, backend="triton")
    assert not torch.equal(m1, m2), "two calls drew the same dropout mask"


@pytest.mark.parametrize("prenorm", [False, True])
def test_stream_written_only_when_read(prenorm, monkeypatch):
    """A residual stream is written when prenorm returns it or autograd records the call, not otherwise (a
    post-norm block's inference): one tensor written instead of two."""
    stored = []
    real_fwd = ln._norm_fwd  # whether the kernel writes the stream shows in no output: watched at the launcher

    def spy(*args):
        out = real_fwd(*args)
        stored.append(out[2] is not None)
        return out

    monkeypatch.setattr(ln, "_norm_fwd", spy)
    monkeypatch.setattr(ln, "_norm_eager", ln.eager_function("FusedNorm", spy, ln._norm_setup_context,
                                                            ln._norm_backward_with(ln._norm_bwd, sums_in_param_dtypes=True)))
    x, r, w = torch.randn(4, 96, device=DEVICE), torch.randn(4, 96, device=DEVICE), torch.randn(96, device=DEVICE)
    with torch.no_grad():
        layer_norm(x, w, residual=r, prenorm=prenorm, backend="triton")
    layer_norm(x, w.requires_grad_(), residual=r, prenorm=prenorm, backend="triton")
    assert stored == [prenorm, True]


def test_matches_torch_modules():
    """The functional form equals torch.nn.LayerNorm / RMSNorm modules with the same parameters."""
    x = torch.randn(3, 11, 77, device=DEVICE)
    ln_mod = torch.nn.LayerNorm(77, eps=1e-5, device=DEVICE)
    rms_mod = torch.nn.RMSNorm(77, eps=1e-6, device=DEVICE)
    with torch.no_grad():
        ln_mod.weight.normal_(), ln_mod.bias.normal_(), rms_mod.weight.normal_()
    assert_close(layer_norm(x, ln_mod.weight, ln_mod.bias, backend="triton"), ln_mod(x), torch.float32, name="ln")
    assert_close(rms_norm(x, rms_mod.weight, backend="triton"), rms_mod(x), torch.float32, name="rms")


def test_compile_fullgraph():
    """A pre-norm residual block traces through torch.compile without graph breaks."""

    def block(hidden, residual, w, lin):
        normed, residual = rms_norm(hidden, w, residual=residual, prenorm=True, backend="triton")
        return F.linear(normed, lin), residual

    x, r = torch.randn(2, 9, 64, device=DEVICE), torch.randn(2, 9, 64, device=DEVICE)
    w = torch.randn(64, device=DEVICE, requires_grad=True)
    lin = torch.randn(64, 64, device=DEVICE, requires_grad=True)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager" if DEVICE == "cpu" else "inductor")
    got, want = compiled(x, r, w, lin), block(x, r, w, lin)
    for g, wv in zip(got, want):
        assert_close(g, wv, torch.float32)
    (got[0].sum() + got[1].sum()).backward()
    assert w.grad is not None and torch.isfinite(w.grad).all()


def test_compile_dual_norm_gradients_match_eager():
    """Under torch.compile the backward is the custom op, whose four weight/bias gradients must be separate
    tensors (custom-op outputs may not alias): same gradients as the eager path."""
    x = torch.randn(2, 9, 64, device=DEVICE, requires_grad=True)
    params = [torch.randn(64, device=DEVICE, requires_grad=True) for _ in range(4)]

    def f(x, w, b, w1, b1):
        y, y1 = layer_norm_dual(x, w, b, w1, b1, backend="triton")
        return (y * y1).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager" if DEVICE == "cpu" else "inductor")
    got = torch.autograd.grad(compiled(x, *params), (x, *params))
    want = torch.autograd.grad(f(x, *params), (x, *params))
    for g, w in zip(got, want):
        assert_close(g, w, torch.float32)


def test_bad_inputs():
    x, w = torch.randn(4, 16, device=DEVICE), torch.randn(16, device=DEVICE)  # on a GPU machine, CUDA tensors
    with pytest.raises(ValueError, match="weight shape"):
        layer_norm(x, torch.randn(15, device=DEVICE), backend="triton")
    with pytest.raises(ValueError, match="residual shape"):
        rms_norm(x, w, residual=torch.randn(4, 15, device=DEVICE), backend="triton")
    with pytest.raises(ValueError, match="dropout_p"):
        layer_norm(x, w, dropout_p=1.0, backend="triton")
    with pytest.raises(ValueError, match="rowscale"):
        layer_norm(x, w, rowscale=torch.rand(3, device=DEVICE), backend="triton")
    with pytest.raises(ValueError, match="dtype"):
        layer_norm(x.double(), w, backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("n", [4096, 5120, 65536])  # 5120: the RMS backward's 4-warp case (_bwd_warps)
def test_gpu_real_size(n):
    rows = 16384 if n <= 5120 else 256
    _check(True, torch.bfloat16, 2.0, shape=(rows, n), dropout_p=0.1, residual=True, prenorm=True,
           residual_in_fp32=True)
    _check(False, torch.bfloat16, 2.0, shape=(rows, n), dual=True, residual=True, prenorm=True)


def test_rows_in_rows_out_add_no_view_to_the_autograd_graph():
    """A 2-D input reaches the kernel and comes back without a view: each view, even to the same shape, is one
    more autograd node, a backward step of host time for an eager norm (host-bound at (16384, 4096))."""
    x = torch.randn(4, 96, device=DEVICE, requires_grad=True)
    w = torch.randn(96, device=DEVICE, requires_grad=True)
    y = rms_norm(x, w, backend="triton")
    assert type(y.grad_fn).__name__.startswith("FusedNorm")
    inputs = [type(node).__name__ for node, _ in y.grad_fn.next_functions if node is not None]
    assert inputs == ["AccumulateGrad", "AccumulateGrad"]
    y3 = rms_norm(x.view(2, 2, 96), w, backend="triton")  # other shapes still come back in their own
    assert y3.shape == (2, 2, 96)
    assert_close(y3.view(4, 96), y, torch.float32, name="3-D vs 2-D")


def test_an_eager_call_records_one_backward_node():
    """Batched (3-D) inputs and outputs go to rows and back inside the autograd.Function: the call is one node
    whose inputs are the leaves themselves (a view around it would be one more node, host time per step)."""
    x = torch.randn(3, 5, 64, device=DEVICE, requires_grad=True)
    r = torch.randn(3, 5, 64, device=DEVICE, requires_grad=True)
    w = torch.randn(64, device=DEVICE, requires_grad=True)
    y, h = rms_norm(x, w, residual=r, prenorm=True, backend="triton")
    assert y.shape == h.shape == x.shape
    assert y.grad_fn is h.grad_fn and type(y.grad_fn).__name__ == "FusedNormBackward"
    leaves = {type(fn).__name__ for fn, _ in y.grad_fn.next_functions if fn is not None}
    assert leaves == {"AccumulateGrad"}


@pytest.mark.parametrize("op", [layer_norm, rms_norm])
def test_float64_reference_keeps_float64_precision(op):
    """float64 inputs compute in float64 (torch.autograd.gradcheck's precision), with the residual stream too."""
    x, res = (torch.randn(3, 11, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w, b = (torch.randn(11, dtype=torch.float64, requires_grad=True) for _ in range(2))
    torch.autograd.gradcheck(
        lambda x, w, b, res: op(x, w, b, residual=res, residual_in_fp32=True, prenorm=True, backend="reference"),
        (x, w, b, res))
    y, stream = op(x, w, b, residual=res, prenorm=True, residual_in_fp32=True, backend="reference")
    assert stream.dtype == torch.float64
    h = x + res
    want = F.layer_norm(h, (11,), w, b) if op is layer_norm else F.rms_norm(h, (11,), w, 1e-6) + b
    assert (y - want).abs().max() < 1e-12


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_weight_none_scales_by_nothing(backend, zero_centered):
    """As torch's norms take weight=None; zero-centred or not, no weight is the identity scale."""
    x = torch.randn(4, 3, 19, device=DEVICE, requires_grad=True)
    b = torch.randn(19, device=DEVICE, requires_grad=True)
    got = (layer_norm(x, None, b, zero_centered_weight=zero_centered, backend=backend),
           rms_norm(x, None, zero_centered_weight=zero_centered, backend=backend))
    want = (F.layer_norm(x, (19,), None, b, 1e-5), F.rms_norm(x, (19,), None, 1e-6))
    g = torch.randn_like(x)
    for ours, ref in zip(got, want):
        assert_close(ours, ref, torch.float32)
        params = (x, b) if ref is want[0] else (x,)
        for a, r in zip(torch.autograd.grad(ours, params, g), torch.autograd.grad(ref, params, g)):
            assert_close(a, r, torch.float32)


def test_parameters_on_another_device_are_named():
    x = torch.randn(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight is on meta"):
        layer_norm(x, torch.ones(8, device="meta"))
    with pytest.raises(ValueError, match="residual is on meta"):
        rms_norm(x, torch.ones(8, device=DEVICE), residual=torch.ones(3, 8, device="meta"))
