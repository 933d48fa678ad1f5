"""Writing new keys and values into a KV cache at given slots, both in one launch.

A decode step stores one token's k and v per row and layer. Done with indexing ops that is several
launches per layer (slot arithmetic, two index_puts); in a CUDA-graph decode step, launches are the cost,
so one Triton program per (token, kv head) copies both rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._backend import use_triton


def kv_append_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """k_cache/v_cache (B, L, Hkv, D); k/v (B, S, Hkv, D); slots (B, S): cache position of each new token."""
    rows = torch.arange(k.shape[0], device=k.device).unsqueeze(1).expand_as(slots)
    k_cache[rows, slots] = k.to(k_cache.dtype)
    v_cache[rows, slots] = v.to(v_cache.dtype)


@triton.jit
def _kv_append_kernel(
    KC, VC, K, V, SLOTS, seqlen, n_heads, head_dim,
    s_kcb, s_kcl, s_kch, s_vcb, s_vcl, s_vch, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, s_slb, s_sls,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)  # b * seqlen + s
    h = tl.program_id(1)
    b, s = token // seqlen, token % seqlen
    slot = tl.load(SLOTS + b * s_slb + s * s_sls)
    d = tl.arange(0, BLOCK_D)
    m = d < head_dim
    k = tl.load(K + b * s_kb + s * s_ks + h * s_kh + d, mask=m)
    v = tl.load(V + b * s_vb + s * s_vs + h * s_vh + d, mask=m)
    tl.store(KC + b * s_kcb + slot * s_kcl + h * s_kch + d, k.to(KC.dtype.element_ty), mask=m)
    tl.store(VC + b * s_vcb + slot * s_vcl + h * s_vch + d, v.to(VC.dtype.element_ty), mask=m)


def _kv_append_triton(k_cache, v_cache, k, v, slots) -> None:
    B, S, H, D = k.shape
    _kv_append_kernel[(B * S, H)](
        k_cache, v_cache, k, v, slots, S, H, D,
        *k_cache.stride()[:3], *v_cache.stride()[:3], *k.stride()[:3], *v.stride()[:3], *slots.stride(),
        BLOCK_D=triton.next_power_of_2(D),
    )


@torch.library.custom_op("flash_kernels::kv_append", mutates_args=("k_cache", "v_cache"))
def _kv_append_op(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    _kv_append_triton(k_cache, v_cache, k, v, slots)


def _check(k_cache, v_cache, k, v, slots) -> None:
    if k_cache.shape != v_cache.shape or k.shape != v.shape:
        raise ValueError(f"kv_append: caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} and new k/v "
                         f"{tuple(k.shape)}/{tuple(v.shape)} must match in pairs")
    if k.dim() != 4 or k_cache.dim() != 4 or k.shape[0] != k_cache.shape[0] or k.shape[2:] != k_cache.shape[2:]:
        raise ValueError(f"kv_append: k {tuple(k.shape)} must be (B, S, Hkv, D) for a cache {tuple(k_cache.shape)}")
    if slots.shape != k.shape[:2] or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"kv_append: slots must be integer (B, S) = {tuple(k.shape[:2])}, got {slots.dtype} {tuple(slots.shape)}")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("kv_append: the head dim must be contiguous in k, v and the caches")


def kv_append(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
    *, backend: str | None = None,
) -> None:
    """Store k, v (B, S, Hkv, D) into k_cache, v_cache (B, L, Hkv, D) at positions ``slots`` (B, S), in place.
    Slots are not bounds-checked on the device (that would sync): the caller keeps them below L."""
    _check(k_cache, v_cache, k, v, slots)
    if use_triton(backend, k, op="kv_append"):
        _kv_append_op(k_cache, v_cache, k, v, slots)
    else:
        kv_append_ref(k_cache, v_cache, k, v, slots)
