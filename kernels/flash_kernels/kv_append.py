"""Writing new keys and values into a KV cache at given slots, both in one launch.

A decode step stores one token's k and v per row and layer. Done with indexing ops that is several
launches per layer (slot arithmetic, two index_puts); in a CUDA-graph decode step, launches are the cost,
so one Triton program per (token, kv head) copies both rows.

Caches are either per row, (B, L, Hkv, D), or paged: a pool (num_blocks, block_size, Hkv, D) with a
``block_table`` (B, max_blocks) int32 mapping row b's logical slot s to block ``table[b, s // block_size]``,
offset ``s % block_size``.
"""

from __future__ import annotations

import torch

from ._backend import use_triton
from ._launch import lean_launch
from ._triton_utils import next_power_of_2, unit_last_stride
from ._pdl import enabled as programmatic_launch_enabled
from ._pdl import launch_options, wait_for_predecessor
from ._triton_compat import tl, triton


def cache_locations(slots: torch.Tensor, block_table: torch.Tensor | None, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(first index, second index) into the cache for logical ``slots`` (B, S): (row, slot) for a per-row
    cache, (block, offset) for a paged one."""
    if block_table is None:
        return torch.arange(slots.shape[0], device=slots.device).unsqueeze(1).expand_as(slots), slots.long()
    blocks = block_table.long().gather(1, slots.long() // block_size)
    return blocks, slots.long() % block_size


def kv_append_ref(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
    block_table: torch.Tensor | None = None,
) -> None:
    """k/v (B, S, Hkv, D) stored at logical ``slots`` (B, S) of the caches, in place."""
    first, second = cache_locations(slots, block_table, k_cache.shape[1])
    k_cache[first, second] = k.to(k_cache.dtype)
    v_cache[first, second] = v.to(v_cache.dtype)


@triton.jit
def slot_location(SLOTS, TABLE, b, s, s_slb, s_sls, s_tb, block_size, n_blocks, PAGED: tl.constexpr):
    """The device side of ``cache_locations`` for token (b, s): its (row, slot) in a per-row cache, or
    (block, offset) in a paged pool, and whether to write there: not for a negative slot or one past a per-row
    cache's length, nor when the block table names a block outside the pool's [0, n_blocks) (the host checks
    slots and tables where that costs no sync; a CUDA graph's replay runs no host code, and a write there would
    land in another row or outside the cache). Shared with rotary_append.py's fused kernel."""
    slot = tl.load(SLOTS + b * s_slb + s * s_sls)
    if PAGED:
        first = tl.load(TABLE + b * s_tb + tl.maximum(slot, 0) // block_size).to(tl.int64)
        second = slot % block_size
        inside = (slot >= 0) & (first >= 0) & (first < n_blocks)
    else:
        first = b.to(tl.int64)
        second = slot
        inside = (slot >= 0) & (slot < block_size)
    return first, second, inside


@lean_launch
@triton.jit
def _kv_append_kernel(
    KC, VC, K, V, SLOTS, TABLE, seqlen, head_dim, block_size, n_blocks,
    s_kc0, s_kc1, s_kch, s_vc0, s_vc1, s_vch, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, s_slb, s_sls, s_tb,
    PAGED: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_predecessor(PDL)
    token = tl.program_id(0)  # b * seqlen + s
    h = tl.program_id(1)
    b, s = token // seqlen, token % seqlen
    first, second, inside = slot_location(SLOTS, TABLE, b, s, s_slb, s_sls, s_tb, block_size, n_blocks, PAGED)
    d = tl.arange(0, BLOCK_D)
    m = (d < head_dim) & inside
    k = tl.load(K + b * s_kb + s * s_ks + h * s_kh + d, mask=m)
    v = tl.load(V + b * s_vb + s * s_vs + h * s_vh + d, mask=m)
    tl.store(KC + first * s_kc0 + second * s_kc1 + h * s_kch + d, k.to(KC.dtype.element_ty), mask=m)
    tl.store(VC + first * s_vc0 + second * s_vc1 + h * s_vch + d, v.to(VC.dtype.element_ty), mask=m)


def _kv_append_triton(k_cache, v_cache, k, v, slots, block_table) -> None:
    B, S, H, D = k.shape
    table = block_table if block_table is not None else slots  # a stand-in pointer, never read
    pdl = programmatic_launch_enabled(k.device)
    _kv_append_kernel[(B * S, H)](
        k_cache, v_cache, k, v, slots, table, S, D, k_cache.shape[1], k_cache.shape[0],
        *k_cache.stride()[:3], *v_cache.stride()[:3], *k.stride()[:3], *v.stride()[:3], *slots.stride(),
        table.stride(0), PAGED=block_table is not None, BLOCK_D=next_power_of_2(D), PDL=pdl, **launch_options(pdl),
    )


@torch.library.custom_op("flash_kernels::kv_append", mutates_args=("k_cache", "v_cache"))
def _kv_append_op(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
    block_table: torch.Tensor | None,
) -> None:
    _kv_append_triton(k_cache, v_cache, k, v, slots, block_table)


def _check(k_cache, v_cache, k, v, slots, block_table, *, op: str = "kv_append") -> None:
    """ValueError for inconsistent inputs; ``op`` names the public function in the message (rotary_kv_append
    checks its k/v views of qkv here too)."""
    if k_cache.shape != v_cache.shape or k.shape != v.shape:
        raise ValueError(f"{op}: caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} and new k/v "
                         f"{tuple(k.shape)}/{tuple(v.shape)} must match in pairs")
    rows_match = block_table is not None or k.shape[0] == k_cache.shape[0]
    if k.dim() != 4 or k_cache.dim() != 4 or not rows_match or k.shape[2:] != k_cache.shape[2:]:
        raise ValueError(f"{op}: k {tuple(k.shape)} must be (B, S, Hkv, D) for a cache {tuple(k_cache.shape)}")
    if slots.shape != k.shape[:2] or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: slots must be integer (B, S) = {tuple(k.shape[:2])}, got {slots.dtype} "
                         f"{tuple(slots.shape)}")
    if block_table is not None and (block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != k.shape[0]):
        raise ValueError(f"{op}: block_table must be int32 (B={k.shape[0]}, max_blocks), got "
                         f"{block_table.dtype} {tuple(block_table.shape)}")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError(f"{op}: the head dim must be contiguous in k, v and the caches")
    if not k.is_cuda and slots.numel() and not torch.compiler.is_compiling():
        _check_slot_values(k_cache, slots, block_table, op)


def _check_slot_values(k_cache, slots, block_table, op) -> None:
    """Every slot inside its row's capacity, and (paged) every block it lands in inside the pool. Only off CUDA,
    where reading the values costs no host sync: the reference's indexing would wrap a negative slot round to
    the row's end, or raise an IndexError naming no input."""
    capacity = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
    low, high = int(slots.min()), int(slots.max())
    if low < 0 or high >= capacity:
        raise ValueError(f"{op}: slots span [{low}, {high}], outside the cache's {capacity} slots a row; keep every "
                         "new token inside the cache (allocate a longer one)")
    if block_table is not None:
        blocks, _ = cache_locations(slots, block_table, k_cache.shape[1])
        if int(blocks.min()) < 0 or int(blocks.max()) >= k_cache.shape[0]:
            raise ValueError(f"{op}: block_table sends a slot to block {int(blocks.min())}..{int(blocks.max())}, "
                             f"outside the pool's [0, {k_cache.shape[0]})")


def kv_append(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
    *, block_table: torch.Tensor | None = None, backend: str | None = None,
) -> None:
    """Store k, v (B, S, Hkv, D) at logical positions ``slots`` (B, S) of k_cache, v_cache, in place: per-row
    caches (B, L, Hkv, D), or paged pools with ``block_table`` (see the module docstring). Slots are not
    bounds-checked (that would sync): the caller keeps them inside the cache. On the Triton path a token whose
    block id is outside the pool is not written."""
    _check(k_cache, v_cache, k, v, slots, block_table)
    if use_triton(backend, k, op="kv_append"):
        _kv_append_op(k_cache, v_cache, k, v, slots, unit_last_stride(block_table))
    else:
        kv_append_ref(k_cache, v_cache, k, v, slots, block_table)
