"""LayerNorm and RMSNorm fused with dropout, residual add and row scaling.

One pass computes, per row:  h = dropout(x * rowscale) + residual;  y = norm(h) * weight + bias.
With ``prenorm=True`` the new residual stream ``h`` is returned too, which is what pre-norm blocks need:
the block contract ``(hidden, residual)`` from DESIGN.md maps straight onto this op.
The dual variants (``layer_norm_dual``, ``rms_norm_dual``) normalize ``h`` once and apply two weight/bias sets,
for parallel-residual blocks (GPT-J, GPT-NeoX) whose attention and MLP branches read differently-normed copies.

Dropout in the kernels draws a Philox mask from a seed kept on the device; the backward regenerates the mask
from that seed rather than storing it. ``return_dropout_mask=True`` also returns the mask, so the reference
can replay it exactly.

This module holds the launchers (with their launch plans), the custom ops and the public functions; the
reference is in ``layer_norm_ref`` and the Triton kernels in ``layer_norm_kernels``.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ._backend import records_grad, use_triton
from ._launch_plans import LaunchPlans, all_aligned, bind_launch, present_slots
from ._pdl import enabled as programmatic_launch_enabled
from ._pdl import launch_options
from ._triton_utils import (
    as_rows, cdiv, dropout_seed, eager_function, next_power_of_2, num_programs, or_dummy,
    or_placeholder, placeholder, unit_last_stride, warps_for_block,
)
from .layer_norm_kernels import _norm_bwd_kernel, _norm_fwd_kernel
from .layer_norm_ref import layer_norm_dual_ref, layer_norm_ref
from .partial_sums import sum_partials


# Rows up to these widths are held whole in registers (one read of the inputs); wider rows loop over blocks of
# _LOOP_BLOCK, recomputing h from the inputs on each pass. The backward also keeps weight-gradient partials in
# registers, so its single-block limit is lower. Module-level so tests can shrink them to reach the loop path.
_MAX_FUSED_FWD = 16384
_MAX_FUSED_BWD = 8192
_LOOP_BLOCK = 4096
MAX_WIDTH = 65536
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------


def _block(n: int, max_fused: int) -> tuple[int, bool]:
    """(BLOCK_N, SINGLE_BLOCK) for a row of n elements."""
    if next_power_of_2(n) <= max_fused:
        return next_power_of_2(n), True
    return min(_LOOP_BLOCK, next_power_of_2(max_fused)), False


# The launch geometry depends on the shape and device alone, so it is worked out once per shape: an eager
# norm's forward + backward is host-bound at (16384, 4096) on an H100 (``scripts/profile/op_kernels.py norms``
# prints its kernel time against its wall time), and uncached this arithmetic is a tenth of its Python.
@functools.cache
def _fwd_plan(n: int) -> tuple[int, bool, int]:
    """(BLOCK_N, SINGLE_BLOCK, num_warps) of the forward kernel for rows of n elements."""
    block, single = _block(n, _MAX_FUSED_FWD)
    if single and block == 1024:
        # Rows of 513-1024 (BERT, GPT-2): 2 warps, not 4. H200, bf16, x + residual -> y: faster at 16384 x 768,
        # level at 9216 x 1024 and with the stream stored. Several rows per program (a (rows, BLOCK_N) tile)
        # gained nothing.
        return block, single, 2
    return block, single, warps_for_block(block, max_warps=8 if block <= 8192 else 16)


@functools.lru_cache(maxsize=256)
def _bwd_plan(m: int, n: int, device: torch.device, is_rms: bool,
              residual_grad: bool) -> tuple[int, int, int, bool, int, int]:
    """(programs, rows per program, BLOCK_N, SINGLE_BLOCK, num_warps, row stages) of the backward kernel."""
    # Narrow rows leave each program little to overlap: 8 programs per SM instead of 4 make the H200's
    # (16384, 768) bf16 backward faster; at 2048 and wider, 4 per SM stay best (measured).
    programs = max(1, min(m, num_programs(device, per_sm=8 if n <= 1024 else 4)))
    rows_per_program = cdiv(m, programs)
    block, single = _block(n, _MAX_FUSED_BWD)
    warps = _bwd_warps(block, single, is_rms and residual_grad)
    return cdiv(m, rows_per_program), rows_per_program, block, single, warps, _bwd_row_stages(block, is_rms)


def _bwd_row_stages(block: int, is_rms: bool) -> int:
    """Software-pipelining stages of the single-block backward's loop over a program's rows (the next rows'
    loads issued while this one reduces): 3 for layer norm over rows of 2049-4096, else none. H200, 16384 x
    4096: 3 stages ran faster than 1 with a bf16 or fp32 weight, with or without the residual's gradient.
    Elsewhere it does not hold up: layer norm at 768 and 2048 wide gains with a bf16 weight but loses with an
    fp32 one; RMS norms gain little; and 3 stages of 8192-wide rows of a dual norm overflow shared memory."""
    return 3 if not is_rms and block == 4096 else 1


def _bwd_warps(block: int, single: bool, rms_with_residual: bool) -> int:
    """num_warps of the backward kernel (a function of its own, so that a sweep can patch it)."""
    if rms_with_residual and single and block == 8192:
        # An RMS norm that also carries the residual stream's gradient, over rows of 4097-8192: 4 warps, not 8.
        # H200, 16384 rows: faster at 5120 and 8192 wide, with a bf16 or an fp32 weight. Without the
        # residual, or for layer norm, 8 warps stay the best or within 5%; at 4096 wide the best moves with
        # the weight's dtype (2, 8 or 16 warps), so 8 stays there.
        return 4
    return warps_for_block(block, max_warps=8 if block <= 8192 else 16)


def _stream_exists(residual, rowscale, dropout_p) -> bool:
    """Whether h differs from x: something is added to x or scales it. Only then is there a residual stream
    to store (prenorm returns it, the backward reads it); otherwise it is x itself."""
    return residual is not None or dropout_p > 0.0 or rowscale is not None


def _dtype_of(t):
    return None if t is None else t.dtype


def _stride_and_dtype(t):
    return None if t is None else (t.stride(0), t.dtype)


def _current_device(t):
    """Part of a plan key: a compiled kernel is loaded per device, and launches go to the current one."""
    return torch.cuda.current_device() if t.is_cuda else None


# Launches kept per call signature (``_launch_plans``): an eager norm's forward + backward is host-bound at
# (16384, 4096) (H200; ``scripts/profile/op_kernels.py norms`` prints kernel against wall time), and in a
# cProfile of it (``scripts/profile/host_cost.py``) the three launches' keys (``LeanKernel.launch_key``) are the
# largest item of our own without the plans.
# Calls with dropout, a rowscale or a returned mask take the full path (more tensors to take). The tensors a
# forward plan takes, where present, sit at these positions of the kernel's arguments: X, RES, W, B, W1, B1,
# Y, Y1, RES_OUT, MEAN, RSTD.
_FWD_PLANS = LaunchPlans()
_FWD_TENSOR_POSITIONS = (0, 1, 4, 5, 6, 7, 8, 9, 10, 12, 13)


def _fwd_plan_key(x, weight, bias, weight1, bias1, residual, eps, is_rms_norm, zero_centered_weight,
                  residual_dtype, out_dtype, store_residual, pdl):
    """Every value the forward's launch arguments derive from other than the tensors a plan takes; None when
    an input is not 16-byte aligned. (Outputs are fresh allocations, aligned and contiguous.)"""
    if not all_aligned(x, residual, weight, bias, weight1, bias1):
        return None
    return (x.shape, x.stride(0), x.dtype, x.device, _current_device(x), _stride_and_dtype(residual),
            weight.dtype, _dtype_of(bias), _dtype_of(weight1), _dtype_of(bias1), eps, is_rms_norm,
            zero_centered_weight, residual_dtype, out_dtype, store_residual, pdl)


def _norm_fwd(
    x, weight, bias, weight1, bias1, residual, rowscale, eps, dropout_p, is_rms_norm, zero_centered_weight,
    residual_dtype, out_dtype, store_residual, store_mask,
):
    """x, residual: (M, N) with unit last stride. Returns y, y1, residual_out, mean, rstd, seed, mask, with None
    for those this call does not make (allocating nothing for them: the eager path's host cost; an RMS norm
    has no mean). ``store_residual`` may be off even where a residual stream exists (``_stream_exists``):
    then it is computed and normalized as stored, but not written."""
    M, N = x.shape
    dev = x.device
    y = torch.empty((M, N), device=dev, dtype=out_dtype)
    y1 = torch.empty((M, N), device=dev, dtype=out_dtype) if weight1 is not None else None
    res_out = torch.empty((M, N), device=dev, dtype=residual_dtype) if store_residual else None
    mean = None if is_rms_norm else torch.empty((M,), device=dev, dtype=torch.float32)  # RMS has none
    rstd = torch.empty((M,), device=dev, dtype=torch.float32)
    seed = dropout_seed(dev) if dropout_p > 0.0 else None
    mask = torch.empty((M, N), device=dev, dtype=torch.uint8) if store_mask else None
    pdl = programmatic_launch_enabled(dev)
    plain = dropout_p == 0.0 and rowscale is None and not store_mask and x.is_cuda
    key = _fwd_plan_key(x, weight, bias, weight1, bias1, residual, eps, is_rms_norm, zero_centered_weight,
                        residual_dtype, out_dtype, store_residual, pdl) if plain else None
    tensors = (x, residual, weight, bias, weight1, bias1, y, y1, res_out, mean, rstd)
    plan = _FWD_PLANS.get(key)
    if plan is not None:
        plan(*(t for t in tensors if t is not None))
        return y, y1, res_out, mean, rstd, seed, None
    block, single, warps = _fwd_plan(N)
    grid = (M,)
    args = (
        x, residual, rowscale, or_dummy(seed, dev, torch.int64), weight, bias, weight1, bias1, y,
        or_dummy(y1, dev, out_dtype), or_dummy(res_out, dev, residual_dtype), or_dummy(mask, dev, torch.uint8),
        or_dummy(mean, dev, torch.float32), rstd, x.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0),
        y1.stride(0) if weight1 is not None else 0, res_out.stride(0) if store_residual else 0,
        N, eps, dropout_p,
    )
    kwargs = dict(
        IS_RMS=is_rms_norm, HAS_RES=residual is not None, HAS_ROWSCALE=rowscale is not None,
        HAS_DROPOUT=dropout_p > 0.0, HAS_B=bias is not None, HAS_W1=weight1 is not None,
        HAS_B1=bias1 is not None, HAS_STREAM=_stream_exists(residual, rowscale, dropout_p),
        STORE_RES=store_residual, STORE_MASK=store_mask,
        ZERO_CENTERED=zero_centered_weight, BLOCK_N=block, SINGLE_BLOCK=single, PDL=pdl,
        num_warps=warps, **launch_options(pdl),
    )
    _norm_fwd_kernel[grid](*args, **kwargs)
    _FWD_PLANS.consider(key, lambda: bind_launch(_norm_fwd_kernel, grid, args, kwargs,
                                                 present_slots(_FWD_TENSOR_POSITIONS, tensors)))
    return y, y1, res_out, mean, rstd, seed, None if mask is None else mask.view(torch.bool)


def _norm_fwd_shaped(x, weight, bias, weight1, bias1, residual, *args):
    """``_norm_fwd`` on x and residual of any rank (..., N), its outputs in x's shape. Eager calls take this form:
    the views to rows and back happen inside the autograd.Function, where autograd records none of them (made
    around it, each would be a backward node of its own: four per call of a norm with a residual)."""
    shape = x.shape
    y, y1, res_out, mean, rstd, seed, mask = _norm_fwd(
        as_rows(x), weight, bias, weight1, bias1, None if residual is None else as_rows(residual), *args)
    return (y.view(shape), None if y1 is None else y1.view(shape), None if res_out is None else res_out.view(shape),
            mean, rstd, seed, None if mask is None else mask.view(shape))


# The tensors a backward plan takes, where present: H, W, W1, DY, DY1, DRES_OUT, MEAN, RSTD, DX, DRES, DW, DB, DW1,
# DB1 (the last four: this call's partial-sum buffers).
_BWD_PLANS = LaunchPlans()
_BWD_TENSOR_POSITIONS = (0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12, 13, 14, 15)


def _bwd_plan_key(h, dy, dy1, dres_out, weight, weight1, mean, rstd, is_rms_norm, zero_centered_weight, has_bias,
                  has_bias1, has_residual, x_dtype, residual_dtype):
    if not all_aligned(h, dy, dy1, dres_out, weight, weight1, mean, rstd):
        return None
    return (h.shape, h.stride(0), h.dtype, h.device, _current_device(h), _stride_and_dtype(dy),
            _stride_and_dtype(dy1), _stride_and_dtype(dres_out), weight.dtype, _dtype_of(weight1), mean is None,
            is_rms_norm, zero_centered_weight, has_bias, has_bias1, has_residual, x_dtype, residual_dtype)


def _norm_bwd(
    h, dy, dy1, dres_out, weight, weight1, mean, rstd, rowscale, seed, dropout_p, is_rms_norm,
    zero_centered_weight, has_bias, has_bias1, has_residual, x_dtype, residual_dtype, param_dtypes=None,
):
    """Gradients of the fused norm. h is the saved residual stream (M, N). Returns dx, dres, dw, db, dw1, db1,
    with None for those absent (dres is dx itself where they are equal). The parameter gradients are float32,
    or with ``param_dtypes`` (dtypes of weight, bias, weight1, bias1) stored in those dtypes by the sum itself,
    which saves the eager backward a cast launch per bf16 parameter."""
    M, N = h.shape
    dev = h.device
    programs, rows_per_program, block, single, warps, stages = _bwd_plan(M, N, dev, is_rms_norm, dres_out is not None)
    dx = torch.empty((M, N), device=dev, dtype=x_dtype)
    # The residual gradient equals dh; it needs its own buffer only when dx differs from dh.
    store_dres = has_residual and (dropout_p > 0.0 or rowscale is not None or residual_dtype != x_dtype)
    dres = torch.empty((M, N), device=dev, dtype=residual_dtype) if store_dres else None

    # Per-program partial sums of dw, db, dw1, db1 (those present) share one buffer, summed by one launch.
    present = (True, has_bias, weight1 is not None, weight1 is not None and has_bias1)
    # The single-block kernel writes every partial; the loop path accumulates into them.
    alloc = torch.empty if single else torch.zeros
    partials = alloc((sum(present), programs, N), device=dev, dtype=torch.float32)
    views = iter(partials)
    dw_p, db_p, dw1_p, db1_p = (next(views) if p else None for p in present)
    plain = dropout_p == 0.0 and rowscale is None and h.is_cuda
    key = _bwd_plan_key(h, dy, dy1, dres_out, weight, weight1, mean, rstd, is_rms_norm, zero_centered_weight,
                        has_bias, has_bias1, has_residual, x_dtype, residual_dtype) if plain else None
    tensors = (h, weight, weight1, dy, dy1, dres_out, mean, rstd, dx, dres, dw_p, db_p, dw1_p, db1_p)
    plan = _BWD_PLANS.get(key)
    if plan is not None:
        plan(*(t for t in tensors if t is not None))
    else:
        grid = (programs,)
        args = (
            h, weight, weight1, dy, dy1, dres_out, or_dummy(mean, dev, torch.float32), rstd, rowscale,
            or_dummy(seed, dev, torch.int64), dx,
            or_dummy(dres, dev, residual_dtype), dw_p, *(or_dummy(p, dev, torch.float32) for p in (db_p, dw1_p, db1_p)),
            h.stride(0), dy.stride(0), dy1.stride(0) if dy1 is not None else 0,
            dres_out.stride(0) if dres_out is not None else 0, dx.stride(0), dres.stride(0) if store_dres else 0,
            M, N, rows_per_program, dropout_p,
        )
        kwargs = dict(
            IS_RMS=is_rms_norm, HAS_B=has_bias, HAS_W1=weight1 is not None, HAS_B1=has_bias1,
            HAS_DRES_OUT=dres_out is not None, STORE_DRES=store_dres, HAS_ROWSCALE=rowscale is not None,
            HAS_DROPOUT=dropout_p > 0.0, ZERO_CENTERED=zero_centered_weight, BLOCK_N=block, SINGLE_BLOCK=single,
            ROW_STAGES=stages, num_warps=warps,
        )
        _norm_bwd_kernel[grid](*args, **kwargs)
        _BWD_PLANS.consider(key, lambda: bind_launch(_norm_bwd_kernel, grid, args, kwargs,
                                                     present_slots(_BWD_TENSOR_POSITIONS, tensors)))
    if has_residual and not store_dres:
        dres = dx
    grad_dtypes = tuple(dt for dt, p in zip(param_dtypes, present) if p) if param_dtypes else None
    sums = iter(sum_partials(partials, grad_dtypes))
    dw, db, dw1, db1 = (next(sums) if p else None for p in present)
    return dx, dres, dw, db, dw1, db1


# ----------------------------------------------------------------------------------------------------------
# torch.library registration: opaque to torch.compile, with fake (shape) implementations and autograd
# ----------------------------------------------------------------------------------------------------------


@torch.library.custom_op("flash_kernels::norm_fwd", mutates_args=())
def _norm_fwd_op(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], weight1: Optional[torch.Tensor],
    bias1: Optional[torch.Tensor], residual: Optional[torch.Tensor], rowscale: Optional[torch.Tensor], eps: float,
    dropout_p: float, is_rms_norm: bool, zero_centered_weight: bool, residual_dtype: torch.dtype,
    out_dtype: torch.dtype, store_residual: bool, store_mask: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    y, y1, res_out, mean, rstd, seed, mask = _norm_fwd(
        x, weight, bias, weight1, bias1, residual, rowscale, eps, dropout_p, is_rms_norm, zero_centered_weight,
        residual_dtype, out_dtype, store_residual, store_mask,
    )
    dev = x.device
    return (y, or_placeholder(y1, dev, out_dtype), or_placeholder(res_out, dev, residual_dtype), or_placeholder(mean, dev), rstd,
            or_placeholder(seed, dev, torch.int64), or_placeholder(mask, dev, torch.bool))


@_norm_fwd_op.register_fake
def _(x, weight, bias, weight1, bias1, residual, rowscale, eps, dropout_p, is_rms_norm, zero_centered_weight,
      residual_dtype, out_dtype, store_residual, store_mask):
    M, N = x.shape
    dev = x.device

    def full(present, dtype):
        return x.new_empty((M, N), dtype=dtype) if present else placeholder(dev, dtype)

    return (
        full(True, out_dtype), full(weight1 is not None, out_dtype), full(store_residual, residual_dtype),
        x.new_empty((0,) if is_rms_norm else (M,), dtype=torch.float32), x.new_empty((M,), dtype=torch.float32),
        x.new_empty((1,) if dropout_p > 0.0 else (0,), dtype=torch.int64), full(store_mask, torch.bool),
    )


@torch.library.custom_op("flash_kernels::norm_bwd", mutates_args=())
def _norm_bwd_op(
    h: torch.Tensor, dy: torch.Tensor, dy1: Optional[torch.Tensor], dres_out: Optional[torch.Tensor],
    weight: torch.Tensor, weight1: Optional[torch.Tensor], mean: torch.Tensor, rstd: torch.Tensor,
    rowscale: Optional[torch.Tensor], seed: torch.Tensor, dropout_p: float, is_rms_norm: bool,
    zero_centered_weight: bool, has_bias: bool, has_bias1: bool, has_residual: bool, x_dtype: torch.dtype,
    residual_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dres, dw, db, dw1, db1 = _norm_bwd(
        h, dy, dy1, dres_out, weight, weight1, mean, rstd, rowscale, seed, dropout_p, is_rms_norm,
        zero_centered_weight, has_bias, has_bias1, has_residual, x_dtype, residual_dtype,
    )
    # Custom-op outputs may not alias each other: hand back a copy where the residual gradient is dx itself.
    dev = h.device
    return (dx, dres.clone() if dres is dx else or_placeholder(dres, dev, residual_dtype), dw,
            *(or_placeholder(g, dev) for g in (db, dw1, db1)))


@_norm_bwd_op.register_fake
def _(h, dy, dy1, dres_out, weight, weight1, mean, rstd, rowscale, seed, dropout_p, is_rms_norm,
      zero_centered_weight, has_bias, has_bias1, has_residual, x_dtype, residual_dtype):
    M, N = h.shape
    vec = lambda present: h.new_empty((N,) if present else (0,), dtype=torch.float32)  # noqa: E731
    dres = h.new_empty((M, N) if has_residual else (0,), dtype=residual_dtype)
    return (h.new_empty((M, N), dtype=x_dtype), dres, vec(True), vec(has_bias), vec(weight1 is not None),
            vec(weight1 is not None and has_bias1))


def _norm_setup_context(ctx, inputs, output):
    (x, weight, bias, weight1, bias1, residual, rowscale, eps, dropout_p, is_rms_norm, zero_centered_weight,
     residual_dtype, out_dtype, store_residual, store_mask) = inputs
    _, _, res_out, mean, rstd, seed, _ = output
    # The backward needs h: the stored residual stream, or x itself when nothing was added to it. (A stream
    # that exists is stored whenever autograd records this call, see _norm.)
    h = res_out if store_residual else x
    ctx.save_for_backward(h, weight, weight1, rowscale, mean, rstd, seed)
    ctx.shape = x.shape  # (M, N) for the custom op; x's own for the eager Function (_norm_fwd_shaped)
    ctx.args = dict(dropout_p=dropout_p, is_rms_norm=is_rms_norm, zero_centered_weight=zero_centered_weight,
                    has_bias=bias is not None, has_bias1=bias1 is not None, has_residual=residual is not None,
                    x_dtype=x.dtype, residual_dtype=residual.dtype if residual is not None else x.dtype)
    ctx.param_dtypes = (weight.dtype, bias.dtype if bias is not None else None,
                        weight1.dtype if weight1 is not None else None, bias1.dtype if bias1 is not None else None)
    ctx.store_residual = store_residual


def _norm_backward_with(bwd, *, sums_in_param_dtypes: bool):
    """The backward, calling ``bwd``: the custom op (traced by torch.compile; its gradients are float32 and
    cast here, which the compiler fuses) or its implementation (eager, which stores them in the parameters'
    dtypes directly: ``sums_in_param_dtypes``)."""

    def backward(ctx, dy, dy1, dres_out, _dmean, _drstd, _dseed, _dmask):
        h, weight, weight1, rowscale, mean, rstd, seed = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros(h.shape, device=h.device, dtype=ctx.args["x_dtype"])
        if weight1 is None:
            dy1 = None
        elif dy1 is None:
            dy1 = torch.zeros_like(dy)
        if not ctx.store_residual or (dres_out is not None and dres_out.numel() == 0):
            dres_out = None
        extra = {"param_dtypes": ctx.param_dtypes} if sums_in_param_dtypes else {}
        dx, dres, dw, db, dw1, db1 = bwd(as_rows(h), as_rows(dy), None if dy1 is None else as_rows(dy1),
                                         None if dres_out is None else as_rows(dres_out), weight, weight1,
                                         mean, rstd, rowscale, seed, **ctx.args, **extra)
        w_dt, b_dt, w1_dt, b1_dt = ctx.param_dtypes
        cast = lambda g, dt: None if dt is None else g if g.dtype == dt else g.to(dt)  # noqa: E731
        dx = dx.view(ctx.shape)
        dres = dres.view(ctx.shape) if ctx.args["has_residual"] else None
        return (dx, cast(dw, w_dt), cast(db, b_dt), cast(dw1, w1_dt), cast(db1, b1_dt), dres,
                None, None, None, None, None, None, None, None, None)

    return backward


_norm_fwd_op.register_autograd(_norm_backward_with(_norm_bwd_op, sums_in_param_dtypes=False),
                               setup_context=_norm_setup_context)
_norm_eager = eager_function("FusedNorm", _norm_fwd_shaped, _norm_setup_context,
                             _norm_backward_with(_norm_bwd, sums_in_param_dtypes=True))


# ----------------------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------------------


def _check_inputs(x, weight, bias, weight1, bias1, residual, rowscale, dropout_p, op):
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"{op}: residual shape {tuple(residual.shape)} != input shape {tuple(x.shape)}")
    device = x.device  # (made once: every .device makes a new object, and this runs at every eager call)
    for name, p in (("weight", weight), ("bias", bias), ("weight1", weight1), ("bias1", bias1), ("residual", residual),
                    ("rowscale", rowscale)):
        if p is not None and p.device != device:
            raise ValueError(f"{op}: {name} is on {p.device}, x on {device}; move them to one device")
        if p is not None and name in ("weight", "bias", "weight1", "bias1") and p.shape != x.shape[-1:]:
            raise ValueError(f"{op}: {name} shape {tuple(p.shape)} != normalized dim ({x.shape[-1]},)")
    if rowscale is not None and rowscale.shape != x.shape[:-1]:
        raise ValueError(f"{op}: rowscale shape {tuple(rowscale.shape)} != x.shape[:-1] {tuple(x.shape[:-1])}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{op}: dropout_p={dropout_p} must be in [0, 1)")


def _unsupported(x: torch.Tensor, residual: torch.Tensor | None) -> str | None:
    if x.dtype not in _DTYPES:
        return f"dtype {x.dtype} (supported: float32, float16, bfloat16)"
    if residual is not None and residual.dtype not in _DTYPES:
        return f"residual dtype {residual.dtype}"
    if x.shape[-1] > MAX_WIDTH:
        return f"row width {x.shape[-1]} > {MAX_WIDTH}"
    return None


def _norm(
    x, weight, bias, weight1, bias1, *, is_rms_norm, residual, eps, dropout_p, rowscale, prenorm,
    residual_in_fp32, zero_centered_weight, out_dtype, return_dropout_mask, backend, op,
):
    _check_inputs(x, weight, bias, weight1, bias1, residual, rowscale, dropout_p, op)
    if weight is None:  # no scale, as torch's norms take weight=None: the identity scale, which gets no gradient
        weight = (torch.zeros if zero_centered_weight else torch.ones)(x.shape[-1], device=x.device)
    dual = weight1 is not None
    if not use_triton(backend, x, op=op, unsupported=_unsupported(x, residual)):
        mask = torch.rand(x.shape, device=x.device) >= dropout_p if dropout_p > 0.0 else None
        common = dict(residual=residual, eps=eps, dropout_p=dropout_p, dropout_mask=mask, rowscale=rowscale,
                      prenorm=prenorm, residual_in_fp32=residual_in_fp32, zero_centered_weight=zero_centered_weight,
                      out_dtype=out_dtype, is_rms_norm=is_rms_norm)
        out = layer_norm_dual_ref(x, weight, bias, weight1, bias1, **common) if dual else layer_norm_ref(x, weight, bias, **common)
        out = out if isinstance(out, tuple) else (out,)
        return (*out, mask) if return_dropout_mask else (out if len(out) > 1 else out[0])

    shape = x.shape
    residual_dtype = torch.float32 if residual_in_fp32 else x.dtype
    # The stream is written only when someone reads it: prenorm returns it, the backward reads it. A post-norm
    # block's norm in inference (BERT) thus writes one tensor instead of two.
    grad = records_grad(x, weight, bias, weight1, bias1, residual)
    store_residual = _stream_exists(residual, rowscale, dropout_p) and (prenorm or grad)
    weight, bias, weight1, bias1 = (unit_last_stride(p) for p in (weight, bias, weight1, bias1))
    rowscale = None if rowscale is None else unit_last_stride(rowscale.reshape(-1))
    args = (rowscale, float(eps), float(dropout_p), is_rms_norm, zero_centered_weight, residual_dtype,
            out_dtype or x.dtype, store_residual, return_dropout_mask and dropout_p > 0.0)
    if torch.compiler.is_compiling():  # the custom op takes rows
        y, y1, res_out, _, _, _, mask = _norm_fwd_op(
            as_rows(x), weight, bias, weight1, bias1, None if residual is None else as_rows(residual), *args)
        # (an absent output is an empty placeholder: x is never empty here, see use_triton)
        y, y1, res_out, mask = (t.view(shape) if t.numel() else t for t in (y, y1, res_out, mask))
    else:  # shaped in and out: no view for autograd to record (_norm_fwd_shaped)
        y, y1, res_out, _, _, _, mask = _norm_eager(x, weight, bias, weight1, bias1, residual, *args)
    out = [y] + ([y1] if dual else [])
    if prenorm:
        out.append(res_out if store_residual else x.to(residual_dtype))
    if return_dropout_mask:
        out.append(mask if dropout_p > 0.0 else None)
    return tuple(out) if len(out) > 1 else out[0]


_NORM_DOC = """{what} over the last dim, fused with dropout, row scaling and residual add (see the module docstring).
    ``weight`` None scales by nothing (as torch's ``weight=None``).

    Returns ``y``{dual}; with ``prenorm=True`` also the new residual stream ``h`` (float32 when
    ``residual_in_fp32``); with ``return_dropout_mask=True`` also the boolean keep mask (None without dropout).
    Gradients flow to x, residual, the weights and biases (not to rowscale).
    """


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    eps: float = 1e-5,
    dropout_p: float = 0.0,
    rowscale: torch.Tensor | None = None,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    zero_centered_weight: bool = False,
    out_dtype: torch.dtype | None = None,
    return_dropout_mask: bool = False,
    backend: str | None = None,
):
    return _norm(
        x, weight, bias, None, None, is_rms_norm=False, residual=residual, eps=eps, dropout_p=dropout_p,
        rowscale=rowscale, prenorm=prenorm, residual_in_fp32=residual_in_fp32,
        zero_centered_weight=zero_centered_weight, out_dtype=out_dtype, return_dropout_mask=return_dropout_mask,
        backend=backend, op="layer_norm",
    )


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    eps: float = 1e-6,
    dropout_p: float = 0.0,
    rowscale: torch.Tensor | None = None,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    zero_centered_weight: bool = False,
    out_dtype: torch.dtype | None = None,
    return_dropout_mask: bool = False,
    backend: str | None = None,
):
    return _norm(
        x, weight, bias, None, None, is_rms_norm=True, residual=residual, eps=eps, dropout_p=dropout_p,
        rowscale=rowscale, prenorm=prenorm, residual_in_fp32=residual_in_fp32,
        zero_centered_weight=zero_centered_weight, out_dtype=out_dtype, return_dropout_mask=return_dropout_mask,
        backend=backend, op="rms_norm",
    )


def layer_norm_dual(
    x: torch.Tensor,
    weight0: torch.Tensor,
    bias0: torch.Tensor | None,
    weight1: torch.Tensor,
    bias1: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    eps: float = 1e-5,
    dropout_p: float = 0.0,
    rowscale: torch.Tensor | None = None,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    zero_centered_weight: bool = False,
    out_dtype: torch.dtype | None = None,
    return_dropout_mask: bool = False,
    is_rms_norm: bool = False,
    backend: str | None = None,
):
    return _norm(
        x, weight0, bias0, weight1, bias1, is_rms_norm=is_rms_norm, residual=residual, eps=eps,
        dropout_p=dropout_p, rowscale=rowscale, prenorm=prenorm, residual_in_fp32=residual_in_fp32,
        zero_centered_weight=zero_centered_weight, out_dtype=out_dtype, return_dropout_mask=return_dropout_mask,
        backend=backend, op="layer_norm_dual",
    )


def rms_norm_dual(
    x: torch.Tensor,
    weight0: torch.Tensor,
    bias0: torch.Tensor | None,
    weight1: torch.Tensor,
    bias1: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    eps: float = 1e-6,
    dropout_p: float = 0.0,
    rowscale: torch.Tensor | None = None,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    zero_centered_weight: bool = False,
    out_dtype: torch.dtype | None = None,
    return_dropout_mask: bool = False,
    backend: str | None = None,
):
    return _norm(
        x, weight0, bias0, weight1, bias1, is_rms_norm=True, residual=residual, eps=eps, dropout_p=dropout_p,
        rowscale=rowscale, prenorm=prenorm, residual_in_fp32=residual_in_fp32,
        zero_centered_weight=zero_centered_weight, out_dtype=out_dtype, return_dropout_mask=return_dropout_mask,
        backend=backend, op="rms_norm_dual",
    )


layer_norm.__doc__ = _NORM_DOC.format(what="LayerNorm", dual="")
rms_norm.__doc__ = _NORM_DOC.format(what="RMSNorm", dual="")
layer_norm_dual.__doc__ = _NORM_DOC.format(what="LayerNorm (two weight/bias sets)", dual=", y1")
rms_norm_dual.__doc__ = _NORM_DOC.format(what="RMSNorm (two weight/bias sets)", dual=", y1")
