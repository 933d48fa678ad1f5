"""The attention forward on Hopper as FlashAttention-3 schedules it, written in Gluon (Triton's explicit-layout
dialect): persistent programs, each a warp-specialized team of one TMA producer warp and two consumer
warpgroups of 64 query rows each.

Why Gluon: a Triton ``tl.dot`` waits for its wgmma right after issuing it, so the Triton forward
(``attention._attn_fwd_kernel``) runs each key tile's Q.K^T, softmax and P.V one after the other. Gluon issues
wgmma asynchronously and waits for a given count of outstanding groups, which is what FA3's two overlaps need:
- within a warpgroup, each consumer issues the next tile's Q.K^T, then this tile's P.V, waits for the Q.K^T
  alone and computes the next softmax while P.V is still in flight;
- between the two (ping-pong), a consumer issues its matrix products only after the other issued its own, so
  one's softmax runs while the other's products hold the tensor cores.
The producer warp keeps STAGES key and value tiles in flight through TMA, and the two consumers share them, so a
key tile is read once per 128 query rows; it loads the next tile's queries while this one's run (Q_BUFFERS).
Programs take units of work from a counter as they finish them (the producer takes each, and posts each tile to
the consumers beside its queries), so they stay level where units cost differently: with varlen sequences of
uneven lengths, taking every n-th unit leaves the programs with the longest sequences' blocks last (slower on
BERT-large at 45% padding).
Each consumer writes its output rows into its query buffer (read for the last time) and stores them with TMA,
which keeps the epilogue short and the consumer's registers free of per-element output pointers (with
``gl.store`` those were hoisted out of the loop and spilled: 460 bytes of spills, 100 without).

What it runs: ``forward_unsupported`` names the conditions (causal with Sq <= Sk, or non-causal; no window,
softcap, ALiBi or dropout; fp16/bf16; head dim 64 or 128; at least ``MIN_KEYS`` keys; (B, S, H, D) tensors
whose (B * S, H * D) view is a strided matrix, as contiguous tensors and the slices of a packed qkv are; varlen
for self-attention, where one cu_seqlens bounds the queries and the keys (BERT's path), with the tokens filling
``MIN_VARLEN_FILL`` of the sequences' tiles; outside a CUDA graph's capture, at least ``EAGER_MIN_FLOP`` of
work, since its launch costs more host time); ``attention`` takes it for those on Hopper and keeps
its Triton kernel (also the interpreter's and the CPU's path, and the test oracle here) for the rest. Keys past
a sequence's end are masked in the last key tile; query rows past it are computed and not stored (a warpgroup
whose rows cross the end stores its rows with ``gl.store``). Causal, a tile walks the key tiles up to its
diagonal only, and programs take query blocks in pairs of equal total cost (``_unit_tiles``). Outputs and the
log-sum-exp follow ``attention``'s forward, so its backward runs unchanged.

Measured on H100s (graph-replayed, `flash-models bench attention --graphs`), B * S = 16k, H * D = 2048: head
dim 128 against cuDNN 1.00-1.08x non-causal and 1.03-1.11x causal at S 1k-8k; head dim 64 1.00-1.02x at 2k and
0.97x at BERT-large's shape (32 x 512, 16 heads: ``--hidden 1024``), where the Triton forward
(``use_hopper_forward(False)``) took 101-103 us to this one's 92.5.
"""

from __future__ import annotations

import functools
import logging

import torch

from ._backend import capturing_cuda_graph
from ._launch import arguments_key, lean_launch
from ._triton_compat import TRITON_AVAILABLE, triton
from ._triton_utils import cdiv, device_capability, dummy_pointer, sm_count

GLUON_AVAILABLE = False
if TRITON_AVAILABLE:  # not Triton's own import where it is not loaded (see _triton_compat)
    try:  # Gluon and its Hopper ops: Triton 3.6 has them; older releases do not.
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                       warpgroup_mma_wait)
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        from triton.compiler.errors import CompilationError

        GLUON_AVAILABLE = True
        # A barrier across the CTA's threads: ``thread_barrier`` in Triton 3.6, ``barrier`` from 3.7 on.
        _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    except (ImportError, AttributeError):  # pragma: no cover - depends on the installed Triton
        pass

logger = logging.getLogger(__name__)

# Head dim -> the fewest keys from which ``attention`` takes this kernel. H100 (`flash-models bench attention
# --graphs`, B * S = 16k, H * D = 2048, graph-replayed forward; ``use_hopper_forward(False)`` gives the Triton
# side): head dim 128, S 512 to 8k, 1.14-1.30x the Triton kernel's speed; head dim 64 at BERT-large's 512 keys
# (B 32, 16 heads) 97 against 103 us; at 128 and 256 keys 1.04-1.40x at both head dims, causal or not. Below 128 keys nothing was measured, and the
# Triton kernel's launch plans cost less host time for short calls.
MIN_KEYS = {128: 128, 64: 128}
# Varlen: the smallest share of the (sequences x max_seqlen) grid the tokens must fill. This kernel's 128-row
# query blocks and 128-key tiles waste more on a sequence's last tiles than the Triton kernel's smaller ones;
# BERT-large (H100): at 512 keys faster than the Triton kernel from 91% full, level at 78-84%, slower below;
# at 256 keys faster at 81%, slower at 70%; at 128 keys ahead down to 68%.
MIN_VARLEN_FILL = 0.8
# Outside a CUDA graph's capture, the least work (matmul FLOPs, halved for causal) of a call that takes this
# kernel (``leave_to_triton``): 2^35 is BERT-large's 512 keys at batch 32, about 90 us of kernel. This kernel's
# launch costs more host time than the Triton kernel's (four TMA descriptors, a zeroed counter), and an eager
# model of small calls waits on its host: BERT-base inference (128 tokens, batch 128) measured slower with this
# forward than without. A graph pays the host once, so captures take this kernel at any size.
EAGER_MIN_FLOP = 2**35
BLOCK_M = 128  # query rows per tile: 64 per consumer warpgroup
# (BLOCK_N, STAGES) by head dim: 128-key tiles, two stages of K and V (128 KB of shared memory at head dim 128,
# 192 KB with the query buffers).
# On an H100 they ran faster than 64-key tiles in 2 or 3 stages, at head dim 128 (B 8, S 2k) and at head dim 64
# (B 16, S 1k, H 32).
TILES = {64: (128, 2), 128: (128, 2)}
# Registers: three warpgroups (the producer's warp is padded to one) share the SM's 64K at 168 each; the
# producer gives all but 24 back, which go to the consumers (240 each).
MAX_REGISTERS, CONSUMER_REGISTERS, PRODUCER_REGISTERS = 168, 240, 24
# Ping-pong between the consumers (``_await_turn``): faster at S 1k-2k, level at 4k-8k (head dim 128, H100).
# A second query buffer per consumer is needed: a consumer gives a tile's buffer back only once its next tile
# has started (``_consume``).
PINGPONG = True
Q_BUFFERS = 2


_enabled = True


def enabled() -> bool:
    """Whether ``attention`` may take this kernel (``use_hopper_forward``)."""
    return _enabled


def use_hopper_forward(enable: bool) -> bool:
    """Let ``attention``'s forward take this kernel where it can run (the default), or keep the Triton kernel
    everywhere; returns the previous setting. A user setting (README, Settings): this kernel is built on Gluon,
    Triton's experimental layer, so a Triton release that miscompiles it must not leave a user stuck; it also
    gives tests and A/B benchmarks the Triton forward on Hopper."""
    global _enabled
    previous, _enabled = _enabled, bool(enable)
    return previous


def forward_unsupported(q, k, v, out, *, cu_q, cu_k, max_k, causal, local, softcap, alibi, dropout_p,
                        scale) -> str | None:
    """Why this kernel cannot run the forward for q, k, v (B, S, H, D) into ``out`` (q's shape), or None.
    Varlen: ``cu_q``/``cu_k`` and the longest key sequence ``max_k``; ``local``: a window beyond the causal mask."""
    # The cheap questions first: every forward on a GPU asks, the causal prefill of a decoder among them.
    if local or softcap > 0 or alibi is not None or dropout_p > 0 or scale <= 0:
        return "a window, softcap, ALiBi, dropout or a non-positive scale"
    varlen = cu_q is not None
    if varlen and (cu_k.data_ptr() != cu_q.data_ptr() or k.shape[1] != q.shape[1]):
        return "varlen with separate query and key sequences (self-attention over one cu_seqlens only)"
    if causal and not varlen and q.shape[1] > k.shape[1]:
        return "causal with more queries than keys (rows that see no key)"
    if q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] not in MIN_KEYS:
        return "a dtype other than fp16/bf16 or a head dim other than 64/128"
    if (max_k if varlen else k.shape[1]) < MIN_KEYS[q.shape[-1]]:
        return f"fewer than {MIN_KEYS[q.shape[-1]]} keys at head dim {q.shape[-1]}, where the Triton kernel is as fast"
    if varlen and q.shape[1] < MIN_VARLEN_FILL * (cu_q.numel() - 1) * max_k:
        return (f"varlen sequences filling less than {MIN_VARLEN_FILL:.0%} of (sequences x max_seqlen), where the "
                "Triton kernel's smaller tiles waste less")
    if not GLUON_AVAILABLE:
        return "this Triton has no Gluon Hopper ops"
    if not q.is_cuda or device_capability(q.device.index) != (9, 0):
        return "not a Hopper (compute capability 9.0) GPU"
    for t in (q, k, v, out):
        b, s, h, d = t.shape
        sb, ss, sh, sd = t.stride()
        # One (B * S, H * D) matrix with row stride ss: TMA needs 16-byte aligned rows and base.
        if sd != 1 or sh != d or (b > 1 and sb != s * ss) or (ss * t.element_size()) % 16 or t.data_ptr() % 16:
            return "a layout that is not a strided (B * S, H * D) matrix with 16-byte aligned rows"
    return None


if GLUON_AVAILABLE:

    @gluon.jit
    def _unit_tiles(unit, n_mblocks, CAUSAL):
        """A program's unit of work: (batch x head, k, tiles). Non-causal, one 128-row query block k of a batch and
        head. Causal, query blocks cost more the later they sit, so a unit pairs the k-th block from the end with
        the k-th from the start (one block alone where a count is odd): every unit costs about the same, and the
        programs, which take units in turn, finish together."""
        per_bh = n_mblocks
        if CAUSAL:
            per_bh = (n_mblocks + 1) // 2
        k = unit % per_bh
        tiles = 1
        if CAUSAL:
            tiles = 2 - (2 * k + 1 == n_mblocks).to(gl.int32)
        return unit // per_bh, k, tiles

    @gluon.jit
    def _sequence(b, CuSeq, VARLEN):
        """Varlen (self-attention): sequence b's first row and length, rows CuSeq[b]:CuSeq[b + 1] of q, k and v.
        Only the producer reads them; it posts them to the consumers with each tile (``_post_tile``)."""
        start = 0
        length = 0
        if VARLEN:
            start = gl.load(CuSeq + b)
            length = gl.load(CuSeq + b + 1) - start
        return start, length

    @gluon.jit
    def _tile(bh, k, part, n_mblocks, sizes, start, length, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, CAUSAL, VARLEN):
        """Tile ``part`` of unit (bh, k): (first q row of the sequence in the (rows, H * D) matrix, first k row,
        q column, kv column, first query row in the sequence, key tiles to walk (0: the tile lies past a short
        sequence's end), query length, key length, the log-sum-exp's offset). Varlen: the sequence's ``start``
        and ``length`` (``_sequence``). Causal: the heavier block first, keys up to the diagonal only."""
        seqlen_q, seqlen_k, n_heads, group, _scale_log2, _n_units, _stride_om, lse_sb, lse_sh = sizes
        b = bh // n_heads
        h = bh % n_heads
        if VARLEN:
            len_q = length
            len_k = len_q
            q_row = start
            k_row = start
            lse_off = h.to(gl.int64) * lse_sh + start
        else:
            len_q = seqlen_q
            len_k = seqlen_k
            q_row = b * seqlen_q
            k_row = b * seqlen_k
            lse_off = b.to(gl.int64) * lse_sb + h * lse_sh
        mb = k
        if CAUSAL:
            mb = k + (1 - part) * (n_mblocks - 1 - 2 * k)
        m0 = mb * BLOCK_M
        kv_end = len_k
        if CAUSAL:
            kv_end = gl.minimum(len_k, m0 + BLOCK_M + len_k - len_q)
        n_kv = gl.cdiv(kv_end, BLOCK_N) * (m0 < len_q).to(gl.int32)
        return q_row, k_row, h * HEAD_DIM, (h // group) * HEAD_DIM, m0, n_kv, len_q, len_k, lse_off

    @gluon.jit
    def _post_tile(tile_codes, slot, code, start, length, VARLEN):
        """The producer tells both consumers which tile the query buffers ``slot`` hold: ``2 * unit + part``
        (or -1: no more) and its sequence's start and length (varlen), so the consumers read no offsets
        themselves. Written before the queries' barriers are armed, whose arrival releases it to them. Field f of
        slot s sits at row f * Q_BUFFERS + s, one value a row: a one-element load is a plain ``ld.shared``."""
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        slots: gl.constexpr = tile_codes.type.shape[0] // 3
        tile_codes.index(slot).store(gl.full([1], code, gl.int32, layout))
        if VARLEN:
            tile_codes.index(slots + slot).store(gl.full([1], start, gl.int32, layout))
            tile_codes.index(2 * slots + slot).store(gl.full([1], length, gl.int32, layout))

    @gluon.jit
    def _posted(tile_codes, slot, field: gl.constexpr):
        """Field 0 (the code), 1 (start) or 2 (length) of what ``_post_tile`` wrote to ``slot``."""
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        slots: gl.constexpr = tile_codes.type.shape[0] // 3
        return gl.max(tile_codes.index(field * slots + slot).load(layout), axis=0)

    @gluon.jit
    def _producer(args):
        """One warp: takes units from the launch's counter in turn (``_unit_tiles``); for each of a unit's tiles
        that has work, posts it to the consumers with the two query halves, then loads every key and value tile
        into the STAGES-deep rings, each slot refilled once both consumers have released it. Programs that take
        units as they finish, rather than every n-th, stay level where units cost differently (varlen sequences
        of uneven lengths), and empty tiles never reach the consumers."""
        descs, pointers, sizes, buffers, barriers, flags = args
        q_desc, k_desc, v_desc, _o_desc = descs
        _O, _LSE, CuSeq, Next = pointers
        q_smem, k_smem, v_smem, tile_codes = buffers
        seqlen_q, _seqlen_k, n_heads, _group, _scale_log2, n_units, _stride_om, _lse_sb, _lse_sh = sizes
        q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, _turn = barriers
        CAUSAL, VARLEN, _pingpong = flags
        HEAD_DIM: gl.constexpr = k_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        HALF: gl.constexpr = q_desc.block_type.shape[0]
        STAGES: gl.constexpr = k_smem.type.shape[0]
        Q_BUFFERS: gl.constexpr = q_smem.type.shape[0] // 2  # per consumer
        n_mblocks = gl.cdiv(seqlen_q, 2 * HALF)
        it = 0
        t = 0
        unit = gl.atomic_add(Next, 1, sem="relaxed")
        while unit < n_units:
            bh, k, tiles = _unit_tiles(unit, n_mblocks, CAUSAL)
            start, length = _sequence(bh // n_heads, CuSeq, VARLEN)
            for part in range(tiles):
                q_row, k_row, q_col, kv_col, m0, n_kv, _len_q, _len_k, _lse_off = _tile(
                    bh, k, part, n_mblocks, sizes, start, length, HEAD_DIM, 2 * HALF, BLOCK_N, CAUSAL, VARLEN)
                if n_kv > 0:
                    slot = t % Q_BUFFERS
                    # An mbarrier starts with its phase 1 complete: the first wait on an "empty" barrier passes.
                    free = ((t // Q_BUFFERS) & 1) ^ 1
                    mbarrier.wait(q_empty.index(2 * slot), free)
                    mbarrier.wait(q_empty.index(2 * slot + 1), free)
                    _post_tile(tile_codes, slot, 2 * unit + part, start, length, VARLEN)
                    for wg in gl.static_range(2):
                        mbarrier.expect(q_ready.index(2 * slot + wg), q_desc.block_type.nbytes)
                        tma.async_copy_global_to_shared(q_desc, [q_row + m0 + wg * HALF, q_col],
                                                        q_ready.index(2 * slot + wg), q_smem.index(2 * slot + wg))
                    for j in range(n_kv):
                        stage = it % STAGES
                        phase = (it // STAGES) & 1
                        mbarrier.wait(k_empty.index(stage), phase ^ 1)
                        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
                        tma.async_copy_global_to_shared(k_desc, [k_row + j * BLOCK_N, kv_col], k_ready.index(stage),
                                                        k_smem.index(stage))
                        mbarrier.wait(v_empty.index(stage), phase ^ 1)
                        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
                        tma.async_copy_global_to_shared(v_desc, [k_row + j * BLOCK_N, kv_col], v_ready.index(stage),
                                                        v_smem.index(stage))
                        it += 1
                    t += 1
            unit = gl.atomic_add(Next, 1, sem="relaxed")
        slot = t % Q_BUFFERS
        free = ((t // Q_BUFFERS) & 1) ^ 1
        mbarrier.wait(q_empty.index(2 * slot), free)
        mbarrier.wait(q_empty.index(2 * slot + 1), free)
        _post_tile(tile_codes, slot, -1, 0, 0, VARLEN)
        for wg in gl.static_range(2):
            mbarrier.arrive(q_ready.index(2 * slot + wg), count=1)

    @gluon.jit
    def _mask_scores(s, tile_start, seqlen_k, row0, diagonal, CAUSAL, BLOCK_N: gl.constexpr,
                     HALF: gl.constexpr, s_layout: gl.constexpr):
        """Scores set to -inf for keys past the sequence's end (the next sequence's rows, or TMA's zeros) and,
        causal, for keys past a row's diagonal: row r of rows [row0, row0 + HALF) sees keys <= r + diagonal,
        where diagonal = Sk - Sq aligns the mask bottom-right."""
        if CAUSAL:
            if tile_start + BLOCK_N - 1 > row0 + diagonal:
                cols = tile_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
                rows = row0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout))
                s = gl.where(gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1) + diagonal, s, float("-inf"))
        if tile_start + BLOCK_N > seqlen_k:
            cols = tile_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            s = gl.where(gl.expand_dims(cols < seqlen_k, 0), s, float("-inf"))
        return s

    @gluon.jit
    def _await_turn(turn, WG: gl.constexpr, event, PINGPONG):
        """Ping-pong: a warpgroup issues its event-th group of wgmma only after the other one issued its previous
        group, so one warpgroup's softmax runs while the other's matrix products hold the tensor cores. The first
        warpgroup's first wait passes on the barrier's initial phase."""
        if PINGPONG:
            mbarrier.wait(turn.index(WG), (event & 1) ^ (1 - WG))

    @gluon.jit
    def _pass_turn(turn, WG: gl.constexpr, PINGPONG):
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - WG), count=1)

    @gluon.jit
    def _store_rows(o_buf, O, q_row, row0, q_col, len_q, stride_om, HALF: gl.constexpr, HEAD_DIM: gl.constexpr):
        """A warpgroup's output rows from shared memory, those past the sequence's end left out: a TMA store
        would write them over the next sequence's first rows. Each thread stores 8 contiguous elements a row (one
        16-byte store where the row stride is known divisible), its pointers made here, not kept across tiles."""
        rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HEAD_DIM // 8), HEAD_DIM // 8], [4, 1], [1, 0])
        _cta_barrier()  # every thread of the warpgroup has written its part of o_buf
        o = o_buf.load(rows_layout)
        rows = row0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, rows_layout))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, rows_layout))
        ptrs = O + gl.expand_dims((q_row + rows).to(gl.int64) * stride_om, 1) + q_col + gl.expand_dims(cols, 0)
        gl.store(ptrs, o, mask=gl.expand_dims(rows < len_q, 1))

    @gluon.jit
    def _consume(args, WG: gl.constexpr):
        """One consumer warpgroup: query rows [WG * 64, WG * 64 + 64) of each tile. The online softmax keeps the
        row maximum of the raw scores (the scale is positive) and folds the scale into the exponent. Every row
        sees key 0 (causal: Sq <= Sk), so the first key tile leaves each row a finite maximum and a later tile
        wholly past a row's diagonal adds nothing to it."""
        descs, pointers, sizes, buffers, barriers, flags = args
        q_desc, k_desc, v_desc, o_desc = descs
        O, LSE, _cu_seq, _next = pointers
        q_smem, k_smem, v_smem, tile_codes = buffers
        seqlen_q, _seqlen_k, _n_heads, _group, scale_log2, _n_units, stride_om, _lse_sb, _lse_sh = sizes
        q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn = barriers
        CAUSAL, VARLEN, PINGPONG = flags
        HEAD_DIM: gl.constexpr = k_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        HALF: gl.constexpr = q_desc.block_type.shape[0]
        STAGES: gl.constexpr = k_smem.type.shape[0]
        Q_BUFFERS: gl.constexpr = q_smem.type.shape[0] // 2  # per consumer
        gl.static_assert(Q_BUFFERS >= 2, "a tile's query buffer is released only once the next tile has started")
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        n_mblocks = gl.cdiv(seqlen_q, 2 * HALF)
        s_zero = gl.zeros([HALF, BLOCK_N], gl.float32, s_layout)
        it = 0
        t = 0
        event = 0
        # The producer posts each tile with work as ``2 * unit + part`` beside its queries, and -1 at the end.
        qb = WG
        mbarrier.wait(q_ready.index(qb), 0)
        code = _posted(tile_codes, 0, 0)
        while code >= 0:
            # Read here, not carried through the loop: at head dim 128 two more loop-carried registers made
            # ptxas spill 468 bytes instead of 76. Dense calls read nothing, so their code stays as it was.
            start = 0
            length = 0
            if VARLEN:
                start = _posted(tile_codes, t % Q_BUFFERS, 1)
                length = _posted(tile_codes, t % Q_BUFFERS, 2)
            bh, k, _tiles = _unit_tiles(code // 2, n_mblocks, CAUSAL)
            q_row, k_row, q_col, kv_col, m0, n_kv, len_q, len_k, lse_off = _tile(
                bh, k, code % 2, n_mblocks, sizes, start, length, HEAD_DIM, 2 * HALF, BLOCK_N, CAUSAL, VARLEN)
            diagonal = len_k - len_q
            row0 = m0 + WG * HALF
            q_buf = q_smem.index(qb)
            slot = it % STAGES
            mbarrier.wait(k_ready.index(slot), (it // STAGES) & 1)
            _await_turn(turn, WG, event, PINGPONG)
            s = warpgroup_mma(q_buf, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            _pass_turn(turn, WG, PINGPONG)
            event += 1
            if t > 0:
                # The previous tile's output store has read its buffer by now, or nearly: it goes back to the
                # producer here, not at the store, so the store overlaps this tile's first Q.K^T (faster on
                # BERT-large varlen at 512 tokens). The producer fills the other buffer meanwhile.
                tma.store_wait(0)
                mbarrier.arrive(q_empty.index(((t - 1) % Q_BUFFERS) * 2 + WG), count=1)
            s = warpgroup_mma_wait(0, deps=(s, ))
            mbarrier.arrive(k_empty.index(slot), count=1)
            s = _mask_scores(s, 0, len_k, row0, diagonal, CAUSAL, BLOCK_N, HALF, s_layout)
            m_i = gl.max(s, axis=1) * scale_log2
            p = gl.exp2(s * scale_log2 - gl.expand_dims(m_i, 1))
            l_i = gl.sum(p, axis=1)
            acc = gl.zeros([HALF, HEAD_DIM], gl.float32, o_layout)
            for j in range(0, n_kv - 1):
                cur = it + j
                nxt = cur + 1
                # The next tile's scores first, then this tile's P.V; wait for the scores alone, so that their
                # softmax runs while P.V is still on the tensor cores.
                mbarrier.wait(k_ready.index(nxt % STAGES), (nxt // STAGES) & 1)
                _await_turn(turn, WG, event, PINGPONG)
                s_next = warpgroup_mma(q_buf, k_smem.index(nxt % STAGES).permute((1, 0)), s_zero,
                                       use_acc=False, is_async=True)
                mbarrier.wait(v_ready.index(cur % STAGES), (cur // STAGES) & 1)
                acc = warpgroup_mma(gl.convert_layout(p.to(q_desc.dtype), p_layout),
                                    v_smem.index(cur % STAGES), acc, is_async=True)
                _pass_turn(turn, WG, PINGPONG)
                event += 1
                s = warpgroup_mma_wait(1, deps=(s_next, ))
                mbarrier.arrive(k_empty.index(nxt % STAGES), count=1)
                s = _mask_scores(s, (j + 1) * BLOCK_N, len_k, row0, diagonal, CAUSAL, BLOCK_N, HALF, s_layout)
                m_new = gl.maximum(m_i, gl.max(s, axis=1) * scale_log2)
                p = gl.exp2(s * scale_log2 - gl.expand_dims(m_new, 1))
                alpha = gl.exp2(m_i - m_new)
                l_i = l_i * alpha + gl.sum(p, axis=1)
                m_i = m_new
                acc = warpgroup_mma_wait(0, deps=(acc, ))
                mbarrier.arrive(v_empty.index(cur % STAGES), count=1)
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            last = it + n_kv - 1
            mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
            _await_turn(turn, WG, event, PINGPONG)
            acc = warpgroup_mma(gl.convert_layout(p.to(q_desc.dtype), p_layout), v_smem.index(last % STAGES),
                                acc, is_async=True)
            _pass_turn(turn, WG, PINGPONG)
            event += 1
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            mbarrier.arrive(v_empty.index(last % STAGES), count=1)
            # The output goes through this tile's query buffer (its queries are read): TMA stores it where the
            # warpgroup's rows all lie in the sequence, which keeps the epilogue short and the registers free of
            # per-element output pointers; the buffer goes back to the producer once the next tile has started.
            l_o = gl.convert_layout(l_i, row_o)
            q_buf.store((acc * gl.expand_dims(1.0 / l_o, 1)).to(o_desc.dtype))
            if row0 + HALF <= len_q:
                fence_async_shared()
                tma.async_copy_shared_to_global(o_desc, [q_row + row0, q_col], q_buf)
            else:
                _store_rows(q_buf, O, q_row, row0, q_col, len_q, stride_om, HALF, HEAD_DIM)
            rows = row0 + gl.arange(0, HALF, layout=row_o)
            lse = (gl.convert_layout(m_i, row_o) + gl.log2(l_o)) * 0.6931471805599453
            gl.store(LSE + lse_off + rows, lse, mask=rows < len_q)
            it += n_kv
            t += 1
            qb = (t % Q_BUFFERS) * 2 + WG
            mbarrier.wait(q_ready.index(qb), (t // Q_BUFFERS) & 1)
            code = _posted(tile_codes, t % Q_BUFFERS, 0)
        tma.store_wait(0)

    @gluon.jit
    def _consumer0(args):
        _consume(args, 0)

    @gluon.jit
    def _consumer1(args):
        _consume(args, 1)

    @lean_launch
    @gluon.jit
    def _attn_fwd_hopper_kernel(q_desc, k_desc, v_desc, o_desc, O, LSE, CuSeq, Next, seqlen_q, seqlen_k, n_heads,
                                group, scale_log2, n_units, stride_om, lse_sb, lse_sh, HEAD_DIM: gl.constexpr,
                                BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                                PRODUCER_REGS: gl.constexpr, CAUSAL: gl.constexpr, VARLEN: gl.constexpr,
                                PINGPONG: gl.constexpr, Q_BUFFERS: gl.constexpr):
        HALF: gl.constexpr = q_desc.block_type.shape[0]
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2 * Q_BUFFERS, HALF, HEAD_DIM], q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        tile_codes = gl.allocate_shared_memory(gl.int32, [3 * Q_BUFFERS, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        q_ready = gl.allocate_shared_memory(gl.int64, [2 * Q_BUFFERS, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [2 * Q_BUFFERS, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2 * Q_BUFFERS):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)  # both consumers release a key or value slot
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(v_empty.index(i), count=2)
        # The flags reach the partitions as i1 values, not constexprs (a tuple made in the kernel holds values):
        # both sides of every ``if`` on them must type-check, and LLVM folds the constant branches.
        args = ((q_desc, k_desc, v_desc, o_desc), (O, LSE, CuSeq, Next),
                (seqlen_q, seqlen_k, n_heads, group, scale_log2, n_units, stride_om, lse_sb, lse_sh),
                (q_smem, k_smem, v_smem, tile_codes), (q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn),
                (gl.constexpr(CAUSAL), gl.constexpr(VARLEN), gl.constexpr(PINGPONG)))
        gl.warp_specialize([(_consumer0, (args, )), (_consumer1, (args, )), (_producer, (args, ))], [4, 1],
                           [CONSUMER_REGS, PRODUCER_REGS])


def _matmul_flop(q, max_seqlen_k: int, causal: bool) -> int:
    """The FLOPs of a call's two matmuls (q.k^T, p.v) over ``max_seqlen_k`` keys, halved for causal (varlen:
    every packed query against the longest sequence, an upper bound)."""
    b, sq, h, d = q.shape
    flop = 4 * b * sq * max_seqlen_k * h * d
    return flop // 2 if causal else flop


def small_eager_call(q, keys: int, causal: bool) -> bool:
    """An eager call (outside a CUDA graph's capture) of under ``EAGER_MIN_FLOP``: one where the Triton kernels'
    cheaper launch wins (the Hopper backward asks this too)."""
    return not capturing_cuda_graph() and _matmul_flop(q, keys, causal) < EAGER_MIN_FLOP


# The specializations (``_specialization``) of this process's launches so far: each one's compiled kernel is
# loaded on its device, so a CUDA graph's capture may launch it (a first launch loads the module, which a
# capture forbids: "operation not permitted when stream is capturing").
_launched: set[tuple] = set()


def leave_to_triton(q, k, out, lse, causal: bool, cu_seqlens, max_seqlen: int) -> bool:
    """Whether a call this kernel can run (``forward_unsupported`` said so) goes to the Triton kernel instead:
    an eager call of under ``EAGER_MIN_FLOP``, where the Triton kernel's cheaper launch wins. The first eager
    call of each specialization still runs here, so that a capture of the same call (after the eager warm-up a
    capture needs anyway) finds this kernel loaded and takes it: a graph pays the host cost once."""
    keys = k.shape[1] if cu_seqlens is None else max_seqlen
    if not small_eager_call(q, keys, causal):
        return False
    scalars = _launch_scalars(q, k, out, lse, causal, cu_seqlens, max_seqlen)
    return _specialization(q, out, lse, cu_seqlens, causal, scalars) in _launched


def _launch_scalars(q, k, out, lse, causal: bool, cu_seqlens, max_seqlen: int) -> tuple[int, ...]:
    """The launch's integer arguments: sequence lengths, heads, query-head group, units of work, the output's row
    stride, the log-sum-exp's strides."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    varlen = cu_seqlens is not None
    if varlen:
        b, sq, sk = cu_seqlens.numel() - 1, max_seqlen, max_seqlen
    n_mblocks = cdiv(sq, BLOCK_M)
    n_units = (cdiv(n_mblocks, 2) if causal else n_mblocks) * b * hq  # see _unit_tiles
    lse_sb, lse_sh = (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))
    return sq, sk, hq, hq // hkv, n_units, out.stride(1), lse_sb, lse_sh


def _specialization(q, out, lse, cu_seqlens, causal: bool, scalars: tuple) -> tuple:
    """What Triton compiles a launch of this kernel for: the device, the dtype (the descriptors' type), the
    head dim and flags (the constexprs), and the pointers' and integers' specialization (``arguments_key``)."""
    return (q.device.index, q.dtype, q.shape[-1], bool(causal), cu_seqlens is not None,
            *arguments_key((out, lse, cu_seqlens, *scalars)))


_GLUON_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


@functools.lru_cache(maxsize=None)
def _box_layout(rows: int, cols: int, dtype: torch.dtype):
    """The shared-memory layout of a (rows, cols) box of ``dtype`` (bf16, fp16, or the backward's fp32 dQ sum).
    Kept: Gluon's ``get_default_for`` costs 15-18 us of host time a call, four or five calls a launch (an
    immutable value, so one object serves every launch)."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], getattr(gl, _GLUON_DTYPES[dtype]))


def _descriptor(t: torch.Tensor, rows: int, cols: int | None = None):
    """A TMA descriptor over t's (B * S, H * D) matrix, moving (rows, cols) boxes (cols: D unless given). Its base
    is t itself: a descriptor reads only the base's address and dtype (no (B * S, H * D) view is made, a few us a
    call). The backward's kernel takes these too."""
    b, s, h, d = t.shape
    cols = cols or d
    return TensorDescriptor(t, [b * s, h * d], [t.stride(1), 1], [rows, cols], _box_layout(rows, cols, t.dtype))


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                      scale: float, causal: bool = False, cu_seqlens: torch.Tensor | None = None,
                      max_seqlen: int = 0) -> bool:
    """Writes the attention of q (B, Sq, Hq, D) over k, v (B, Sk, Hkv, D) into ``out`` (q's shape, a strided
    (B * Sq, Hq * D) matrix) and its natural-log log-sum-exp into ``lse``: (B, Hq, Sq), or (Hq, total) for
    varlen. Causal aligns the mask bottom-right and needs Sq <= Sk. Varlen (``cu_seqlens``, int32): self-attention
    over packed sequences, q, k, v (1, total, H, D), sequence b in rows cu_seqlens[b]:cu_seqlens[b + 1] of all
    three, none longer than ``max_seqlen``. The caller has checked ``forward_unsupported``.

    Returns False, having launched nothing, where this Triton's Gluon cannot compile the kernel (its API moves
    between releases: 3.7 renamed ``thread_barrier``); the kernel is then switched off for the process, with a
    warning, and the caller runs the Triton forward."""
    d = q.shape[-1]
    block_n, stages = TILES[d]
    scalars = _launch_scalars(q, k, out, lse, causal, cu_seqlens, max_seqlen)
    sq, sk, hq, group, n_units, stride_om, lse_sb, lse_sh = scalars
    grid = (min(n_units, sm_count(q.device.index)), )  # (a CUDA tensor's device always has its index)
    cu = cu_seqlens if cu_seqlens is not None else dummy_pointer(q.device, torch.int32)
    next_unit = torch.zeros(1, dtype=torch.int32, device=q.device)  # the programs' shared count of units taken
    try:
        _attn_fwd_hopper_kernel[grid](
            _descriptor(q, BLOCK_M // 2), _descriptor(k, block_n), _descriptor(v, block_n),
            _descriptor(out, BLOCK_M // 2), out, lse, cu, next_unit, sq, sk, hq, group, scale * 1.4426950408889634,
            n_units, stride_om, lse_sb, lse_sh,
            HEAD_DIM=d, BLOCK_N=block_n, STAGES=stages, CONSUMER_REGS=CONSUMER_REGISTERS,
            PRODUCER_REGS=PRODUCER_REGISTERS, CAUSAL=bool(causal), VARLEN=cu_seqlens is not None, PINGPONG=PINGPONG,
            Q_BUFFERS=Q_BUFFERS, num_warps=4, maxnreg=MAX_REGISTERS,
        )
    except CompilationError as error:  # raised before anything is queued: nothing half-done
        use_hopper_forward(False)
        logger.warning("flash_kernels: this Triton (%s) cannot compile the Hopper attention forward, so attention "
                       "keeps its Triton forward (slower on Hopper; Triton 3.6 and 3.8 compile it):\n%s",
                       triton.__version__, error)
        return False
    _launched.add(_specialization(q, out, lse, cu_seqlens, causal, scalars))
    return True
