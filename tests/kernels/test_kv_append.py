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
