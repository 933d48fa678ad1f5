import pytest
import torch

from flash_kernels.kv_append import kv_append, kv_append_ref

# The Triton kernel runs on the GPU where there is one, through the interpreter on the CPU otherwise.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,S,H,D", [(3, 1, 2, 32), (2, 5, 3, 80), (1, 7, 1, 17)])
def test_triton_append_equals_reference(B, S, H, D, dtype):
    L = 23
    caches = [torch.randn(B, L, H, D, dtype=dtype, device=DEVICE) for _ in range(2)]
    k, v = torch.randn(B, S, H, D, dtype=dtype, device=DEVICE), torch.randn(B, S, H, D, dtype=dtype, device=DEVICE)
    k = k.transpose(1, 2).contiguous().transpose(1, 2)  # strided over (S, H): the kernel reads strides
    slots = torch.stack([torch.randperm(L, device=DEVICE)[:S] for _ in range(B)])
    ref = [c.clone() for c in caches]
    kv_append_ref(*ref, k, v, slots)
    kv_append(*caches, k, v, slots.int(), backend="triton")
    assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])


def test_bad_shapes_are_named():
    cache = torch.zeros(2, 8, 2, 16)
    with pytest.raises(ValueError, match="slots must be integer"):
        kv_append(cache, cache.clone(), torch.zeros(2, 1, 2, 16), torch.zeros(2, 1, 2, 16), torch.zeros(2, 1))
    with pytest.raises(ValueError, match=r"must be \(B, S, Hkv, D\)"):
        kv_append(cache, cache.clone(), torch.zeros(2, 1, 3, 16), torch.zeros(2, 1, 3, 16), torch.zeros(2, 1, dtype=torch.long))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_triton_append_equals_reference(dtype):
    B, S, H, D, block_size, blocks = 3, 4, 2, 24, 5, 12
    pools = [torch.randn(blocks, block_size, H, D, dtype=dtype, device=DEVICE) for _ in range(2)]
    table = torch.randperm(blocks, device=DEVICE)[: B * 4].view(B, 4).int()  # 4 blocks per row, no block shared
    k, v = torch.randn(B, S, H, D, dtype=dtype, device=DEVICE), torch.randn(B, S, H, D, dtype=dtype, device=DEVICE)
    slots = torch.stack([torch.randperm(4 * block_size, device=DEVICE)[:S] for _ in range(B)])
    ref = [p.clone() for p in pools]
    kv_append_ref(*ref, k, v, slots, table)
    kv_append(*pools, k, v, slots.int(), block_table=table, backend="triton")
    assert torch.equal(pools[0], ref[0]) and torch.equal(pools[1], ref[1])
    # and the reference itself puts row b's slot s at (table[b, s // block_size], s % block_size)
    b, s = 1, int(slots[1, 2])
    assert torch.equal(ref[0][table[b, s // block_size], s % block_size], k[1, 2])


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("paged", [False, True])
def test_slots_outside_the_cache_are_refused(backend, paged):
    """A negative slot would wrap round to the row's end (reference) or write before the row (kernel), one past
    the row into the next row's cache: checked where that costs no host sync."""
    cache = torch.zeros(6, 4, 1, 8, device=DEVICE)  # per-row: 6 rows of 4 slots; paged: 6 blocks of 4
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE) if paged else None
    k = torch.ones(2 if paged else 6, 1, 1, 8, device=DEVICE)
    capacity = 8 if paged else 4
    for bad in (-1, capacity):
        slots = torch.zeros(k.shape[:2], dtype=torch.long, device=DEVICE)
        slots[1, 0] = bad
        if DEVICE == "cpu":
            with pytest.raises(ValueError, match="outside the cache"):
                kv_append(cache, cache.clone(), k, k.clone(), slots, block_table=table, backend=backend)
    if paged and DEVICE == "cpu":
        with pytest.raises(ValueError, match="outside the pool"):
            kv_append(cache, cache.clone(), k, k.clone(), torch.zeros(2, 1, dtype=torch.long, device=DEVICE),
                      block_table=table + 5, backend=backend)


def test_kernel_writes_nothing_for_a_slot_outside_the_cache():
    """On CUDA the slots are not read back (a sync): the kernel itself leaves out a write outside a row."""
    from flash_kernels.kv_append import _kv_append_triton

    cache = torch.zeros(3, 4, 1, 8, device=DEVICE)
    k = torch.arange(3, dtype=torch.float32, device=DEVICE).view(3, 1, 1, 1).expand(3, 1, 1, 8) + 1
    slots = torch.tensor([[-1], [4], [2]], dtype=torch.int32, device=DEVICE)
    v_cache = cache.clone()
    _kv_append_triton(cache, v_cache, k, k, slots, None)
    want = torch.zeros_like(cache)
    want[2, 2] = 3
    assert torch.equal(cache, want) and torch.equal(v_cache, want)
