"""flash_attn_qkvpacked_func / flash_attn_varlen_qkvpacked_func: the packed entry points against the reference
on q, k, v slices, and bit for bit against the unpacked kernels (same kernels, only the gradient buffer differs)."""

import pytest
import torch

from flash_kernels import (
    flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func, flash_attn_varlen_qkvpacked_func,
)
from flash_kernels._testing import assert_close
from flash_kernels.attention import flash_attn_func_ref, flash_attn_varlen_func_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GRAD_SCALE = 2.0  # as in test_attention: gradients pass through two more low-precision matmuls


def _packed(shape, dtype, seed):
    torch.manual_seed(seed)
    return torch.randn(*shape, dtype=dtype, device=DEVICE, requires_grad=True)


def _split(qkv, hkv):
    hq = qkv.shape[-2] - 2 * hkv
    return qkv[..., :hq, :], qkv[..., hq:hq + hkv, :], qkv[..., hq + hkv:, :]


# (B, S, Hq, Hkv, D, causal, window, softcap, alibi)
CASES = [
    (2, 17, 2, 2, 32, False, (-1, -1), 0.0, False),
    (1, 113, 4, 2, 64, True, (-1, -1), 0.0, False),  # GQA 2
    (1, 47, 3, 1, 80, True, (9, -1), 0.0, False),  # MQA, causal + left window
    (2, 33, 2, 2, 32, True, (-1, -1), 5.0, True),  # softcap and ALiBi
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:6])))
def test_packed_matches_reference(case, dtype):
    b, s, hq, hkv, d, causal, window, softcap, alibi = case
    qkv = _packed((b, s, hq + 2 * hkv, d), dtype, seed=1)
    slopes = torch.rand(hq, device=DEVICE) if alibi else None
    kw = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)
    out, lse = flash_attn_qkvpacked_func(qkv, num_heads_kv=hkv, return_lse=True, backend="triton", **kw)
    ref, ref_lse = flash_attn_func_ref(*_split(qkv, hkv), return_lse=True, **kw)
    assert_close(out, ref, dtype, name="out")
    assert_close(lse, ref_lse, torch.float32, scale=10, name="lse")
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    (ref_dqkv,) = torch.autograd.grad(ref, qkv, dout)
    assert dqkv.shape == qkv.shape
    assert_close(dqkv, ref_dqkv, dtype, scale=GRAD_SCALE, name="dqkv")


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_packed_equals_unpacked_kernels_bitwise(dropout_p):
    """Same kernels, same seed: the packed op differs only in where the gradients land."""
    hq, hkv = 4, 2
    qkv = _packed((2, 37, hq + 2 * hkv, 64), torch.float16, seed=2)
    dout = torch.randn(2, 37, hq, 64, dtype=torch.float16, device=DEVICE)
    torch.manual_seed(3)
    out = flash_attn_qkvpacked_func(qkv, num_heads_kv=hkv, causal=True, dropout_p=dropout_p, backend="triton")
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    torch.manual_seed(3)
    ref = flash_attn_func(*_split(qkv, hkv), causal=True, dropout_p=dropout_p, backend="triton")
    (ref_dqkv,) = torch.autograd.grad(ref, qkv, dout)
    assert torch.equal(out, ref)
    assert torch.equal(dqkv, ref_dqkv)


def test_fa2_layout_is_the_same_attention():
    """(B, S, 3, H, D), FlashAttention-2's layout, is (B, S, 3H, D) heads-concatenated with Hkv = H."""
    qkv5 = _packed((2, 21, 3, 2, 32), torch.float16, seed=4)
    out = flash_attn_qkvpacked_func(qkv5, causal=True, backend="triton")
    ref = flash_attn_func_ref(qkv5[:, :, 0], qkv5[:, :, 1], qkv5[:, :, 2], causal=True)
    assert_close(out, ref, torch.float16, name="out")
    dout = torch.randn_like(out)
    (g,) = torch.autograd.grad(out, qkv5, dout)
    (rg,) = torch.autograd.grad(ref, qkv5, dout)
    assert g.shape == qkv5.shape
    assert_close(g, rg, torch.float16, scale=GRAD_SCALE, name="dqkv")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_varlen_packed_with_empty_sequences(dtype):
    hq, hkv = 2, 1
    cu = torch.tensor([0, 7, 7, 20, 33], dtype=torch.int32, device=DEVICE)
    qkv = _packed((33, hq + 2 * hkv, 32), dtype, seed=5)
    out = flash_attn_varlen_qkvpacked_func(qkv, cu, 13, num_heads_kv=hkv, causal=True, backend="triton")
    q, k, v = _split(qkv, hkv)
    ref = flash_attn_varlen_func_ref(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    assert_close(out, ref, dtype, name="out")
    dout = torch.randn_like(out)
    (g,) = torch.autograd.grad(out, qkv, dout)
    (rg,) = torch.autograd.grad(ref, qkv, dout)
    assert_close(g, rg, dtype, scale=GRAD_SCALE, name="dqkv")
    unpacked = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=13, max_seqlen_k=13,
                                      causal=True, backend="triton")
    assert torch.equal(out, unpacked)


def test_packed_torch_compile_fullgraph():
    qkv = _packed((1, 17, 4, 32), torch.float16, seed=6)  # Hq 2, Hkv 1

    def f(qkv):
        return flash_attn_qkvpacked_func(qkv, num_heads_kv=1, causal=True, backend="triton").float().square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager" if DEVICE == "cpu" else "inductor")
    loss = compiled(qkv)
    (g,) = torch.autograd.grad(loss, qkv)
    ref_loss = f(qkv)
    (rg,) = torch.autograd.grad(ref_loss, qkv)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(g, rg)


def test_auto_backend_on_cpu_is_reference():
    qkv = torch.randn(1, 9, 6, 32, requires_grad=True)
    out = flash_attn_qkvpacked_func(qkv, causal=True, backend="auto")
    torch.testing.assert_close(out, flash_attn_func_ref(*_split(qkv, 2), causal=True))


def test_validation_errors():
    x = torch.zeros(1, 4, 8, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match="do not split into equal q, k, v; pass num_heads_kv"):
        flash_attn_qkvpacked_func(x)
    with pytest.raises(ValueError, match="must be a positive multiple of num_heads_kv"):
        flash_attn_qkvpacked_func(x, num_heads_kv=3)  # 8 heads - 6 = 2 q heads < 3
    with pytest.raises(ValueError, match=r"must be \(B, S, 3, H, D\)"):
        flash_attn_qkvpacked_func(torch.zeros(1, 4, 2, 2, 32))
    with pytest.raises(ValueError, match="for GQA pass the"):
        flash_attn_qkvpacked_func(torch.zeros(1, 4, 3, 2, 32), num_heads_kv=1)
    with pytest.raises(ValueError, match="got 3-D"):
        flash_attn_qkvpacked_func(torch.zeros(4, 6, 32))
    with pytest.raises(ValueError, match="cu_seqlens must be int32"):
        flash_attn_varlen_qkvpacked_func(torch.zeros(4, 6, 32), torch.tensor([0, 4]), 4)
    with pytest.raises(ValueError, match="smaller than the longest sequence"):
        flash_attn_varlen_qkvpacked_func(torch.zeros(4, 6, 32), torch.tensor([0, 4], dtype=torch.int32), 3)


@pytest.mark.gpu
def test_gpu_packed_real_size():
    hq, hkv = 16, 4
    qkv = _packed((2, 1000, hq + 2 * hkv, 128), torch.bfloat16, seed=7)
    out = flash_attn_qkvpacked_func(qkv, num_heads_kv=hkv, causal=True)
    ref = flash_attn_func_ref(*_split(qkv, hkv), causal=True)
    assert_close(out, ref, torch.bfloat16, name="out")
    dout = torch.randn_like(out)
    (g,) = torch.autograd.grad(out, qkv, dout)
    (rg,) = torch.autograd.grad(ref, qkv, dout)
    assert_close(g, rg, torch.bfloat16, scale=GRAD_SCALE, name="dqkv")


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_packed_lse_is_not_differentiable(backend):
    qkv = torch.randn(2, 5, 3, 2, 16, dtype=torch.float16, device=DEVICE, requires_grad=True)
    out, lse = flash_attn_qkvpacked_func(qkv, causal=True, return_lse=True, backend=backend)
    assert out.requires_grad and not lse.requires_grad
