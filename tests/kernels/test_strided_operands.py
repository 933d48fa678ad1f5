"""The Triton paths take their small operands (norm weights, labels, ids, offsets, positions, cos/sin and block
tables) in any layout: a strided or expanded one gives the result of its contiguous copy. The kernels index them
as if contiguous (a table by its row stride only), so each op makes its own unit-stride copy where needed."""

import pytest
import torch

import flash_kernels as fk

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def strided(t):
    """t's values in a view whose last dim has stride 2."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    wide[..., ::2] = t
    return wide[..., ::2]


def _calls():
    """name -> (the op on strided operands, the op on their contiguous copies)."""
    h = torch.randn(6, 16, device=DEVICE)
    w, b = torch.randn(16, device=DEVICE), torch.randn(16, device=DEVICE)
    labels = torch.randint(0, 9, (6,), device=DEVICE)
    logits, weight = torch.randn(6, 9, device=DEVICE), torch.randn(9, 16, device=DEVICE)
    ids, table = torch.randint(0, 10, (2, 3), device=DEVICE), torch.randn(10, 16, device=DEVICE)
    positions, pos_table = torch.randint(0, 8, (2, 3), device=DEVICE), torch.randn(8, 16, device=DEVICE)
    x = torch.randn(2, 3, 2, 8, device=DEVICE)
    cos, sin = torch.rand(12, 4, device=DEVICE), torch.rand(12, 4, device=DEVICE)
    offsets = torch.tensor([4, 1], device=DEVICE)
    q = torch.randn(9, 2, 16, dtype=torch.float16, device=DEVICE)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32, device=DEVICE)
    qd, pool = torch.randn(2, 1, 2, 16, dtype=torch.float16, device=DEVICE), torch.randn(6, 4, 1, 16, dtype=torch.float16, device=DEVICE)
    lens, blocks = torch.tensor([5, 7], dtype=torch.int32, device=DEVICE), torch.tensor([[4, 1], [0, 5]], dtype=torch.int32, device=DEVICE)
    new_kv = torch.randn(2, 1, 1, 16, device=DEVICE)
    slots = torch.tensor([[6], [2]], device=DEVICE)

    def appended(block_table):
        pools = [torch.zeros(6, 4, 1, 16, device=DEVICE) for _ in range(2)]
        fk.kv_append(*pools, new_kv, new_kv, slots, block_table=block_table, backend="triton")
        return pools[0]

    def rotary_appended(c, s):
        qkv = torch.randn(1, 1, 4, 8, generator=torch.Generator().manual_seed(0)).to(DEVICE)
        caches = [torch.zeros(1, 4, 1, 8, device=DEVICE) for _ in range(2)]
        q_rot = fk.rotary_kv_append(qkv, c, s, position_ids=torch.tensor([[3]], device=DEVICE), k_cache=caches[0],
                                    v_cache=caches[1], slots=torch.tensor([[1]], device=DEVICE), num_q_heads=2,
                                    backend="triton")
        return torch.cat((q_rot.flatten(), caches[0].flatten()))

    expanded_weight = torch.ones(1, device=DEVICE).expand(16)
    return {
        "layer_norm weight, bias": (lambda: fk.layer_norm(h, strided(w), strided(b), backend="triton"),
                                    lambda: fk.layer_norm(h, w, b, backend="triton")),
        "layer_norm expanded weight": (lambda: fk.layer_norm(h, expanded_weight, b, backend="triton"),
                                       lambda: fk.layer_norm(h, expanded_weight.contiguous(), b, backend="triton")),
        "rms_norm_dual weights": (lambda: fk.rms_norm_dual(h, strided(w), None, strided(b), None, backend="triton")[1],
                                  lambda: fk.rms_norm_dual(h, w, None, b, None, backend="triton")[1]),
        "cross_entropy labels": (lambda: fk.cross_entropy(logits, strided(labels), backend="triton"),
                                 lambda: fk.cross_entropy(logits, labels, backend="triton")),
        "linear_cross_entropy labels": (lambda: fk.linear_cross_entropy(h, weight, strided(labels), backend="triton"),
                                        lambda: fk.linear_cross_entropy(h, weight, labels, backend="triton")),
        "embedding_layer_norm ids, weights": (
            lambda: fk.embedding_layer_norm(strided(ids), table, strided(w), strided(b), position_ids=strided(positions),
                                            position_table=pos_table, backend="triton"),
            lambda: fk.embedding_layer_norm(ids, table, w, b, position_ids=positions, position_table=pos_table,
                                            backend="triton")),
        "apply_rotary cos, sin, position_ids": (
            lambda: fk.apply_rotary(x, strided(cos), strided(sin), position_ids=strided(positions), backend="triton"),
            lambda: fk.apply_rotary(x, cos, sin, position_ids=positions, backend="triton")),
        "apply_rotary expanded cos, offsets": (
            lambda: fk.apply_rotary(x, cos[:1].expand(12, 4), sin, seqlen_offsets=strided(offsets), backend="triton"),
            lambda: fk.apply_rotary(x, cos[:1].expand(12, 4).contiguous(), sin, seqlen_offsets=offsets,
                                    backend="triton")),
        "flash_attn_varlen_func cu_seqlens": (
            lambda: fk.flash_attn_varlen_func(q, q, q, strided(cu), strided(cu), 5, 5, causal=True, backend="triton"),
            lambda: fk.flash_attn_varlen_func(q, q, q, cu, cu, 5, 5, causal=True, backend="triton")),
        "flash_attn_varlen_qkvpacked_func cu_seqlens": (
            lambda: fk.flash_attn_varlen_qkvpacked_func(torch.stack((q, q, q), 1), strided(cu), 5, backend="triton"),
            lambda: fk.flash_attn_varlen_qkvpacked_func(torch.stack((q, q, q), 1), cu, 5, backend="triton")),
        "flash_attn_with_kvcache seqlens, block_table": (
            lambda: fk.flash_attn_with_kvcache(qd, pool, pool, cache_seqlens=strided(lens), block_table=blocks.t().contiguous().t(),
                                               backend="triton"),
            lambda: fk.flash_attn_with_kvcache(qd, pool, pool, cache_seqlens=lens, block_table=blocks, backend="triton")),
        "kv_append block_table": (lambda: appended(blocks.t().contiguous().t()), lambda: appended(blocks)),
        "rotary_kv_append cos, sin": (lambda: rotary_appended(strided(cos), strided(sin)),
                                      lambda: rotary_appended(cos, sin)),
    }


@pytest.mark.parametrize("name", list(_calls()))
def test_strided_operand_gives_its_contiguous_copys_result(name):
    torch.manual_seed(0)
    on_strided, on_contiguous = _calls()[name]
    assert torch.equal(on_strided(), on_contiguous())
