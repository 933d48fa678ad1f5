"""Matrix-vector product for decoding: ``y = x @ weight.T (+ bias)`` with x one row (batch 1) or a few (up to
16: a decode step's batch), optionally fused with the small ops around a decoder layer's projections.

At batch 1 a decoder step reads every weight once and does little else, so its projections are bound by
memory bandwidth. cuBLAS's GEMVs reach 83% of the copy bandwidth on LLaMA-1.1B's gate/up projection (46 MB)
but only 39% on qkv and o (10.5 and 8.4 MB) and 53% on down, with a split-K reduction kernel after it
(``scripts/profile/gemv_sweep.py``, H100). This kernel splits the output rows over the programs and runs
the whole reduction over K inside each, in float32, so there is one launch and no partial sums; the tile
shape is autotuned per (N, K) and prologue. For 2-16 rows a second kernel reads each weight tile once and
multiplies it with every row on the tensor cores (cuBLAS at 16 rows: a GEMM launch that a programmatic launch
chain cannot include, see below).

The ops next to those projections each read and write one row, yet cost a kernel (about 1.3-1.9 us of GPU time
plus a launch gap in the CUDA graph), about as much as a small projection. So the kernel can absorb them:
- an RMSNorm prologue, ``rms_norm(x, norm_weight, norm_eps) @ weight.T``, for qkv and gate/up: every program
  recomputes the row's sum of squares (K elements, next to its BLOCK_N x K weight tile) instead of waiting
  for a norm kernel (Gemma's norm, scaling by 1 + weight, too);
- a SwiGLU prologue, ``(silu(gate) * up) @ weight.T`` with x the packed row [gate; up], for down;
- a residual epilogue, ``... + residual``, for o and down: it writes the new residual stream;
- a SwiGLU epilogue, ``silu(x @ gate.T) * (x @ up.T)`` with weight the packed [gate; up] rows, for gate/up:
  each program reads matching gate and up rows and writes their product, so the activation costs no kernel
  and, unlike the prologue above, nothing is computed twice.
Each rounds where the unfused path stores a tensor (the normed row, the SwiGLU product, the projection before
the add: see ``gemv_ref``), so fused and unfused decoding give the same logits up to float32 summation order.

Backends: "triton" runs the kernel (inference only: it has no backward, and refuses inputs that need one);
"reference" is ``F.linear`` composed with the norm, SwiGLU and add references; "auto" is the reference too.
``scripts/profile/gemv_sweep.py`` measures the kernel against cuBLAS and the fused calls against the unfused
kernels at LLaMA-1.1B's shapes, in CUDA graphs. On an H100 (bf16, us per call, with the norm prologue's sum of
squares read in a loop of dependent loads): plain gemv 0.94-1.08x cuBLAS; fused against unfused, norm + qkv 8.25
against 9.83 and o + add 7.12 against 8.05, but norm + gate/up 21.29 against 20.46 and swiglu + down + add 16.30
against 14.87: the prologue every program recomputes over K costs about 1.8 us (norm) and 4 us (SwiGLU) there,
more than the kernel it saves on the long projections. Hence the SwiGLU epilogue, and the norm's sum of squares
read in one load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._autotune_cache import cached_autotune
from ._backend import check_backend_name, needs_grad_reason, triton_interpreter_enabled, use_triton
from ._pdl import enabled as programmatic_launch_enabled
from ._pdl import launch_options, wait_for_predecessor
from ._triton_compat import tl, triton
from ._triton_utils import cdiv, next_power_of_2, or_dummy, pick, sm_count
from .activations import _act_and_grad, swiglu_ref
from .layer_norm_ref import rms_norm_ref

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def gemv_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float | None = None,
    norm_zero_centered: bool = False,
    swiglu: bool = False,
    swiglu_output: bool = False,
) -> torch.Tensor:
    """The unfused path, each step stored in x's dtype as its own kernel stores it: the normed row or the SwiGLU
    product, the projection (and its SwiGLU), then the residual add in float32 (as the fused add+norm adds the
    stream)."""
    if norm_weight is not None:
        x = rms_norm_ref(x, norm_weight, eps=norm_eps, zero_centered_weight=norm_zero_centered)
    elif swiglu:
        x = swiglu_ref(x)
    y = F.linear(x, weight, bias)
    if swiglu_output:
        y = swiglu_ref(y)
    return y if residual is None else (y.float() + residual.float()).to(y.dtype)


def _configs():
    """(BLOCK_N, BLOCK_K, warps, stages) candidates: few output rows per program so that even N = 2048 spreads
    over every SM, long K tiles so each row is read in wide, coalesced pieces. The interpreter gets one small
    tile so test shapes cross several row blocks and K tiles."""
    if triton_interpreter_enabled():
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 32}, num_warps=4, num_stages=1)]
    shapes = [(8, 256, 4, 3), (16, 256, 4, 3), (4, 512, 4, 3), (8, 512, 8, 3), (16, 128, 4, 4), (32, 256, 8, 3),
              (4, 1024, 4, 2), (8, 1024, 8, 2), (2, 1024, 4, 3)]  # long rows in flight: the big projections
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s) for n, k, w, s in shapes]


@triton.jit
def _rms_rstd(X, K, eps, BLOCK_ROW: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) of the whole row, in float32. Every program computes it (K is a few thousand),
    before its first dot, so it reads the row in as few loads as it can: BLOCK_ROW covers K up to 8192."""
    sq = tl.zeros([BLOCK_ROW], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_ROW):
        cols = k0 + tl.arange(0, BLOCK_ROW)
        x = tl.load(X + cols, mask=cols < K, other=0.0).to(tl.float32)
        sq += x * x
    return tl.rsqrt(tl.sum(sq, axis=0) / K + eps)


@triton.jit
def _swiglu_pair(gate, up, dtype):
    """silu(gate) * up from two float32 projections, each first rounded to ``dtype`` as the unfused path stores
    the gate/up projection, then computed as the swiglu kernel computes it (its own SiLU)."""
    silu, _ = _act_and_grad(gate.to(dtype).to(tl.float32), 0, False)
    return silu * up.to(dtype).to(tl.float32)


@triton.jit
def _input_tile(X, offsets, NW, cols, mask, K, rstd, PROLOGUE: tl.constexpr):
    """The tile of x at ``offsets`` (its columns ``cols``) that the dot reads, in float32: a row's (1-D) or a few
    rows' (2-D, ``rstd`` then a column of per-row values). A prologue's result is rounded to x's dtype, as the
    norm or SwiGLU kernel stores it in the unfused path: the dot then sees the same values."""
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    if PROLOGUE == "rms_norm":
        w = tl.load(NW + cols, mask=cols < K, other=0.0).to(tl.float32)
        x = (x * rstd * w).to(X.dtype.element_ty).to(tl.float32)  # the norm kernel's order: x * rstd, then * w
    elif PROLOGUE == "rms_norm_zero_centered":  # Gemma's: 1 + weight, added in float32 as the norm kernel adds it
        w = tl.load(NW + cols, mask=cols < K, other=0.0).to(tl.float32) + 1.0
        x = (x * rstd * w).to(X.dtype.element_ty).to(tl.float32)
    elif PROLOGUE == "swiglu":
        up = tl.load(X + K + offsets, mask=mask, other=0.0)
        x = _swiglu_pair(x, up, X.dtype.element_ty).to(X.dtype.element_ty).to(tl.float32)
    return x


# With ``static_weight`` (a decode step's chain of GEMVs under PDL) the one-row kernel's tile is set by rule, not
# autotuned: the autotuner times each config as one lone launch, which need not rank tiles as the chain does.
# scripts/profile/gemv_chain_sweep.py on an H100 (LLaMA-1.1B's projections in a PDL chain with the
# block's fusions, us per call): 8 x 512 (4 warps, 2 stages) is within 0.2 us of the best of the 21 tiles
# timed on qkv (4.93 vs 4.74), o (4.51, the best), gate/up (18.21 vs 18.19; 8 x 256: 21.12) and the LM head
# (44.10 vs 44.00); down's long rows (K = 5632, 2048 outputs) want more, shorter programs: 2 x 1024 (4, 3) 10.32,
# the best, against 11.23. (BLOCK_N, BLOCK_K, warps, stages):
CHAIN_TILE = (8, 512, 4, 2)
CHAIN_TILE_LONG_ROWS = (2, 1024, 4, 3)  # K >= 4096, or too few outputs for one program of 8 per SM


def _chain_tile(N: int, K: int, device: torch.device) -> tuple[int, int, int, int]:
    long_rows = K >= 4096 or cdiv(N, CHAIN_TILE[0]) < sm_count(device.index if device.index is not None else
                                                                 torch.cuda.current_device())
    return CHAIN_TILE_LONG_ROWS if long_rows else CHAIN_TILE


# The most rows ``gemv`` takes: a decode step up to batch 16, whose weights the few-rows kernel still reads once.
GEMV_MAX_ROWS = 16

# With ``static_weight``, the weight elements a program reads before waiting for the kernel before it (its first
# PREFETCH_ELEMENTS // BLOCK_N columns, held in registers: 64 per thread at 4 warps).
PREFETCH_ELEMENTS = tl.constexpr(16384)


@cached_autotune
@triton.autotune(configs=_configs(), key=["N", "K", "PROLOGUE", "GATED", "PREFETCH"])
@triton.jit
def _gemv_kernel(
    X, W, B, R, NW, Y, N, K, stride_w, eps,
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PROLOGUE: tl.constexpr, GATED: tl.constexpr,
    PDL: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_ROW: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # GATED: the weight holds 2N rows [gate; up]; this program's output rows n read gate row n and up row N + n.
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_in = rows < N
    row_offsets = rows.to(tl.int64)[:, None] * stride_w
    up_offsets = (rows + N).to(tl.int64)[:, None] * stride_w
    if PREFETCH:  # the weight is no kernel's output: its first columns stream in while the kernel before runs
        # The same registers either way: a gated program holds half as many columns of twice the rows.
        pre_cols = tl.arange(0, PREFETCH_ELEMENTS // BLOCK_N // (1 + GATED))
        pre_mask = row_in[:, None] & (pre_cols < K)[None, :]
        w_pre = tl.load(W + row_offsets + pre_cols[None, :], mask=pre_mask, other=0.0)
        if GATED:
            u_pre = tl.load(W + up_offsets + pre_cols[None, :], mask=pre_mask, other=0.0)
    wait_for_predecessor(PDL)
    rstd = 0.0
    if PROLOGUE == "rms_norm":
        rstd = _rms_rstd(X, K, eps, BLOCK_ROW)
    elif PROLOGUE == "rms_norm_zero_centered":
        rstd = _rms_rstd(X, K, eps, BLOCK_ROW)
    y = tl.zeros([BLOCK_N], dtype=tl.float32)
    y_up = tl.zeros([BLOCK_N], dtype=tl.float32)
    start = 0
    if PREFETCH:
        x_pre = _input_tile(X, pre_cols, NW, pre_cols, pre_cols < K, K, rstd, PROLOGUE)
        y = tl.sum(w_pre.to(tl.float32) * x_pre[None, :], axis=1)
        if GATED:
            y_up = tl.sum(u_pre.to(tl.float32) * x_pre[None, :], axis=1)
        start = PREFETCH_ELEMENTS // BLOCK_N // (1 + GATED)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(start, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_in = cols < K
        x = _input_tile(X, cols, NW, cols, col_in, K, rstd, PROLOGUE)
        w_mask = row_in[:, None] & col_in[None, :]
        w = tl.load(W + row_offsets + cols[None, :], mask=w_mask, other=0.0)
        acc += w.to(tl.float32) * x[None, :]  # summed over K once, after the loop
        if GATED:
            u = tl.load(W + up_offsets + cols[None, :], mask=w_mask, other=0.0)
            acc_up += u.to(tl.float32) * x[None, :]
    y += tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(B + rows, mask=row_in, other=0.0).to(tl.float32)
    if GATED:
        y_up += tl.sum(acc_up, axis=1)
        if HAS_BIAS:
            y_up += tl.load(B + N + rows, mask=row_in, other=0.0).to(tl.float32)
        y = _swiglu_pair(y, y_up, Y.dtype.element_ty)
    if HAS_RESIDUAL:
        # The unfused path stores the projection in the dtype, then adds it to the stream in float32.
        y = y.to(Y.dtype.element_ty).to(tl.float32) + tl.load(R + rows, mask=row_in, other=0.0).to(tl.float32)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_in)


def _rows_configs():
    """(BLOCK_N, BLOCK_K, warps, stages) for the few-rows kernel: narrow output tiles so that GPT-2's 768 outputs
    still make 24-48 programs, K tiles long enough for wide loads; tensor-core dots need tiles of 16+."""
    if triton_interpreter_enabled():
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 32}, num_warps=4, num_stages=1)]
    shapes = [(16, 256, 4, 3), (32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 3), (16, 512, 4, 2), (64, 256, 8, 3)]
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s) for n, k, w, s in shapes]


@triton.jit
def _rms_rstd_rows(X, x_rows, m_in, K, eps, BLOCK_M: tl.constexpr, BLOCK_ROW: tl.constexpr):
    """``_rms_rstd`` of BLOCK_M rows at offsets ``x_rows`` (BLOCK_M, 1): a (BLOCK_M, 1) column."""
    sq = tl.zeros([BLOCK_M, BLOCK_ROW], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_ROW):
        cols = k0 + tl.arange(0, BLOCK_ROW)
        x = tl.load(X + x_rows + cols[None, :], mask=m_in[:, None] & (cols < K)[None, :], other=0.0).to(tl.float32)
        sq += x * x
    return tl.rsqrt(tl.sum(sq, axis=1) / K + eps)[:, None]


@triton.jit
def _dot_rows(x, w, acc, EXACT: tl.constexpr):
    """acc + x @ w.T on the tensor cores. EXACT: in float32 at full precision (float32 inputs, where TF32 would
    differ from F.linear; and the CPU interpreter, whose bfloat16 dot is wrong)."""
    if EXACT:
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(x.to(w.dtype), tl.trans(w), acc)


@cached_autotune
@triton.autotune(configs=_rows_configs(), key=["N", "K", "BLOCK_M", "PROLOGUE", "GATED", "PREFETCH"])
@triton.jit
def _gemv_rows_kernel(
    X, W, B, R, NW, Y, M, N, K, stride_x, stride_r, stride_y, stride_w, eps,
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PROLOGUE: tl.constexpr, GATED: tl.constexpr,
    PDL: tl.constexpr, PREFETCH: tl.constexpr, EXACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_ROW: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``_gemv_kernel`` for M <= BLOCK_M rows (a decode step at batch 2-16): each program reads a block of
    weight rows once and multiplies every x row with it on the tensor cores, so the weight is still read once."""
    offs_m = tl.arange(0, BLOCK_M)
    m_in = offs_m < M
    outs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    out_in = outs < N
    w_rows = outs.to(tl.int64)[:, None] * stride_w
    up_rows = (outs + N).to(tl.int64)[:, None] * stride_w
    x_rows = offs_m.to(tl.int64)[:, None] * stride_x
    first = tl.arange(0, BLOCK_K)
    if PREFETCH:  # the weight is no kernel's output: its first K tile streams in while the kernel before runs
        w_first = tl.load(W + w_rows + first[None, :], mask=out_in[:, None] & (first < K)[None, :], other=0.0)
        if GATED:
            u_first = tl.load(W + up_rows + first[None, :], mask=out_in[:, None] & (first < K)[None, :], other=0.0)
    wait_for_predecessor(PDL)
    rstd = tl.zeros([BLOCK_M, 1], dtype=tl.float32)
    if PROLOGUE == "rms_norm":
        rstd = _rms_rstd_rows(X, x_rows, m_in, K, eps, BLOCK_M, BLOCK_ROW)
    elif PROLOGUE == "rms_norm_zero_centered":
        rstd = _rms_rstd_rows(X, x_rows, m_in, K, eps, BLOCK_M, BLOCK_ROW)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    start = 0
    if PREFETCH:
        x = _input_tile(X, x_rows + first[None, :], NW, first[None, :], m_in[:, None] & (first < K)[None, :], K,
                        rstd, PROLOGUE)
        acc = _dot_rows(x, w_first, acc, EXACT)
        if GATED:
            acc_up = _dot_rows(x, u_first, acc_up, EXACT)
        start = BLOCK_K
    for k0 in range(start, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_in = cols < K
        x = _input_tile(X, x_rows + cols[None, :], NW, cols[None, :], m_in[:, None] & col_in[None, :], K, rstd,
                        PROLOGUE)
        w_mask = out_in[:, None] & col_in[None, :]
        acc = _dot_rows(x, tl.load(W + w_rows + cols[None, :], mask=w_mask, other=0.0), acc, EXACT)
        if GATED:
            acc_up = _dot_rows(x, tl.load(W + up_rows + cols[None, :], mask=w_mask, other=0.0), acc_up, EXACT)
    y = acc
    if HAS_BIAS:
        y += tl.load(B + outs, mask=out_in, other=0.0).to(tl.float32)[None, :]
    if GATED:
        y_up = acc_up
        if HAS_BIAS:
            y_up += tl.load(B + N + outs, mask=out_in, other=0.0).to(tl.float32)[None, :]
        y = _swiglu_pair(y, y_up, Y.dtype.element_ty)
    mask = m_in[:, None] & out_in[None, :]
    if HAS_RESIDUAL:
        residual = tl.load(R + offs_m.to(tl.int64)[:, None] * stride_r + outs[None, :], mask=mask, other=0.0)
        y = y.to(Y.dtype.element_ty).to(tl.float32) + residual.to(tl.float32)
    tl.store(Y + offs_m.to(tl.int64)[:, None] * stride_y + outs[None, :], y.to(Y.dtype.element_ty), mask=mask)


def _unit_vector(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """t as n contiguous elements (the kernel indexes its vectors with unit stride), copying only when it must."""
    if t is None:
        return None
    t = t.reshape(n)
    return t if t.stride(0) == 1 else t.contiguous()


def _gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
          norm_weight: torch.Tensor | None, norm_eps: float, prologue: str, swiglu_output: bool,
          static_weight: bool) -> torch.Tensor:
    rows, K = weight.shape
    N = rows // 2 if swiglu_output else rows
    M = x.numel() // x.shape[-1]
    dev, dt = x.device, x.dtype
    pdl = programmatic_launch_enabled(dev)
    flags = dict(HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, PROLOGUE=prologue, GATED=swiglu_output,
                 PDL=pdl, PREFETCH=static_weight, **launch_options(pdl))
    bias, norm_weight = or_dummy(_unit_vector(bias, rows), dev, dt), or_dummy(_unit_vector(norm_weight, K), dev, dt)
    grid = lambda meta: (cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    if M == 1:
        y = torch.empty(N, device=dev, dtype=dt)
        args = (_unit_vector(x, x.shape[-1]), weight, bias, or_dummy(_unit_vector(residual, N), dev, dt), norm_weight,
                y, N, K, weight.stride(0), norm_eps)
        if static_weight and dev.type == "cuda" and not triton_interpreter_enabled():
            block_n, block_k, warps, stages = _chain_tile(N, K, dev)
            _gemv_kernel.jit[(cdiv(N, block_n),)](*args, BLOCK_ROW=_rstd_block(K), BLOCK_N=block_n, BLOCK_K=block_k,
                                                  num_warps=warps, num_stages=stages, **flags)
        else:
            _gemv_kernel[grid](*args, BLOCK_ROW=_rstd_block(K), **flags)
        return y.view(*x.shape[:-1], N)
    x2 = _unit_rows(x)
    r2 = or_dummy(None if residual is None else _unit_rows(residual), dev, dt)
    y = torch.empty(M, N, device=dev, dtype=dt)
    _gemv_rows_kernel[grid](x2, weight, bias, r2, norm_weight, y, M, N, K, x2.stride(0), r2.stride(0), y.stride(0),
                            weight.stride(0), norm_eps, EXACT=dt == torch.float32 or triton_interpreter_enabled(),
                            BLOCK_M=GEMV_MAX_ROWS, BLOCK_ROW=_rstd_block(K, GEMV_MAX_ROWS), **flags)
    return y.view(*x.shape[:-1], N)


def _unit_rows(t: torch.Tensor) -> torch.Tensor:
    """t as (rows, width) with unit stride along the width (what the few-rows kernel indexes)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _rstd_block(K: int, rows: int = 1) -> int:
    """The norm prologue's load width: the whole row in one load up to 8192 elements in all, more being likely
    to spill registers (with 16 rows of 2048 in one load, LLaMA-1.1B's norm + qkv GEMV took 13.4 us at batch 16
    against 2.8 at batch 1 on an H100; not re-measured since); in the interpreter a short block, so that test
    shapes run its loop over several."""
    return 32 if triton_interpreter_enabled() else min(next_power_of_2(K), 8192 // rows)


# torch.compile traces the custom op as one opaque node; eager calls skip the dispatcher (``pick``).
@torch.library.custom_op("flash_kernels::gemv", mutates_args=())
def _gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
             norm_weight: torch.Tensor | None, norm_eps: float, prologue: str, swiglu_output: bool,
             static_weight: bool) -> torch.Tensor:
    return _gemv(x, weight, bias, residual, norm_weight, norm_eps, prologue, swiglu_output, static_weight)


@_gemv_op.register_fake
def _(x, weight, bias, residual, norm_weight, norm_eps, prologue, swiglu_output, static_weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0] // 2 if swiglu_output else weight.shape[0]))


def _check(x, weight, bias, residual, norm_weight, norm_eps, norm_zero_centered, swiglu, swiglu_output) -> str:
    """Raise a ValueError for inconsistent inputs; return the prologue ("none", "rms_norm",
    "rms_norm_zero_centered" or "swiglu")."""
    if norm_zero_centered and norm_weight is None:
        raise ValueError("gemv: norm_zero_centered=True describes the RMSNorm prologue's weight: pass norm_weight "
                         "and norm_eps too")
    if norm_weight is not None and swiglu:
        raise ValueError("gemv: norm_weight (an RMSNorm prologue) and swiglu=True (a SwiGLU prologue) exclude "
                         "each other; pass one")
    if (norm_weight is None) != (norm_eps is None):
        raise ValueError("gemv: the RMSNorm prologue needs both norm_weight and norm_eps (the model's eps: "
                         "no default, a wrong one would go unnoticed)")
    if weight.dim() != 2:
        raise ValueError(f"gemv: weight must be 2-D (N, K), got shape {tuple(weight.shape)}")
    rows, K = weight.shape
    if swiglu_output and rows % 2:
        raise ValueError(f"gemv: swiglu_output=True needs the packed [gate; up] weight, an even number of rows; "
                         f"got {rows}")
    N = rows // 2 if swiglu_output else rows
    width = 2 * K if swiglu else K  # swiglu: x is the packed [gate; up]
    if x.shape[-1] != width:
        what = "the packed [gate; up] of 2 * " if swiglu else ""
        raise ValueError(f"gemv: x {tuple(x.shape)} does not match weight {tuple(weight.shape)} (expected last "
                         f"dim {what}{K} = {width})")
    if x.numel() > GEMV_MAX_ROWS * x.shape[-1]:
        raise ValueError(f"gemv: x must hold at most {GEMV_MAX_ROWS} rows (a decode step), got shape "
                         f"{tuple(x.shape)}; use F.linear")
    if bias is not None and bias.shape != (rows,):
        raise ValueError(f"gemv: bias shape {tuple(bias.shape)} != ({rows},)")
    if residual is not None and residual.shape != (*x.shape[:-1], N):
        raise ValueError(f"gemv: residual shape {tuple(residual.shape)} != output shape {(*x.shape[:-1], N)}")
    if norm_weight is not None and norm_weight.shape != (K,):
        raise ValueError(f"gemv: norm_weight shape {tuple(norm_weight.shape)} != ({K},)")
    named = {"x": x, "weight": weight, "bias": bias, "residual": residual, "norm_weight": norm_weight}
    dtypes = {name: t.dtype for name, t in named.items() if t is not None}
    if len(set(dtypes.values())) > 1:
        raise ValueError(f"gemv: {', '.join(dtypes)} must share a dtype, got "
                         + ", ".join(f"{name} {dt}" for name, dt in dtypes.items()))
    if norm_weight is not None:
        return "rms_norm_zero_centered" if norm_zero_centered else "rms_norm"
    return "swiglu" if swiglu else "none"


def _unsupported(x: torch.Tensor, weight: torch.Tensor, *others: torch.Tensor | None) -> str | None:
    if x.dtype not in _DTYPES:
        return f"dtype {x.dtype} (supported: float32, float16, bfloat16)"
    if weight.stride(1) != 1:
        return "a weight whose rows are not contiguous"
    return needs_grad_reason(x, weight, *others)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float | None = None,
    norm_zero_centered: bool = False,
    swiglu: bool = False,
    swiglu_output: bool = False,
    static_weight: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x (..., K) of at most ``GEMV_MAX_ROWS`` (16) rows -> (..., N),
    optionally with a prologue on x and a residual epilogue (see the module docstring):

    - ``norm_weight`` and ``norm_eps``: x is RMS-normed first, ``rms_norm(x, norm_weight, eps=norm_eps)``;
      ``norm_zero_centered=True``: the norm scales by ``1 + norm_weight`` (Gemma's; ``zero_centered_weight``);
    - ``swiglu=True``: x is the packed [gate; up] (..., 2K) and ``silu(gate) * up`` is projected;
    - ``swiglu_output=True``: weight (and bias) are the packed [gate; up] rows (2N, K) and the result is
      ``silu(gate projection) * up projection`` (..., N);
    - ``residual`` (..., N): added to the projection, giving the new residual stream.

    The two prologues exclude each other; every tensor shares x's dtype.

    ``static_weight=True`` promises that no kernel launched just before writes ``weight`` (a model's parameter
    in a decode step): inside ``flash_kernels.programmatic_launch()`` the kernel then reads the first columns
    of its weight rows before waiting for its predecessor, so they stream in while that kernel still runs.
    """
    prologue = _check(x, weight, bias, residual, norm_weight, norm_eps, norm_zero_centered, swiglu, swiglu_output)
    if check_backend_name(backend) == "auto" or not use_triton(
            backend, x, op="gemv", unsupported=_unsupported(x, weight, bias, residual, norm_weight)):
        return gemv_ref(x, weight, bias, residual=residual, norm_weight=norm_weight, norm_eps=norm_eps,
                        norm_zero_centered=norm_zero_centered, swiglu=swiglu, swiglu_output=swiglu_output)
    eps = 0.0 if norm_eps is None else float(norm_eps)
    return pick(_gemv_op, _gemv)(x, weight, bias, residual, norm_weight, eps, prologue, swiglu_output, static_weight)
