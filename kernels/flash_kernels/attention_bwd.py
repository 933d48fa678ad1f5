"""The attention backward's Triton kernels: the row term delta = rowsum(dO * O), dK/dV (one program per key
block, looping over the query rows and, for GQA, the q heads of its kv head or a share of them) and dQ (one
program per query block). Atomics-free, hence deterministic. Launched by ``attention._attn_bwd_impl``."""

from __future__ import annotations

from ._autotune_cache import cached_autotune
from ._launch import lean_launch
from ._triton_compat import tl, triton
from .attention_tiles import (
    _LN2, _LOG2E, _configs, _head_seed, _keep, _key_range, _load_rows, _mm, _prune_big_head, _scores, _seq_bounds,
    _store_rows,
)


@lean_launch
@triton.jit
def _bwd_preprocess_kernel(O, DO, Delta, CuQ, stride_ob, stride_os, stride_oh, stride_db, stride_ds, stride_dh,
                           stride_lb, stride_lh, seqlen_q, n_heads,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta[b, h, i] = sum_d dO * O, the row term of the softmax gradient."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    q_start, len_q, _, _ = _seq_bounds(CuQ, CuQ, b, seqlen_q, seqlen_q, VARLEN)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    b64 = b.to(tl.int64)
    o = _load_rows(O + b64 * stride_ob + (q_start + offs_m[:, None]).to(tl.int64) * stride_os + h * stride_oh + offs_d[None, :],
                   offs_m, len_q, offs_d, HEAD_DIM, BLOCK_D, True)
    do = _load_rows(DO + b64 * stride_db + (q_start + offs_m[:, None]).to(tl.int64) * stride_ds + h * stride_dh + offs_d[None, :],
                    offs_m, len_q, offs_d, HEAD_DIM, BLOCK_D, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + b64 * stride_lb + h * stride_lh + q_start + offs_m, delta, mask=offs_m < len_q)


@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_ds, offs_n, offs_d, lo, hi,
                    len_q, len_k, left, right, scale_log2, softcap, slope_log2, seed, max_k, dropout_p,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, MASK: tl.constexpr,
               DOT_F32: tl.constexpr):
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load_rows(q_base + offs_m[:, None] * stride_qs + offs_d[None, :], offs_m, len_q, offs_d, HEAD_DIM, BLOCK_D, MASK)
        do = _load_rows(do_base + offs_m[:, None] * stride_ds + offs_d[None, :], offs_m, len_q, offs_d, HEAD_DIM, BLOCK_D, MASK)
        if MASK:
            lse = tl.load(lse_base + offs_m, mask=offs_m < len_q, other=0.0)
            delta = tl.load(delta_base + offs_m, mask=offs_m < len_q, other=0.0)
        else:
            lse = tl.load(lse_base + offs_m)
            delta = tl.load(delta_base + offs_m)
        lse = tl.where(lse == float("-inf"), float("inf"), lse) * _LOG2E  # empty rows: p = 0
        # Work on the transposed tile (keys x rows) so dK, dV accumulate without a transpose.
        qkT = _mm(k, tl.trans(q), None, DOT_F32)  # (N, M)
        sT, tT = _scores(qkT, offs_m[None, :], offs_n[:, None], len_q, len_k, left, right, scale_log2, softcap,
                         slope_log2, SOFTCAP, ALIBI, MASK)
        pT = tl.math.exp2(sT - lse[None, :])  # (N, M)
        dpT = _mm(v, tl.trans(do), None, DOT_F32)  # (N, M)
        if DROPOUT:
            keepT = _keep(seed, offs_m[None, :], offs_n[:, None], max_k, dropout_p)
            inv = 1.0 / (1.0 - dropout_p)
            dv = _mm(tl.where(keepT, pT * inv, 0.0).to(do.dtype), do, dv, DOT_F32)
            dpT = tl.where(keepT, dpT * inv, 0.0)
        else:
            dv = _mm(pT.to(do.dtype), do, dv, DOT_F32)
        dsT = pT * (dpT - delta[None, :])
        if SOFTCAP:
            dsT = dsT * (1.0 - tT * tT)
        dk = _mm(dsT.to(q.dtype), q, dk, DOT_F32)
    return dk, dv


@triton.jit
def _q_range(n0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, len_q, len_k, left, right, KEYS_PARTIAL):
    """Query-row ranges that see keys [n0, n0 + BLOCK_N): masked [lo, full_lo), unmasked, masked [full_hi, hi)."""
    off = len_k - len_q
    lo = tl.maximum(n0 - off - right, 0) // BLOCK_M * BLOCK_M
    hi = tl.minimum(n0 + BLOCK_N - 1 - off + left + 1, len_q)
    hi = tl.maximum(hi, lo)
    full_lo = (tl.maximum(n0 + BLOCK_N - 1 - off - right, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(n0 - off + left + 1, len_q) // BLOCK_M * BLOCK_M
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    if KEYS_PARTIAL:  # the key bound needs the mask on every row block
        full_lo = hi
        full_hi = hi
    return lo, full_lo, full_hi, hi


def _bwd_configs(kind):
    """Autotune candidates of the two backward kernels. dQ's 128 x 64 with 4 warps and 3 stages: at head dim 64,
    S 4k, non-causal (the thinnest point of ``bench attention``'s grid) it made the H100's forward + backward
    5% faster than 64 x 64 w4 s3, the autotuner's pick without it."""
    if kind == "dkdv":
        return _configs([(32, 128, 4, 3), (64, 128, 8, 2), (64, 64, 4, 3), (32, 64, 4, 3), (32, 64, 4, 4)])
    return _configs([(128, 32, 4, 3), (128, 64, 8, 2), (64, 64, 4, 3), (64, 32, 4, 3), (64, 32, 4, 4),
                     (128, 64, 4, 3)])


@cached_autotune
@triton.autotune(configs=_bwd_configs("dkdv"),
                 key=["tune_q", "tune_k", "BLOCK_D", "CAUSAL_OR_LOCAL", "DROPOUT", "group", "group_splits"],
                 prune_configs_by={"early_config_prune": _prune_big_head})
@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, Delta, CuQ, CuK, Alibi,
    scale_log2, softcap, dropout_p, Seed,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
    stride_lb, stride_lh, stride_ab,
    seqlen_q, seqlen_k, n_heads, group, group_splits, left, right, tune_q, tune_k,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, VARLEN: tl.constexpr, CAUSAL_OR_LOCAL: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program per (key block, batch, kv head, share of the GQA group): it loops over its share of the kv
    head's q heads, so their dK/dV sum stays in registers (no atomics). With ``group_splits`` shares, share s
    writes its sum to head ``hk * group_splits + s`` of DK and DV (float32 buffers the caller then sums over
    the shares); with one, to head hk."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    n_kv_heads = n_heads // group
    share = pid_bh % group_splits
    b = pid_bh // group_splits // n_kv_heads
    hk = pid_bh // group_splits % n_kv_heads
    per_share = tl.cdiv(group, group_splits)
    g_lo = share * per_share
    g_hi = tl.minimum(g_lo + per_share, group)
    q_start, len_q, k_start, len_k = _seq_bounds(CuQ, CuK, b, seqlen_q, seqlen_k, VARLEN)
    n0 = pid_n * BLOCK_N
    if n0 >= len_k:
        return
    b64 = b.to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_rows(K + b64 * stride_kb + (k_start + offs_n[:, None]).to(tl.int64) * stride_ks + hk * stride_kh + offs_d[None, :],
                   offs_n, len_k, offs_d, HEAD_DIM, BLOCK_D, True)
    v = _load_rows(V + b64 * stride_vb + (k_start + offs_n[:, None]).to(tl.int64) * stride_vs + hk * stride_vh + offs_d[None, :],
                   offs_n, len_k, offs_d, HEAD_DIM, BLOCK_D, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    keys_partial = n0 + BLOCK_N > len_k
    if CAUSAL_OR_LOCAL:
        lo, full_lo, full_hi, hi = _q_range(n0, BLOCK_M, BLOCK_N, len_q, len_k, left, right, keys_partial)
    else:
        lo = 0
        hi = len_q
        full_lo = 0
        full_hi = tl.where(keys_partial, 0, len_q // BLOCK_M * BLOCK_M)
    for g in range(g_lo, g_hi):
        h = hk * group + g
        q_base = Q + b64 * stride_qb + q_start.to(tl.int64) * stride_qs + h * stride_qh
        do_base = DO + b64 * stride_db + q_start.to(tl.int64) * stride_ds + h * stride_dh
        lse_base = LSE + b64 * stride_lb + h * stride_lh + q_start
        delta_base = Delta + b64 * stride_lb + h * stride_lh + q_start
        slope_log2 = 0.0
        if ALIBI:
            slope_log2 = tl.load(Alibi + b * stride_ab + h).to(tl.float32) * _LOG2E
        seed_bh = _head_seed(Seed, b, n_heads, h, DROPOUT)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_ds, offs_n, offs_d,
                                 lo, full_lo, len_q, len_k, left, right, scale_log2, softcap, slope_log2, seed_bh,
                                 seqlen_k, dropout_p, HEAD_DIM, BLOCK_D, BLOCK_M, SOFTCAP, ALIBI, DROPOUT, True, DOT_F32)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_ds, offs_n, offs_d,
                                 full_lo, full_hi, len_q, len_k, left, right, scale_log2, softcap, slope_log2, seed_bh,
                                 seqlen_k, dropout_p, HEAD_DIM, BLOCK_D, BLOCK_M, SOFTCAP, ALIBI, DROPOUT, False, DOT_F32)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_ds, offs_n, offs_d,
                                 full_hi, hi, len_q, len_k, left, right, scale_log2, softcap, slope_log2, seed_bh,
                                 seqlen_k, dropout_p, HEAD_DIM, BLOCK_D, BLOCK_M, SOFTCAP, ALIBI, DROPOUT, True, DOT_F32)
    # scores were scaled by softmax_scale before the softmax; dK picks that factor up here.
    dk = dk * (scale_log2 * _LN2)
    h_out = hk * group_splits + share
    _store_rows(DK + b64 * stride_dkb + (k_start + offs_n[:, None]).to(tl.int64) * stride_dks + h_out * stride_dkh + offs_d[None, :],
                dk.to(DK.dtype.element_ty), offs_n, len_k, offs_d, HEAD_DIM, BLOCK_D)
    _store_rows(DV + b64 * stride_dvb + (k_start + offs_n[:, None]).to(tl.int64) * stride_dvs + h_out * stride_dvh + offs_d[None, :],
                dv.to(DV.dtype.element_ty), offs_n, len_k, offs_d, HEAD_DIM, BLOCK_D)


@triton.jit
def _bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_vs, offs_m, offs_d, lo, hi,
                  len_q, len_k, left, right, scale_log2, softcap, slope_log2, seed, max_k, dropout_p,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, MASK: tl.constexpr,
               DOT_F32: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_rows(k_base + offs_n[:, None] * stride_ks + offs_d[None, :], offs_n, len_k, offs_d, HEAD_DIM, BLOCK_D, MASK)
        v = _load_rows(v_base + offs_n[:, None] * stride_vs + offs_d[None, :], offs_n, len_k, offs_d, HEAD_DIM, BLOCK_D, MASK)
        qk = _mm(q, tl.trans(k), None, DOT_F32)
        s, t = _scores(qk, offs_m[:, None], offs_n[None, :], len_q, len_k, left, right, scale_log2, softcap, slope_log2,
                       SOFTCAP, ALIBI, MASK)
        p = tl.math.exp2(s - lse[:, None])
        dp = _mm(do, tl.trans(v), None, DOT_F32)
        if DROPOUT:
            keep = _keep(seed, offs_m[:, None], offs_n[None, :], max_k, dropout_p)
            dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq = _mm(ds.to(k.dtype), k, dq, DOT_F32)
    return dq


@cached_autotune
@triton.autotune(configs=_bwd_configs("dq"), key=["tune_q", "tune_k", "BLOCK_D", "CAUSAL_OR_LOCAL", "DROPOUT"],
                 prune_configs_by={"early_config_prune": _prune_big_head})
@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE, Delta, CuQ, CuK, Alibi,
    scale_log2, softcap, dropout_p, Seed,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh, stride_dqb, stride_dqs, stride_dqh, stride_lb, stride_lh, stride_ab,
    seqlen_q, seqlen_k, n_heads, group, left, right, tune_q, tune_k,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, VARLEN: tl.constexpr, CAUSAL_OR_LOCAL: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if CAUSAL_OR_LOCAL:  # causal: the last row blocks have the most keys; start them first (less tail)
        pid_m = tl.num_programs(0) - 1 - pid_m
    pid_bh = tl.program_id(1)
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    q_start, len_q, k_start, len_k = _seq_bounds(CuQ, CuK, b, seqlen_q, seqlen_k, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= len_q:
        return
    b64 = b.to(tl.int64)
    hk = h // group
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < len_q
    q = _load_rows(Q + b64 * stride_qb + (q_start + offs_m[:, None]).to(tl.int64) * stride_qs + h * stride_qh + offs_d[None, :],
                   offs_m, len_q, offs_d, HEAD_DIM, BLOCK_D, True)
    do = _load_rows(DO + b64 * stride_db + (q_start + offs_m[:, None]).to(tl.int64) * stride_ds + h * stride_dh + offs_d[None, :],
                    offs_m, len_q, offs_d, HEAD_DIM, BLOCK_D, True)
    lse = tl.load(LSE + b64 * stride_lb + h * stride_lh + q_start + offs_m, mask=row_ok, other=0.0)
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * _LOG2E
    delta = tl.load(Delta + b64 * stride_lb + h * stride_lh + q_start + offs_m, mask=row_ok, other=0.0)
    k_base = K + b64 * stride_kb + k_start.to(tl.int64) * stride_ks + hk * stride_kh
    v_base = V + b64 * stride_vb + k_start.to(tl.int64) * stride_vs + hk * stride_vh
    slope_log2 = 0.0
    if ALIBI:
        slope_log2 = tl.load(Alibi + b * stride_ab + h).to(tl.float32) * _LOG2E
    seed_bh = _head_seed(Seed, b, n_heads, h, DROPOUT)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if CAUSAL_OR_LOCAL:
        lo, full_lo, full_hi, hi = _key_range(m0, BLOCK_M, BLOCK_N, len_q, len_k, left, right)
    else:
        lo = 0
        full_lo = 0
        full_hi = len_k // BLOCK_N * BLOCK_N
        hi = len_k
    dq = _bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_vs, offs_m, offs_d, lo, full_lo, len_q, len_k,
                       left, right, scale_log2, softcap, slope_log2, seed_bh, seqlen_k, dropout_p,
                       HEAD_DIM, BLOCK_D, BLOCK_N, SOFTCAP, ALIBI, DROPOUT, True, DOT_F32)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_vs, offs_m, offs_d, full_lo, full_hi, len_q, len_k,
                       left, right, scale_log2, softcap, slope_log2, seed_bh, seqlen_k, dropout_p,
                       HEAD_DIM, BLOCK_D, BLOCK_N, SOFTCAP, ALIBI, DROPOUT, False, DOT_F32)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_vs, offs_m, offs_d, full_hi, hi, len_q, len_k,
                       left, right, scale_log2, softcap, slope_log2, seed_bh, seqlen_k, dropout_p,
                       HEAD_DIM, BLOCK_D, BLOCK_N, SOFTCAP, ALIBI, DROPOUT, True, DOT_F32)
    dq = dq * (scale_log2 * _LN2)
    _store_rows(DQ + b64 * stride_dqb + (q_start + offs_m[:, None]).to(tl.int64) * stride_dqs + h * stride_dqh + offs_d[None, :],
                dq.to(DQ.dtype.element_ty), offs_m, len_q, offs_d, HEAD_DIM, BLOCK_D)
