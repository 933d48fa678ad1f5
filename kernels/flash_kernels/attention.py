"""FlashAttention forward and backward in Triton, with a plain PyTorch reference.

Semantics follow FlashAttention-2's public functions:

- q is (B, Sq, Hq, D), k and v are (B, Sk, Hkv, D); GQA/MQA when Hq % Hkv == 0 (q head h reads kv head
  h // (Hq // Hkv)).
- Query row i sits at absolute key position ``i + Sk - Sq`` (bottom-right alignment). Key j is visible
  to row i when ``diag - left <= j <= diag + right`` with ``diag = i + Sk - Sq``; ``causal`` means
  ``right = 0``; -1 means unbounded.
- ``softcap > 0`` replaces a score s by ``softcap * tanh(s / softcap)`` (s already scaled); ALiBi then adds
  ``-slope * |diag - j|``.
- Dropout (training) drops entries of the normalised probabilities, as FA2 does. The keep mask comes from
  Philox (``tl.rand``) keyed on (seed, batch, head, row, column); ``dropout_keep_mask`` regenerates it so the
  reference can replay exactly what the kernel did.
- A row that sees no key outputs zeros; its log-sum-exp is -inf (FA2 leaves +inf there; -inf is the value
  that keeps ``exp(s - lse)`` meaning "nothing").
- ``return_lse`` adds the natural-log log-sum-exp, (B, Hq, Sq) (varlen: (Hq, total_q)), float32. It is not
  differentiable (as in FA2).

The Triton path is registered as ``flash_kernels::attn_fwd`` / ``attn_bwd`` custom ops with fake
implementations and autograd, so ``torch.compile(fullgraph=True)`` traces through it. The Triton backward is
atomics-free (one kernel for dK/dV that loops over the q heads of a GQA group or a share of them, one for dQ),
hence deterministic.

The forward loads its Q, K, V tiles either with pointer loads or (``TMA``, Hopper and newer) through tensor
descriptors that each program builds on the device over its own sequence, so rows past the sequence's end and
columns past the head dim arrive as zeros. Which one runs is an autotune choice, not a replacement: on an H200
(`flash-models bench attention --graphs --hdims 128`) TMA tiles win at head dim 128 from 1k keys non-causal and
2k causal, and lose at 1k causal, at head dim 64 and at BERT's varlen S = 128. TMA configs are only candidates where they can run (``_tma_flag``: the device, the Triton version, the
16-byte alignment of every descriptor base and row stride); tests force or forbid them (``_set_tma_loads``).

On a Hopper GPU the forward of fp16/bf16 attention at head dims 128 and 64 from 128 keys, causal or not, with no
window, softcap, ALiBi or dropout (varlen: self-attention only, its tokens filling 80% of (sequences x
max_seqlen); outside a CUDA graph's capture, 2^35 FLOPs of work or more) runs instead on ``attention_hopper``'s
Gluon kernel (FlashAttention-3's schedule, which Triton's ``tl.dot`` cannot express); its output and
log-sum-exp are this module's, so either backward takes them.

On a Hopper GPU the backward of dense (not varlen) fp16/bf16 attention at head dim 128 from 512 keys (causal:
1024) or head dim 64 from 1024 keys (causal: 2048), with no window, softcap, ALiBi or dropout (outside a capture,
2^35 FLOPs or more), runs on
``attention_hopper_bwd``'s Gluon kernel (FA3's single-pass backward, dQ summed with TMA reduce-adds), unless
``deterministic=True`` or torch's deterministic algorithms ask for a reproducible dQ.

This module holds the validation, the forward kernel, the launchers (with their launch plans), the custom ops
and the public functions. The reference is in ``attention_ref``, the backward kernels in ``attention_bwd``, and
the tile-level pieces the forward, the backward and the decode kernels share in ``attention_tiles``.
"""

from __future__ import annotations

import math

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ._autotune_cache import cached_autotune
from ._backend import capturing_cuda_graph, triton_interpreter_enabled, use_triton
from ._launch import lean_launch
from ._launch_plans import LaunchPlans, bind_launch
from ._triton_compat import TRITON_AVAILABLE, tl, triton
from ._triton_utils import (
    cdiv, dropout_seed, dummy_pointer, eager_function, hopper_or_newer, next_power_of_2, pick, placeholder,
    sm_count, unit_last_stride,
)
from . import attention_hopper, attention_hopper_bwd
from .attention_bwd import _attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel, _bwd_preprocess_kernel
from .attention_ref import flash_attn_func_ref, flash_attn_varlen_func_ref
from .attention_tiles import (
    LOG2E, _LN2, _LOG2E, _configs, _head_seed, _keep, _key_range, _load_tile, _mm, _prune_big_head, _scores,
    _seq_bounds, _store_rows, _tune_buckets, _visible,
)

# Any head dim up to MAX_HEAD_DIM, as FlashAttention-2 takes: the kernels hold a head in a tile of the next power of
# two (at least 16, tl.dot's smallest) and mask the columns past it, which reads them as zeros: q.k and p @ v are
# then those of the unpadded head, and the stores leave the padding unwritten.
MAX_HEAD_DIM = 256
TRITON_DTYPES = (torch.float16, torch.bfloat16)

# ----------------------------------------------------------------------------------------------------------
# Validation (shared with attention_decode)
# ----------------------------------------------------------------------------------------------------------


def _check_qkv(op, q, k, v, q_dims):
    if q.dim() != q_dims or k.dim() != q_dims or v.dim() != q_dims:
        raise ValueError(f"{op}: q, k, v must be {q_dims}-D, got {q.dim()}, {k.dim()}, {v.dim()}-D")
    if k.shape != v.shape:
        raise ValueError(f"{op}: k shape {tuple(k.shape)} != v shape {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{op}: head dim of q ({q.shape[-1]}) != head dim of k ({k.shape[-1]})")
    if q.shape[-1] == 0 or k.shape[-2] == 0:
        raise ValueError(f"{op}: q, k, v need a head dim and a number of kv heads of at least 1, got q "
                         f"{tuple(q.shape)} and k {tuple(k.shape)}")
    if q.shape[-2] % k.shape[-2] != 0:
        raise ValueError(
            f"{op}: number of q heads ({q.shape[-2]}) must be a multiple of the number of kv heads ({k.shape[-2]})"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{op}: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    _check_float_dtype(op, q.dtype)
    if not (q.device == k.device == v.device):
        raise ValueError(f"{op}: q, k, v are on different devices: {q.device}, {k.device}, {v.device}")


def _check_float_dtype(op, dtype) -> None:
    """Every backend refuses integer q/k/v alike (softmax weights of integers mean nothing)."""
    if not dtype.is_floating_point:
        raise ValueError(f"{op}: q, k, v must be floating point (float16, bfloat16, float32 or float64), got {dtype}")


def _check_common(op, *, window_size, softcap, dropout_p, alibi_slopes, batch, hq, device):
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or any(w < -1 for w in window_size):
        raise ValueError(f"{op}: window_size must be (left, right) with -1 for unbounded, got {window_size}")
    if softcap < 0:
        raise ValueError(f"{op}: softcap must be >= 0, got {softcap}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{op}: dropout_p must be in [0, 1), got {dropout_p}")
    if alibi_slopes is not None:
        if alibi_slopes.shape not in ((hq,), (batch, hq)):
            raise ValueError(
                f"{op}: alibi_slopes must be ({hq},) or ({batch}, {hq}), got {tuple(alibi_slopes.shape)}"
            )
        if alibi_slopes.device != device:
            raise ValueError(f"{op}: alibi_slopes is on {alibi_slopes.device}, q on {device}")


def _triton_unsupported(q) -> str | None:
    """Why our kernels cannot take q (None when they can)."""
    if not 1 <= q.shape[-1] <= MAX_HEAD_DIM:
        return f"head dim {q.shape[-1]} is not in [1, {MAX_HEAD_DIM}]"
    if q.dtype not in TRITON_DTYPES:
        return f"dtype {q.dtype} is not float16 or bfloat16"
    return None


# cu_seqlens tensors already checked on the device -> (version, total, max_seqlen) they were checked against.
_CHECKED_OFFSETS = WeakIdKeyDictionary()


def block_d(head_dim: int) -> int:
    """The width of a kernel's head-dim tile: the next power of two, at least tl.dot's 16."""
    return max(16, next_power_of_2(head_dim))


def fa2_attn_probs(op, dropout_p):
    """The third output of FA2's ``return_attn_probs=True`` where we can give FA2's: without dropout FA2 returns an
    empty tensor there; with dropout it returns the dropout-encoded probabilities, which we do not."""
    if dropout_p > 0:
        raise ValueError(f"{op}: return_attn_probs=True with dropout_p > 0 (FlashAttention-2's dropout-encoded "
                         "probabilities) is not supported by flash_kernels; pass return_lse=True for the log-sum-exp")


def _check_cu_seqlens(op, name, cu, total, device, max_seqlen):
    if cu.dtype != torch.int32:
        raise ValueError(f"{op}: {name} must be int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{op}: {name} must be 1-D with batch + 1 >= 2 entries, got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{op}: {name} is on {cu.device}, q on {device}")
    if torch.compiler.is_compiling():
        return None  # the value checks read the tensor (a sync and a graph break); eager calls make them
    if capturing_cuda_graph():
        return None  # a replay would check the values at capture time, not its own: the capturer owns them
    if cu.is_cuda:
        # Reading the offsets on the host would stall the launch queue in every layer: assert on the device,
        # once per offsets tensor (every layer of a model passes the same one; an in-place edit bumps its version).
        # Inference tensors keep no version counter; inference mode is also the only place they can change.
        checked = (None if cu.is_inference() else cu._version, total, max_seqlen)
        if _CHECKED_OFFSETS.get(cu) == checked:
            return None
        lengths = cu.diff()
        valid = (cu[0] == 0) & (cu[-1] == total) & (lengths >= 0).all() & (lengths.max() <= max_seqlen)
        torch._assert_async(valid, f"{op}: {name} must start at 0, not decrease, end at {total} and have no "
                                   f"sequence longer than max_seqlen ({max_seqlen})")
        _CHECKED_OFFSETS[cu] = checked
        return None
    values = cu.tolist()
    if values[0] != 0:
        raise ValueError(f"{op}: {name}[0] must be 0, got {values[0]}")
    if any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"{op}: {name} must be non-decreasing, got {values}")
    if values[-1] != total:
        raise ValueError(f"{op}: {name}[-1] = {values[-1]} != number of packed tokens {total}")
    return max(b - a for a, b in zip(values, values[1:]))


# ----------------------------------------------------------------------------------------------------------
# The forward kernel (the backward's are in attention_bwd)
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_ks, stride_vs, offs_m, offs_d, lo, hi,
               len_q, len_k, left, right, scale_log2, softcap, slope_log2, seed, max_k, dropout_p,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
               SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, MASK: tl.constexpr,
               DOT_F32: tl.constexpr, RAW_MAX: tl.constexpr, TMA: tl.constexpr):
    """Online softmax over key blocks [lo, hi); k_src / v_src are base pointers or (TMA) descriptors."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(k_src, start_n, offs_n, len_k, stride_ks, offs_d, HEAD_DIM, BLOCK_D, MASK, TMA)  # (N, D)
        qk = _mm(q, tl.trans(k), None, DOT_F32)  # (M, N)
        if RAW_MAX:
            # Scores are qk * scale_log2 with scale_log2 > 0: the row maximum of the raw products, scaled once
            # per row, and the scaling folded into the exponent's FMA: one multiply an element fewer.
            if MASK:
                qk = tl.where(_visible(offs_m[:, None], offs_n[None, :], len_q, len_k, left, right), qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)
        else:
            s, _ = _scores(qk, offs_m[:, None], offs_n[None, :], len_q, len_k, left, right, scale_log2, softcap,
                           slope_log2, SOFTCAP, ALIBI, MASK)
            m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = m_new
        if MASK:
            # A row that has seen no key yet keeps m = -inf (so its first real maximum still counts); only
            # the exponent uses 0 then, which keeps exp2 finite: p = 0 and alpha = 0 for that row.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        if RAW_MAX:
            p = tl.math.exp2(qk * scale_log2 - m_use[:, None])
        else:
            p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if DROPOUT:
            p = tl.where(_keep(seed, offs_m[:, None], offs_n[None, :], max_k, dropout_p), p, 0.0)
        v = _load_tile(v_src, start_n, offs_n, len_k, stride_vs, offs_d, HEAD_DIM, BLOCK_D, MASK, TMA)
        acc = _mm(p.to(v.dtype), v, acc, DOT_F32)
        m_i = m_new
    return acc, l_i, m_i


# ---- TMA loads in the forward (see the module docstring for why they are an autotune choice) ----------------

# Device-side tensor descriptors, and the allocator of the global scratch they are written to at each launch.
# NVIDIA only: a ROCm build reports its GPUs' gfx versions as compute capabilities (MI300: 9.4).
TMA_AVAILABLE = (TRITON_AVAILABLE and hasattr(tl, "make_tensor_descriptor") and hasattr(triton, "set_allocator")
                 and torch.version.hip is None)
# Values of the forward kernel's ``tma_ok`` argument (part of its autotune key): TMA cannot run for this launch;
# it can, and the autotuner may pick it; it can, and TMA configs are the only candidates (_set_tma_loads("force")).
_TMA_NO, _TMA_MAY, _TMA_MUST = 0, 1, 2
# Whether the autotuner picks TMA by itself. Not under the interpreter (one tile, never benchmarked): there only
# a forced launch takes a TMA config.
_TMA_AUTOTUNED = not triton_interpreter_enabled()
_TMA_MODES = ("auto", "force", "off")
_tma_mode = "auto"


def _set_tma_loads(mode: str) -> str:
    """How the attention forward loads its tiles; returns the previous mode. Not a setting: the autotuner
    chooses TMA where it is faster, and this seam lets the tests reach (or avoid) the TMA path whatever it
    chose, and under the interpreter, which never benchmarks.

    "auto" (the default): the autotuner may pick a TMA config wherever TMA can run. "force": only TMA configs
    wherever TMA can run, the plain loads elsewhere, e.g. for an input that is not 16-byte aligned. "off": plain
    loads only. Kept launch plans are dropped, since they hold the config chosen under the old mode."""
    global _tma_mode
    if mode not in _TMA_MODES:
        raise ValueError(f"_set_tma_loads: mode must be one of {_TMA_MODES}, got {mode!r}")
    previous, _tma_mode = _tma_mode, mode
    _FWD_PLANS.clear()
    return previous


def _tma_flag(q, k, v) -> int:
    """The launch's ``tma_ok``: TMA configs are candidates only on a device with TMA (compute capability 9.0 or
    newer; on the CPU, Triton's interpreter), with a Triton that has device-side descriptors, and where every
    descriptor base is 16-byte aligned: q, k, v's addresses and all their strides but the unit last one in
    bytes (a program's base is the address plus multiples of those strides; a varlen sequence's first row
    moves it by q_start * stride_s, which the row stride covers). All it reads but the mode is in
    _fwd_plan_key, and _set_tma_loads drops every plan."""
    mode = _tma_mode
    if mode == "off" or not TMA_AVAILABLE:
        return _TMA_NO
    if q.is_cuda:
        if not hopper_or_newer(q.device):
            return _TMA_NO
    elif not triton_interpreter_enabled():
        return _TMA_NO
    # Every stride times the element size (q, k, v share a dtype) is a multiple of 16 iff their gcd's is: one
    # C call instead of a Python loop over nine strides.
    strides = math.gcd(*q.stride()[:-1], *k.stride()[:-1], *v.stride()[:-1])
    if (q.data_ptr() | k.data_ptr() | v.data_ptr() | strides * q.element_size()) % 16:
        return _TMA_NO
    return _TMA_MUST if mode == "force" else _TMA_MAY


def _scratch_alloc(size: int, alignment: int, stream):
    """Triton's global scratch (the device-side descriptors, 128 bytes each per program) from torch's caching
    allocator on the current device, on whose current stream Triton launches. Its blocks are 512-byte aligned,
    more than the 128 Triton asks for. Freed when the launch returns, the block is reused only by work queued
    after the kernel on that stream; under CUDA-graph capture it comes from the graph's private pool, so each
    replay writes its descriptors into memory the graph owns."""
    return torch.empty(size, dtype=torch.uint8, device="cuda")


def _ensure_scratch_allocator() -> None:
    """Install ``_scratch_alloc`` unless an allocator is set already (a user's stays). In Triton 3.6 and 3.8 the
    allocator is a ContextVar: each thread (autograd's worker re-running a checkpointed forward, say) starts
    without one, so this runs before every launch that may take a TMA config, plan launches included. The
    check is one ContextVar read (a module global in older Triton)."""
    allocation = triton.runtime._allocation
    current = allocation._allocator
    if hasattr(current, "get"):
        current = current.get()
    if isinstance(current, allocation.NullAllocator):
        triton.set_allocator(_scratch_alloc)


def _with_scratch_allocator(relaunch):
    """A launch plan that makes sure of the allocator before relaunching (None stays None)."""
    if relaunch is None:
        return None

    def plan(*tensors):
        _ensure_scratch_allocator()
        relaunch(*tensors)

    return plan


def _fwd_configs():
    """The pointer-load candidates, then (where Triton has device-side descriptors) the TMA ones: the two that
    measured best on the H200, or the interpreter's one small tile. Per launch, ``_prune_fwd`` decides whether
    TMA configs are candidates at all."""
    shapes = [(128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 128, 4, 3), (64, 64, 4, 4)]
    plain = [triton.Config({**c.kwargs, "TMA": False}, num_warps=c.num_warps, num_stages=c.num_stages)
             for c in _configs(shapes)]
    if not TMA_AVAILABLE:
        return plain
    tma = [(16, 16, 4, 1)] if triton_interpreter_enabled() else [(128, 64, 4, 2), (128, 128, 8, 3)]
    return plain + [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "TMA": True}, num_warps=w, num_stages=s)
                    for m, n, w, s in tma]


def _prune_fwd(configs, named_args, **kwargs):
    """``_prune_big_head``, then TMA configs by the launch's ``tma_ok``: dropped where TMA cannot run (or where
    the autotuner does not pick it by itself), the only ones left where forced (the first alone without
    autotuning, so nothing is benchmarked)."""
    configs = _prune_big_head(configs, named_args, **kwargs)
    tma = [c for c in configs if c.kwargs.get("TMA")]
    plain = [c for c in configs if not c.kwargs.get("TMA")]
    flag = kwargs.get("tma_ok", named_args.get("tma_ok", _TMA_NO))
    if flag == _TMA_MUST and tma:
        return tma if _TMA_AUTOTUNED else tma[:1]
    if flag == _TMA_MAY and _TMA_AUTOTUNED:
        return configs
    return plain


@cached_autotune
@triton.autotune(configs=_fwd_configs(), key=["tune_q", "tune_k", "BLOCK_D", "CAUSAL_OR_LOCAL", "DROPOUT", "tma_ok"],
                 prune_configs_by={"early_config_prune": _prune_fwd})
@triton.jit(do_not_specialize=["tma_ok"])  # read by the prune only: one compiled kernel whatever its value
def _attn_fwd_kernel(
    Q, K, V, O, LSE, CuQ, CuK, Alibi,
    scale_log2, softcap, dropout_p, Seed,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ab,
    seqlen_q, seqlen_k, n_heads, group, left, right, tune_q, tune_k, tma_ok,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, VARLEN: tl.constexpr, CAUSAL_OR_LOCAL: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, DOT_F32: tl.constexpr,
    POSITIVE_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    RAW_MAX: tl.constexpr = POSITIVE_SCALE and not SOFTCAP and not ALIBI  # scores are qk * scale_log2
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
    q_base = Q + b64 * stride_qb + q_start.to(tl.int64) * stride_qs + h * stride_qh
    k_base = K + b64 * stride_kb + k_start.to(tl.int64) * stride_ks + hk * stride_kh
    v_base = V + b64 * stride_vb + k_start.to(tl.int64) * stride_vs + hk * stride_vh
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    if TMA:
        # Descriptors over this (sequence, head)'s rows only, HEAD_DIM wide: TMA zero-fills what lies outside,
        # the rows past the sequence's end (never the next sequence's) and the columns past HEAD_DIM (head dims
        # 80, 96 in 128-wide tiles). An empty key sequence gets extent 1, not 0: nothing is loaded from it.
        # (len_q > 0 here.) Only the loads change; masks, softmax and the store are the same on either path.
        q_src = tl.make_tensor_descriptor(q_base, shape=[len_q, HEAD_DIM], strides=[stride_qs, 1],
                                          block_shape=[BLOCK_M, BLOCK_D])
        k_src = tl.make_tensor_descriptor(k_base, shape=[tl.maximum(len_k, 1), HEAD_DIM], strides=[stride_ks, 1],
                                          block_shape=[BLOCK_N, BLOCK_D])
        v_src = tl.make_tensor_descriptor(v_base, shape=[tl.maximum(len_k, 1), HEAD_DIM], strides=[stride_vs, 1],
                                          block_shape=[BLOCK_N, BLOCK_D])
    else:
        q_src = q_base
        k_src = k_base
        v_src = v_base
    q = _load_tile(q_src, m0, offs_m, len_q, stride_qs, offs_d, HEAD_DIM, BLOCK_D, True, TMA)
    slope_log2 = 0.0
    if ALIBI:
        slope_log2 = tl.load(Alibi + b * stride_ab + h).to(tl.float32) * _LOG2E
    seed_bh = _head_seed(Seed, b, n_heads, h, DROPOUT)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if CAUSAL_OR_LOCAL:
        lo, full_lo, full_hi, hi = _key_range(m0, BLOCK_M, BLOCK_N, len_q, len_k, left, right)
    else:
        lo = 0
        full_lo = 0
        full_hi = len_k // BLOCK_N * BLOCK_N
        hi = len_k
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_ks, stride_vs, offs_m, offs_d, lo, full_lo,
                               len_q, len_k, left, right, scale_log2, softcap, slope_log2, seed_bh, seqlen_k, dropout_p,
                               HEAD_DIM, BLOCK_D, BLOCK_N, SOFTCAP, ALIBI, DROPOUT, True, DOT_F32, RAW_MAX, TMA)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_ks, stride_vs, offs_m, offs_d, full_lo, full_hi,
                               len_q, len_k, left, right, scale_log2, softcap, slope_log2, seed_bh, seqlen_k, dropout_p,
                               HEAD_DIM, BLOCK_D, BLOCK_N, SOFTCAP, ALIBI, DROPOUT, False, DOT_F32, RAW_MAX, TMA)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_ks, stride_vs, offs_m, offs_d, full_hi, hi,
                               len_q, len_k, left, right, scale_log2, softcap, slope_log2, seed_bh, seqlen_k, dropout_p,
                               HEAD_DIM, BLOCK_D, BLOCK_N, SOFTCAP, ALIBI, DROPOUT, True, DOT_F32, RAW_MAX, TMA)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if DROPOUT:
        out = out * (1.0 / (1.0 - dropout_p))
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe)) * _LN2)
    row_ok = offs_m < len_q
    o_base = O + b64 * stride_ob + q_start.to(tl.int64) * stride_os + h * stride_oh
    _store_rows(o_base + offs_m[:, None] * stride_os + offs_d[None, :], out.to(O.dtype.element_ty), offs_m, len_q, offs_d, HEAD_DIM, BLOCK_D)
    tl.store(LSE + b64 * stride_lb + h * stride_lh + q_start + offs_m, lse, mask=row_ok)


@lean_launch
@triton.jit
def _dropout_mask_kernel(M, Seed, dropout_p, n_heads, max_q, max_k, BLOCK: tl.constexpr):
    """keep[b, h, i, j] for all (i < max_q, j < max_k): the same Philox stream the attention kernels draw."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    offs_m = pid_m * BLOCK + tl.arange(0, BLOCK)
    for start_n in range(0, max_k, BLOCK):
        offs_n = start_n + tl.arange(0, BLOCK)
        keep = _keep(_head_seed(Seed, b, n_heads, h, True), offs_m[:, None], offs_n[None, :], max_k, dropout_p)
        ptrs = M + pid_bh.to(tl.int64) * max_q * max_k + offs_m[:, None] * max_k + offs_n[None, :]
        tl.store(ptrs, keep.to(tl.int8), mask=(offs_m[:, None] < max_q) & (offs_n[None, :] < max_k))


def dropout_keep_mask(rng_state: torch.Tensor, batch: int, n_heads: int, max_q: int, max_k: int, dropout_p: float,
                      *, device: torch.device | str):
    """(B, H, max_q, max_k) bool on ``device``: the keep mask the Triton kernels used for ``rng_state`` (as
    returned by the ``attn_fwd`` op). Runs a Triton kernel, so it needs CUDA or the interpreter. For the
    reference's replay."""
    mask = torch.empty(batch, n_heads, max_q, max_k, dtype=torch.int8, device=device)
    block = 16 if triton_interpreter_enabled() else 64
    _dropout_mask_kernel[(cdiv(max_q, block), batch * n_heads)](mask, rng_state.to(device), dropout_p, n_heads, max_q, max_k, BLOCK=block)
    return mask.bool()


# ----------------------------------------------------------------------------------------------------------
# Launchers. Internally every input is 4-D: varlen tensors (total, H, D) are viewed as (1, total, H, D) and
# the kernels find each sequence through cu_seqlens.
# ----------------------------------------------------------------------------------------------------------


def _dot_f32(q):
    return triton_interpreter_enabled() and q.dtype == torch.bfloat16


def _as4d(x):
    return x.unsqueeze(0) if x.dim() == 3 else x


def _bsh_strides(t4, varlen):
    """(batch, sequence, head) strides of a (B, S, H, D) view, from one ``stride()`` call; the batch stride is
    0 for varlen (one packed row)."""
    sb, ss, sh, _ = t4.stride()
    return (0 if varlen else sb), ss, sh


def _lse_layout(q4, varlen, max_q):
    """LSE tensor and its (batch, head) strides: (B, Hq, Sq) or, for varlen, (Hq, total_q)."""
    hq = q4.shape[2]
    if varlen:
        lse = torch.empty(hq, q4.shape[1], dtype=torch.float32, device=q4.device)
        return lse, 0, lse.stride(0)
    lse = torch.empty(q4.shape[0], hq, max_q, dtype=torch.float32, device=q4.device)
    return lse, lse.stride(0), lse.stride(1)


def _window_bounds(causal, wl, wr, max_q, max_k):
    """Kernel window bounds: -1 (unbounded) becomes a bound no row can reach; causal sets right = 0."""
    unbounded = max_q + max_k + 1
    right = 0 if causal else (wr if wr >= 0 else unbounded)
    left = wl if wl >= 0 else unbounded
    local = causal or wl >= 0 or wr >= 0
    return left, right, local


def _launch_params(q, cu_q, alibi):
    """(varlen, head dim, padded head dim, dummy int pointer, alibi pointer, alibi batch stride)."""
    varlen = cu_q is not None
    d = q.shape[-1]
    dummy = dummy_pointer(q.device, torch.int32)
    alibi_t = alibi if alibi is not None else dummy_pointer(q.device, torch.float32)
    stride_ab = 0 if alibi is None or alibi.dim() == 1 else alibi.stride(0)
    return varlen, d, block_d(d), dummy, alibi_t, stride_ab


# Forward launches kept per call signature (see _launch_plans); the tensors each plan takes, in order.
_FWD_PLANS = LaunchPlans()
_FWD_SLOTS, _FWD_SLOTS_VARLEN = (0, 1, 2, 3, 4), (0, 1, 2, 3, 4, 5, 6)  # Q, K, V, O, LSE[, CuQ, CuK]


def _fwd_plan_key(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, wl, wr, softcap, alibi, dropout_p):
    """Every value the forward's launch arguments derive from, other than the tensors a plan takes; None for a
    call that gets no plan: ALiBi or dropout (more tensors to take), or an input not 16-byte aligned (Triton
    specializes on alignment, and a plan must not meet a tensor aligned unlike its first one). ``tma_ok`` is
    a function of the key too: of the device, dtype and strides, with the addresses 16-byte aligned; the TMA
    mode is not in it, but _set_tma_loads drops every plan."""
    if alibi is not None or dropout_p > 0:
        return None
    ptrs = q.data_ptr() | k.data_ptr() | v.data_ptr()
    offsets = None
    if cu_q is not None:
        ptrs |= cu_q.data_ptr() | cu_k.data_ptr()
        offsets = (cu_q.shape, cu_k.shape, cu_q.dtype, cu_k.dtype)
    if ptrs % 16:
        return None
    # The current device too: a compiled kernel is loaded per device, and launches go to the current one.
    current = torch.cuda.current_device() if q.is_cuda else None
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype, q.device,
            current, offsets, max_q, max_k, causal, scale, wl, wr, softcap)


def _attn_fwd_impl(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, wl, wr, softcap, alibi, dropout_p,
                   deterministic=False):
    """(out, lse, rng_state). ``deterministic`` is the backward's (kept with the inputs for it)."""
    q4, k4, v4 = _as4d(q), _as4d(k), _as4d(v)
    varlen = cu_q is not None
    out = torch.empty_like(q)
    o4 = _as4d(out)
    lse, slb, slh = _lse_layout(q4, varlen, max_q)
    # The Hopper kernel first: a launch plan is only ever made for the Triton kernel.
    if q4.numel() and max_q > 0 and attention_hopper.enabled() and attention_hopper.forward_unsupported(
            q4, k4, v4, o4, cu_q=cu_q, cu_k=cu_k, max_k=max_k, causal=causal,
            local=wl >= 0 or (wr >= 0 and not causal), softcap=softcap, alibi=alibi, dropout_p=dropout_p,
            scale=scale) is None and not attention_hopper.leave_to_triton(q4, k4, o4, lse, causal, cu_q, max_q):
        if attention_hopper.attention_forward(q4, k4, v4, o4, lse, scale, causal, cu_q, max_q):
            return out, lse, placeholder(q.device, torch.int64)
        # (else this Triton could not compile it, and it is now off: the Triton forward below runs)
    plan_key = _fwd_plan_key(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, wl, wr, softcap, alibi, dropout_p)
    plan = _FWD_PLANS.get(plan_key)
    if plan is not None:  # (a plan exists only for a launch that was made: q is not empty)
        plan(q4, k4, v4, o4, lse, cu_q, cu_k) if varlen else plan(q4, k4, v4, o4, lse)
        return out, lse, placeholder(q.device, torch.int64)  # no dropout in a plan, so no seed
    # The seed stays on the device: no host sync, and graph replays draw fresh masks.
    rng_state = dropout_seed(q.device) if dropout_p > 0 else placeholder(q.device, torch.int64)
    if not (q4.numel() and max_q > 0):
        return out, lse, rng_state
    nseq = cu_q.numel() - 1 if varlen else q4.shape[0]
    _, d, bd, dummy, alibi_t, stride_ab = _launch_params(q4, cu_q, alibi)
    hq, hkv = q4.shape[2], k4.shape[2]
    left, right, local = _window_bounds(causal, wl, wr, max_q, max_k)
    seed = rng_state if dropout_p > 0 else dummy_pointer(q.device, torch.int64)
    tma_ok = _tma_flag(q, k, v)
    grid = lambda meta: (cdiv(max_q, meta["BLOCK_M"]), nseq * hq)  # noqa: E731
    args = (
        q4, k4, v4, o4, lse, cu_q if varlen else dummy, cu_k if varlen else dummy, alibi_t,
        scale * LOG2E, softcap, dropout_p, seed,
        *_bsh_strides(q4, varlen), *_bsh_strides(k4, varlen), *_bsh_strides(v4, varlen),
        *_bsh_strides(o4, varlen), slb, slh, stride_ab,
        max_q, max_k, hq, hq // hkv, left, right, *_tune_buckets(max_q, max_k), tma_ok,
    )
    kwargs = dict(HEAD_DIM=d, BLOCK_D=bd, VARLEN=varlen, CAUSAL_OR_LOCAL=local, SOFTCAP=softcap > 0,
                  ALIBI=alibi is not None, DROPOUT=dropout_p > 0, DOT_F32=_dot_f32(q), POSITIVE_SCALE=scale > 0)
    if tma_ok and q.is_cuda:  # (the interpreter needs no scratch)
        _ensure_scratch_allocator()
    _attn_fwd_kernel[grid](*args, **kwargs)
    bind = getattr(_attn_fwd_kernel, "bind", None)  # absent where launches go through Triton's own path
    if bind is not None:
        slots = _FWD_SLOTS_VARLEN if varlen else _FWD_SLOTS
        if tma_ok:
            _FWD_PLANS.consider(plan_key, lambda: _with_scratch_allocator(bind(grid, args, kwargs, slots)))
        else:
            _FWD_PLANS.consider(plan_key, lambda: bind(grid, args, kwargs, slots))
    return out, lse, rng_state


# Backward launches (preprocess, dK/dV, dQ) kept per call signature, and the tensors each takes, in order:
# (O, dO, Delta[, CuQ]); (Q, K, V, dO, dK, dV, LSE, Delta[, CuQ, CuK]); (Q, K, V, dO, dQ, LSE, Delta[, CuQ, CuK]).
_BWD_PLANS = LaunchPlans()
_BWD_SLOTS = {False: ((0, 1, 2), tuple(range(8)), tuple(range(7))),
              True: ((0, 1, 2, 3), tuple(range(10)), tuple(range(9)))}


def _bwd_plan_key(do, q, k, v, out, cu_q, cu_k, max_q, max_k, causal, scale, wl, wr, softcap, alibi, dropout_p,
                  grads):
    """The forward's plan key plus what else the backward's launches derive from: the strides of dO and O,
    and of the gradient buffers when the caller gives them (all 16-byte aligned, or no plan)."""
    fwd = _fwd_plan_key(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, wl, wr, softcap, alibi, dropout_p)
    if fwd is None:
        return None
    tensors = (do, out) if grads is None else (do, out, *grads)
    ptrs = 0
    for t in tensors:
        ptrs |= t.data_ptr()
    if ptrs % 16:
        return None
    return (fwd, *(t.stride() for t in tensors), do.dtype, out.dtype, None if grads is None else grads[0].dtype)


def _attn_bwd_impl(do, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, wl, wr, softcap, alibi, dropout_p,
                   rng_state, deterministic=False, grads=None):
    """dq, dk, dv; written into ``grads`` (three tensors shaped like q, k, v, any strides) when given, which is
    how the packed-qkv op gets one dqkv buffer without a gradient copy per slice."""
    do = do.contiguous()
    q4, k4, v4, o4, do4 = _as4d(q), _as4d(k), _as4d(v), _as4d(out), _as4d(do)
    varlen = cu_q is not None
    dq, dk, dv = grads if grads is not None else (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    if max_q == 0 or q4.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    dq4, dk4, dv4 = _as4d(dq), _as4d(dk), _as4d(dv)
    delta = torch.empty_like(lse)
    hopper_runs = attention_hopper_bwd.backward_unsupported(
        q4, k4, v4, do4, dk4, dv4, varlen=varlen, causal=causal, local=wl >= 0 or (wr >= 0 and not causal),
        softcap=softcap, alibi=alibi, dropout_p=dropout_p, scale=scale, deterministic=deterministic) is None
    if hopper_runs and not attention_hopper_bwd.leave_to_triton(q4, k4, lse, dk4, dv4, causal):
        _bwd_delta(o4, do4, delta, None, False, max_q, q4.shape[2])
        if attention_hopper_bwd.attention_backward(q4, k4, v4, do4, lse, delta, dq4, dk4, dv4, scale, causal):
            return dq, dk, dv
        # (else this Triton could not compile it, and it is now off: the Triton backward below runs)
    plan_key = _bwd_plan_key(do, q, k, v, out, cu_q, cu_k, max_q, max_k, causal, scale, wl, wr, softcap, alibi,
                             dropout_p, grads)
    plan = _BWD_PLANS.get(plan_key)
    if plan is not None:
        preprocess, dkdv, dq_only = plan
        offsets = (cu_q, cu_k) if varlen else ()
        preprocess(o4, do4, delta, *offsets[:1])
        if dkdv is not None:
            dkdv(q4, k4, v4, do4, dk4, dv4, lse, delta, *offsets)
        dq_only(q4, k4, v4, do4, dq4, lse, delta, *offsets)
        return dq, dk, dv
    nseq = cu_q.numel() - 1 if varlen else q4.shape[0]
    _, d, bd, dummy, alibi_t, stride_ab = _launch_params(q4, cu_q, alibi)
    hq, hkv = q4.shape[2], k4.shape[2]
    slb, slh = (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))
    left, right, local = _window_bounds(causal, wl, wr, max_q, max_k)
    seed = rng_state if dropout_p > 0 else dummy_pointer(q.device, torch.int64)
    cu_q_t, cu_k_t = (cu_q, cu_k) if varlen else (dummy, dummy)
    q_s, k_s, v_s, do_s = (_bsh_strides(t, varlen) for t in (q4, k4, v4, do4))
    launches = [_bwd_delta(o4, do4, delta, cu_q, varlen, max_q, hq)]  # (kernel, grid, args, kwargs) for the plan
    common = dict(HEAD_DIM=d, BLOCK_D=bd, VARLEN=varlen, CAUSAL_OR_LOCAL=local, SOFTCAP=softcap > 0,
                  ALIBI=alibi is not None, DROPOUT=dropout_p > 0, DOT_F32=_dot_f32(q))
    tune = _tune_buckets(max_q, max_k)
    shares = _group_shares(nseq, hkv, max_k, hq // hkv, q.device)
    if max_k > 0:
        dk_out, dv_out = (dk4, dv4) if shares == 1 else (_share_sums(dk4, shares), _share_sums(dv4, shares))
        grid_kv = lambda meta: (cdiv(max_k, meta["BLOCK_N"]), nseq * hkv * shares)  # noqa: E731
        kv_args = (
            q4, k4, v4, do4, dk_out, dv_out, lse, delta, cu_q_t, cu_k_t, alibi_t, scale * LOG2E, softcap, dropout_p,
            seed, *q_s, *k_s, *v_s, *do_s, *_bsh_strides(dk_out, varlen), *_bsh_strides(dv_out, varlen), slb, slh,
            stride_ab, max_q, max_k, hq, hq // hkv, shares, left, right, *tune,
        )
        _attn_bwd_dkdv_kernel[grid_kv](*kv_args, **common)
        if shares > 1:
            _sum_shares(dk_out, dk4)
            _sum_shares(dv_out, dv4)
        launches.append((_attn_bwd_dkdv_kernel, grid_kv, kv_args, common))
    else:
        launches.append(None)
    grid_q = lambda meta: (cdiv(max_q, meta["BLOCK_M"]), nseq * hq)  # noqa: E731
    q_args = (
        q4, k4, v4, do4, dq4, lse, delta, cu_q_t, cu_k_t, alibi_t, scale * LOG2E, softcap, dropout_p, seed,
        *q_s, *k_s, *v_s, *do_s, *_bsh_strides(dq4, varlen), slb, slh, stride_ab,
        max_q, max_k, hq, hq // hkv, left, right, *tune,
    )
    _attn_bwd_dq_kernel[grid_q](*q_args, **common)
    launches.append((_attn_bwd_dq_kernel, grid_q, q_args, common))
    _BWD_PLANS.consider(plan_key, lambda: _with_shares_summed(_bind_all(launches, _BWD_SLOTS[varlen]), shares))
    return dq, dk, dv


# The dK/dV kernel runs one program per (key block, sequence, kv head), each summing over the q heads of its GQA
# group. With few kv heads that grid is small, and under a causal mask uneven (the first key block is seen by
# every query row, the last by one block of them): Qwen2-0.5B at batch 4 and 2k tokens (2 kv heads of 7 q heads)
# makes 128 programs for 132 SMs, the longest walking 7 heads x 2k rows. Below DKDV_SPLIT_BELOW programs per SM
# (counting 128-key blocks) each q head of the group gets a program of its own; each writes its dK/dV to a float32
# buffer, and the heads are summed after (in a fixed order: deterministic). On an H200 (bf16, head dim 64, causal,
# 2k tokens, the Triton forward + backward queued back to back) that took Qwen2-0.5B's shape from 0.82 to 0.48 ms
# (sdpa with the kv heads repeated: 0.44) and LLaMA-1.1B's (4 kv heads of 8, 256 programs) from 1.02 to 0.96
# (sdpa 0.87). In Qwen2-0.5B's training step the dK/dV kernel went from 7.9 to 5.4 ms, and the step's kernel time,
# with the sums of the shares, from 64.1 to 62.8 ms. In a first, noisier measurement, shares of 2-3 heads gained
# less on Qwen2's shape, and SmolLM2-135M's (8 sequences x 3 kv heads, 384 programs) was no faster split: it
# stays whole.
DKDV_SPLIT_BELOW = 2.5


def _group_shares(nseq: int, hkv: int, max_k: int, group: int, device: torch.device) -> int:
    """How many programs share one kv head's GQA group in the dK/dV kernel: the group's size where its grid is
    small (see DKDV_SPLIT_BELOW), else one. Under the interpreter two (where the group allows), so that the
    tests' small shapes take the shared path with more than one head in a share."""
    if group == 1:
        return 1
    if device.type != "cuda" or triton_interpreter_enabled():
        return 2
    programs = cdiv(max(max_k, 1), 128) * nseq * hkv
    sms = sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return group if programs < DKDV_SPLIT_BELOW * sms else 1


def _share_sums(grad4: torch.Tensor, shares: int) -> torch.Tensor:
    """The float32 buffer of the dK (or dV) kernel's per-share sums: grad4's (B, S, H, D) with H x shares heads,
    share s of kv head h at head h * shares + s."""
    b, s, h, d = grad4.shape
    return torch.empty(b, s, h * shares, d, dtype=torch.float32, device=grad4.device)


def _sum_shares(parts: torch.Tensor, grad4: torch.Tensor) -> None:
    """grad4 = the sum over the shares of ``parts`` (``_share_sums``'s layout), in grad4's dtype."""
    b, s, h, d = grad4.shape
    grad4.copy_(parts.view(b, s, h, -1, d).sum(3))


def _with_shares_summed(plan, shares: int):
    """A backward plan whose dK/dV launch writes per-share sums (``shares`` > 1) takes dK and dV as before: it
    launches into fresh share buffers, then sums them into the given dK and dV."""
    if plan is None or shares == 1 or plan[1] is None:
        return plan
    preprocess, dkdv, dq_only = plan

    def dkdv_shared(q4, k4, v4, do4, dk4, dv4, lse, delta, *offsets):
        dk_parts, dv_parts = _share_sums(dk4, shares), _share_sums(dv4, shares)
        dkdv(q4, k4, v4, do4, dk_parts, dv_parts, lse, delta, *offsets)
        _sum_shares(dk_parts, dk4)
        _sum_shares(dv_parts, dv4)

    return preprocess, dkdv_shared, dq_only


def _bwd_delta(o4, do4, delta, cu_q, varlen, max_q, hq):
    """Launches delta = rowsum(dO * O) into ``delta`` (the log-sum-exp's layout); returns the launch, for a plan."""
    nseq = cu_q.numel() - 1 if varlen else o4.shape[0]
    d = o4.shape[-1]
    slb, slh = (0, delta.stride(0)) if varlen else (delta.stride(0), delta.stride(1))
    block = 16 if triton_interpreter_enabled() else 64
    grid = (cdiv(max_q, block), nseq * hq)
    args = (o4, do4, delta, cu_q if varlen else dummy_pointer(o4.device, torch.int32),
            *_bsh_strides(o4, varlen), *_bsh_strides(do4, varlen), slb, slh, max_q, hq)
    kwargs = dict(HEAD_DIM=d, BLOCK_D=next_power_of_2(d), VARLEN=varlen, BLOCK_M=block)
    _bwd_preprocess_kernel[grid](*args, **kwargs)
    return _bwd_preprocess_kernel, grid, args, kwargs


def _bind_all(launches, slots):
    """One Relaunch per launch (None stays None), or None when any launch cannot be bound."""
    bound = []
    for launch, launch_slots in zip(launches, slots):
        if launch is None:
            bound.append(None)
            continue
        relaunch = bind_launch(*launch, launch_slots)
        if relaunch is None:
            return None
        bound.append(relaunch)
    return tuple(bound)


# ----------------------------------------------------------------------------------------------------------
# Custom ops: opaque to torch.compile, with fake implementations and autograd.
# ----------------------------------------------------------------------------------------------------------


@torch.library.custom_op("flash_kernels::attn_fwd", mutates_args=())
def _attn_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float,
    window_left: int, window_right: int, softcap: float, alibi_slopes: torch.Tensor | None, dropout_p: float,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _attn_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                          window_left, window_right, softcap, alibi_slopes, dropout_p)


@_attn_fwd_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_left,
      window_right, softcap, alibi_slopes, dropout_p, deterministic=False):
    hq = q.shape[-2]
    if cu_seqlens_q is not None:
        lse = q.new_empty(hq, q.shape[0], dtype=torch.float32)
    else:
        lse = q.new_empty(q.shape[0], hq, q.shape[1], dtype=torch.float32)
    return torch.empty_like(q), lse, q.new_empty((1,) if dropout_p > 0 else (0,), dtype=torch.int64)


@torch.library.custom_op("flash_kernels::attn_bwd", mutates_args=())
def _attn_bwd_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int, max_seqlen_k: int,
    causal: bool, softmax_scale: float, window_left: int, window_right: int, softcap: float,
    alibi_slopes: torch.Tensor | None, dropout_p: float, rng_state: torch.Tensor, deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _attn_bwd_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                          softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state,
                          deterministic)


@_attn_bwd_op.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
      window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state, deterministic=False):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_FWD_ARGS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "causal", "softmax_scale",
             "window_left", "window_right", "softcap", "alibi_slopes", "dropout_p")


def _setup_context(ctx, inputs, output):
    q, k, v = inputs[:3]
    out, lse, rng_state = output
    ctx.mark_non_differentiable(lse, rng_state)  # as the reference's (and FA2's) lse: no gradient flows back from it
    ctx.save_for_backward(q, k, v, out, lse, rng_state, inputs[3], inputs[4], inputs[12])
    # max_q, max_k, causal, scale, wl, wr, softcap, dropout_p, deterministic (a direct op call may leave it out)
    ctx.args = inputs[5:12] + (inputs[13], bool(inputs[14]) if len(inputs) > 14 else False)


def _backward_with(bwd):
    """The backward, calling ``bwd``: the custom op (traced by torch.compile) or its implementation (eager)."""

    def backward(ctx, dout, _dlse, _drng):
        q, k, v, out, lse, rng_state, cu_q, cu_k, alibi = ctx.saved_tensors
        max_q, max_k, causal, scale, wl, wr, softcap, dropout_p, deterministic = ctx.args
        dq, dk, dv = bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, wl, wr, softcap,
                         alibi, dropout_p, rng_state, deterministic)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None, None

    return backward


torch.library.register_autograd("flash_kernels::attn_fwd", _backward_with(_attn_bwd_op), setup_context=_setup_context)
_attn_eager = eager_function("FlashAttention", _attn_fwd_impl, _setup_context, _backward_with(_attn_bwd_impl))


# ----------------------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------------------


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    return_lse: bool = False,
    backend: str | None = None,
):
    """Attention over q (B, Sq, Hq, D), k/v (B, Sk, Hkv, D) -> (B, Sq, Hq, D) [, lse (B, Hq, Sq)].

    FlashAttention-2's signature: its arguments in its order with its defaults, any head dim up to 256.
    ``return_attn_probs=True`` returns (out, lse, an empty tensor), as FA2 does without dropout; with dropout
    it raises (FA2's dropout-encoded probabilities are not supported). ``return_lse=True`` returns (out, lse).
    See the module docstring for masking, softcap, ALiBi and dropout semantics. ``deterministic=True`` (or
    ``torch.use_deterministic_algorithms``) keeps the backward bitwise reproducible: the Hopper backward
    (``attention_hopper_bwd``, head dim 128) sums dQ with atomic reductions, so then the
    atomics-free Triton backward runs instead.
    """
    op = "flash_attn_func"
    _check_qkv(op, q, k, v, 4)
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"{op}: batch of q ({q.shape[0]}) != batch of k/v ({k.shape[0]})")
    return _attend(op, q, k, v, None, None, q.shape[1], k.shape[1], batch=q.shape[0], dropout_p=dropout_p,
                   softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                   alibi_slopes=alibi_slopes, deterministic=deterministic, return_lse=return_lse,
                   return_attn_probs=return_attn_probs, backend=backend)


def _attend(op, q, k, v, cu_q, cu_k, max_q, max_k, *, batch, dropout_p, softmax_scale, causal, window_size, softcap,
            alibi_slopes, deterministic, return_lse, return_attn_probs, backend):
    """Both public functions once q, k, v (and the offsets) are checked: the reference or the kernels."""
    _check_common(op, window_size=window_size, softcap=softcap, dropout_p=dropout_p, alibi_slopes=alibi_slopes,
                  batch=batch, hq=q.shape[-2], device=q.device)
    if return_attn_probs:
        fa2_attn_probs(op, dropout_p)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    if not use_triton(backend, q, op=op, unsupported=_triton_unsupported(q)):
        common = dict(causal=causal, softmax_scale=scale, window_size=window_size, softcap=softcap,
                      alibi_slopes=alibi_slopes, dropout_p=dropout_p, return_lse=True)
        if cu_q is None:
            out, lse = flash_attn_func_ref(q, k, v, **common)
        else:
            out, lse = flash_attn_varlen_func_ref(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **common)
    else:
        q, k, v = unit_last_stride(q), unit_last_stride(k), unit_last_stride(v)
        cu_q, cu_k = unit_last_stride(cu_q), unit_last_stride(cu_k)
        alibi = alibi_slopes.float().contiguous() if alibi_slopes is not None else None
        out, lse, _ = pick(_attn_fwd_op, _attn_eager)(
            q, k, v, cu_q, cu_k, int(max_q), int(max_k), causal, float(scale), int(window_size[0]),
            int(window_size[1]), float(softcap), alibi, float(dropout_p), bool(deterministic))
    return _outputs(out, lse, return_lse, return_attn_probs)


def _outputs(out, lse, return_lse, return_attn_probs):
    """out, (out, lse) or FA2's (out, lse, probabilities: an empty tensor, see ``fa2_attn_probs``)."""
    if return_attn_probs:
        return out, lse, out.new_empty(0)
    return (out, lse) if return_lse else out


def _gather_pages(op, cache, block_table, cu_seqlens_k):
    """Paged prefill: the keys (or values) of every sequence gathered from a paged cache (num_blocks, page_size,
    Hkv, D) through ``block_table`` (B, max_blocks) int32 into the packed (total_k, Hkv, D) layout that
    ``cu_seqlens_k`` describes. Reads the total length on the host (a sync on CUDA); the pages are checked on the
    device there, and clamped so that nothing is read outside the pool."""
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != cu_seqlens_k.numel() - 1:
        raise ValueError(f"{op}: block_table must be int32 (batch={cu_seqlens_k.numel() - 1}, max_blocks), got "
                         f"{block_table.dtype} {tuple(block_table.shape)}")
    if cache.dim() != 4:
        raise ValueError(f"{op}: with block_table, k and v are paged caches (num_blocks, page_size, Hkv, D), got "
                         f"{tuple(cache.shape)}")
    page_size = cache.shape[1]
    lengths = cu_seqlens_k.diff().long()
    total = int(cu_seqlens_k[-1])
    capacity = block_table.shape[1] * page_size
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=cache.device), lengths, output_size=total)
    pos = torch.arange(total, device=cache.device) - cu_seqlens_k[:-1].long()[seq]
    fits = (lengths <= capacity).all()
    pages = block_table.long()[seq, (pos // page_size).clamp_(max=block_table.shape[1] - 1)]
    in_pool = ((pages >= 0) & (pages < cache.shape[0])).all()
    problems = {f"a sequence's keys exceed what block_table holds ({block_table.shape[1]} pages of {page_size})": fits,
                f"block_table holds page ids outside [0, {cache.shape[0]}) for the keys in use": in_pool}
    for message, ok in problems.items():
        if cache.is_cuda:  # no more host reads than the total above: asserted on the device
            torch._assert_async(ok, f"{op}: {message}")
        elif not bool(ok):
            raise ValueError(f"{op}: {message}")
    return cache[pages.clamp_(0, cache.shape[0] - 1), pos % page_size]


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
    *,
    return_lse: bool = False,
    backend: str | None = None,
):
    """Attention over packed sequences: q (total_q, Hq, D), k/v (total_k, Hkv, D); sequence b is rows
    cu_seqlens[b]:cu_seqlens[b+1] (int32, length batch + 1, empty sequences allowed) -> (total_q, Hq, D)
    [, lse (Hq, total_q)]. FlashAttention-2's signature (see ``flash_attn_func``), paged prefill included: with
    ``block_table`` (B, max_blocks) int32, k and v are paged caches (num_blocks, page_size, Hkv, D) and
    sequence b's keys are the first ``cu_seqlens_k[b+1] - cu_seqlens_k[b]`` entries of its pages (gathered into
    the packed layout first, which reads the total key count on the host)."""
    op = "flash_attn_varlen_func"
    if block_table is not None:
        total_k = int(cu_seqlens_k[-1]) if cu_seqlens_k.numel() else 0  # the check below names an empty one
        _check_cu_seqlens(op, "cu_seqlens_k", cu_seqlens_k, total_k, q.device, max_seqlen_k)
        k = _gather_pages(op, k, block_table, cu_seqlens_k)
        v = _gather_pages(op, v, block_table, cu_seqlens_k)
    _check_qkv(op, q, k, v, 3)
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"{op}: cu_seqlens_q shape {tuple(cu_seqlens_q.shape)} != cu_seqlens_k shape {tuple(cu_seqlens_k.shape)}")
    longest_q = _check_cu_seqlens(op, "cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device, max_seqlen_q)
    longest_k = _check_cu_seqlens(op, "cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device, max_seqlen_k)
    if longest_q is not None and (longest_q > max_seqlen_q or longest_k > max_seqlen_k):
        raise ValueError(
            f"{op}: max_seqlen_q/k ({max_seqlen_q}, {max_seqlen_k}) is smaller than the longest sequence "
            f"({longest_q}, {longest_k})"
        )
    return _attend(op, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   batch=cu_seqlens_q.numel() - 1, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                   window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                   return_lse=return_lse, return_attn_probs=return_attn_probs, backend=backend)
