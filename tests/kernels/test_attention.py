"""flash_attn_func / flash_attn_varlen_func: Triton kernels (the CPU interpreter in CI) against the reference.

On the CPU the interpreter's bf16 tl.dot is wrong (triton 3.8), so under the interpreter the kernels upcast
bf16 dot operands to fp32 (a constexpr switch, see attention_tiles._mm); fp16 runs as is. On CUDA both run natively.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from flash_kernels import flash_attn_func, flash_attn_varlen_func
from flash_kernels._testing import assert_close
from flash_kernels.attention import dropout_keep_mask, flash_attn_func_ref, flash_attn_varlen_func_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float16, torch.bfloat16]
# Gradients go through two more low-precision matmuls than the output: a looser bound.
GRAD_SCALE = 2.0


def _qkv(b, sq, sk, hq, hkv, d, dtype, device=DEVICE):
    q = torch.randn(b, sq, hq, d, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(b, sk, hkv, d, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(b, sk, hkv, d, dtype=dtype, device=device, requires_grad=True)
    return q, k, v


def _check_fwd_bwd(q, k, v, dtype, *, varlen_kwargs=None, **kw):
    """Ours (triton) vs reference: output, lse and the three gradients."""
    fn, ref_fn = (flash_attn_func, flash_attn_func_ref) if varlen_kwargs is None else (flash_attn_varlen_func, flash_attn_varlen_func_ref)
    extra = varlen_kwargs or {}
    out, lse = fn(q, k, v, **extra, **kw, return_lse=True, backend="triton")
    ref, ref_lse = ref_fn(q, k, v, **extra, **kw, return_lse=True)
    assert_close(out, ref, dtype, name="out")
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "lse: -inf rows differ from the reference"
    assert_close(lse[finite], ref_lse[finite], torch.float32, scale=10, name="lse")
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(g, rg, dtype, scale=GRAD_SCALE, name=name)


# (B, Sq, Sk, Hq, Hkv, D, causal, window, softcap, alibi)
CASES = [
    (2, 17, 17, 2, 2, 32, False, (-1, -1), 0.0, False),
    (1, 113, 113, 2, 1, 64, True, (-1, -1), 0.0, False),
    (1, 1, 113, 4, 1, 64, True, (-1, -1), 0.0, False),  # decode-like row, MQA
    (2, 17, 1, 2, 1, 32, False, (-1, -1), 0.0, False),
    (1, 47, 113, 6, 2, 80, True, (-1, -1), 0.0, False),  # Sq < Sk, bottom-right causal, GQA 3
    (1, 113, 47, 2, 2, 96, True, (-1, -1), 0.0, False),  # Sq > Sk: leading rows fully masked
    (1, 113, 113, 2, 1, 64, False, (16, 7), 0.0, False),  # local window
    (1, 64, 97, 2, 2, 64, True, (20, -1), 0.0, False),  # causal + left window
    (1, 33, 33, 2, 2, 32, False, (-1, -1), 4.0, False),  # softcap
    (2, 33, 49, 4, 2, 32, True, (-1, -1), 0.0, True),  # ALiBi
    (1, 49, 49, 2, 2, 64, True, (9, -1), 10.0, True),  # everything at once
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:7])) + f"-w{c[7]}-sc{c[8]}-al{c[9]}")
def test_forward_backward(case, dtype):
    torch.manual_seed(0)
    b, sq, sk, hq, hkv, d, causal, window, softcap, alibi = case
    q, k, v = _qkv(b, sq, sk, hq, hkv, d, dtype)
    slopes = torch.rand(b, hq, device=DEVICE) if alibi else None
    _check_fwd_bwd(q, k, v, dtype, causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)


@pytest.mark.parametrize("shares", [1, 2, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_backward_in_shares(shares, causal, monkeypatch):
    """dK/dV of a GQA group summed by one program a kv head, or split over programs (an uneven split: 2 shares of
    3 q heads) whose float32 sums are added after: every way gives the reference's gradients."""
    import flash_kernels.attention as attention

    monkeypatch.setattr(attention, "_group_shares", lambda *args: shares)
    torch.manual_seed(shares)
    q, k, v = _qkv(2, 37, 45, 6, 2, 32, torch.float16)
    _check_fwd_bwd(q, k, v, torch.float16, causal=causal)


@pytest.mark.parametrize("d", [32, 64, 80, 96, 128, 192, 256])
def test_head_dims(d):
    torch.manual_seed(d)
    q, k, v = _qkv(1, 19, 23, 2, 1, d, torch.float16)
    _check_fwd_bwd(q, k, v, torch.float16, causal=True, softmax_scale=0.3)


def test_fully_masked_rows_are_zero():
    torch.manual_seed(1)
    # Sq > Sk with causal: rows i < Sq - Sk see no key. A window of (0, 0) ends up the same for the rest.
    q, k, v = _qkv(1, 40, 9, 2, 2, 32, torch.float16)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True, backend="triton")
    assert torch.isfinite(out).all()
    assert (out[:, :31] == 0).all() and (out[:, 31:].abs() > 0).any()
    assert torch.isneginf(lse[:, :, :31]).all() and torch.isfinite(lse[:, :, 31:]).all()
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[:, :31] == 0).all()


def test_very_negative_scores_after_an_invisible_tile():
    """All logits about -290: a row whose first key tile was fully masked must still normalise by its own
    maximum (not by a placeholder 0, which would underflow every exp to 0 and output zeros)."""
    torch.manual_seed(14)
    q = torch.full((1, 40, 1, 32), 3.0, dtype=torch.float16, device=DEVICE)
    k = (-3.0 + 0.1 * torch.randn(1, 40, 1, 32, device=DEVICE)).half()
    v = torch.randn(1, 40, 1, 32, dtype=torch.float16, device=DEVICE)
    for window in ((5, 0), (3, 7)):
        out = flash_attn_func(q, k, v, softmax_scale=1.0, window_size=window, backend="triton")
        ref = flash_attn_func_ref(q, k, v, softmax_scale=1.0, window_size=window)
        assert_close(out, ref, torch.float16, name=f"window {window}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_with_empty_sequences(causal, dtype):
    torch.manual_seed(2)
    lens_q = [17, 0, 1, 40, 5]
    lens_k = [17, 3, 0, 40, 33]
    cu_q = torch.tensor([0] + lens_q, device=DEVICE).cumsum(0).int()
    cu_k = torch.tensor([0] + lens_k, device=DEVICE).cumsum(0).int()
    hq, hkv, d = 4, 2, 32
    q = torch.randn(sum(lens_q), hq, d, dtype=dtype, device=DEVICE, requires_grad=True)
    k = torch.randn(sum(lens_k), hkv, d, dtype=dtype, device=DEVICE, requires_grad=True)
    v = torch.randn(sum(lens_k), hkv, d, dtype=dtype, device=DEVICE, requires_grad=True)
    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    _check_fwd_bwd(q, k, v, dtype, varlen_kwargs=varlen, causal=causal, alibi_slopes=torch.rand(hq, device=DEVICE))


def test_varlen_matches_padded_batch():
    """Equal-length packed sequences give the same numbers as the batched kernel."""
    torch.manual_seed(3)
    q, k, v = _qkv(3, 21, 21, 2, 2, 64, torch.float16)
    out = flash_attn_func(q, k, v, causal=True, backend="triton")
    cu = torch.arange(0, 64, 21, device=DEVICE, dtype=torch.int32)
    packed = flash_attn_varlen_func(q.reshape(63, 2, 64), k.reshape(63, 2, 64), v.reshape(63, 2, 64), cu_seqlens_q=cu,
                                    cu_seqlens_k=cu, max_seqlen_q=21, max_seqlen_k=21, causal=True, backend="triton")
    torch.testing.assert_close(packed.reshape(3, 21, 2, 64), out, rtol=0, atol=0)


# ---- dropout -----------------------------------------------------------------------------------------------


def _fwd_op(q, k, v, *, causal, dropout_p, cu_q=None, cu_k=None, max_q=None, max_k=None, alibi=None):
    max_q = q.shape[1] if max_q is None else max_q
    max_k = k.shape[1] if max_k is None else max_k
    return torch.ops.flash_kernels.attn_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, q.shape[-1] ** -0.5, -1, -1, 0.0,
                                            alibi, dropout_p)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dropout_matches_reference_with_same_mask(dtype):
    torch.manual_seed(4)
    p = 0.3
    q, k, v = _qkv(1, 37, 45, 4, 2, 32, dtype)
    out, _, rng_state = _fwd_op(q, k, v, causal=True, dropout_p=p)
    mask = dropout_keep_mask(rng_state, 1, 4, 37, 45, p, device=DEVICE)
    ref = flash_attn_func_ref(q, k, v, causal=True, dropout_p=p, dropout_mask=mask)
    assert_close(out, ref, dtype, name="out")
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(g, rg, dtype, scale=GRAD_SCALE, name=name)


def test_dropout_varlen_matches_reference():
    torch.manual_seed(5)
    p = 0.2
    lens = [9, 0, 30]
    cu = torch.tensor([0] + lens, device=DEVICE).cumsum(0).int()
    q = torch.randn(39, 2, 32, dtype=torch.float16, device=DEVICE, requires_grad=True)
    k = torch.randn(39, 2, 32, dtype=torch.float16, device=DEVICE, requires_grad=True)
    v = torch.randn(39, 2, 32, dtype=torch.float16, device=DEVICE, requires_grad=True)
    out, _, rng_state = _fwd_op(q, k, v, causal=False, dropout_p=p, cu_q=cu, cu_k=cu, max_q=30, max_k=30)
    mask = dropout_keep_mask(rng_state, 3, 2, 30, 30, p, device=DEVICE)
    ref = flash_attn_varlen_func_ref(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, dropout_p=p, dropout_mask=mask)
    assert_close(out, ref, torch.float16, name="out")
    dout = torch.randn_like(out)
    for name, g, rg in zip("qkv", torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        assert_close(g, rg, torch.float16, scale=GRAD_SCALE, name="d" + name)


def test_dropout_keep_rate_and_fresh_masks():
    torch.manual_seed(6)
    p = 0.25
    q, k, v = _qkv(1, 8, 8, 1, 1, 32, torch.float16)
    _, _, rng1 = _fwd_op(q, k, v, causal=False, dropout_p=p)
    _, _, rng2 = _fwd_op(q, k, v, causal=False, dropout_p=p)
    m1 = dropout_keep_mask(rng1, 2, 3, 96, 160, p, device=DEVICE)
    m2 = dropout_keep_mask(rng2, 2, 3, 96, 160, p, device=DEVICE)
    n = m1.numel()
    rate = m1.float().mean().item()
    # Binomial: 6 standard deviations around 1 - p.
    assert abs(rate - (1 - p)) < 6 * math.sqrt(p * (1 - p) / n), rate
    assert not torch.equal(m1, m2), "two calls drew the same dropout mask"
    # Heads and rows must not share a stream.
    assert not torch.equal(m1[0, 0], m1[0, 1]) and not torch.equal(m1[0, 0, 0], m1[0, 0, 1])
    # Unbiased: averaging the dropped-out output over many draws approaches the output without dropout.
    # 64 draws leave ~1/8 relative noise; a missing 1 / (1 - p) rescale would be off by 1/2.
    x = torch.stack([flash_attn_func(q, k, v, dropout_p=0.5, backend="triton") for _ in range(64)]).float().mean(0)
    clean = flash_attn_func(q, k, v, backend="triton").float()
    assert (x - clean).norm() / clean.norm() < 0.3


# ---- backends, compile, errors -----------------------------------------------------------------------------


def test_reference_matches_sdpa_and_gradcheck():
    torch.manual_seed(7)
    q, k, v = _qkv(2, 13, 13, 2, 1, 16, torch.float64, device="cpu")
    ref = flash_attn_func_ref(q, k, v, causal=True)
    sdpa = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                          enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(ref, sdpa)
    small = [t[:1, :5].detach().requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradcheck(
        lambda a, b, c: flash_attn_func_ref(a, b, c, causal=True, softcap=2.0, window_size=(2, 1),
                                            alibi_slopes=torch.tensor([0.3, 0.1], dtype=torch.float64)),
        small,
    )


def test_auto_backend_on_cpu_is_reference():
    torch.manual_seed(8)
    q, k, v = _qkv(1, 9, 9, 2, 2, 32, torch.float32, device="cpu")
    torch.testing.assert_close(flash_attn_func(q, k, v, causal=True, backend="auto"), flash_attn_func_ref(q, k, v, causal=True))


def test_torch_compile_fullgraph():
    torch.manual_seed(9)
    q, k, v = _qkv(1, 17, 17, 2, 1, 32, torch.float16)

    def f(q, k, v):
        return flash_attn_func(q, k, v, causal=True, backend="triton").float().square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager" if DEVICE == "cpu" else "inductor")
    loss = compiled(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    ref_loss = f(q, k, v)
    ref_grads = torch.autograd.grad(ref_loss, (q, k, v))
    torch.testing.assert_close(loss, ref_loss)
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g, rg)


def test_varlen_torch_compile_fullgraph():
    torch.manual_seed(13)
    cu = torch.tensor([0, 7, 7, 20], dtype=torch.int32, device=DEVICE)
    q, k, v = (torch.randn(20, 2, 32, dtype=torch.float16, device=DEVICE, requires_grad=True) for _ in range(3))

    def f(q, k, v):
        out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=13, max_seqlen_k=13,
                                     causal=True, backend="triton")
        return out.float().square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager" if DEVICE == "cpu" else "inductor")
    loss = compiled(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    ref_loss = f(q, k, v)
    ref_grads = torch.autograd.grad(ref_loss, (q, k, v))
    torch.testing.assert_close(loss, ref_loss)
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g, rg)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_lse_is_not_differentiable(backend):
    """As FA2's: a gradient taken through the lse would be silently dropped by the backward, so the lse does
    not require one, on every backend, dense and varlen."""
    q, k, v = _qkv(2, 5, 5, 2, 1, 16, torch.float16)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True, backend=backend)
    assert out.requires_grad and not lse.requires_grad
    cu = torch.tensor([0, 3, 10], dtype=torch.int32, device=DEVICE)
    out, lse = flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, 7, 7,
                                      return_lse=True, backend=backend)
    assert out.requires_grad and not lse.requires_grad


def test_validation_errors():
    q, k, v = _qkv(1, 8, 8, 4, 2, 32, torch.float16)
    with pytest.raises(ValueError, match="multiple of the number of kv heads"):
        flash_attn_func(q, k[:, :, :1].expand(1, 8, 3, 32), v[:, :, :1].expand(1, 8, 3, 32), backend="triton")
    with pytest.raises(ValueError, match="k shape"):
        flash_attn_func(q, k, v[:, :4], backend="triton")
    wide = torch.randn(1, 8, 2, 264, dtype=torch.float16, device=DEVICE)  # past FA2's 256 too
    with pytest.raises(ValueError, match="head dim"):
        flash_attn_func(wide, wide, wide, backend="triton")
    with pytest.raises(ValueError, match="dtype"):
        flash_attn_func(q.float(), k.float(), v.float(), backend="triton")
    with pytest.raises(ValueError, match="batch"):
        flash_attn_func(q.expand(2, 8, 4, 32), k, v, backend="triton")
    for window in ((-2, 0), 3, (1, 0, 0)):
        with pytest.raises(ValueError, match="window_size"):
            flash_attn_func(q, k, v, window_size=window)
    for backend in ("reference", "triton"):  # no ZeroDivisionError from the scale or the GQA group
        with pytest.raises(ValueError, match="at least 1"):
            flash_attn_func(q[..., :0], k[..., :0], v[..., :0], backend=backend)
        with pytest.raises(ValueError, match="at least 1"):
            flash_attn_func(q, k[:, :, :0], v[:, :, :0], backend=backend)
    with pytest.raises(ValueError, match="alibi_slopes"):
        flash_attn_func(q, k, v, alibi_slopes=torch.rand(3, device=q.device))
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="not a kernel backend"):
            flash_attn_func(q, k, v, backend="cuda")
    flat = dict(max_seqlen_q=8, max_seqlen_k=8)
    q2, k2, v2 = q[0], k[0], v[0]
    good = torch.tensor([0, 3, 8], dtype=torch.int32, device=q.device)
    bad_offsets = [(good.long(), "int32")]
    if DEVICE == "cpu":  # on CUDA the values are asserted on the device (no sync), which no ValueError reports
        bad_offsets += [
            (torch.tensor([0, 5, 3], dtype=torch.int32, device=q.device), "non-decreasing"),
            (torch.tensor([0, 3, 7], dtype=torch.int32, device=q.device), "number of packed tokens"),
            (torch.tensor([1, 3, 8], dtype=torch.int32, device=q.device), r"\[0\] must be 0"),
        ]
    for bad, msg in bad_offsets:
        with pytest.raises(ValueError, match=msg):
            flash_attn_varlen_func(q2, k2, v2, cu_seqlens_q=bad, cu_seqlens_k=bad, **flat, backend="triton")
    with pytest.raises(ValueError, match="cu_seqlens_q shape"):
        flash_attn_varlen_func(q2, k2, v2, cu_seqlens_q=good, cu_seqlens_k=good[:2], **flat, backend="triton")
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="max_seqlen"):
            flash_attn_varlen_func(q2, k2, v2, cu_seqlens_q=good, cu_seqlens_k=good, max_seqlen_q=2, max_seqlen_k=8)


# ---- GPU, real sizes ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype,d,causal",
    [(torch.bfloat16, 128, True), (torch.bfloat16, 128, False), (torch.float16, 64, True), (torch.bfloat16, 64, False),
     (torch.bfloat16, 256, True)],
    ids=str,
)
def test_gpu_real_sizes(dtype, d, causal):
    torch.manual_seed(10)
    q, k, v = _qkv(2, 1000, 1000, 16, 4, d, dtype)
    _check_fwd_bwd(q, k, v, dtype, causal=causal)


@pytest.mark.gpu
def test_gpu_gqa_backward_repeats():
    """A GQA backward whose dK/dV are summed in shares (Qwen2-0.5B's heads at 2k tokens), repeated: the later calls
    replay a launch plan, which must sum the shares into the new gradients as the first call did, bit for bit
    (``deterministic``: the Triton backward, not Hopper's, whose dQ is summed with atomics)."""
    torch.manual_seed(13)
    q, k, v = _qkv(4, 2048, 2048, 14, 2, 64, torch.bfloat16)
    out = flash_attn_func(q, k, v, causal=True, deterministic=True, backend="triton")
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    for _ in range(3):
        for a, b in zip(first, torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    ref = flash_attn_func_ref(q, k, v, causal=True)
    for name, g, rg in zip(("dq", "dk", "dv"), first, torch.autograd.grad(ref, (q, k, v), dout)):
        assert_close(g, rg, torch.bfloat16, scale=GRAD_SCALE, name=name)


@pytest.mark.gpu
def test_gpu_features_real_sizes():
    torch.manual_seed(11)
    q, k, v = _qkv(2, 777, 1537, 8, 2, 128, torch.bfloat16)
    _check_fwd_bwd(q, k, v, torch.bfloat16, causal=True, window_size=(256, -1), softcap=30.0,
                   alibi_slopes=torch.rand(8, device=DEVICE))
    lens = [1000, 0, 1, 513, 2048]
    cu = torch.tensor([0] + lens, device=DEVICE).cumsum(0).int()
    qv, kv, vv = (torch.randn(sum(lens), h, 128, dtype=torch.bfloat16, device=DEVICE, requires_grad=True) for h in (8, 2, 2))
    _check_fwd_bwd(qv, kv, vv, torch.bfloat16, causal=True,
                   varlen_kwargs=dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=2048, max_seqlen_k=2048))


@pytest.mark.gpu
def test_gpu_dropout_matches_reference():
    torch.manual_seed(12)
    q, k, v = _qkv(2, 1024, 1024, 8, 8, 64, torch.bfloat16)
    out, _, rng_state = _fwd_op(q, k, v, causal=True, dropout_p=0.1)
    mask = dropout_keep_mask(rng_state, 2, 8, 1024, 1024, 0.1, device=DEVICE)
    ref = flash_attn_func_ref(q, k, v, causal=True, dropout_p=0.1, dropout_mask=mask)
    assert_close(out, ref, torch.bfloat16, name="out")
    dout = torch.randn_like(out)
    for name, g, rg in zip("qkv", torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        assert_close(g, rg, torch.bfloat16, scale=GRAD_SCALE, name="d" + name)
    rate = mask.float().mean().item()
    assert abs(rate - 0.9) < 1e-3
