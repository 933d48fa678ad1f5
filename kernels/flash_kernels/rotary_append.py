"""Rotary embedding of q and k plus the KV-cache append of k and v, in one launch: a decode step's attention input.

A decoder layer's decode step rotates the q and k heads of its packed projection (``apply_rotary``) and then
stores the rotated k and the v heads into the cache (``kv_append``): two launches a layer. At batch 1 each
moves a few kilobytes, so it is the launch, not the memory traffic, that costs; in a CUDA-graph decode step of
a 22-layer model (TinyLlama-1.1B) this op is 22 launches fewer per token (measured on an H100 at its sizes,
batch 1, CUDA-graph replay: 1.4 us a layer against 2.4 us for the two launches). It computes exactly what the
two ops compute one after the other (the same float32 rotation, shared with rotary.py's kernel and like it
compiled without FMA contraction, and the same roundings: to qkv's dtype, then to the cache's), so swapping one
for the other changes no bit.

One program per (token, block of heads): axis 1 walks the q head blocks, then the k blocks, then the v blocks,
so a block never straddles two of them. q heads rotate into the new q tensor, k heads rotate into the k cache,
v heads are copied into the v cache; channels past rotary_dim pass through unrotated.

Inference only: the kernel has no backward. Under grad mode with an input that needs gradients, "auto" runs
the reference (which autograd records) and "triton" raises.
"""

from __future__ import annotations

import torch

from ._backend import needs_grad_reason, use_triton
from ._launch import lean_launch
from ._pdl import enabled as programmatic_launch_enabled
from ._pdl import launch_options, wait_for_predecessor
from ._triton_compat import tl, triton
from ._triton_utils import cdiv, next_power_of_2, pick, unit_last_stride, warps_for_block
from .kv_append import _check as _check_kv_append
from .kv_append import kv_append_ref, slot_location
from .rotary import ROTATION_COMPILE_OPTIONS, _DTYPES, _TILE, apply_rotary_ref, rotary_cos_sin, rotate_pairs

_INT_DTYPES = (torch.int32, torch.int64)


def rotary_kv_append_ref(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, position_ids: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, num_q_heads: int,
    block_table: torch.Tensor | None = None, interleaved: bool = False,
) -> torch.Tensor:
    """apply_rotary_ref on the q and the k heads of qkv (B, S, Hq + 2 * Hkv, D), then kv_append_ref of the
    rotated k and of v; returns the rotated q (B, S, Hq, D)."""
    hq = num_q_heads
    hkv = (qkv.shape[2] - hq) // 2
    # Heads rotate independently: q and k in one call (on a CPU every op call costs as much as its math here).
    qk = apply_rotary_ref(qkv[:, :, :hq + hkv], cos, sin, interleaved=interleaved, position_ids=position_ids)
    kv_append_ref(k_cache, v_cache, qk[:, :, hq:], qkv[:, :, hq + hkv:], slots, block_table)
    return qk[:, :, :hq]


# ----------------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------------


@lean_launch
@triton.jit
def _rotary_kv_append_kernel(
    QKV, Q, KC, VC, COS, SIN, POS, SLOTS, TABLE, S, HQ, HKV, HALF, D, max_pos, block_size, n_blocks,
    s_xb, s_xs, s_xh, s_qb, s_qs, s_qh, s_kc0, s_kc1, s_kch, s_vc0, s_vc1, s_vch,
    s_cos, s_sin, s_pb, s_ps, s_slb, s_sls, s_tb,
    INTERLEAVED: tl.constexpr, PAGED: tl.constexpr, PARTIAL: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_predecessor(PDL)
    token = tl.program_id(0).to(tl.int64)  # b * S + s
    b = token // S
    s = token % S
    blk = tl.program_id(1)
    q_blocks = tl.cdiv(HQ, BLOCK_H)
    kv_blocks = tl.cdiv(HKV, BLOCK_H)
    x_token = QKV + b * s_xb + s * s_xs
    d = tl.arange(0, BLOCK_D)
    if blk >= q_blocks + kv_blocks:  # v heads: into the v cache as they are
        h = (blk - q_blocks - kv_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        row, slot, inside = slot_location(SLOTS, TABLE, b, s, s_slb, s_sls, s_tb, block_size, n_blocks, PAGED)
        m = (h[:, None] < HKV) & (d[None, :] < D) & inside
        v = tl.load(x_token + (HQ + HKV + h[:, None]) * s_xh + d[None, :], mask=m)
        tl.store(VC + row * s_vc0 + slot * s_vc1 + h[:, None] * s_vch + d[None, :], v.to(VC.dtype.element_ty), mask=m)
    else:  # q or k heads: rotate
        is_q = blk < q_blocks
        h = tl.where(is_q, blk, blk - q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)  # head within q, or within k
        n_heads = tl.where(is_q, HQ, HKV)
        x_rows = x_token + (h[:, None] + tl.where(is_q, 0, HQ)) * s_xh
        pos = tl.load(POS + b * s_pb + s * s_ps).to(tl.int64)
        k = tl.arange(0, BLOCK_K)
        c, sn, first, second = rotary_cos_sin(COS, SIN, pos, max_pos, s_cos, s_sin, HALF, k, INTERLEAVED, False)
        mask = (h[:, None] < n_heads) & (k[None, :] < HALF)
        o1, o2 = rotate_pairs(x_rows, c, sn, first, second, mask)
        # Rounded to qkv's dtype first, as apply_rotary's output is, before kv_append casts k to the cache's.
        o1 = o1.to(QKV.dtype.element_ty)
        o2 = o2.to(QKV.dtype.element_ty)
        pass_mask = (h[:, None] < n_heads) & (d[None, :] >= 2 * HALF) & (d[None, :] < D)
        if is_q:
            q_rows = Q + b * s_qb + s * s_qs + h[:, None] * s_qh
            tl.store(q_rows + first[None, :], o1, mask=mask)
            tl.store(q_rows + second[None, :], o2, mask=mask)
            if PARTIAL:
                tl.store(q_rows + d[None, :], tl.load(x_rows + d[None, :], mask=pass_mask), mask=pass_mask)
        else:
            row, slot, inside = slot_location(SLOTS, TABLE, b, s, s_slb, s_sls, s_tb, block_size, n_blocks, PAGED)
            k_rows = KC + row * s_kc0 + slot * s_kc1 + h[:, None] * s_kch
            tl.store(k_rows + first[None, :], o1.to(KC.dtype.element_ty), mask=mask & inside)
            tl.store(k_rows + second[None, :], o2.to(KC.dtype.element_ty), mask=mask & inside)
            if PARTIAL:
                rest = tl.load(x_rows + d[None, :], mask=pass_mask)
                tl.store(k_rows + d[None, :], rest.to(KC.dtype.element_ty), mask=pass_mask & inside)


def _rotary_kv_append(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, slots: torch.Tensor, block_table: torch.Tensor | None, num_q_heads: int,
    interleaved: bool,
) -> torch.Tensor:
    B, S, H, D = qkv.shape
    hkv = (H - num_q_heads) // 2
    q = qkv.new_empty((B, S, num_q_heads, D))
    half = cos.shape[-1]
    block_d = next_power_of_2(D)
    # Head blocks sized for the kv heads: at GQA ratios the q heads then spread over several programs, which a
    # batch-1 decode step (a handful of tokens in the grid) needs to fill more than a few SMs.
    block_h = min(next_power_of_2(hkv), max(1, _TILE // block_d))
    table = block_table if block_table is not None else slots  # a stand-in pointer, never read
    pdl = programmatic_launch_enabled(qkv.device)
    grid = (B * S, cdiv(num_q_heads, block_h) + 2 * cdiv(hkv, block_h))
    _rotary_kv_append_kernel[grid](
        qkv, q, k_cache, v_cache, cos, sin, position_ids, slots, table, S, num_q_heads, hkv, half, D,
        cos.shape[0], k_cache.shape[1], k_cache.shape[0], *qkv.stride()[:3], *q.stride()[:3], *k_cache.stride()[:3],
        *v_cache.stride()[:3], cos.stride(0), sin.stride(0), *position_ids.stride(), *slots.stride(),
        table.stride(0), INTERLEAVED=interleaved, PAGED=block_table is not None, PARTIAL=2 * half < D,
        BLOCK_H=block_h, BLOCK_K=next_power_of_2(half), BLOCK_D=block_d, PDL=pdl,
        num_warps=warps_for_block(block_h * block_d, elems_per_thread=4, max_warps=4), **ROTATION_COMPILE_OPTIONS,
        **launch_options(pdl),
    )
    return q


# ----------------------------------------------------------------------------------------------------------
# torch.library registration
# ----------------------------------------------------------------------------------------------------------

# torch.compile traces the custom op as one opaque node; eager calls skip the dispatcher (``pick``).
_rotary_kv_append_op = torch.library.custom_op(
    "flash_kernels::rotary_kv_append", mutates_args=("k_cache", "v_cache"))(_rotary_kv_append)


@_rotary_kv_append_op.register_fake
def _(qkv, cos, sin, position_ids, k_cache, v_cache, slots, block_table, num_q_heads, interleaved):
    B, S, _, D = qkv.shape
    return qkv.new_empty((B, S, num_q_heads, D))


# ----------------------------------------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------------------------------------


def _check(qkv, cos, sin, position_ids, k_cache, v_cache, slots, block_table, num_q_heads) -> None:
    op = "rotary_kv_append"
    if qkv.dim() != 4:
        raise ValueError(f"{op}: qkv must be the packed projection (B, S, Hq + 2 * Hkv, D), got shape "
                         f"{tuple(qkv.shape)}; view it as (B, S, heads, head_dim)")
    if k_cache.dim() != 4:
        raise ValueError(f"{op}: k_cache must be (B, L, Hkv, D) or a paged pool (num_blocks, block_size, Hkv, D), "
                         f"got shape {tuple(k_cache.shape)}")
    B, S, H, D = qkv.shape
    hkv = k_cache.shape[2]
    if num_q_heads <= 0 or hkv == 0 or num_q_heads % hkv:
        raise ValueError(f"{op}: num_q_heads={num_q_heads} must be a positive multiple of the cache's {hkv} kv heads "
                         "(each kv head serves a whole group of q heads); pass the model's number of query heads")
    if H != num_q_heads + 2 * hkv:
        raise ValueError(f"{op}: qkv has {H} heads, expected num_q_heads + 2 * Hkv = {num_q_heads} + 2 * {hkv} = "
                         f"{num_q_heads + 2 * hkv} (Hkv from the cache {tuple(k_cache.shape)}); pass the packed "
                         "[q | k | v] projection, the model's num_q_heads and that layer's cache")
    if k_cache.shape[3] != D:
        raise ValueError(f"{op}: qkv's head dim {D} != the cache's {k_cache.shape[3]} (cache {tuple(k_cache.shape)}); "
                         "allocate the cache with the model's head_dim")
    if cos.dim() != 2 or cos.shape != sin.shape:
        raise ValueError(f"{op}: cos and sin must be (max_positions, rotary_dim // 2) tables of one shape, got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if 2 * cos.shape[1] > D:
        raise ValueError(f"{op}: cos/sin have {cos.shape[1]} columns, more than head_dim / 2 = {D // 2} (rotary_dim "
                         f"{2 * cos.shape[1]} > head dim {D}); build the tables for a rotary_dim <= head_dim")
    if position_ids.shape != (B, S) or position_ids.dtype not in _INT_DTYPES:
        raise ValueError(f"{op}: position_ids must be an integer (B, S) = {(B, S)} tensor, got {position_ids.dtype} "
                         f"{tuple(position_ids.shape)}; pass one position per new token")
    if qkv.stride(-1) != 1:
        raise ValueError(f"{op}: qkv's head dim must be contiguous (stride 1), got strides {qkv.stride()}; "
                         "pass the projection's output viewed as (B, S, heads, head_dim)")
    if not qkv.is_cuda and position_ids.numel() and not torch.compiler.is_compiling():
        low, high = int(position_ids.min()), int(position_ids.max())
        if low < 0 or high >= cos.shape[0]:  # only off CUDA, where reading them costs no host sync
            raise ValueError(f"{op}: position_ids span [{low}, {high}], outside the cos/sin table of {cos.shape[0]} "
                             f"positions; pass positions in [0, {cos.shape[0]}) or build a longer table")
    k, v = qkv[:, :, num_q_heads:num_q_heads + hkv], qkv[:, :, num_q_heads + hkv:]
    _check_kv_append(k_cache, v_cache, k, v, slots, block_table, op=op)


def _unsupported(qkv, cos, sin, k_cache, v_cache) -> str | None:
    if qkv.dtype not in _DTYPES:
        return f"dtype {qkv.dtype} (supported: float32, float16, bfloat16)"
    if cos.dtype not in _DTYPES or sin.dtype not in _DTYPES:
        return f"cos/sin dtype {cos.dtype}"
    return needs_grad_reason(qkv, cos, sin, k_cache, v_cache)


def rotary_kv_append(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    position_ids: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    num_q_heads: int,
    block_table: torch.Tensor | None = None,
    interleaved: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """The decode step's attention input in one launch: returns q (B, S, Hq, D), the rotated q heads of the
    packed projection ``qkv`` (B, S, Hq + 2 * Hkv, D) (heads ordered [q | k | v], Hq = ``num_q_heads``), and
    stores its rotated k heads and its v heads into ``k_cache``/``v_cache`` at ``slots``, in place.

    Exactly ``apply_rotary`` of the q and of the k heads (``cos``/``sin`` tables, ``position_ids`` (B, S),
    ``interleaved`` as there; channels past rotary_dim pass through) followed by ``kv_append`` of k and v
    (``slots`` (B, S), per-row caches (B, L, Hkv, D) or paged pools with ``block_table``, as there). qkv may be
    a strided view (unit stride on D) and is not modified. Inference only: see the module docstring.
    """
    _check(qkv, cos, sin, position_ids, k_cache, v_cache, slots, block_table, num_q_heads)
    if not use_triton(backend, qkv, op="rotary_kv_append", unsupported=_unsupported(qkv, cos, sin, k_cache, v_cache)):
        return rotary_kv_append_ref(qkv, cos, sin, position_ids=position_ids, k_cache=k_cache, v_cache=v_cache,
                                    slots=slots, num_q_heads=num_q_heads, block_table=block_table,
                                    interleaved=interleaved)
    cos, sin, block_table = unit_last_stride(cos), unit_last_stride(sin), unit_last_stride(block_table)
    return pick(_rotary_kv_append_op, _rotary_kv_append)(
        qkv, cos, sin, position_ids, k_cache, v_cache, slots, block_table, int(num_q_heads), bool(interleaved))
