"""Gated and plain activations on the packed [gate; up] projection: SwiGLU, GeGLU, GELU (erf and tanh).

The Triton kernels are elementwise: the forward reads gate and up once and writes the product; the backward
recomputes the activation from the saved input (no activation is stored) and writes d[gate; up] packed, so
the gradient feeds the fused up-projection's backward as one tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _ptx_math
from ._backend import compute_dtype, use_triton
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
    compute = compute_dtype(gate_up.dtype)
    return (F.silu(gate.to(compute)) * up.to(compute)).to(gate_up.dtype)


def geglu_ref(gate_up: torch.Tensor, *, approximate: str = "tanh") -> torch.Tensor:
    gate, up = _split_gate_up(gate_up, "geglu")
    compute = compute_dtype(gate_up.dtype)
    return (F.gelu(gate.to(compute), approximate=approximate) * up.to(compute)).to(gate_up.dtype)


def gelu_ref(x: torch.Tensor, *, approximate: str = "none") -> torch.Tensor:
    return F.gelu(x.to(compute_dtype(x.dtype)), approximate=approximate).to(x.dtype)



# ----------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_BLOCK = 2048  # the backward by rows (see _launch_grid)
# A plain (non-gated) activation on contiguous memory runs as one flat row: no per-row tail block half
# masked (11008 = 5 x 2048 + 768), and blocks of its own, (BLOCK, warps) per direction. 32 elements a thread
# in the forward and 16 in the backward (which reads two tensors) keep the most loads in flight: on an H200
# (bf16, erf and tanh GELU at 16384 x 3072 / 16384 x 4096 / 8192 x 11008) both directions ran faster than with
# 2048-element blocks of 8 warps, and faster than torch's kernel (``flash-models bench ops --only activations``
# times ours against torch's at 8192 x 11008).
_FLAT = {"fwd": (4096, 4), "bwd": (2048, 4)}
# The forward by rows (the gated activations: gate and up halves of one row) takes 1024-element blocks of 4
# warps. H200, 8192 rows, graph-replayed: GeGLU's forward at 11008 ran faster than with _BLOCK's rule (2048 x 8
# warps: 6 blocks a row, the last 3/8 full), every other case (SwiGLU and GeGLU at widths 3072-14336) within 1%
# of it.
_ROW_BLOCK_FWD = 1024
_KINDS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
# The GELU kernels' exp2 is ``_ptx_math``'s single instruction on the GPU (its docstring says why).


@triton.jit
def _normal_tail(x, PTX: tl.constexpr):
    """Phi(-|x|), the standard normal's lower tail, in float32: 2^P(|x|), P a degree-8 polynomial.

    The exact GELU is x * Phi(x) = max(x, 0) - |x| * Phi(-|x|), so this one exp2 is all its arithmetic
    needs beyond the polynomial: no reciprocal, and no cancellation in the negative tail (where torch's
    0.5 * (1 + erf(x / sqrt2)) is off by 0.7% at x = -4 and returns 0 below about -5.5). The erfc form
    (Numerical Recipes' erfcc: a reciprocal, 10 FMAs and an exp2) is within 1.1e-6 of the CDF for |x| < 4,
    but its two MUFU instructions and ~20 instructions an element are what a fused GEMM + GELU epilogue
    (``linear_act``) would spend beyond a bias-only one. Relative error of
    Phi(-|x|), float32 Horner (scripts/fit_gelu_tail.py; tests/kernels/test_activations.py checks the kernel):
    7e-6 for |x| < 4, 1.4e-5 to 9, then the fit extrapolated: 1.2% to 11 and 26% to 13, where the GELU is
    below 1e-18 and 1e-26. NaN stays NaN; +-inf give 0."""
    # P falls monotonically to 16 (P(16) = -183, below float32's smallest subnormal): clamping there makes
    # Phi(-inf) exactly 0, with no inf - inf inside the polynomial.
    a = tl.minimum(tl.abs(x), 16.0, propagate_nan=tl.PropagateNan.ALL)
    # P's coefficients, highest degree first: scripts/fit_gelu_tail.py's output.
    p = tl.fma(7.463183493428005e-08, a, -3.655749424069654e-06)
    p = tl.fma(p, a, 7.943720265757293e-05)
    p = tl.fma(p, a, -0.0010200459510087967)
    p = tl.fma(p, a, 0.008750857785344124)
    p = tl.fma(p, a, -0.054304637014865875)
    p = tl.fma(p, a, -0.4582415521144867)
    p = tl.fma(p, a, -1.1512949466705322)
    p = tl.fma(p, a, -0.9999966025352478)
    return _ptx_math.exp2(p, PTX)


@triton.jit
def _cdf_from_tail(x, tail):
    """Phi(x) from tail = Phi(-|x|): 1 - tail for x >= 0 (no cancellation there: tail <= 1/2), tail below."""
    return tl.where(x >= 0, 1.0 - tail, tail)


@triton.jit
def _act_and_grad(g, KIND: tl.constexpr, PTX: tl.constexpr):
    """(act(g), act'(g)) in float32. KIND 0: SiLU, 1: exact GELU (erf), 2: tanh-approximated GELU. PTX: the
    exact GELU's exp2 as a single instruction (``_ptx_math``). SiLU and the tanh GELU keep the
    portable forms: with the PTX ones the tanh GELU ran no faster (H200: 0.96-0.99 of copy bandwidth either
    way, the fraction ``flash-models bench ops --only activations`` reports)."""
    if KIND == 0:
        sig = 1.0 / (1.0 + tl.exp(-g))
        a = g * sig
        da = sig * (1.0 + g * (1.0 - sig))
    elif KIND == 1:
        tail = _normal_tail(g, PTX)
        a = tl.fma(-tl.abs(g), tail, tl.maximum(g, 0.0))  # g * Phi(g); see _normal_tail
        cdf = _cdf_from_tail(g, tail)
        da = cdf + g * tl.exp(-0.5 * g * g) * 0.3989422804014327
    else:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        t = 2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0  # tanh, written with exp for portability
        a = 0.5 * g * (1.0 + t)
        da = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * g * g)
    return a, da


@triton.jit
def _blocks(F_OUT, BLOCK: tl.constexpr, REVERSE: tl.constexpr):
    """(row, cols, mask) of this program in a 1-D grid over rows x column blocks (no grid-dim-1 limit). REVERSE:
    the last block first. The backward walks its rows that way: what the kernel before it touched last may still
    sit in L2, and those are the rows it then reads first. In the bench that is the forward's last rows; in a
    model, perhaps the last tiles of the GEMM that wrote the incoming gradient (not measured). H100, GeGLU /
    SwiGLU at 8192 x 11008 bf16, forward + backward graph-replayed: about 1% faster than in row order, the
    backward alone level."""
    n_col_blocks = tl.cdiv(F_OUT, BLOCK)
    pid = tl.program_id(0).to(tl.int64)
    if REVERSE:
        pid = tl.num_programs(0) - 1 - pid
    row = pid // n_col_blocks
    cols = (pid % n_col_blocks) * BLOCK + tl.arange(0, BLOCK)
    return row, cols, cols < F_OUT


@lean_launch
@triton.jit
def _act_fwd_kernel(X, OUT, stride_x, stride_o, F_OUT, KIND: tl.constexpr, GATED: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr, PTX: tl.constexpr):
    wait_for_predecessor(PDL)
    row, cols, mask = _blocks(F_OUT, BLOCK, False)
    g = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    out, _ = _act_and_grad(g, KIND, PTX)
    if GATED:
        out = out * tl.load(X + row * stride_x + F_OUT + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, out.to(OUT.dtype.element_ty), mask=mask)


@lean_launch
@triton.jit
def _act_bwd_kernel(
    X, DY, DX, OUT, stride_x, stride_dy, stride_dx, stride_o, F_OUT, KIND: tl.constexpr, GATED: tl.constexpr,
    STORE_OUT: tl.constexpr, BLOCK: tl.constexpr, PTX: tl.constexpr,
):
    """dx for dy; with STORE_OUT also the forward's output, recomputed from the values loaded anyway."""
    row, cols, mask = _blocks(F_OUT, BLOCK, True)
    g = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    a, da = _act_and_grad(g, KIND, PTX)
    if GATED:
        up = tl.load(X + row * stride_x + F_OUT + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + row * stride_dx + cols, (dy * up * da).to(DX.dtype.element_ty), mask=mask)
        tl.store(DX + row * stride_dx + F_OUT + cols, (dy * a).to(DX.dtype.element_ty), mask=mask)
        if STORE_OUT:
            tl.store(OUT + row * stride_o + cols, (a * up).to(OUT.dtype.element_ty), mask=mask)
    else:
        tl.store(DX + row * stride_dx + cols, (dy * da).to(DX.dtype.element_ty), mask=mask)
        if STORE_OUT:
            tl.store(OUT + row * stride_o + cols, a.to(OUT.dtype.element_ty), mask=mask)


def _launch_grid(rows: int, f_out: int, direction: str) -> tuple[tuple[int], int, int]:
    """Grid, block and warps. A single (flat) row takes the direction's _FLAT block. Otherwise the forward takes
    _ROW_BLOCK_FWD (never halved: 512 at LLaMA-1.1B's 5632 ran 9-15% slower), and the backward _BLOCK, or half
    of it when that divides the row and _BLOCK does not (GPT-2's 3072 takes 1024 rather than 2048 with its
    second block half masked): smaller blocks would cost more in per-program overhead than the masked lanes
    they save."""
    if rows == 1:
        flat_block, flat_warps = _FLAT[direction]
        block = min(flat_block, next_power_of_2(f_out))
        return (cdiv(f_out, block),), block, flat_warps if block == flat_block else 4
    if direction == "fwd":
        block = min(_ROW_BLOCK_FWD, next_power_of_2(f_out))
        return (rows * cdiv(f_out, block),), block, 4
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
    return _act_bwd_launch(x, dy, kind, gated, store_out=False)[0]


def _act_bwd_launch(x: torch.Tensor, dy: torch.Tensor, kind: str, gated: bool, *, store_out: bool):
    """(dx, the forward's output or None): one pass over x and dy."""
    x2, dy2 = _as_launch_rows(gated, x, dy)
    rows, width = x2.shape
    dx = torch.empty((rows, width), device=x.device, dtype=x.dtype)
    out = torch.empty_like(dy2) if store_out else None
    grid, block, warps = _launch_grid(rows, dy2.shape[1], "bwd")
    _act_bwd_kernel[grid](x2, dy2, dx, dx if out is None else out, x2.stride(0), dy2.stride(0), dx.stride(0),
                          0 if out is None else out.stride(0), dy2.shape[1], KIND=_KINDS[kind], GATED=gated,
                          STORE_OUT=store_out, BLOCK=block, PTX=_ptx_math.ENABLED, num_warps=warps)
    return dx.view(x.shape), None if out is None else out.view(dy.shape)


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

    "auto" takes our kernel on CUDA: faster than torch's in both directions (H200; ``flash-models bench ops
    --only activations`` times them), and the erf form
    is more accurate than torch's in the negative tail (see ``_normal_tail``), so results differ from torch's
    there, towards the exact GELU."""
    _check_approximate(approximate)
    if not use_triton(backend, x, op="gelu", unsupported=_unsupported(x)):
        return gelu_ref(x, approximate=approximate)
    return pick(_act_fwd_op, _act_eager)(x, "gelu_tanh" if approximate == "tanh" else "gelu", False)


_GRAD_KINDS = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_tanh"}


def activation_backward_ref(x: torch.Tensor, dout: torch.Tensor, *, activation: str, gated: bool):
    """Reference of ``activation_backward``: autograd through the float32 (float64 for float64 x) reference
    forward."""
    approximate = "tanh" if activation == "gelu_tanh" else "none"
    compute = compute_dtype(x.dtype)
    with torch.enable_grad():
        x32 = x.detach().to(compute).requires_grad_()
        if gated:
            gate, up = _split_gate_up(x32, "activation_backward")
            out = (F.silu(gate) if activation == "silu" else F.gelu(gate, approximate=approximate)) * up
        else:
            out = F.silu(x32) if activation == "silu" else F.gelu(x32, approximate=approximate)
        (dx,) = torch.autograd.grad(out, x32, dout.to(compute))
    return dx.to(x.dtype), out.detach().to(x.dtype)


def activation_backward(x: torch.Tensor, dout: torch.Tensor, *, activation: str, gated: bool,
                        backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient of ``swiglu``/``geglu`` (``gated``: x is the packed [gate; up]) or of a plain SiLU/GELU
    (``activation``: "silu", "gelu" or "gelu_tanh") for the output gradient ``dout``, and the forward's output
    recomputed in the same pass: ``(dx, act(x))``. For a backward that recomputes the activation instead of
    keeping it (the layer after it needs the output for its weight gradient): one kernel where a forward and a
    backward kernel would read x twice."""
    if activation not in _GRAD_KINDS:
        raise ValueError(f"activation_backward: activation={activation!r}; use one of {tuple(_GRAD_KINDS)}")
    if gated:
        _split_gate_up(x, "activation_backward")
    expected = (*x.shape[:-1], x.shape[-1] // 2 if gated else x.shape[-1])
    if tuple(dout.shape) != expected:
        raise ValueError(f"activation_backward: dout has shape {tuple(dout.shape)}, expected {expected} for x of "
                         f"shape {tuple(x.shape)} (gated={gated})")
    if not use_triton(backend, x, op="activation_backward", unsupported=_unsupported(x)):
        return activation_backward_ref(x, dout, activation=activation, gated=gated)
    return _act_bwd_launch(x, dout.to(x.dtype), _GRAD_KINDS[activation], gated, store_out=True)
