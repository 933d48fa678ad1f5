"""Building blocks of the attention kernels (``attention``'s forward, ``attention_bwd``, ``attention_decode``):
masked tile loads and stores, the score transform and visibility mask, the key and row ranges a tile needs,
dropout's Philox keep mask, sequence bounds, and the autotune candidates and buckets they share."""

from __future__ import annotations


from ._backend import triton_interpreter_enabled
from ._triton_compat import tl, triton
from ._triton_utils import next_power_of_2

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# Globals a @triton.jit function reads must be constexpr.
_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(LN2)


@triton.jit
def _load_rows(ptrs, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROW_MASK: tl.constexpr):
    """Load a (rows, BLOCK_D) tile, masking only what can be out of range: a mask that varies along the head
    dim stops Triton from vectorising the load (2-byte loads, and no cp.async pipelining)."""
    if ROW_MASK:
        if HEAD_DIM == BLOCK_D:
            x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            x = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    else:
        if HEAD_DIM == BLOCK_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return x


@triton.jit
def _load_tile(src, start, rows, n_rows, stride_s, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               ROW_MASK: tl.constexpr, TMA: tl.constexpr):
    """The (len(rows), BLOCK_D) tile at rows ``rows`` = start + arange of one (sequence, head)'s rows: from its
    TMA descriptor (one bulk copy) or, from its base pointer, by loads masked as ``_load_rows`` masks them.
    Either way rows >= n_rows and columns >= HEAD_DIM read as zeros."""
    # if/else with one return: the compiler also visits code after a constexpr-if that returns.
    if TMA:
        x = src.load([start, 0])
    else:
        x = _load_rows(src + rows[:, None] * stride_s + offs_d[None, :], rows, n_rows, offs_d, HEAD_DIM, BLOCK_D,
                       ROW_MASK)
    return x


@triton.jit
def _store_rows(ptrs, x, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    if HEAD_DIM == BLOCK_D:
        tl.store(ptrs, x, mask=rows[:, None] < n_rows)
    else:
        tl.store(ptrs, x, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _mm(a, b, acc, DOT_F32: tl.constexpr):
    """a @ b (+ acc) in fp32. DOT_F32 upcasts the operands first: only for Triton's CPU interpreter, whose
    bf16 tl.dot is wrong (triton 3.8); the values are bf16-exact either way, so the result is the same."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def _key_range(m0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, len_q, len_k, left, right):
    """Key ranges for query rows [m0, m0 + BLOCK_M): masked [lo, full_lo), unmasked [full_lo, full_hi),
    masked [full_hi, hi). Starts are multiples of BLOCK_N; only the masked ranges pay for the mask."""
    off = len_k - len_q  # bottom-right alignment: row i sits at key position i + off
    lo = tl.maximum(m0 + off - left, 0) // BLOCK_N * BLOCK_N
    hi = tl.minimum(m0 + BLOCK_M - 1 + off + right + 1, len_k)
    hi = tl.maximum(hi, lo)
    # The rows beyond len_q in the last block are never stored, so only real rows decide "unmasked".
    last_row = tl.minimum(m0 + BLOCK_M, len_q) - 1
    full_lo = tl.minimum(tl.maximum((tl.maximum(last_row + off - left, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N, lo), hi)
    full_hi = tl.minimum(m0 + off + right + 1, len_k) // BLOCK_N * BLOCK_N
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _scores(qk, rows, cols, len_q, len_k, left, right, scale_log2, softcap, slope_log2,
            SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, MASK: tl.constexpr):
    """Raw q.k products -> scores in log2 units, -inf where invisible. ``rows``/``cols`` are the query and key
    indices broadcast to qk's layout (either orientation). Also returns tanh(s / softcap), which the
    backward's chain rule needs (qk itself when there is no softcap)."""
    if SOFTCAP:
        # tanh(x) = 1 - 2 / (exp(2x) + 1): finite for any x, and tl has no tanh that the interpreter runs.
        t = 1.0 - 2.0 / (tl.exp(2.0 * qk * (scale_log2 * _LN2 / softcap)) + 1.0)
        s = t * (softcap * _LOG2E)
    else:
        t = qk
        s = qk * scale_log2
    if ALIBI:
        dist = tl.abs(rows + (len_k - len_q) - cols).to(tl.float32)
        s = s - slope_log2 * dist
    if MASK:
        s = tl.where(_visible(rows, cols, len_q, len_k, left, right), s, float("-inf"))
    return s, t


@triton.jit
def _visible(rows, cols, len_q, len_k, left, right):
    """Which (query row, key col) pairs attend: real keys inside the window around the bottom-right diagonal."""
    diag = rows + (len_k - len_q)
    return (cols < len_k) & (cols >= diag - left) & (cols <= diag + right)


@triton.jit
def _keep(seed, rows, cols, max_k, dropout_p):
    """Philox keep mask for one (batch, head) at query rows x key cols (broadcast 2-D): True = kept."""
    return tl.rand(seed, rows * max_k + cols) >= dropout_p


@triton.jit
def _head_seed(Seed, b, n_heads, h, DROPOUT: tl.constexpr):
    """The Philox seed of one (batch, head): the step's seed, read from the device (so a CUDA graph replay
    draws a fresh mask each time), plus the head's index. Unused without dropout."""
    if DROPOUT:
        seed = tl.load(Seed) + b * n_heads + h
    else:
        seed = (b * n_heads + h).to(tl.int64)
    return seed


@triton.jit
def _seq_bounds(CuQ, CuK, b, seqlen_q, seqlen_k, VARLEN: tl.constexpr):
    if VARLEN:
        q_start = tl.load(CuQ + b)
        len_q = tl.load(CuQ + b + 1) - q_start
        k_start = tl.load(CuK + b)
        len_k = tl.load(CuK + b + 1) - k_start
    else:
        q_start = 0
        len_q = seqlen_q
        k_start = 0
        len_k = seqlen_k
    return q_start, len_q, k_start, len_k


def _configs(shapes):
    """Autotune candidates (BLOCK_M, BLOCK_N, warps, stages). The interpreter gets one small tile, so short
    test sequences still cross several blocks."""
    if triton_interpreter_enabled():
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
    # Small tiles for head dims > 128, chosen by the prune (Triton skips the prune when there is one config).
    shapes = shapes + [(64, 32, 4, 2), (32, 32, 4, 2)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in shapes]


def _tune_buckets(max_q: int, max_k: int) -> tuple[int, int]:
    """What the autotuners key on instead of the exact lengths: the next power of two. Keyed on the exact
    lengths, every new prompt or padded-batch length would re-run the whole tuning sweep (with host syncs)."""
    return next_power_of_2(max(max_q, 1)), next_power_of_2(max(max_k, 1))


def _prune_big_head(configs, named_args, **kwargs):
    """Head dims above 128 (padded to 256) need small tiles to fit registers and shared memory (and no TMA,
    whose staged tiles take more shared memory)."""
    bd = kwargs.get("BLOCK_D", named_args.get("BLOCK_D"))
    small = [c for c in configs if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 32 and c.num_stages <= 2]
    if bd <= 128:
        return [c for c in configs if c not in small] or configs
    keep = [c for c in small if not c.kwargs.get("TMA")]
    return keep or [triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=2)]
