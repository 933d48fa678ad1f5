"""The fused norm's Triton kernels: the forward (dropout, row scale, residual add, LayerNorm or RMSNorm, one
or two affine outputs, per row) and the backward (dx and the residual gradient per row, per-program partial
sums of the weight and bias gradients that ``partial_sums`` adds up). Launched by ``layer_norm``."""

from __future__ import annotations

from ._launch import lean_launch
from ._pdl import wait_for_predecessor
from ._triton_compat import tl, triton


@triton.jit
def _keep_mask(seed, row, cols, N, p):
    """Philox keep mask for one block of one row; the same (seed, row, col) always gives the same bit."""
    return tl.rand(seed, (row * N + cols).to(tl.int32)) >= p


@triton.jit
def _residual_stream(
    X, RES, ROWSCALE, seed, row, cols, mask, N, stride_x, stride_res, p,
    HAS_RES: tl.constexpr, HAS_ROWSCALE: tl.constexpr, HAS_DROPOUT: tl.constexpr,
):
    """h = dropout(x * rowscale) + residual for one block of one row, in float32."""
    h = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_ROWSCALE:
        h = h * tl.load(ROWSCALE + row).to(tl.float32)
    if HAS_DROPOUT:
        h = tl.where(_keep_mask(seed, row, cols, N, p), h / (1.0 - p), 0.0)
    if HAS_RES:
        h = h + tl.load(RES + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
    return h


@triton.jit
def _as_stored(h, RES_OUT, HAS_STREAM: tl.constexpr):
    """h as the stored residual stream holds it (rounded to its dtype): the norm normalizes exactly what the
    backward reads back, so recomputing the output from the stored stream gives the same bits. Rounded also
    when the stream is not written (inference), so that y does not depend on whether it was."""
    if HAS_STREAM:
        h = h.to(RES_OUT.dtype.element_ty).to(tl.float32)
    return h


@triton.jit
def _store_affine(Y, W, B, row, stride_y, cols, mask, xhat, HAS_B: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    y = xhat * w
    if HAS_B:
        y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@lean_launch
@triton.jit
def _norm_fwd_kernel(
    X, RES, ROWSCALE, SEED, W, B, W1, B1, Y, Y1, RES_OUT, MASK_OUT, MEAN, RSTD,
    stride_x, stride_res, stride_y, stride_y1, stride_res_out, N, eps, p,
    IS_RMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_ROWSCALE: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    HAS_B: tl.constexpr, HAS_W1: tl.constexpr, HAS_B1: tl.constexpr, HAS_STREAM: tl.constexpr,
    STORE_RES: tl.constexpr, STORE_MASK: tl.constexpr, ZERO_CENTERED: tl.constexpr, BLOCK_N: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_predecessor(PDL)
    row = tl.program_id(0).to(tl.int64)
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(SEED)
    if SINGLE_BLOCK:
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        h = _residual_stream(X, RES, ROWSCALE, seed, row, cols, mask, N, stride_x, stride_res, p,
                             HAS_RES, HAS_ROWSCALE, HAS_DROPOUT)
        h = _as_stored(h, RES_OUT, HAS_STREAM)
        if STORE_RES:
            tl.store(RES_OUT + row * stride_res_out + cols, h.to(RES_OUT.dtype.element_ty), mask=mask)
        if STORE_MASK:
            tl.store(MASK_OUT + row * N + cols, _keep_mask(seed, row, cols, N, p).to(tl.uint8), mask=mask)
        mean = 0.0
        if not IS_RMS:
            mean = tl.sum(h, axis=0) / N
        d = tl.where(mask, h - mean, 0.0)
        rstd = tl.rsqrt(tl.sum(d * d, axis=0) / N + eps)
        xhat = d * rstd
        _store_affine(Y, W, B, row, stride_y, cols, mask, xhat, HAS_B, ZERO_CENTERED)
        if HAS_W1:
            _store_affine(Y1, W1, B1, row, stride_y1, cols, mask, xhat, HAS_B1, ZERO_CENTERED)
    else:
        # Wide rows: pass 1 the mean (LayerNorm only), pass 2 the variance (and the stores of h and the
        # mask), pass 3 the output. Two-pass variance keeps float32 accuracy on rows of 64k.
        mean = 0.0
        if not IS_RMS:
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                mask = cols < N
                h = _residual_stream(X, RES, ROWSCALE, seed, row, cols, mask, N, stride_x, stride_res, p,
                                     HAS_RES, HAS_ROWSCALE, HAS_DROPOUT)
                acc += _as_stored(h, RES_OUT, HAS_STREAM)
            mean = tl.sum(acc, axis=0) / N
        acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < N
            h = _residual_stream(X, RES, ROWSCALE, seed, row, cols, mask, N, stride_x, stride_res, p,
                                 HAS_RES, HAS_ROWSCALE, HAS_DROPOUT)
            h = _as_stored(h, RES_OUT, HAS_STREAM)
            if STORE_RES:
                tl.store(RES_OUT + row * stride_res_out + cols, h.to(RES_OUT.dtype.element_ty), mask=mask)
            if STORE_MASK:
                tl.store(MASK_OUT + row * N + cols, _keep_mask(seed, row, cols, N, p).to(tl.uint8), mask=mask)
            d = tl.where(mask, h - mean, 0.0)
            acc2 += d * d
        rstd = tl.rsqrt(tl.sum(acc2, axis=0) / N + eps)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < N
            h = _residual_stream(X, RES, ROWSCALE, seed, row, cols, mask, N, stride_x, stride_res, p,
                                 HAS_RES, HAS_ROWSCALE, HAS_DROPOUT)
            h = _as_stored(h, RES_OUT, HAS_STREAM)
            xhat = tl.where(mask, h - mean, 0.0) * rstd
            _store_affine(Y, W, B, row, stride_y, cols, mask, xhat, HAS_B, ZERO_CENTERED)
            if HAS_W1:
                _store_affine(Y1, W1, B1, row, stride_y1, cols, mask, xhat, HAS_B1, ZERO_CENTERED)
    if not IS_RMS:
        tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)


@triton.jit
def _load_weight(W, cols, mask, ZERO_CENTERED: tl.constexpr):
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = tl.where(mask, w + 1.0, 0.0)
    return w


@triton.jit
def _bwd_block_terms(
    H, W, W1, DY, DY1, row, cols, mask, mean, rstd, stride_h, stride_dy, stride_dy1,
    HAS_W1: tl.constexpr, ZERO_CENTERED: tl.constexpr,
):
    """xhat, dy, dy1 and w * dy (+ w1 * dy1) for one block of one row, in float32."""
    h = tl.load(H + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    xhat = tl.where(mask, (h - mean) * rstd, 0.0)
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    wdy = _load_weight(W, cols, mask, ZERO_CENTERED) * dy
    dy1 = dy
    if HAS_W1:
        dy1 = tl.load(DY1 + row * stride_dy1 + cols, mask=mask, other=0.0).to(tl.float32)
        wdy += _load_weight(W1, cols, mask, ZERO_CENTERED) * dy1
    return xhat, dy, dy1, wdy


@triton.jit
def _bwd_store_dx(
    DX, DRES, DRES_OUT, ROWSCALE, seed, row, cols, mask, N, p, dh, stride_dx, stride_dres, stride_dres_out,
    HAS_DRES_OUT: tl.constexpr, STORE_DRES: tl.constexpr, HAS_ROWSCALE: tl.constexpr, HAS_DROPOUT: tl.constexpr,
):
    """Route dh (the gradient of h) to the residual input and, through dropout and rowscale, to x."""
    if HAS_DRES_OUT:
        dh += tl.load(DRES_OUT + row * stride_dres_out + cols, mask=mask, other=0.0).to(tl.float32)
    if STORE_DRES:
        tl.store(DRES + row * stride_dres + cols, dh.to(DRES.dtype.element_ty), mask=mask)
    dx = dh
    if HAS_DROPOUT:
        dx = tl.where(_keep_mask(seed, row, cols, N, p), dx / (1.0 - p), 0.0)
    if HAS_ROWSCALE:
        dx = dx * tl.load(ROWSCALE + row).to(tl.float32)
    tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _add_pairs(a1, b1, a2, b2):
    return a1 + a2, b1 + b2


@lean_launch
@triton.jit
def _norm_bwd_kernel(
    H, W, W1, DY, DY1, DRES_OUT, MEAN, RSTD, ROWSCALE, SEED, DX, DRES, DW, DB, DW1, DB1,
    stride_h, stride_dy, stride_dy1, stride_dres_out, stride_dx, stride_dres, M, N, rows_per_program, p,
    IS_RMS: tl.constexpr, HAS_B: tl.constexpr, HAS_W1: tl.constexpr, HAS_B1: tl.constexpr,
    HAS_DRES_OUT: tl.constexpr, STORE_DRES: tl.constexpr, HAS_ROWSCALE: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    ZERO_CENTERED: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_BLOCK: tl.constexpr,
    ROW_STAGES: tl.constexpr,
):
    # Each program owns a contiguous run of rows and one row of the (programs, N) weight-gradient partials,
    # which the launcher sums: no atomics, and a deterministic result.
    pid = tl.program_id(0)
    row_start = pid.to(tl.int64) * rows_per_program
    n_rows = tl.minimum(rows_per_program, M - row_start)
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(SEED)
    partial = pid.to(tl.int64) * N
    if SINGLE_BLOCK:
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        db = tl.zeros([BLOCK_N], dtype=tl.float32)
        dw1 = tl.zeros([BLOCK_N], dtype=tl.float32)
        db1 = tl.zeros([BLOCK_N], dtype=tl.float32)
        for i in tl.range(0, n_rows, num_stages=ROW_STAGES):
            row = row_start + i
            mean = 0.0
            if not IS_RMS:
                mean = tl.load(MEAN + row)
            rstd = tl.load(RSTD + row)
            xhat, dy, dy1, wdy = _bwd_block_terms(H, W, W1, DY, DY1, row, cols, mask, mean, rstd, stride_h,
                                                  stride_dy, stride_dy1, HAS_W1, ZERO_CENTERED)
            dw += dy * xhat
            db += dy
            if HAS_W1:
                dw1 += dy1 * xhat
                db1 += dy1
            if IS_RMS:
                c1 = tl.sum(xhat * wdy, axis=0) / N
                dh = (wdy - xhat * c1) * rstd
            else:
                # Both row sums in one reduction: one cross-warp exchange per row instead of two.
                s1, s2 = tl.reduce((xhat * wdy, wdy), 0, _add_pairs)
                dh = (wdy - (xhat * (s1 / N) + s2 / N)) * rstd
            _bwd_store_dx(DX, DRES, DRES_OUT, ROWSCALE, seed, row, cols, mask, N, p, dh, stride_dx, stride_dres,
                          stride_dres_out, HAS_DRES_OUT, STORE_DRES, HAS_ROWSCALE, HAS_DROPOUT)
        tl.store(DW + partial + cols, dw, mask=mask)
        if HAS_B:
            tl.store(DB + partial + cols, db, mask=mask)
        if HAS_W1:
            tl.store(DW1 + partial + cols, dw1, mask=mask)
            if HAS_B1:
                tl.store(DB1 + partial + cols, db1, mask=mask)
    else:
        # Wide rows: pass 1 reduces the two row sums, pass 2 writes dx and adds into this program's partials
        # (zero-initialised by the launcher) block by block.
        for i in range(0, n_rows):
            row = row_start + i
            mean = 0.0
            if not IS_RMS:
                mean = tl.load(MEAN + row)
            rstd = tl.load(RSTD + row)
            acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
            acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                mask = cols < N
                xhat, dy, dy1, wdy = _bwd_block_terms(H, W, W1, DY, DY1, row, cols, mask, mean, rstd, stride_h,
                                                      stride_dy, stride_dy1, HAS_W1, ZERO_CENTERED)
                acc1 += xhat * wdy
                acc2 += wdy
            c1 = tl.sum(acc1, axis=0) / N
            c2 = tl.sum(acc2, axis=0) / N
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                mask = cols < N
                xhat, dy, dy1, wdy = _bwd_block_terms(H, W, W1, DY, DY1, row, cols, mask, mean, rstd, stride_h,
                                                      stride_dy, stride_dy1, HAS_W1, ZERO_CENTERED)
                if IS_RMS:
                    dh = (wdy - xhat * c1) * rstd
                else:
                    dh = (wdy - (xhat * c1 + c2)) * rstd
                _bwd_store_dx(DX, DRES, DRES_OUT, ROWSCALE, seed, row, cols, mask, N, p, dh, stride_dx,
                              stride_dres, stride_dres_out, HAS_DRES_OUT, STORE_DRES, HAS_ROWSCALE, HAS_DROPOUT)
                tl.store(DW + partial + cols, tl.load(DW + partial + cols, mask=mask) + dy * xhat, mask=mask)
                if HAS_B:
                    tl.store(DB + partial + cols, tl.load(DB + partial + cols, mask=mask) + dy, mask=mask)
                if HAS_W1:
                    tl.store(DW1 + partial + cols, tl.load(DW1 + partial + cols, mask=mask) + dy1 * xhat, mask=mask)
                    if HAS_B1:
                        tl.store(DB1 + partial + cols, tl.load(DB1 + partial + cols, mask=mask) + dy1, mask=mask)
