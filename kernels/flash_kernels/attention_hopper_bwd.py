"""The attention backward on Hopper in Gluon, in FlashAttention-3's single-pass form, with dQ summed by TMA
reduce-adds.

Why: the Triton backward (``attention_bwd``) runs dK/dV and dQ as two kernels, so S = Q K^T and dP = dO V^T are
computed twice, and each ``tl.dot`` waits for its wgmma right after issuing it. Here one program per (128-key
block, batch, kv head) computes them once: a TMA producer warp loads the key block once and a ring of (Q, dO)
tiles of 64 or 128 rows (``TILES``) of every query head of the kv head's group, with each tile's log-sum-exp and
delta rows (by cp.async into shared memory: the consumers read them where they use them, so no register holds them
through the tile); two consumer warpgroups own 64 keys each and keep dK and dV in registers. Per query tile,
transposed so that keys are the wgmma M dimension:
    S^T = K Q^T,  P^T = exp2(S^T * scale * log2e - lse * log2e),  dP^T = V dO^T,  dS^T = P^T (dP^T - delta),
    dV += P^T dO,  dK += dS^T Q,  dQ_tile = scale * dS K.
Both warpgroups' dS^T go through shared memory, and each computes one half of dQ_tile's columns from all 128
keys. dQ_tile is then summed over the key blocks into an fp32 buffer: each warpgroup stages its half in shared
memory and one thread issues a TMA reduce-add of it, which runs while the warpgroup goes on to the next tile (it
waits for the reduction to have read the buffer only before writing the buffer again). The sum's order varies
between runs, so dQ is not bitwise deterministic: ``deterministic=True`` (or torch's deterministic algorithms)
keeps the Triton backward.

The TMA reduce-add: Triton 3.7+ Gluon has it (``tma.async_atomic_add``); Triton 3.6's Gluon has only the TMA
store, so there the kernel issues a store and a compiler-stage hook (``_ptx_reduce_hook``, installed on
``triton.knobs.runtime.add_stages_inspection_hook`` beside any hook already there) rewrites this kernel's PTX
``cp.async.bulk.tensor...`` store into ``cp.reduce.async.bulk.tensor...add`` (the instruction FA3's
SM90_TMA_REDUCE_ADD issues). Every compiled kernel's PTX is checked for the reduction after its first launch
(``_reduces``): where it is missing, the Triton backward runs instead and overwrites all three gradients.

Causal, each program walks its query tiles last-first (``_tile_index``), and the launch order starts each group
of heads' longest key blocks first (``_key_block``); both measured faster than the plain order. The log-sum-exp
and delta rows sit in shared memory, not registers: in registers ptxas spilled more (504 bytes non-causal, 432
causal, against 96 and 132) and the backward alone ran slower. Forward + backward on an H100 (B * S = 16k,
H * D = 2048, bf16, graph-replayed: `flash-models bench attention --graphs`) ran 0.934-0.958x cuDNN's non-causal
and 0.929-0.932x causal at S 2k-8k. ``attention`` takes it from ``MIN_KEYS`` keys (``backward_unsupported``).
"""

from __future__ import annotations

import logging
import weakref

import torch

from . import attention_hopper
from ._launch import arguments_key, lean_launch
from ._triton_compat import triton
from .attention_hopper import _descriptor

PTX_REWRITE = False  # whether dQ's TMA stores become reduce-adds in the PTX (Triton 3.6)
if attention_hopper.GLUON_AVAILABLE:
    from triton.compiler.errors import CompilationError
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier, tma,
                                                                   warpgroup_mma, warpgroup_mma_wait)

    # cp.async of a pointer tensor into shared memory: ``async_copy_global_to_shared`` in Triton 3.6, ``async_load``
    # from 3.8 on.
    _async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

    # The TMA reduce-add of a staged dQ tile; before Triton 3.7, a TMA store that ``_ptx_reduce_hook`` rewrites.
    _tma_reduce_add = getattr(tma, "async_atomic_add", None)
    PTX_REWRITE = _tma_reduce_add is None
    if PTX_REWRITE:
        _tma_reduce_add = tma.async_copy_shared_to_global

logger = logging.getLogger(__name__)

BLOCK_N = 128  # keys per program: 64 per consumer warpgroup
# Per (head dim, causal): query rows per (Q, dO) tile, and tiles in flight. Head dim 128 has room for two 64-row
# tiles only (198 KB of shared memory). Head dim 64 (H100, graph-replayed forward + backward at S 2k and 8k):
# non-causal, two 128-row tiles (199 KB; ptxas spills 224 bytes) ran faster than four or two 64-row tiles;
# causal, two 64-row tiles ran faster than 128-row tiles or four 64-row tiles.
TILES = {(128, False): (64, 2), (128, True): (64, 2), (64, False): (128, 2), (64, True): (64, 2)}
# Where ``attention`` takes this kernel: the fewest keys for each (head dim, causal) pair measured faster than the
# Triton backward (H100, graph-replayed forward + backward; ``use_hopper_backward(False)`` gives the Triton side).
# Head dim 128 non-causal: faster at S 512 (below 512 nothing was measured). Head dim 128 causal: faster at 1k,
# slower at 512. Head dim 64 non-causal: faster at 1k, level at 512. Head dim 64 causal: faster at 2k, level at
# 1k, slower at 512.
MIN_KEYS = {(128, False): 512, (128, True): 1024, (64, False): 1024, (64, True): 2048}
# The masks (causal or not) whose query tiles each program walks last-first (``_tile_index``).
LAST_FIRST = {True}
# The L2 share of one group of heads in the causal launch order (``_heads_per_group``): 8 heads of 2k queries at
# head dim 128 (H100: 50 MB of L2).
GROUP_L2_BYTES = 16 << 20
# The PTX instruction a TMA store of dQ compiles to on Triton 3.6, and the reduce-add it becomes.
_PTX_STORE = "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group"
_PTX_REDUCE = "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group"
_KERNEL_NAME = "_attn_bwd_hopper_kernel"

_enabled = True


def use_hopper_backward(enable: bool) -> bool:
    """Let ``attention``'s backward take this kernel where it runs (the default), or keep the Triton backward
    everywhere; returns the previous setting. A user setting (README, Settings), for the reason
    ``attention_hopper.use_hopper_forward`` gives; also for tests and A/B benchmarks."""
    global _enabled
    previous, _enabled = _enabled, bool(enable)
    return previous


def backward_unsupported(q, k, v, do, dk, dv, *, varlen: bool, causal: bool, local: bool, softcap: float, alibi,
                         dropout_p: float, scale: float, deterministic: bool) -> str | None:
    """Why ``attention``'s backward does not take this kernel for q, k, v, dO (B, S, H, D) and the gradient
    buffers dk, dv (k's shape), or None."""
    if not _enabled:
        return "switched off (use_hopper_backward)"
    if varlen:
        return "varlen (packed sequences)"
    if deterministic or torch.are_deterministic_algorithms_enabled():
        return "a deterministic backward was asked for (this kernel sums dQ with atomic reductions)"
    minimum = MIN_KEYS.get((q.shape[-1], bool(causal)))
    if minimum is None:
        return f"head dim {q.shape[-1]} (this kernel has head dims 64 and 128)"
    if k.shape[1] < minimum:
        return f"fewer than {minimum} keys{' causal' if causal else ''}, where the Triton backward is as fast"
    if dk.stride(-1) != 1 or dv.stride(-1) != 1:
        return "gradient buffers whose last dim is not contiguous"
    # The forward's conditions: the Hopper GPU, Gluon, the dtype, the mask and the (B * S, H * D) layouts. Its
    # own key minimum is below ours.
    return attention_hopper.forward_unsupported(q, k, v, do, cu_q=None, cu_k=None, max_k=k.shape[1], causal=causal,
                                                local=local, softcap=softcap, alibi=alibi, dropout_p=dropout_p,
                                                scale=scale)


if attention_hopper.GLUON_AVAILABLE:

    @gluon.jit
    def _key_block(seqlen_k, n_heads_q, group, heads_per_group, BLOCK_N: gl.constexpr):
        """This program's first key, batch and kv head. Programs run in launch order in groups of
        ``heads_per_group`` (batch, kv head) pairs, and within a group key block by key block, for every head
        of the group: one head's blocks run together and share each (Q, dO) tile and dQ row through L2 (heads
        first was 1.5x slower), and causal, where the first blocks cost the most, the longest blocks of a group
        start first, so the last programs to start are short (one head at a time: 6-7% of the time in a tail,
        by a list-scheduling count; measured: forward + backward faster at 2k and 8k, level at 4k)."""
        n_blocks = gl.cdiv(seqlen_k, BLOCK_N)
        n_pairs = gl.num_programs(0) // n_blocks
        pid = gl.program_id(0)
        first_pair = pid // (heads_per_group * n_blocks) * heads_per_group
        in_group = gl.minimum(heads_per_group, n_pairs - first_pair)
        rank = pid - first_pair * n_blocks
        pair = first_pair + rank % in_group
        n_kv_heads = n_heads_q // group
        return (rank // in_group) * BLOCK_N, pair // n_kv_heads, pair % n_kv_heads

    @gluon.jit
    def _query_tiles(n0, seqlen_q, seqlen_k, BLOCK_M: gl.constexpr, CAUSAL):
        """The first and end query tile for the key block at n0. Causal (bottom-right), query row q sees key n
        where n <= q + Sk - Sq, so the tiles before the block's first key's diagonal see none of it."""
        first = 0
        if CAUSAL:
            first = gl.maximum(n0 - (seqlen_k - seqlen_q), 0) // BLOCK_M
        return first, gl.cdiv(seqlen_q, BLOCK_M)

    @gluon.jit
    def _tile_index(t, first, end, LAST_FIRST):
        """The query tile a program's t-th step (t from first to end) works on: t itself, or counting down from
        the last tile. Last-first, the key blocks of one head, launched together, reach the same (Q, dO) tile
        at the same time causal too (first-first, block j starts at tile 2j), so they share it and its dQ
        rows through L2 as the non-causal ones do."""
        i = t
        if LAST_FIRST:
            i = end - 1 - (t - first)
        return i

    @gluon.jit
    def _producer(args):
        descs, ptrs, sizes, bufs, bars, flags = args
        q_desc, k_desc, v_desc, do_desc, _dq_desc = descs
        LSE, Delta, _DK, _DV = ptrs
        k_smem, v_smem, q_smem, do_smem, _ds_smem, _dq_smem, stat_smem = bufs
        kv_ready, q_ready, q_empty, _ds_ready = bars
        seqlen_q, seqlen_k, n_heads_q, group, heads_per_group = sizes[:5]
        lse_sb, lse_sh = sizes[8:10]
        CAUSAL, LAST_FIRST = flags
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        STAGES: gl.constexpr = q_smem.type.shape[0]
        n0, b, hk = _key_block(seqlen_k, n_heads_q, group, heads_per_group, BLOCK_N)
        mbarrier.expect(kv_ready, 2 * k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b * seqlen_k + n0, hk * HEAD_DIM], kv_ready, k_smem)
        tma.async_copy_global_to_shared(v_desc, [b * seqlen_k + n0, hk * HEAD_DIM], kv_ready, v_smem)
        first, end = _query_tiles(n0, seqlen_q, seqlen_k, BLOCK_M, CAUSAL)
        stat_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
        it = 0
        for g in range(group):
            hq = hk * group + g
            lse_base = (b * lse_sb + hq * lse_sh).to(gl.int64)
            for t in range(first, end):
                i = _tile_index(t, first, end, LAST_FIRST)
                slot = it % STAGES
                mbarrier.wait(q_empty.index(slot), ((it // STAGES) & 1) ^ 1)
                # The tile's log-sum-exp and delta rows into shared memory by cp.async, which arrives on the
                # slot's barrier when done (counted in, so the barrier's count stays one): the consumers read them
                # where they use them, instead of holding 32 registers of them through the tile (ptxas spilled
                # 504 bytes that way, 96 this way).
                cols = i * BLOCK_M + gl.arange(0, BLOCK_M, layout=stat_layout)
                col_ok = cols < seqlen_q
                _async_load(stat_smem.index(2 * slot), LSE + lse_base + cols, mask=col_ok)
                _async_load(stat_smem.index(2 * slot + 1), Delta + lse_base + cols, mask=col_ok)
                async_copy.mbarrier_arrive(q_ready.index(slot))
                mbarrier.expect(q_ready.index(slot), 2 * q_desc.block_type.nbytes)
                row = b * seqlen_q + i * BLOCK_M
                tma.async_copy_global_to_shared(q_desc, [row, hq * HEAD_DIM], q_ready.index(slot), q_smem.index(slot))
                tma.async_copy_global_to_shared(do_desc, [row, hq * HEAD_DIM], q_ready.index(slot),
                                                do_smem.index(slot))
                it += 1

    @gluon.jit
    def _consume(args, WG: gl.constexpr):
        """Consumer warpgroup WG: keys n0 + 64 WG to n0 + 64 WG + 63, and columns 64 WG.. of each dQ tile (half
        the head dim)."""
        descs, ptrs, sizes, bufs, bars, flags = args
        q_desc, k_desc, _v_desc, _do_desc, dq_desc = descs
        _LSE, _Delta, DK, DV = ptrs
        (seqlen_q, seqlen_k, n_heads_q, group, heads_per_group, scale_log2, scale, dq_rows, _lse_sb, _lse_sh, dk_sb,
         dk_ss, dk_sh, dv_sb, dv_ss, dv_sh) = sizes
        k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, stat_smem = bufs
        kv_ready, q_ready, q_empty, ds_ready = bars
        CAUSAL, LAST_FIRST = flags
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        HALF_N: gl.constexpr = BLOCK_N // 2
        HALF_D: gl.constexpr = HEAD_DIM // 2
        STAGES: gl.constexpr = q_smem.type.shape[0]
        st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, BLOCK_M, 16])
        kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, HEAD_DIM, 16])
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, HALF_D, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
        n0, b, hk = _key_block(seqlen_k, n_heads_q, group, heads_per_group, BLOCK_N)
        diagonal = seqlen_k - seqlen_q
        k_w = k_smem.slice(WG * HALF_N, HALF_N)
        v_w = v_smem.slice(WG * HALF_N, HALF_N)
        k_half_d = k_smem.slice(WG * HALF_D, HALF_D, dim=1)  # the key columns of this warpgroup's half of dQ
        dq_buf = dq_smem.index(WG)
        keys = n0 + WG * HALF_N + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, st_layout))
        st_zero = gl.zeros([HALF_N, BLOCK_M], gl.float32, st_layout)
        dq_zero = gl.zeros([BLOCK_M, HALF_D], gl.float32, dq_layout)
        dk = gl.zeros([HALF_N, HEAD_DIM], gl.float32, kv_layout)
        dv = gl.zeros([HALF_N, HEAD_DIM], gl.float32, kv_layout)
        mbarrier.wait(kv_ready, 0)
        first, end = _query_tiles(n0, seqlen_q, seqlen_k, BLOCK_M, CAUSAL)
        it = 0
        for g in range(group):
            hq = hk * group + g
            for t in range(first, end):
                i = _tile_index(t, first, end, LAST_FIRST)
                slot = it % STAGES
                q0 = i * BLOCK_M
                mbarrier.wait(q_ready.index(slot), (it // STAGES) & 1)
                q_buf = q_smem.index(slot)
                do_buf = do_smem.index(slot)
                st = warpgroup_mma(k_w, q_buf.permute((1, 0)), st_zero, use_acc=False, is_async=True)
                dpt = warpgroup_mma(v_w, do_buf.permute((1, 0)), st_zero, use_acc=False, is_async=True)
                cols = q0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
                col_ok = cols < seqlen_q
                st = warpgroup_mma_wait(1, deps=(st, ))
                lse = stat_smem.index(2 * slot).load(gl.SliceLayout(0, st_layout)) * 1.4426950408889634
                pt = gl.exp2(st * scale_log2 - gl.expand_dims(lse, 0))
                # Masks only where a tile needs them: query rows past the end (TMA read the next batch's rows or
                # zeros there), keys past the end (the last key block), and causal tiles that cross the diagonal.
                if q0 + BLOCK_M > seqlen_q or n0 + BLOCK_N > seqlen_k:
                    pt = gl.where(gl.expand_dims(col_ok, 0) & gl.expand_dims(keys < seqlen_k, 1), pt, 0.0)
                if CAUSAL:
                    if n0 + BLOCK_N - 1 > q0 + diagonal:
                        pt = gl.where(gl.expand_dims(keys, 1) <= gl.expand_dims(cols, 0) + diagonal, pt, 0.0)
                dv = warpgroup_mma(gl.convert_layout(pt.to(q_desc.dtype), a_layout), do_buf, dv, is_async=True)
                dpt = warpgroup_mma_wait(1, deps=(dpt, ))
                delta = stat_smem.index(2 * slot + 1).load(gl.SliceLayout(0, st_layout))
                dst = (pt * (dpt - gl.expand_dims(delta, 0))).to(q_desc.dtype)
                dk = warpgroup_mma(gl.convert_layout(dst, a_layout), q_buf, dk, is_async=True)
                # Both warpgroups' dS^T into shared memory (two buffers: a warpgroup reaches tile it + 2 only
                # after the other has finished tile it), then this warpgroup's half of the dQ tile.
                ds_buf = ds_smem.index(it % 2)
                ds_buf.slice(WG * HALF_N, HALF_N).store(dst)
                fence_async_shared()
                mbarrier.arrive(ds_ready.index(it % 2), count=1)
                mbarrier.wait(ds_ready.index(it % 2), (it // 2) & 1)
                dq = warpgroup_mma(ds_buf.permute((1, 0)), k_half_d, dq_zero, use_acc=False, is_async=True)
                dq, dk, dv = warpgroup_mma_wait(0, deps=(dq, dk, dv))
                mbarrier.arrive(q_empty.index(slot), count=1)
                # The previous tile's reduction has read dq_buf (it ran under this tile's four products).
                tma.store_wait(0)
                dq_buf.store(dq * scale)
                fence_async_shared()
                # dQ's fp32 buffer has ``dq_rows`` rows per batch (a multiple of BLOCK_M): rows past the end
                # are summed where nothing reads them.
                _tma_reduce_add(dq_desc, [b * dq_rows + q0, hq * HEAD_DIM + WG * HALF_D], dq_buf)
                it += 1
        tma.store_wait(0)  # the last reduction reads shared memory that ends with the program
        rows = n0 + WG * HALF_N + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, kv_layout))
        dcols = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout)), 0)
        rows64 = gl.expand_dims(rows.to(gl.int64), 1)
        ok = gl.expand_dims(rows < seqlen_k, 1)
        b64 = b.to(gl.int64)
        gl.store(DK + b64 * dk_sb + rows64 * dk_ss + hk * dk_sh + dcols, (dk * scale).to(DK.dtype.element_ty),
                 mask=ok)
        gl.store(DV + b64 * dv_sb + rows64 * dv_ss + hk * dv_sh + dcols, dv.to(DV.dtype.element_ty), mask=ok)

    @gluon.jit
    def _consumer0(args):
        _consume(args, 0)

    @gluon.jit
    def _consumer1(args):
        _consume(args, 1)

    @lean_launch
    @gluon.jit
    def _attn_bwd_hopper_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, LSE, Delta, DK, DV, seqlen_q, seqlen_k,
                                n_heads_q, group, heads_per_group, scale_log2, scale, dq_rows, lse_sb, lse_sh,
                                dk_sb, dk_ss, dk_sh, dv_sb, dv_ss, dv_sh, CAUSAL: gl.constexpr,
                                LAST_FIRST: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                                PRODUCER_REGS: gl.constexpr):
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [BLOCK_N, HEAD_DIM], v_desc.layout)
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(do_desc.dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], q_desc.dtype)
        ds_smem = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
        # One staged dQ half-tile per warpgroup, in the descriptor's layout: TMA reads it.
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_DIM // 2], dq_desc.layout)
        # Each (Q, dO) slot's log-sum-exp and delta rows (the producer's cp.async writes them).
        stat_smem = gl.allocate_shared_memory(gl.float32, [2 * STAGES, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_ready, count=1)
        for s in gl.static_range(STAGES):
            mbarrier.init(q_ready.index(s), count=1)
            mbarrier.init(q_empty.index(s), count=2)  # both consumers release a (Q, dO) slot
        for s in gl.static_range(2):
            mbarrier.init(ds_ready.index(s), count=2)  # both consumers have stored their dS^T
        # The flag reaches the partitions as an i1 value, not a constexpr (see attention_hopper).
        args = ((q_desc, k_desc, v_desc, do_desc, dq_desc), (LSE, Delta, DK, DV),
                (seqlen_q, seqlen_k, n_heads_q, group, heads_per_group, scale_log2, scale, dq_rows, lse_sb, lse_sh,
                 dk_sb, dk_ss, dk_sh, dv_sb, dv_ss, dv_sh),
                (k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, stat_smem), (kv_ready, q_ready, q_empty, ds_ready),
                (gl.constexpr(CAUSAL), gl.constexpr(LAST_FIRST)))
        gl.warp_specialize([(_consumer0, (args, )), (_consumer1, (args, )), (_producer, (args, ))], [4, 1],
                           [CONSUMER_REGS, PRODUCER_REGS])

    def _ptx_reduce_hook(previous):
        """A stages-inspection hook that makes this kernel's PTX reduce where Triton 3.6 wrote a TMA store,
        after running ``previous`` (a hook that was installed before, or None)."""

        def hook(backend, stages, options, language, capability):
            if previous is not None:
                previous(backend, stages, options, language, capability)
            make_ptx = stages.get("ptx")
            if make_ptx is None:
                return

            def ptx(src, metadata):
                text = make_ptx(src, metadata)
                if metadata.get("name", "").startswith(_KERNEL_NAME):
                    text = rewrite_ptx(text)
                return text

            stages["ptx"] = ptx

        hook.flash_kernels_reduce = True
        return hook


class PtxRewriteError(RuntimeError):
    """The backward kernel's PTX has no TMA store for ``rewrite_ptx`` to make a reduce-add of."""


def rewrite_ptx(text: str) -> str:
    """The backward kernel's PTX with its TMA stores (dQ's, its only ones) as TMA reduce-adds."""
    if _PTX_STORE not in text:
        raise PtxRewriteError(f"no '{_PTX_STORE}' in the Hopper attention backward's PTX to make a reduce-add of")
    return text.replace(_PTX_STORE, _PTX_REDUCE)


def _install_reduce_hook() -> None:
    """Puts ``_ptx_reduce_hook`` on Triton's stages hook unless it is there already (someone may have replaced
    the hook since), chaining whatever hook is there."""
    knobs = triton.knobs.runtime
    current = knobs.add_stages_inspection_hook
    if not getattr(current, "flash_kernels_reduce", False):
        knobs.add_stages_inspection_hook = _ptx_reduce_hook(current)


# The compiled kernels whose PTX has been seen to reduce dQ, and the launches' specializations (a capture may
# launch only a loaded kernel).
_checked: weakref.WeakSet = weakref.WeakSet()
_launched: set[tuple] = set()


def _reduces(compiled) -> bool:
    """Whether the compiled kernel sums dQ with TMA reduce-adds (checked once per compiled kernel)."""
    if compiled not in _checked:
        ptx = getattr(compiled, "asm", {}).get("ptx")
        if ptx is not None and "cp.reduce.async.bulk.tensor" not in ptx:
            return False
        _checked.add(compiled)
    return True


def _give_up(problem: str, error) -> bool:
    use_hopper_backward(False)
    logger.warning("flash_kernels: %s, so attention keeps its Triton backward (Triton %s):\n%s", problem,
                   triton.__version__, error)
    return False


def _heads_per_group(sq: int, d: int, group: int, causal: bool) -> int:
    """How many (batch, kv head) pairs the launch order groups (``_key_block``): causal, as many as keep their
    queries, output gradients and fp32 dQ rows (8 bytes a query element) within ``GROUP_L2_BYTES``; one
    otherwise, where every key block costs the same."""
    if not causal:
        return 1
    return max(1, GROUP_L2_BYTES // (8 * sq * d * group))


def _launch_scalars(q, k, lse, dk, dv, block_m: int) -> tuple[int, ...]:
    """The launch's integer arguments: lengths, heads, the query-head group, dQ's rows per batch (padded to
    whole ``block_m``-row tiles), and the strides of the log-sum-exp (delta shares its layout), dK and dV."""
    b, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    dq_rows = -(-sq // block_m) * block_m
    return (sq, sk, hq, hq // hkv, dq_rows, lse.stride(0), lse.stride(1), *dk.stride()[:3], *dv.stride()[:3])


def _specialization(q, lse, dk, dv, causal: bool, scalars: tuple) -> tuple:
    """What Triton compiles a launch for: the device, the dtype, the head dim, the mask, and the pointers' and
    integers' specialization (the descriptors follow from the dtype and head dim)."""
    return (q.device.index, q.dtype, q.shape[-1], bool(causal), *arguments_key((lse, dk, dv, *scalars)))


def leave_to_triton(q, k, lse, dk, dv, causal: bool) -> bool:
    """An eager call too small for this kernel's launch cost (``attention_hopper.EAGER_MIN_FLOP``, the forward's
    FLOPs), once this specialization is loaded (as ``attention_hopper.leave_to_triton``: a capture, which cannot
    load a kernel, then finds it loaded)."""
    if not attention_hopper.small_eager_call(q, k.shape[1], causal):
        return False
    scalars = _launch_scalars(q, k, lse, dk, dv, TILES[q.shape[-1], bool(causal)][0])
    return _specialization(q, lse, dk, dv, causal, scalars) in _launched


def attention_backward(q, k, v, do, lse, delta, dq, dk, dv, scale: float, causal: bool) -> bool:
    """Writes the gradients of attention over q (B, Sq, Hq, D), k, v (B, Sk, Hkv, D) into dq, dk, dv, from the
    output's gradient ``do`` (q's shape and layout rules), the forward's natural-log ``lse`` and delta =
    rowsum(dO * O), both (B, Hq, Sq) with any strides of the last dim 1. The caller has checked
    ``backward_unsupported``.

    Returns False where this Triton cannot compile the kernel (nothing launched), or where the compiled kernel
    turns out to lack its reduce-add (dK and dV written, dQ not); the kernel is then switched off for the
    process, with a warning, and the caller runs the Triton backward, which writes all three gradients."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    block_m, stages = TILES[d, bool(causal)]
    scalars = _launch_scalars(q, k, lse, dk, dv, block_m)
    sq, sk, hq, group, dq_rows = scalars[:5]
    dq_sum = torch.zeros(b, dq_rows, hq, d, dtype=torch.float32, device=q.device)
    if PTX_REWRITE:
        _install_reduce_hook()
    grid = (-(-sk // BLOCK_N) * b * hkv, )
    try:
        compiled = _attn_bwd_hopper_kernel[grid](
            _descriptor(q, block_m), _descriptor(k, BLOCK_N), _descriptor(v, BLOCK_N), _descriptor(do, block_m),
            _descriptor(dq_sum, block_m, d // 2), lse, delta, dk, dv, sq, sk, hq, group,
            _heads_per_group(sq, d, group, causal), scale * 1.4426950408889634, scale, *scalars[4:],
            CAUSAL=bool(causal), LAST_FIRST=bool(causal) in LAST_FIRST, STAGES=stages,
            CONSUMER_REGS=attention_hopper.CONSUMER_REGISTERS, PRODUCER_REGS=attention_hopper.PRODUCER_REGISTERS,
            num_warps=4, maxnreg=attention_hopper.MAX_REGISTERS,
        )
    except (CompilationError, PtxRewriteError) as error:  # raised before anything is queued: nothing half-done
        return _give_up("this Triton cannot compile the Hopper attention backward", error)
    if not _reduces(compiled):
        # Not expected (the hook is in place before every launch): the Triton backward then overwrites all
        # three gradients, so the wrong dQ sum is never seen.
        return _give_up("the Hopper attention backward compiled without its dQ reduce-add",
                        "was triton.knobs.runtime.add_stages_inspection_hook replaced while it compiled?")
    _launched.add(_specialization(q, lse, dk, dv, causal, scalars))
    dq.copy_(dq_sum[:, :sq])
    return True
