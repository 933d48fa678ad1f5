"""Attention over a KV cache (decoding), as FlashAttention-2's ``flash_attn_with_kvcache``, with its arguments.

The new keys/values (if given; rotated first with ``rotary_cos``/``rotary_sin``) are written into the cache in
place at positions ``cache_seqlens[b] ...``; then the queries attend over cache entries
[``cache_leftpad[b]``, ``cache_seqlens[b] + S_new``), masks aligned bottom-right (the last query row sits at the
last key). ``cache_seqlens`` is the length *before* the append and is not modified; the caller advances it.
A per-row cache read through ``cache_batch_idx`` is taken as a paged cache whose pages are its rows.

The Triton path uses a split-KV ("flash-decoding") schedule: the cache is cut into chunks along its length,
one program per (chunk, batch, kv head) computes a partial softmax over its chunk for all query rows of the
kv head's GQA group at once (each K/V byte is read once), and a second kernel merges the partials by their
log-sum-exp. With batch 1 and a long cache the chunks fill the GPU; when batch x kv heads already fill it and
the cache is short, one chunk writes the output directly and the merge launch is skipped. A paged cache (``block_table``) is
read through the table, row by row, so any page size works.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ._backend import capturing_cuda_graph, triton_interpreter_enabled, use_triton
from ._launch import lean_launch
from ._triton_compat import tl, triton
from ._pdl import enabled as programmatic_launch_enabled
from ._pdl import TRIGGER_BEFORE_WAIT, launch_options, wait_for_predecessor
from ._triton_utils import cdiv, next_power_of_2, sm_count, unit_last_stride
from .attention import _check_common, _check_float_dtype, _triton_unsupported, _window_bounds, block_d
from .attention_ref import _alibi_2d, _attention_ref
from .attention_tiles import _LOG2E, LN2, LOG2E, _load_rows, _mm, _scores, _store_rows
from .kv_append import _kv_append_op, kv_append_ref
from .rotary import apply_rotary

# ----------------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------------


def _rotary_positions(cache_seqlens, length, per_token):
    """(B, length) positions of new tokens: cache_seqlens[b] + t, or cache_seqlens[b] for every token."""
    base = cache_seqlens.long()[:, None]
    if per_token:
        return base + torch.arange(length, device=base.device)
    return base.expand(-1, length)


def _rotate_new(q, k, rotary_cos, rotary_sin, cache_seqlens, *, causal, window_size, interleaved, backend):
    """FA2's rotary in the kvcache call: the new keys rotate at positions cache_seqlens + t; the queries too when
    the attention is causal or local, else all at position cache_seqlens."""
    per_token_q = causal or tuple(window_size) != (-1, -1)
    k = apply_rotary(k, rotary_cos, rotary_sin, interleaved=interleaved, backend=backend,
                     position_ids=_rotary_positions(cache_seqlens, k.shape[1], True))
    q = apply_rotary(q, rotary_cos, rotary_sin, interleaved=interleaved, backend=backend,
                     position_ids=_rotary_positions(cache_seqlens, q.shape[1], per_token_q))
    return q, k


def _cache_table(block_table, cache_batch_idx):
    """The block table the kernels read: a paged cache's, or for a per-row cache read through ``cache_batch_idx``
    one page a row, the whole row (a per-row cache is a paged one whose pages are its rows), or None."""
    if block_table is not None or cache_batch_idx is None:
        return block_table
    return cache_batch_idx[:, None]


def _gather_cache(cache, b, start, length, block_table):
    """(length - start, Hkv, D): entries [start, length) of batch row b's cache."""
    if block_table is None:
        return cache[b, start:length]
    page_size = cache.shape[1]
    n_pages = -(-length // page_size)
    pages = block_table[b, :n_pages].long()
    return cache[pages].reshape(-1, *cache.shape[2:])[start:length]


def flash_attn_with_kvcache_ref(
    q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
    cache_leftpad=None, block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    rotary_interleaved=True, alibi_slopes=None, return_softmax_lse=False,
):
    """Plain PyTorch reference, FA2's semantics: rotates and appends k/v in place, then attends per batch row over
    its cache entries [cache_leftpad[b], cache_seqlens[b] + S_new) in float32. The caller has checked the inputs
    (``flash_attn_with_kvcache`` does)."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    table = _cache_table(block_table, cache_batch_idx)
    cache_seqlens = _seqlens_tensor(cache_seqlens, q, _capacity(k_cache, table))
    if rotary_cos is not None:
        q, k = _rotate_new(q, k, rotary_cos, rotary_sin, cache_seqlens, causal=causal, window_size=window_size,
                           interleaved=rotary_interleaved, backend="reference")
    s_new = 0
    if k is not None:
        s_new = k.shape[1]
        slots = cache_seqlens.long()[:, None] + torch.arange(s_new, device=k.device)  # (B, S_new)
        kv_append_ref(k_cache, v_cache, k, v, slots, block_table=table)
    alibi = _alibi_2d(alibi_slopes, q.shape[0], q.shape[2])
    starts = cache_leftpad.tolist() if cache_leftpad is not None else [0] * q.shape[0]
    outs, lses = [], []
    for b, length in enumerate((cache_seqlens + s_new).tolist()):
        kb = _gather_cache(k_cache, b, starts[b], length, table)[None]  # (1, L, Hkv, D)
        vb = _gather_cache(v_cache, b, starts[b], length, table)[None]
        o, lse = _attention_ref(q[b:b + 1], kb, vb, causal=causal, softmax_scale=scale, window_size=tuple(window_size),
                                softcap=softcap, alibi_slopes=None if alibi is None else alibi[b:b + 1],
                                dropout_p=0.0, dropout_mask=None)
        outs.append(o)
        lses.append(lse)
    if not outs:  # an empty batch
        out, lse = q.new_empty(q.shape), q.new_empty(0, q.shape[2], q.shape[1], dtype=torch.float32)
        return (out, lse) if return_softmax_lse else out
    out = torch.cat(outs, dim=0)
    return (out, torch.cat(lses, dim=0)) if return_softmax_lse else out


# ----------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------


# Split-KV schedule. A decode step reads each K/V byte once, so what matters is keeping every SM streaming:
# about DECODE_PROGRAMS_PER_SM programs per SM, each over a chunk of at least DECODE_MIN_CHUNK keys. Chunks are
# multiples of CHUNK_ALIGN so no key tile (BLOCK_N <= CHUNK_ALIGN) straddles two splits.
# DECODE_TILE = (BLOCK_N, num_warps, num_stages) is fixed, not autotuned: autotuning re-reads one cache and so
# measures L2, not HBM. Three stages of 64-key K and V tiles (96 KB at head dim 128) leave room for two
# programs per SM. The schedule numbers come from `flash-models bench attention --decode-sweep` on an H200:
# 2 programs per SM is best at batch 1 (the target case; batch 16 prefers 4). Merging the splits inside this
# kernel (an atomic counter, the last split merges) instead of a second launch gains nothing: inside a CUDA
# graph the merge launch is free.
# Chunks are as short as 64 keys (a tile per program, the merge launch after): a graph's split plan follows the
# cache's capacity, which generation rounds up to 256 positions, and with longer minimum chunks a short cache
# decodes in one or two programs per kv head walking several tiles in a row (GPT-2's batch-1 step is faster
# with 64, LLaMA-1.1B's level: `flash-models bench generate --batches 1`).
# The split count is rounded down, so the programs never pass one wave of DECODE_PROGRAMS_PER_SM per SM (the
# occupancy the tile allows): rounding up sends batch 16 x 16 kv heads over 8k keys (256 programs, 132 SMs) to
# two splits, 512 programs in 1.94 waves, against one split with no merge launch, which streams at copy
# bandwidth (`bench attention --decode-sweep`). It also gives GPT-2 at batch 16 (192 programs over a few
# hundred keys) one split.
DECODE_PROGRAMS_PER_SM = 2
DECODE_MIN_CHUNK = 64
CHUNK_ALIGN = 128
DECODE_TILE = (64, 4, 3)
# A split walking a long chunk of a contiguous cache at head dims 65-128 loads its next key tile into registers
# before the current tile's dots (``PREFETCH_NEXT``), with no cp.async stages: the compiled pipeline above
# issues tile i+2's copies only after tile i's dots, so one tile is in flight while a tile is computed. It wins
# on long chunks at head dims 65-128 (`flash-models bench attention --decode-batch 16,32 --decode-kv 4096,8192`:
# one split streams at copy bandwidth), and loses at head dim 256 (registers), on shorter chunks and on paged
# caches, whose rows come through the block table; at head dim 64 it is mixed, so it stays off there.
PREFETCH_NEXT_MIN_CHUNK = 4096
# Under programmatic launch with the early trigger (batch 1) the split kernel reads the start of its chunk
# before it waits for the kernel before it (``_prefetch_kv``), in one of two ways (``_prefetch_mode``):
# - PREFETCH_REGISTERS: the first key tiles into registers, PREFETCH_TILES_HEAD_DIM_64 of them at head dims up to
#   64, one above (at head dim 128 two tiles are 64 KB of registers a program, and spill);
# - WAIT_IN_LOOP: the wait moves into the pipelined key loop's first step, so the tiles the pipeliner loads ahead
#   of the loop (its first stages, in shared memory) go out before it: head dim 65-128, contiguous cache, with
#   four stages (DECODE_TILE_WAIT_IN_LOOP, one program a SM) on chunks of WAIT_IN_LOOP_LONG_CHUNK keys or more.
# On an H200, waiting in the loop with four stages beats one register tile at 8k keys (the shipped mode reads
# about 0.81 of copy bandwidth there: `flash-models bench attention --skip-train --decode-batch 1`); on 2k-key
# caches (128-key chunks) three stages beat four, and head dim 64 prefers registers. Two register tiles are attended as two 64-key dots, the same arithmetic as plain launches (bit for
# bit). Paged caches and head dim 256 keep the register tile (not measured in the loop).
PREFETCH_REGISTERS, WAIT_IN_LOOP = 1, 2
PREFETCH_TILES_HEAD_DIM_64 = 2
WAIT_IN_LOOP_LONG_CHUNK = 512
DECODE_TILE_WAIT_IN_LOOP = (64, 4, 4)
DECODE_TILE_PREFETCH_NEXT = (64, 4, 1)

# The merge kernel is one program per query row and head, a latency chain (load, reduce over the splits, store)
# at batch 1. In one warp its reductions over the splits stay in registers and shuffles; with more, they cross
# warps through shared memory, which costs a short decode step several percent of copy bandwidth at batch 1
# (`bench attention --decode-batch 1`; batch 16 is level). One warp holds (splits x head dim) float32 partials:
# up to COMBINE_ONE_WARP_ELEMENTS (128 a thread) at head dims up to 128; bigger merges (many splits: MQA at
# batch 1) keep four warps, and so does head dim 256, where one warp is no faster.
COMBINE_ONE_WARP_ELEMENTS = 4096


@triton.jit
def _kv_rows(BlockTable, b64, offs_n, n_ok, stride_btb, stride_kb, stride_ks, stride_vb, stride_vs, page_size,
             n_pages, PAGED: tl.constexpr):
    """(K offsets, V offsets, which rows to read) for cache rows ``offs_n`` of batch row b: the rows in ``n_ok``,
    paged through the block table, less those whose page id is outside the pool's [0, n_pages). The host checks
    the ids where that costs no sync, but a CUDA graph's replay runs no host code: such a row is clamped to a
    real page (its address stays inside the pool) and left out (its load is masked, its score -inf)."""
    if PAGED:
        page = tl.load(BlockTable + b64 * stride_btb + offs_n // page_size, mask=n_ok, other=0)
        ok = n_ok & (page >= 0) & (page < n_pages)
        page = tl.minimum(tl.maximum(page, 0), n_pages - 1).to(tl.int64)
        return (page * stride_kb + (offs_n % page_size) * stride_ks,
                page * stride_vb + (offs_n % page_size) * stride_vs, ok)
    return b64 * stride_kb + offs_n.to(tl.int64) * stride_ks, b64 * stride_vb + offs_n.to(tl.int64) * stride_vs, n_ok


@triton.jit
def _load_keys(ptrs, ok, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """A (N, BLOCK_D) tile of cache rows, zeros in the rows not ``ok``; masked along the head dim only where it is
    padded (see ``_load_rows``)."""
    if HEAD_DIM == BLOCK_D:
        return tl.load(ptrs, mask=ok[:, None], other=0.0)
    return tl.load(ptrs, mask=ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)


@triton.jit
def _kv_tile(K, V, BlockTable, b64, hk, offs_n, hi, offs_d, stride_btb, stride_kb, stride_ks, stride_kh, stride_vb,
             stride_vs, stride_vh, page_size, n_pages, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
             PAGED: tl.constexpr):
    """(K, V, keys) for rows ``offs_n`` of kv head hk of batch row b: K and V (N, D) each, zeros in the rows that
    are not keys (from ``hi`` on, or on a page outside the pool: ``keys`` is False there)."""
    k_rows, v_rows, keys = _kv_rows(BlockTable, b64, offs_n, offs_n < hi, stride_btb, stride_kb, stride_ks, stride_vb,
                                    stride_vs, page_size, n_pages, PAGED)
    k = _load_keys(K + k_rows[:, None] + hk * stride_kh + offs_d[None, :], keys, offs_d, HEAD_DIM, BLOCK_D)
    v = _load_keys(V + v_rows[:, None] + hk * stride_vh + offs_d[None, :], keys, offs_d, HEAD_DIM, BLOCK_D)
    return k, v, keys


@triton.jit
def _with_fresh_rows(k, v, keys, K, V, BlockTable, b64, hk, offs_n, hi, fresh_from, offs_d, stride_btb, stride_kb,
                     stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, page_size, n_pages, HEAD_DIM: tl.constexpr,
                     PAGED: tl.constexpr):
    """Tiles k, v, keys (read before the wait, for the rows below ``fresh_from``) with the rows from ``fresh_from``
    to ``hi`` read now."""
    fresh = (offs_n >= fresh_from) & (offs_n < hi)
    k_rows, v_rows, fresh_keys = _kv_rows(BlockTable, b64, offs_n, fresh, stride_btb, stride_kb, stride_ks, stride_vb,
                                          stride_vs, page_size, n_pages, PAGED)
    mask = fresh_keys[:, None] & (offs_d[None, :] < HEAD_DIM)
    k = tl.where(fresh[:, None], tl.load(K + k_rows[:, None] + hk * stride_kh + offs_d[None, :], mask=mask, other=0.0), k)
    v = tl.where(fresh[:, None], tl.load(V + v_rows[:, None] + hk * stride_vh + offs_d[None, :], mask=mask, other=0.0), v)
    return k, v, keys | fresh_keys


@triton.jit
def _attend_tile(q, k, v, keys, m_i, l_i, acc, i, offs_n, seqlen_q, len_k, left, right, scale_log2, softcap,
                 slope_log2, kv_lo, PAGED: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
                 LEFTPAD: tl.constexpr, DOT_F32: tl.constexpr):
    """The online softmax over one key tile: (m_i, l_i, acc) updated. ``slope_log2`` (ALIBI) is per row (M, 1);
    with LEFTPAD the keys before ``kv_lo`` are invisible; PAGED: so are the rows on no valid page (not ``keys``:
    the other rows past the keys are masked by their position)."""
    qk = _mm(q, tl.trans(k), None, DOT_F32)  # (M, N)
    s, _ = _scores(qk, i[:, None], offs_n[None, :], seqlen_q, len_k, left, right, scale_log2, softcap, slope_log2,
                   SOFTCAP, ALIBI, True)
    if PAGED:
        s = tl.where(keys[None, :], s, float("-inf"))
    if LEFTPAD:
        s = tl.where(offs_n[None, :] >= kv_lo, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: keep m = -inf, exp2 finite
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = _mm(p.to(v.dtype), v, acc * alpha[:, None], DOT_F32)
    return m_new, l_i, acc


@lean_launch
@triton.jit
def _decode_split_kernel(
    Q, K, V, Opart, Lpart, O, Seqlens, BlockTable, Leftpad, Alibi, scale_log2, softcap,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_btb, stride_ps, stride_pb, stride_ph, stride_pq, stride_lps, stride_lpb, stride_lph,
    stride_ob, stride_os, stride_oh, stride_ab,
    seqlen_q, n_new, group, n_kv_heads, left, right, chunk, page_size, n_pages, capacity,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, LEFTPAD: tl.constexpr, DOT_F32: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr, PDL: tl.constexpr, PREFETCH_KV: tl.constexpr, PREFETCH_TILES: tl.constexpr,
    PREFETCH_NEXT: tl.constexpr,
):
    """Partial attention of the GQA group's query rows over cache chunk ``split``. Rows r = g * Sq + i.
    With SINGLE_SPLIT (one chunk covers the cache) the rows are final: written to O, no merge needed.
    PREFETCH_KV (PREFETCH_REGISTERS: PREFETCH_TILES tiles; WAIT_IN_LOOP: the pipeliner's first stages): the start
    of the chunk is read before the wait for the kernel before (see ``_prefetch_kv``), all but the newest keys,
    which that kernel may still be writing. PREFETCH_NEXT: the key loop loads tile n+1 into registers before tile
    n's dots (see PREFETCH_NEXT_MIN_CHUNK)."""
    split = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // n_kv_heads
    hk = pid_bh % n_kv_heads
    b64 = b.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    if PREFETCH_KV == 0:
        wait_for_predecessor(PDL)  # inside flash_kernels.programmatic_launch(): see _pdl
    # Never past the cache's ``capacity`` keys (the caller checks the lengths where that costs no sync; a length
    # it cannot check, in a CUDA graph's capture, must still not read past the cache or the block table).
    len_k = tl.minimum(tl.load(Seqlens + b) + n_new, capacity)
    kv_lo = 0
    if LEFTPAD:  # the row's cache starts at kv_lo (FA2's cache_leftpad): whole tiles before it are skipped
        kv_lo = tl.load(Leftpad + b)
    # Keys any row may see, intersected with this split's chunk.
    off = len_k - seqlen_q
    lo = tl.maximum(split * chunk, tl.maximum(tl.maximum(off - left, 0), kv_lo) // BLOCK_N * BLOCK_N)
    hi = tl.minimum(tl.minimum((split + 1) * chunk, len_k), seqlen_q - 1 + off + right + 1)
    start = lo
    fresh_from = len_k - tl.maximum(seqlen_q, n_new)  # the keys the kernel before may be appending
    if PREFETCH_KV == 1:  # PREFETCH_REGISTERS: the first key tiles into registers, all but their fresh rows
        first = lo + tl.arange(0, BLOCK_N)
        k0, v0, keys0 = _kv_tile(K, V, BlockTable, b64, hk, first, tl.minimum(hi, fresh_from), offs_d, stride_btb,
                                 stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, page_size, n_pages,
                                 HEAD_DIM, BLOCK_D, PAGED)
        if PREFETCH_TILES == 2:
            k1, v1, keys1 = _kv_tile(K, V, BlockTable, b64, hk, first + BLOCK_N, tl.minimum(hi, fresh_from), offs_d,
                                     stride_btb, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                     page_size, n_pages, HEAD_DIM, BLOCK_D, PAGED)
        wait_for_predecessor(PDL)
        k0, v0, keys0 = _with_fresh_rows(k0, v0, keys0, K, V, BlockTable, b64, hk, first, hi, fresh_from, offs_d,
                                         stride_btb, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                         page_size, n_pages, HEAD_DIM, PAGED)
        if PREFETCH_TILES == 2:
            k1, v1, keys1 = _with_fresh_rows(k1, v1, keys1, K, V, BlockTable, b64, hk, first + BLOCK_N, hi,
                                             fresh_from, offs_d, stride_btb, stride_kb, stride_ks, stride_kh,
                                             stride_vb, stride_vs, stride_vh, page_size, n_pages, HEAD_DIM, PAGED)
    offs_r = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_r < group * seqlen_q
    g = offs_r // seqlen_q
    i = offs_r % seqlen_q
    h = hk * group + g
    slope_log2 = 0.0
    if ALIBI:
        slope_log2 = (tl.load(Alibi + b64 * stride_ab + h, mask=row_ok, other=0.0) * _LOG2E)[:, None]
    q_ptrs = Q + b64 * stride_qb + i[:, None] * stride_qs + h[:, None] * stride_qh + offs_d[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if PREFETCH_KV == 2:  # WAIT_IN_LOOP
        # The wait sits in the key loop's first step, so the loads the pipeliner issues ahead of the loop (its
        # first stages) go out before it. Only tiles without a fresh key take that loop; the rest follow it.
        stale_hi = tl.maximum(tl.minimum(hi, fresh_from // BLOCK_N * BLOCK_N), lo)
        q = tl.zeros([BLOCK_M, BLOCK_D], dtype=Q.dtype.element_ty)
        for start_n in range(lo, stale_hi, BLOCK_N):
            if start_n == lo:
                wait_for_predecessor(PDL)
                q = _load_rows(q_ptrs, offs_r, group * seqlen_q, offs_d, HEAD_DIM, BLOCK_D, True)
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k, v, keys = _kv_tile(K, V, BlockTable, b64, hk, offs_n, hi, offs_d, stride_btb, stride_kb, stride_ks,
                                  stride_kh, stride_vb, stride_vs, stride_vh, page_size, n_pages, HEAD_DIM, BLOCK_D,
                                  PAGED)
            m_i, l_i, acc = _attend_tile(q, k, v, keys, m_i, l_i, acc, i, offs_n, seqlen_q, len_k, left, right,
                                         scale_log2, softcap, slope_log2, kv_lo, PAGED, SOFTCAP, ALIBI, LEFTPAD,
                                         DOT_F32)
        if stale_hi == lo:
            wait_for_predecessor(PDL)
            q = _load_rows(q_ptrs, offs_r, group * seqlen_q, offs_d, HEAD_DIM, BLOCK_D, True)
        # Unpipelined, as measured: only the tile holding the fresh keys runs here (in the last split).
        for start_n in tl.range(stale_hi, hi, BLOCK_N, num_stages=1):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k, v, keys = _kv_tile(K, V, BlockTable, b64, hk, offs_n, hi, offs_d, stride_btb, stride_kb, stride_ks,
                                  stride_kh, stride_vb, stride_vs, stride_vh, page_size, n_pages, HEAD_DIM, BLOCK_D,
                                  PAGED)
            m_i, l_i, acc = _attend_tile(q, k, v, keys, m_i, l_i, acc, i, offs_n, seqlen_q, len_k, left, right,
                                         scale_log2, softcap, slope_log2, kv_lo, PAGED, SOFTCAP, ALIBI, LEFTPAD,
                                         DOT_F32)
        start = hi
    else:
        q = _load_rows(q_ptrs, offs_r, group * seqlen_q, offs_d, HEAD_DIM, BLOCK_D, True)  # (M, D)
    if PREFETCH_KV == 1:
        # Tiles start BLOCK_N-aligned and a chunk ends on a multiple of BLOCK_N: a tile starting before ``hi``
        # holds no key of the next chunk.
        if lo < hi:
            m_i, l_i, acc = _attend_tile(q, k0, v0, keys0, m_i, l_i, acc, i, first, seqlen_q, len_k, left, right,
                                         scale_log2, softcap, slope_log2, kv_lo, PAGED, SOFTCAP, ALIBI, LEFTPAD,
                                         DOT_F32)
        if PREFETCH_TILES == 2:  # noqa: SIM102 (a compile-time branch: k1 and v1 exist only in it)
            if lo + BLOCK_N < hi:
                m_i, l_i, acc = _attend_tile(q, k1, v1, keys1, m_i, l_i, acc, i, first + BLOCK_N, seqlen_q, len_k,
                                             left, right, scale_log2, softcap, slope_log2, kv_lo, PAGED, SOFTCAP,
                                             ALIBI, LEFTPAD, DOT_F32)
        start = lo + PREFETCH_TILES * BLOCK_N
    if PREFETCH_NEXT:
        k_next, v_next, keys_next = _kv_tile(K, V, BlockTable, b64, hk, start + tl.arange(0, BLOCK_N), hi, offs_d,
                                             stride_btb, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                                             stride_vh, page_size, n_pages, HEAD_DIM, BLOCK_D, PAGED)
        for start_n in range(start, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k, v, keys = k_next, v_next, keys_next
            k_next, v_next, keys_next = _kv_tile(K, V, BlockTable, b64, hk, offs_n + BLOCK_N, hi, offs_d, stride_btb,
                                                 stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                                 page_size, n_pages, HEAD_DIM, BLOCK_D,
                                                 PAGED)  # past the chunk's end: masked, nothing read
            m_i, l_i, acc = _attend_tile(q, k, v, keys, m_i, l_i, acc, i, offs_n, seqlen_q, len_k, left, right,
                                         scale_log2, softcap, slope_log2, kv_lo, PAGED, SOFTCAP, ALIBI, LEFTPAD,
                                         DOT_F32)
    else:
        for start_n in range(start, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k, v, keys = _kv_tile(K, V, BlockTable, b64, hk, offs_n, hi, offs_d, stride_btb, stride_kb, stride_ks,
                                  stride_kh, stride_vb, stride_vs, stride_vh, page_size, n_pages, HEAD_DIM, BLOCK_D,
                                  PAGED)  # (N, D) each
            m_i, l_i, acc = _attend_tile(q, k, v, keys, m_i, l_i, acc, i, offs_n, seqlen_q, len_k, left, right,
                                         scale_log2, softcap, slope_log2, kv_lo, PAGED, SOFTCAP, ALIBI, LEFTPAD,
                                         DOT_F32)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    if SINGLE_SPLIT:  # a row that saw no key gets zeros (acc is 0 there)
        out = O + b64 * stride_ob + i[:, None] * stride_os + h[:, None] * stride_oh + offs_d[None, :]
        _store_rows(out, (acc / l_safe[:, None]).to(O.dtype.element_ty), offs_r, group * seqlen_q, offs_d, HEAD_DIM, BLOCK_D)
        return
    lse2 = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
    part = split * stride_ps + b64 * stride_pb + h * stride_ph + i * stride_pq
    _store_rows(Opart + part[:, None] + offs_d[None, :], acc / l_safe[:, None], offs_r, group * seqlen_q, offs_d, HEAD_DIM, BLOCK_D)
    tl.store(Lpart + split * stride_lps + b64 * stride_lpb + h * stride_lph + i, lse2, mask=row_ok)


@lean_launch
@triton.jit
def _decode_combine_kernel(Opart, Lpart, O, num_splits, n_heads, seqlen_q,
                           stride_ps, stride_pb, stride_ph, stride_pq, stride_lps, stride_lpb, stride_lph,
                           stride_ob, stride_os, stride_oh,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    """out[b, i, h] = sum_s w_s * O_s with w_s = exp(lse_s) / sum exp(lse); all -inf (nothing seen) -> 0."""
    wait_for_predecessor(PDL)  # launched while the split kernel runs: its partials are visible after the wait
    pid = tl.program_id(0)
    i = pid % seqlen_q
    h = (pid // seqlen_q) % n_heads
    b = (pid // seqlen_q // n_heads).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    lse = tl.load(Lpart + offs_s * stride_lps + b * stride_lpb + h * stride_lph + i, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m)  # (S,)
    denom = tl.sum(w, 0)
    # Every split stores its partial (zeros where it saw no key), so they load alongside the lse, not after
    # them: a decode step's merge is one memory round trip shorter.
    part = Opart + offs_s[:, None] * stride_ps + b * stride_pb + h * stride_ph + i * stride_pq + offs_d[None, :]
    o = tl.load(part, mask=s_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(O + b * stride_ob + i * stride_os + h * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=offs_d < HEAD_DIM)


def _prefetch_kv(device: torch.device) -> bool:
    """Whether the split kernel reads the start of its chunk before waiting for the kernel before it (how:
    ``_prefetch_mode``): in the early-trigger mode of programmatic dependent launch
    (``programmatic_launch(early_trigger=True)``, the decode step at batch 1), where that wait is most of a
    short decode step's attention. It relies on the chain's
    contract (see ``flash_attn_with_kvcache``): the kernel before writes no key but the newest. It makes the
    batch-1 decode step faster; at batch 16, with the trigger after the wait, reading early costs a few percent
    (`flash-models bench generate --peers ours-pdl`), so it is off there. A function so that
    the interpreter tests can turn the reordered path on without PDL."""
    return programmatic_launch_enabled(device) == TRIGGER_BEFORE_WAIT


def _prefetch_mode(block_d: int, paged: bool, prefetch_next: bool) -> int:
    """How the split kernel reads ahead of its wait when it does (``_prefetch_kv``): PREFETCH_REGISTERS or
    WAIT_IN_LOOP (see there). The register-prefetch key loop (``PREFETCH_NEXT``) keeps its register tile."""
    return WAIT_IN_LOOP if block_d == 128 and not paged and not prefetch_next else PREFETCH_REGISTERS


def _prefetch_tiles(block_d: int) -> int:
    """How many key tiles PREFETCH_REGISTERS reads (see PREFETCH_TILES_HEAD_DIM_64). A function so that the
    interpreter tests can take two at any head dim."""
    return PREFETCH_TILES_HEAD_DIM_64 if block_d <= 64 else 1


def _prefetch_next(chunk: int, paged: bool, head_dim: int) -> bool:
    """Whether the split kernel takes the register-prefetch key loop (``PREFETCH_NEXT``): for chunks of at
    least PREFETCH_NEXT_MIN_CHUNK keys of a contiguous cache at head dims 65-128 (a 128-wide tile), where it was
    measured to win (see there). A function so that the interpreter tests can take that loop at their small
    sizes."""
    return not paged and next_power_of_2(head_dim) == 128 and chunk >= PREFETCH_NEXT_MIN_CHUNK


def _split_count(capacity, n_prog_other, sms):
    """How many chunks to split a cache of ``capacity`` keys into, for ``n_prog_other`` (batch x kv heads)
    programs per split on ``sms`` SMs: as many as fit one wave, each at least DECODE_MIN_CHUNK keys long."""
    return max(1, min(DECODE_PROGRAMS_PER_SM * sms // n_prog_other, -(-capacity // DECODE_MIN_CHUNK)))


def _split_plan(q, capacity, n_prog_other, num_splits=0):
    """(chunk, num_splits) for a cache of ``capacity`` keys and ``n_prog_other`` (batch x kv heads) programs
    per split; ``num_splits`` > 0 asks for that many (FA2's argument), fewer where the chunks would be empty."""
    if q.device.type == "cuda":
        sms = sm_count(q.device.index if q.device.index is not None else torch.cuda.current_device())
        splits, align = _split_count(capacity, n_prog_other, sms), CHUNK_ALIGN
    else:
        splits, align = max(1, min(4, -(-capacity // 32))), 16  # the interpreter: a few splits so the merge is tested
    if num_splits > 0:
        splits = num_splits
    chunk = -(-capacity // splits)
    chunk = -(-chunk // align) * align
    return chunk, -(-capacity // chunk)


def _capacity(k_cache, table):
    """How many keys a batch row's cache holds: its length, or (paged) its pages' worth."""
    return table.shape[1] * k_cache.shape[1] if table is not None else k_cache.shape[1]


def _kvcache_impl(q, k_cache, v_cache, cache_seqlens, k, v, block_table, leftpad, alibi, causal, scale, wl, wr,
                  softcap, num_splits=0, return_lse=False):
    """(out, lse: (B, Hq, Sq) float32, or an empty tensor unless ``return_lse``)."""
    paged = block_table is not None
    capacity = _capacity(k_cache, block_table)
    s_new = k.shape[1] if k is not None else 0
    if k is not None:
        # Clamped: a length the caller could not check (in a CUDA graph's capture) writes inside the cache. The
        # Triton append, as the attention, also skips a page outside the pool (see slot_location); the public
        # function checked the rest, so kv_append's op is called without kv_append's checks of the values.
        slots = (cache_seqlens[:, None] + torch.arange(s_new, device=k.device, dtype=cache_seqlens.dtype))
        _kv_append_op(k_cache, v_cache, k, v, slots.clamp_(0, capacity - 1), block_table)
    bsz, seqlen_q, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    out = torch.empty_like(q)
    no_lse = q.new_empty(0, dtype=torch.float32)
    if q.numel() == 0:
        return out, q.new_empty(bsz, hq, seqlen_q, dtype=torch.float32) if return_lse else no_lse
    chunk, splits = _split_plan(q, capacity, bsz * hkv, num_splits)
    rows = group * seqlen_q
    block_m = 16 if triton_interpreter_enabled() else min(64, max(16, next_power_of_2(rows)))
    single = splits == 1 and not return_lse  # one split writes the output itself; the lse comes from the partials
    parts = 0 if single else splits
    opart = torch.empty(parts, bsz, hq, seqlen_q, d, dtype=torch.float32, device=q.device)
    lpart = torch.empty(parts, bsz, hq, seqlen_q, dtype=torch.float32, device=q.device)
    left, right, _ = _window_bounds(causal, wl, wr, seqlen_q, capacity)
    bd = block_d(d)
    table = block_table if paged else cache_seqlens
    dot_f32 = triton_interpreter_enabled() and q.dtype == torch.bfloat16
    prefetch_next = _prefetch_next(chunk, paged, d)
    prefetch = _prefetch_mode(bd, paged, prefetch_next) if _prefetch_kv(q.device) else 0
    if prefetch_next:
        tile = DECODE_TILE_PREFETCH_NEXT
    elif prefetch == WAIT_IN_LOOP and chunk >= WAIT_IN_LOOP_LONG_CHUNK:
        tile = DECODE_TILE_WAIT_IN_LOOP
    else:
        tile = DECODE_TILE
    block_n, num_warps, num_stages = (16, 4, 1) if triton_interpreter_enabled() else tile
    pdl = programmatic_launch_enabled(q.device)
    launch = launch_options(pdl)
    _decode_split_kernel[(splits, bsz * hkv, cdiv(rows, block_m))](
        q, k_cache, v_cache, opart, lpart, out, cache_seqlens, table,
        leftpad if leftpad is not None else cache_seqlens, alibi if alibi is not None else opart,
        scale * LOG2E, softcap,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), table.stride(0),
        opart.stride(0), opart.stride(1), opart.stride(2), opart.stride(3), lpart.stride(0), lpart.stride(1), lpart.stride(2),
        out.stride(0), out.stride(1), out.stride(2), 0 if alibi is None or alibi.dim() == 1 else alibi.stride(0),
        seqlen_q, s_new, group, hkv, left, right, chunk, k_cache.shape[1] if paged else 1, k_cache.shape[0], capacity,
        HEAD_DIM=d, BLOCK_D=bd, BLOCK_M=block_m, BLOCK_N=block_n, PAGED=paged, SOFTCAP=softcap > 0,
        ALIBI=alibi is not None, LEFTPAD=leftpad is not None, DOT_F32=dot_f32,
        SINGLE_SPLIT=single, PDL=pdl, PREFETCH_KV=prefetch, PREFETCH_TILES=_prefetch_tiles(bd),
        PREFETCH_NEXT=prefetch_next,
        num_warps=num_warps, num_stages=num_stages,
        **launch,
    )
    if single:
        return out, no_lse
    block_s = max(2, next_power_of_2(splits))
    combine_warps = 1 if block_s * bd <= COMBINE_ONE_WARP_ELEMENTS and bd <= 128 else 4
    _decode_combine_kernel[(bsz * hq * seqlen_q,)](
        opart, lpart, out, splits, hq, seqlen_q,
        opart.stride(0), opart.stride(1), opart.stride(2), opart.stride(3), lpart.stride(0), lpart.stride(1), lpart.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        HEAD_DIM=d, BLOCK_D=bd, BLOCK_S=block_s, PDL=pdl, num_warps=combine_warps, **launch,
    )
    # The partials' log-sum-exps are in log2 units; a row that saw no key has -inf in every split.
    return out, torch.logsumexp(lpart * LN2, dim=0) if return_lse else no_lse


@torch.library.custom_op("flash_kernels::attn_kvcache", mutates_args=("k_cache", "v_cache"))
def _kvcache_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
    k: torch.Tensor | None, v: torch.Tensor | None, block_table: torch.Tensor | None,
    cache_leftpad: torch.Tensor | None, alibi_slopes: torch.Tensor | None, causal: bool, softmax_scale: float,
    window_left: int, window_right: int, softcap: float, num_splits: int, return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _kvcache_impl(q, k_cache, v_cache, cache_seqlens, k, v, block_table, cache_leftpad, alibi_slopes, causal,
                         softmax_scale, window_left, window_right, softcap, num_splits, return_lse)


@_kvcache_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, k, v, block_table, cache_leftpad, alibi_slopes, causal, softmax_scale,
      window_left, window_right, softcap, num_splits, return_lse):
    lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if return_lse else (0,)
    return torch.empty_like(q), q.new_empty(lse_shape, dtype=torch.float32)


# ----------------------------------------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------------------------------------


def _seqlens_tensor(cache_seqlens, q, capacity):
    """cache_seqlens as int32 (B,): FA2 takes an int for every row, or None for full caches."""
    if cache_seqlens is None:
        cache_seqlens = capacity
    if isinstance(cache_seqlens, int):
        return torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    return cache_seqlens


def _check_index(op, name, t, bsz, device):
    if t is not None and (t.dtype != torch.int32 or t.shape != (bsz,) or t.device != device):
        raise ValueError(f"{op}: {name} must be int32 of shape ({bsz},) on {device}, got {t.dtype} "
                         f"{tuple(t.shape)} on {t.device}")


def _check_kvcache(op, q, k_cache, v_cache, cache_seqlens, k, v, block_table, cache_batch_idx, cache_leftpad,
                   rotary_cos, rotary_sin, num_splits):
    if q.dim() != 4 or k_cache.dim() != 4:
        raise ValueError(f"{op}: q (B, S, Hq, D) and k_cache must be 4-D, got {q.dim()}-D and {k_cache.dim()}-D")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"{op}: k_cache shape {tuple(k_cache.shape)} != v_cache shape {tuple(v_cache.shape)}")
    bsz, _, hq, d = q.shape
    hkv = k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise ValueError(f"{op}: head dim of q ({d}) != head dim of the cache ({k_cache.shape[3]})")
    if hq % hkv:
        raise ValueError(f"{op}: number of q heads ({hq}) must be a multiple of the number of kv heads ({hkv})")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"{op}: q and cache dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    _check_float_dtype(op, q.dtype)
    if k_cache.device != q.device or v_cache.device != q.device:
        raise ValueError(f"{op}: q and the caches must be on one device, got {q.device}, {k_cache.device}, {v_cache.device}")
    if isinstance(cache_seqlens, torch.Tensor):
        _check_index(op, "cache_seqlens", cache_seqlens, bsz, q.device)
    elif cache_seqlens is not None and not isinstance(cache_seqlens, int):
        raise ValueError(f"{op}: cache_seqlens must be an int32 tensor (B,), an int or None, got {type(cache_seqlens)}")
    if (k is None) != (v is None):
        raise ValueError(f"{op}: pass both k and v to append, or neither")
    if k is not None:
        if k.shape != v.shape or k.dim() != 4 or k.shape[0] != bsz or k.shape[2:] != (hkv, d):
            raise ValueError(
                f"{op}: k/v to append must both be ({bsz}, S_new, {hkv}, {d}), got {tuple(k.shape)} and {tuple(v.shape)}"
            )
    _check_index(op, "cache_batch_idx", cache_batch_idx, bsz, q.device)
    _check_index(op, "cache_leftpad", cache_leftpad, bsz, q.device)
    if block_table is None:
        if cache_batch_idx is None and k_cache.shape[0] != bsz:
            raise ValueError(f"{op}: k_cache batch ({k_cache.shape[0]}) != q batch ({bsz}); pass cache_batch_idx to "
                             "read other cache rows")
    else:
        if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != bsz:
            raise ValueError(
                f"{op}: block_table must be int32 (B={bsz}, max_blocks), got {block_table.dtype} {tuple(block_table.shape)}"
            )
        if cache_batch_idx is not None:
            raise ValueError(f"{op}: cache_batch_idx with a paged cache (block_table) is not supported (as in FA2): "
                             "the block table already picks each row's pages")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError(f"{op}: pass both rotary_cos and rotary_sin, or neither")
    if rotary_cos is not None:
        if k is None:
            raise ValueError(f"{op}: rotary_cos/rotary_sin rotate the new keys: pass k and v too (as FA2 requires)")
        rotary_dim = 2 * rotary_cos.shape[-1]
        capacity = _capacity(k_cache, _cache_table(block_table, cache_batch_idx))
        if rotary_cos.dim() != 2 or rotary_cos.shape != rotary_sin.shape or rotary_dim > d:
            raise ValueError(f"{op}: rotary_cos and rotary_sin must both be (seqlen_ro, rotary_dim / 2) with "
                             f"rotary_dim <= {d}, got {tuple(rotary_cos.shape)} and {tuple(rotary_sin.shape)}")
        if rotary_cos.shape[0] < capacity:
            raise ValueError(f"{op}: rotary_cos/rotary_sin cover {rotary_cos.shape[0]} positions, fewer than the "
                             f"cache's {capacity}")
    if not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"{op}: num_splits must be an int >= 0 (0: chosen by the heuristic), got {num_splits!r}")


# cache_seqlens tensors already checked on the device -> the arguments they were checked with (see _check_lengths).
_CHECKED_LENGTHS = WeakIdKeyDictionary()


def _version(t):
    return None if t is None or t.is_inference() else (id(t), t._version)


def _check_lengths(op, cache_seqlens, s_new, capacity, cache_leftpad, table, n_pages, page_size):
    """Every row's keys inside its cache: 0 <= cache_seqlens, cache_seqlens + s_new <= capacity, 0 <=
    cache_leftpad <= cache_seqlens, and the pages those keys use in [0, n_pages). A ValueError on the CPU; on CUDA
    an asynchronous device assert (reading the lengths on the host would stall the launch queue), once per lengths
    tensor version (inference tensors have none: once), and nothing while a CUDA graph is captured (the kernel
    still reads no key past the capacity); under torch.compile an assert in the graph."""
    compiling = torch.compiler.is_compiling()  # traced into the graph: a device assert, no host read
    on_device = cache_seqlens.is_cuda and not compiling
    if on_device:
        if capturing_cuda_graph():
            return
        key = (_version(cache_seqlens), s_new, capacity, _version(cache_leftpad), _version(table), n_pages)
        if _CHECKED_LENGTHS.get(cache_seqlens) == key:
            return
    lengths = cache_seqlens.long() + s_new
    problems = {
        "cache_seqlens must be >= 0": cache_seqlens < 0,
        f"cache_seqlens + {s_new} new tokens exceeds the cache capacity {capacity}"
        + (f" ({table.shape[1]} pages of {page_size} in block_table)" if table is not None and page_size else ""):
            lengths > capacity,
    }
    if cache_leftpad is not None:
        problems["cache_leftpad must be in [0, cache_seqlens]"] = (cache_leftpad < 0) | (cache_leftpad > cache_seqlens)
    if table is not None:
        used = torch.arange(table.shape[1], device=table.device) < (lengths[:, None] + page_size - 1) // page_size
        problems[f"block_table (or cache_batch_idx) names pages (rows) outside [0, {n_pages})"] = (
            used & ((table < 0) | (table >= n_pages))).any(dim=1)
    if on_device or compiling:
        valid = ~torch.stack(list(problems.values())).any()  # each (B,), B may be 0
        # CUDA takes assert messages under 255 characters: the short form (the CPU's ValueError names the rule).
        torch._assert_async(valid, f"{op}: cache_seqlens, cache_leftpad or block_table put a row's keys outside the "
                                   f"cache (capacity {capacity} keys, {n_pages} pages or rows)")
        if on_device:
            _CHECKED_LENGTHS[cache_seqlens] = key
        return
    for message, bad in problems.items():
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            raise ValueError(f"{op}: {message} (batch row {row}: cache_seqlens {int(cache_seqlens[row])})")


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | int | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Decode-time attention, FlashAttention-2's ``flash_attn_with_kvcache``: its arguments in its order, with its
    defaults (``causal=False``: pass ``causal=True`` for a causal prefill chunk; a single query row is unaffected).

    q (B, S_q, Hq, D); k_cache/v_cache (B_cache, S_cache, Hkv, D), or with ``block_table`` (B, max_blocks) int32 a
    paged cache (num_blocks, page_size, Hkv, D), any page size. ``cache_seqlens`` (int32 (B,), or an int; None:
    every cache full) are the lengths before the append; they are not modified. k/v (B, S_new, Hkv, D) are
    written into the cache in place at positions cache_seqlens[b] + t, then the queries attend over the cache
    entries [cache_leftpad[b] (default 0), cache_seqlens[b] + S_new), causal and windows aligned bottom-right
    (the last query row at the last key). ``rotary_cos``/``rotary_sin`` (seqlen_ro, rotary_dim / 2) rotate the new
    keys at positions cache_seqlens[b] + t and the queries at the same positions when causal or local, else all
    at cache_seqlens[b] (``rotary_interleaved``: pairs (0, 1), (2, 3)...; else GPT-NeoX's halves); the rotated
    keys are what the cache keeps. ``cache_batch_idx`` (int32 (B,)): batch row b reads and appends to cache
    row cache_batch_idx[b] (per-row caches only). ``alibi_slopes`` (Hq,) or (B, Hq) float32. ``num_splits``: how
    many chunks the cache is split into (0: a heuristic). Returns (B, S_q, Hq, D), and with
    ``return_softmax_lse`` also the log-sum-exp (B, Hq, S_q) float32 (-inf for a row that sees no key). No
    backward (as in FA2). Cache lengths, ``cache_leftpad`` and the page ids of ``block_table`` (rows of
    ``cache_batch_idx``) are checked without a host sync: a ValueError on the CPU, a device assert on CUDA. A CUDA
    graph's replay checks nothing (its host code does not run), so the kernels bound what they read themselves:
    keys past the capacity are not read, and a page (row) id outside the pool's [0, num_blocks) is clamped into
    it for the address and left out: its keys are masked from the softmax (the row attends over its other keys;
    with none left its output is zeros and its lse -inf, as for an empty cache) and the append writes nothing
    there.

    Inside ``flash_kernels.programmatic_launch()`` the kernel reads the cache, ``cache_seqlens``, ``block_table``
    (or ``cache_batch_idx``), ``cache_leftpad`` and ``alibi_slopes`` before it waits for the kernel launched just
    before it, except each row's newest
    ``max(S_q, S_new)`` keys: that kernel may write those (an append, as ``kv_append`` and ``rotary_kv_append``
    do) but nothing else this call reads."""
    op = "flash_attn_with_kvcache"
    _check_kvcache(op, q, k_cache, v_cache, cache_seqlens, k, v, block_table, cache_batch_idx, cache_leftpad,
                   rotary_cos, rotary_sin, num_splits)
    table = _cache_table(block_table, cache_batch_idx)
    capacity = _capacity(k_cache, table)
    cache_seqlens = _seqlens_tensor(cache_seqlens, q, capacity)
    _check_common(op, window_size=window_size, softcap=softcap, dropout_p=0.0, alibi_slopes=alibi_slopes,
                  batch=q.shape[0], hq=q.shape[2], device=q.device)
    _check_lengths(op, cache_seqlens, k.shape[1] if k is not None else 0, capacity, cache_leftpad, table,
                   k_cache.shape[0], k_cache.shape[1])
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    if not use_triton(backend, q, op=op, unsupported=_triton_unsupported(q)):
        return flash_attn_with_kvcache_ref(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, return_softmax_lse)
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError(f"{op}: the caches must be contiguous in the head dim (they are written in place)")
    if rotary_cos is not None:
        q, k = _rotate_new(q, k, rotary_cos, rotary_sin, cache_seqlens, causal=causal, window_size=window_size,
                           interleaved=rotary_interleaved, backend="triton")
    q = q if q.stride(-1) == 1 else q.contiguous()
    alibi = alibi_slopes.float().contiguous() if alibi_slopes is not None else None
    cache_seqlens, table, cache_leftpad = (unit_last_stride(t) for t in (cache_seqlens, table, cache_leftpad))
    out, lse = _kvcache_op(q, k_cache, v_cache, cache_seqlens, k, v, table, cache_leftpad, alibi, causal, float(scale),
                           int(window_size[0]), int(window_size[1]), float(softcap), int(num_splits),
                           bool(return_softmax_lse))
    return (out, lse) if return_softmax_lse else out
