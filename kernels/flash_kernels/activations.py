"""Gated and plain activations on the packed [gate; up] projection: SwiGLU, GeGLU, GELU (erf and tanh).

The Triton kernels are elementwise: the forward reads gate and up once and writes the product; the backward
recomputes the activation from the saved input (no activation is stored) and writes d[gate; up] packed, so
the gradient feeds the fused up-projection's backward as one tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _ptx_math
from ._backend import use_triton
from ._launch import lean_launch
from ._pdl import enabled as programmatic_launch_enabled
from ._pdl import launch_options, wait_for_predecessor
from ._triton_compat import tl, triton
from ._triton_utils import as_rows, cdiv, eager_function, next_power_of_2, pick

GELU_APPROXIMATIONS = ("none", "tanh")


def _check_approximate(approximate: str) -> None:
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate={approximate!r}; use one of {GELU_APPROXIMATIONS}")


def _split_gate_up(gate_up: torch.Tensor, op: str) -> tuple[torch.Tensor, torch.Tensor]:
    if gate_up.shape[-1] % 2:
        raise ValueError(f"{op}: the packed [gate; up] dim must be even, got {gate_up.shape[-1]}")
    return gate_up.chunk(2, dim=-1)


def swiglu_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = _split_gate_up(gate_up, "swiglu")
    return (F.silu(gate.float()) * up.float()).to(gate_up.dtype)


def geglu_ref(gate_up: torch.Tensor, *, approximate: str = "tanh") -> torch.Tensor:
    gate, up = _split_gate_up(gate_up, "geglu")
    return (F.gelu(gate.float(), approximate=approximate) * up.float()).to(gate_up.dtype)


def gelu_ref(x: torch.Tensor, *, approximate: str = "none") -> torch.Tensor:
    return F.gelu(x.float(), approximate=approximate).to(x.dtype)



# ----------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_BLOCK = 2048
# A plain (non-gated) activation on contiguous memory runs as one flat row: no per-row tail block half
# masked (11008 = 5 x 2048 + 768), and blocks of its own, (BLOCK, warps) per direction. 32 elements a thread
# in the forward and 16 in the backward (which reads two tensors) keep the most loads in flight: H200, bf16,
# GELU at 16384 x 3072 / 16384 x 4096 / 8192 x 11008 (scripts/profile/activation_sweep.py, session 14): erf
# forward 62.0 / 81.1 / 107.4 us against 72.7 / 97.5 / 128.0 with the former 2048 x 8 warps (torch's kernel:
# 66.6 / 88.0 / 117.4), backward 84.3 / 111.7 / 147.7 against 90.0 / 119.6 / 159.0 (torch's 88.8 / 117.2 /
# 156.5); tanh alike.
_FLAT = {"fwd": (4096, 4), "bwd": (2048, 4)}
_KINDS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
# The GELU kernels' reciprocal and exp2 are ``_ptx_math``'s single instructions on the GPU. H200, erf GELU,
# 16384 x 3072 / 16384 x 4096 / 8192 x 11008 bf16 (activation_sweep.py, session 15): forward 56.0 / 72.9 /
# 97.0 us against 60.0 / 78.8 / 103.9 with the portable forms, backward 73.9 / 97.3 / 129.1 against 82.3 /
# 108.4 / 145.3.


@triton.jit
def _gelu_cdf(x, PTX: tl.constexpr):
    """Phi(x), the standard normal CDF that the exact GELU x * Phi(x) takes, in float32, as erfc(|x|/sqrt2)/2
    mirrored: 1 - e/2 for x >= 0, e/2 below.

    Why not 0.5 * (1 + erf(x / sqrt2)), as torch and libdevice's erff compute it: (1) for negative x the sum
    cancels (torch's float32 GELU is off by 0.7% at x = -4, and returns 0 below about -5.5; its bf16 outputs
    round differently from the exact GELU's for 25% of the inputs in [-9, 9], ours for 0.01%); (2) libdevice's
    erff picks one of two polynomials with a branch, which keeps a thread's elements from interleaving, and
    evaluating both branchlessly takes ~30 instructions an element (counted from the source): an erf GELU
    ran at about 70% of the H200's copy bandwidth, by that count bound by its arithmetic (not profiled). This form is one polynomial of 9 FMAs, an approximate reciprocal and an
    exp2: 16384 x 3072 bf16 in 61.6 us against torch's 65.8 and the branchless erf's 66.8 (H200, session 14);
    with the constants folded into the polynomial (below) the shipped kernel went 62.0 -> 59.9 us (torch's
    66.3). Relative error against float64 on the GPU: 1.1e-6 for |x| < 4, 3.4e-6 down to -9 (float32
    rounding of the exponent).

    erfc(z) = t * exp(-z^2 + P(t)), t = 1 / (1 + z / 2), z >= 0, is Numerical Recipes' "erfcc" (Press et al.),
    fractional error below 1.2e-7 everywhere in exact arithmetic."""
    # With z = |x| / sqrt2: t = 1 / (1 + z / 2), and erfc(z) / 2 = t * 2^(log2(e) * (P(t) - z^2) - 1). The
    # coefficients below are P's times log2(e), the constant term less 1 (the halving), so that no multiply
    # is left outside the polynomial: 3-5% faster than scaling after it (H200, session 14), and more accurate.
    a = tl.abs(x)
    t = _ptx_math.rcp(tl.fma(a, 0.35355339059327373, 1.0), PTX)
    p = tl.fma(0.24651729790196045, t, -1.1861149450768025)
    p = tl.fma(p, t, 2.147474463933521)
    p = tl.fma(p, t, -1.637753152343414)
    p = tl.fma(p, t, 0.40232158165127635)
    p = tl.fma(p, t, -0.2687568603388257)
    p = tl.fma(p, t, 0.1396300565225048)
    p = tl.fma(p, t, 0.5397006155284324)
    p = tl.fma(p, t, 1.4427292039075317)
    p = tl.fma(p, t, -2.825748218405333)
    half_erfc = t * _ptx_math.exp2(tl.fma(-a * 0.7213475204444817, a, p), PTX)  # log2(e) / 2 * x^2 = log2(e) z^2
    return tl.where(x >= 0, 1.0 - half_erfc, half_erfc)


@triton.jit
def _act_and_grad(g, KIND: tl.constexpr, PTX: tl.constexpr):
    """(act(g), act'(g)) in float32. KIND 0: SiLU, 1: exact GELU (erf), 2: tanh-approximated GELU. PTX: the
    exact GELU's reciprocal and exp2 as single instructions (``_ptx_math``). SiLU and the tanh GELU keep the
    portable forms: with the PTX ones the tanh GELU ran no faster (H200, session 16: it is at 0.96-0.99 of
    copy bandwidth either way)."""
    if KIND == 0:
        sig = 1.0 / (1.0 + tl.exp(-g))
        a = g * sig
        da = sig * (1.0 + g * (1.0 - sig))
    elif KIND == 1:
        cdf = _gelu_cdf(g, PTX)
        a = g * cdf
        da = cdf + g * tl.exp(-0.5 * g * g) * 0.3989422804014327
    else:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        t = 2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0  # tanh, written with exp for portability
        a = 0.5 * g * (1.0 + t)
        da = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * g * g)
    return a, da


@triton.jit
def _blocks(F_OUT, BLOCK: tl.constexpr):
    """(row, cols, mask) of this program in a 1-D grid over rows x column blocks (no grid-dim-1 limit)."""
    n_col_blocks = tl.cdiv(F_OUT, BLOCK)
    pid = tl.program_id(0).to(tl.int64)
    row = pid // n_col_blocks
    cols = (pid % n_col_blocks) * BLOCK + tl.arange(0, BLOCK)
    return row, cols, cols < F_OUT


@lean_launch
@triton.jit
def _act_fwd_kernel(X, OUT, stride_x, stride_o, F_OUT, KIND: tl.constexpr, GATED: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr, PTX: tl.constexpr):
    wait_for_predecessor(PDL)
    row, cols, mask = _blocks(F_OUT, BLOCK)
    g = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    out, _ = _act_and_grad(g, KIND, PTX)
    if GATED:
        out = out * tl.load(X + row * stride_x + F_OUT + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, out.to(OUT.dtype.element_ty), mask=mask)


@lean_launch
@triton.jit
def _act_bwd_kernel(
    X, DY, DX, stride_x, stride_dy, stride_dx, F_OUT, KIND: tl.constexpr, GATED: tl.constexpr, BLOCK: tl.constexpr,
    PTX: tl.constexpr,
):
    row, cols, mask = _blocks(F_OUT, BLOCK)
    g = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    a, da = _act_and_grad(g, KIND, PTX)
    if GATED:
        up = tl.load(X + row * stride_x + F_OUT + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + row * stride_dx + cols, (dy * up * da).to(DX.dtype.element_ty), mask=mask)
        tl.store(DX + row * stride_dx + F_OUT + cols, (dy * a).to(DX.dtype.element_ty), mask=mask)
    else:
        tl.store(DX + row * stride_dx + cols, (dy * da).to(DX.dtype.element_ty), mask=mask)


def _launch_grid(rows: int, f_out: int, direction: str) -> tuple[tuple[int], int, int]:
    """Grid, block and warps. A single (flat) row takes the direction's _FLAT block. Otherwise _BLOCK, or half of
    it when that divides the row and _BLOCK does not (GPT-2's 3072 takes 1024 rather than 2048 with its second
    block half masked): smaller blocks would cost more in per-program overhead than the masked lanes they save."""
    if rows == 1:
        flat_block, flat_warps = _FLAT[direction]
        block = min(flat_block, next_power_of_2(f_out))
        return (cdiv(f_out, block),), block, flat_warps if block == flat_block else 4
    block = min(_BLOCK, next_power_of_2(f_out))
    if f_out % _BLOCK and f_out % (_BLOCK // 2) == 0:
        block = _BLOCK // 2
    return (rows * cdiv(f_out, block),), block, 4 if block <= 1024 else 8


def _as_launch_rows(gated: bool, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """2-D views to launch on: one flat row when the activation is plain and every tensor contiguous (the
    elementwise map ignores rows), else (rows, last dim)."""
    if not gated and all(t.is_contiguous() for t in tensors):
        return [t.view(1, -1) for t in tensors]
    return [as_rows(t) for t in tensors]


def _act_fwd(x: torch.Tensor, kind: str, gated: bool) -> torch.Tensor:
    (x2,) = _as_launch_rows(gated, x)
    rows, width = x2.shape
    f_out = width // 2 if gated else width
    out = torch.empty((rows, f_out), device=x.device, dtype=x.dtype)
    grid, block, warps = _launch_grid(rows, f_out, "fwd")
    pdl = programmatic_launch_enabled(x.device)
    _act_fwd_kernel[grid](x2, out, x2.stride(0), out.stride(0), f_out, KIND=_KINDS[kind], GATED=gated, BLOCK=block,
                          PDL=pdl, PTX=_ptx_math.ENABLED, num_warps=warps, **launch_options(pdl))
    return out.view(*x.shape[:-1], x.shape[-1] // 2 if gated else x.shape[-1])


def _act_bwd(x: torch.Tensor, dy: torch.Tensor, kind: str, gated: bool) -> torch.Tensor:
    x2, dy2 = _as_launch_rows(gated, x, dy)
    rows, width = x2.shape
    dx = torch.empty((rows, width), device=x.device, dtype=x.dtype)
    grid, block, warps = _launch_grid(rows, dy2.shape[1], "bwd")
    _act_bwd_kernel[grid](x2, dy2, dx, x2.stride(0), dy2.stride(0), dx.stride(0), dy2.shape[1], KIND=_KINDS[kind],
                          GATED=gated, BLOCK=block, PTX=_ptx_math.ENABLED, num_warps=warps)
    return dx.view(x.shape)


# ----------------------------------------------------------------------------------------------------------
# torch.library registration
# ----------------------------------------------------------------------------------------------------------


@torch.library.custom_op("flash_kernels::activation_fwd", mutates_args=())
def _act_fwd_op(x: torch.Tensor, kind: str, gated: bool) -> torch.Tensor:
    return _act_fwd(x, kind, gated)


@_act_fwd_op.register_fake
def _(x, kind, gated):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2 if gated else x.shape[-1]))


@torch.library.custom_op("flash_kernels::activation_bwd", mutates_args=())
def _act_bwd_op(x: torch.Tensor, dy: torch.Tensor, kind: str, gated: bool) -> torch.Tensor:
    return _act_bwd(x, dy, kind, gated)


@_act_bwd_op.register_fake
def _(x, dy, kind, gated):
    return torch.empty_like(x)


def _act_setup_context(ctx, inputs, output):
    x, kind, gated = inputs
    ctx.save_for_backward(x)
    ctx.kind, ctx.gated = kind, gated


def _act_backward_with(bwd):
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return bwd(x, dy, ctx.kind, ctx.gated), None, None

    return backward


_act_fwd_op.register_autograd(_act_backward_with(_act_bwd_op), setup_context=_act_setup_context)
_act_eager = eager_function("Activation", _act_fwd, _act_setup_context, _act_backward_with(_act_bwd))


# ----------------------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------------------


def _unsupported(x: torch.Tensor) -> str | None:
    if x.dtype not in _DTYPES:
        return f"dtype {x.dtype} (supported: float32, float16, bfloat16)"
    if x.numel() == 0:
        return "an empty input"
    return None


def swiglu(gate_up: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """silu(gate) * up, with gate_up = [gate; up] packed on the last dim. Returns half the last dim."""
    _split_gate_up(gate_up, "swiglu")
    if not use_triton(backend, gate_up, op="swiglu", unsupported=_unsupported(gate_up)):
        return swiglu_ref(gate_up)
    return pick(_act_fwd_op, _act_eager)(gate_up, "silu", True)


def geglu(gate_up: torch.Tensor, *, approximate: str = "tanh", backend: str | None = None) -> torch.Tensor:
    """gelu(gate) * up, with gate_up = [gate; up] packed on the last dim. Returns half the last dim."""
    _check_approximate(approximate)
    _split_gate_up(gate_up, "geglu")
    if not use_triton(backend, gate_up, op="geglu", unsupported=_unsupported(gate_up)):
        return geglu_ref(gate_up, approximate=approximate)
    return pick(_act_fwd_op, _act_eager)(gate_up, "gelu_tanh" if approximate == "tanh" else "gelu", True)


def gelu(x: torch.Tensor, *, approximate: str = "none", backend: str | None = None) -> torch.Tensor:
    """GELU, exact (erf) or tanh-approximated ("gelu_new" in HF).

    "auto" takes our kernel on CUDA: faster than torch's in both directions (H200, session 14: erf forward
    62.0 vs 66.6 us at 16k x 3072 bf16, backward 84.3 vs 88.8; tanh 51.3 vs 57.1 forward), and the erf form
    is more accurate than torch's in the negative tail (see ``_gelu_cdf``), so results differ from torch's
    there, towards the exact GELU."""
    _check_approximate(approximate)
    if not use_triton(backend, x, op="gelu", unsupported=_unsupported(x)):
        return gelu_ref(x, approximate=approximate)
    return pick(_act_fwd_op, _act_eager)(x, "gelu_tanh" if approximate == "tanh" else "gelu", False)
