"""apply_rotary: Triton kernel (the interpreter on CPU) against the reference: layouts, partial rotary dim,
int / per-batch offsets, position_ids, varlen, in place, the backward and torch.compile."""

import importlib

import pytest
import torch

from flash_kernels import apply_rotary
from flash_kernels._testing import assert_close

rot = importlib.import_module("flash_kernels.rotary")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [(torch.float32, 1.0), (torch.float16, 1.0), (torch.bfloat16, 1.0)]


def _tables(rotary_dim, positions=64):
    angles = torch.rand(positions, rotary_dim // 2, device=DEVICE) * 6.28
    return angles.cos(), angles.sin()


def _check(x, cos, sin, dtype, scale, **kw):
    out = apply_rotary(x, cos, sin, backend="triton", **kw)
    ref = rot.apply_rotary_ref(x, cos, sin, **kw)
    assert_close(out, ref, dtype, scale=scale, name="out")
    g = torch.randn_like(ref)
    got, want = torch.autograd.grad(out, x, g)[0], torch.autograd.grad(ref, x, g)[0]
    assert_close(got, want, dtype, scale=scale, name="grad")
    return ref


@pytest.mark.parametrize("dtype,scale", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [24, 16])
def test_layouts_and_partial_dim(dtype, scale, interleaved, rotary_dim):
    x = torch.randn(2, 13, 3, 24, dtype=dtype, device=DEVICE, requires_grad=True)
    cos, sin = _tables(rotary_dim)
    _check(x, cos, sin, dtype, scale, interleaved=interleaved, seqlen_offsets=5)


@pytest.mark.parametrize("positions", ["tensor_offsets", "position_ids"])
def test_positions(positions):
    x = torch.randn(3, 11, 2, 16, device=DEVICE, requires_grad=True)
    cos, sin = _tables(16)
    if positions == "tensor_offsets":
        kw = dict(seqlen_offsets=torch.tensor([0, 7, 30], device=DEVICE))
    else:
        kw = dict(position_ids=torch.randint(0, 64, (3, 11), device=DEVICE))
    _check(x, cos, sin, torch.float32, 1.0, **kw)


@pytest.mark.parametrize("offsets", [3, "tensor"])
def test_varlen(offsets):
    cu = torch.tensor([0, 5, 12, 20], device=DEVICE)
    x = torch.randn(20, 3, 16, device=DEVICE, requires_grad=True)
    cos, sin = _tables(16)
    off = torch.tensor([1, 2, 3], device=DEVICE) if offsets == "tensor" else offsets
    _check(x, cos, sin, torch.float32, 1.0, cu_seqlens=cu, seqlen_offsets=off, interleaved=True)


def test_inplace_and_non_contiguous_heads():
    qkv = torch.randn(2, 9, 3, 4, 32, device=DEVICE)  # a packed qkv: q and k are strided views
    cos, sin = _tables(32)
    q = qkv[:, :, 0]
    ref = rot.apply_rotary_ref(q, cos, sin)
    out = apply_rotary(q, cos, sin, inplace=True, backend="triton")
    assert out.data_ptr() == q.data_ptr()
    assert_close(qkv[:, :, 0], ref, torch.float32, name="inplace")
    # In place with autograd: computed out of place and copied back, gradient still correct.
    base = torch.randn(2, 9, 4, 32, device=DEVICE, requires_grad=True)
    y = base * 1.0
    apply_rotary(y, cos, sin, inplace=True, backend="triton")
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, base, g)[0]
    want = torch.autograd.grad(rot.apply_rotary_ref(base, cos, sin), base, g)[0]
    assert_close(got, want, torch.float32, name="inplace grad")


@pytest.mark.parametrize("rotary_dim", [32, 16])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_num_rotated_heads_rotates_q_and_k_of_a_packed_qkv(backend, rotary_dim):
    """A heads-concatenated qkv [q (3) | k (1) | v (1)]: q and k heads rotate, v passes through, and so does
    its gradient."""
    qkv = torch.randn(2, 9, 5, 32, device=DEVICE, requires_grad=True)
    cos, sin = _tables(rotary_dim)
    pos = torch.randint(0, 64, (2, 9), device=DEVICE)
    out = apply_rotary(qkv, cos, sin, position_ids=pos, num_rotated_heads=4, backend=backend)
    ref = torch.cat((rot.apply_rotary_ref(qkv[:, :, :4], cos, sin, position_ids=pos), qkv[:, :, 4:]), dim=2)
    assert_close(out, ref, torch.float32, name="out")
    assert torch.equal(out[:, :, 4:], qkv[:, :, 4:])
    g = torch.randn_like(ref)
    got, want = torch.autograd.grad(out, qkv, g)[0], torch.autograd.grad(ref, qkv, g)[0]
    assert_close(got, want, torch.float32, name="grad")
    assert torch.equal(got[:, :, 4:], g[:, :, 4:])
    with torch.no_grad():  # in place without autograd: only the rotated heads change
        copy = qkv.detach().clone()
        apply_rotary(copy, cos, sin, position_ids=pos, num_rotated_heads=4, inplace=True, backend=backend)
    assert_close(copy, ref, torch.float32, name="inplace")
    with pytest.raises(ValueError, match="num_rotated_heads=6 must be in"):
        apply_rotary(qkv, cos, sin, num_rotated_heads=6, backend=backend)


@pytest.mark.parametrize("rotated", [0, 3])
def test_heads_passed_through_are_copied_bit_for_bit(rotated):
    """The heads past num_rotated_heads come out exactly as they went in, non-finite values and bf16 included
    (the kernel copies them; it does not rotate them by a zero angle)."""
    qkv = torch.randn(2, 7, 5, 16, device=DEVICE, dtype=torch.bfloat16)
    qkv[0, 1, 4, 3], qkv[1, 2, 3, 0], qkv[1, 5, 4, 9] = float("inf"), float("nan"), -float("inf")
    cos, sin = _tables(16)
    out = apply_rotary(qkv, cos, sin, num_rotated_heads=rotated, backend="triton")
    assert torch.equal(out[:, :, rotated:].view(torch.int16), qkv[:, :, rotated:].view(torch.int16))
    assert_close(out[:, :, :rotated], rot.apply_rotary_ref(qkv[:, :, :rotated], cos, sin), torch.bfloat16)


def test_backward_is_inverse_rotation():
    """With no cos/sin gradients, the backward is the rotation by -sin: it undoes the forward."""
    x = torch.randn(2, 7, 2, 16, device=DEVICE, requires_grad=True)
    cos, sin = _tables(16)
    y = apply_rotary(x, cos, sin, backend="triton")
    back = torch.autograd.grad(y, x, y.detach())[0]  # the backward of y itself: R^T (R x), x again
    assert_close(back, x.detach(), torch.float32, name="inverse")


def test_compile_fullgraph():
    def attn_in(q, k, cos, sin):
        return apply_rotary(q, cos, sin, backend="triton"), apply_rotary(k, cos, sin, interleaved=True, backend="triton")

    q = torch.randn(2, 9, 4, 16, device=DEVICE, requires_grad=True)
    k = torch.randn(2, 9, 2, 16, device=DEVICE, requires_grad=True)
    cos, sin = _tables(16)
    compiled = torch.compile(attn_in, fullgraph=True, backend="aot_eager" if DEVICE == "cpu" else "inductor")
    got, want = compiled(q, k, cos, sin), attn_in(q, k, cos, sin)
    for g, w in zip(got, want):
        assert_close(g, w, torch.float32)
    sum(t.sum() for t in got).backward()
    assert q.grad is not None and k.grad is not None


def test_bad_inputs():
    cos, sin = _tables(16, positions=8)
    with pytest.raises(ValueError, match="exceeds head dim"):
        apply_rotary(torch.randn(1, 4, 2, 8), cos, sin, backend="triton")
    with pytest.raises(ValueError, match="cos/sin table"):
        apply_rotary(torch.randn(1, 6, 2, 16), cos, sin, seqlen_offsets=4, backend="triton")
    with pytest.raises(ValueError, match="differ in shape"):
        apply_rotary(torch.randn(1, 4, 2, 16), cos, sin[:, :4], backend="triton")
    with pytest.raises(ValueError, match="expected x"):
        apply_rotary(torch.randn(4, 2, 16), cos, sin, backend="triton")


@pytest.mark.gpu
def test_gpu_llama7b_size():
    x = torch.randn(4, 4096, 32, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    cos, sin = _tables(128, positions=8192)
    _check(x, cos, sin, torch.bfloat16, 1.0, seqlen_offsets=torch.tensor([0, 10, 100, 1000], device="cuda"))


def test_float64_reference_keeps_float64_precision():
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64, requires_grad=True)
    angles = torch.rand(16, 3, dtype=torch.float64) * 6.28
    cos, sin = angles.cos(), angles.sin()
    torch.autograd.gradcheck(lambda t: apply_rotary(t, cos, sin, seqlen_offsets=2, backend="reference"), (x,))
    out = apply_rotary(x, cos, sin, backend="reference")
    x1, x2, rest = x[..., :3], x[..., 3:6], x[..., 6:]
    c, s = cos[:5, None], sin[:5, None]
    want = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c, rest), dim=-1)
    assert (out - want).abs().max() < 1e-12


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_positions_outside_the_table_are_refused(backend):
    """Out-of-table positions would index past the table (an IndexError, a silent wrap for negative ones, or zeros
    from the kernel): every form of positions is checked, and malformed offsets are named."""
    x = torch.randn(2, 3, 2, 8, device=DEVICE)
    cos, sin = _tables(8, positions=8)
    bad = {
        "outside the cos/sin table": [dict(position_ids=torch.tensor([[0, 1, 8], [0, 1, 2]], device=DEVICE)),
                                      dict(position_ids=torch.tensor([[0, 1, -1], [0, 1, 2]], device=DEVICE)),
                                      dict(seqlen_offsets=torch.tensor([0, 6], device=DEVICE))],
        "must be integer positions": [dict(position_ids=torch.zeros(2, 3, device=DEVICE))],
        "one integer offset per sequence": [dict(seqlen_offsets=torch.tensor([0, 1, 2], device=DEVICE)),
                                            dict(seqlen_offsets=torch.tensor([0.0, 1.0], device=DEVICE))],
        "must be >= 0": [dict(seqlen_offsets=-1)],
    }
    for message, cases in bad.items():
        for kw in cases:
            with pytest.raises(ValueError, match=message):
                apply_rotary(x, cos, sin, backend=backend, **kw)
    packed = torch.randn(12, 2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="outside the cos/sin table"):  # a sequence of 10 tokens
        apply_rotary(packed, cos, sin, cu_seqlens=torch.tensor([0, 2, 12], dtype=torch.int32, device=DEVICE),
                     backend=backend)
    with pytest.raises(ValueError, match="end at the 12 tokens"):
        apply_rotary(packed, cos, sin, cu_seqlens=torch.tensor([0, 2, 5], dtype=torch.int32, device=DEVICE),
                     backend=backend)


def test_kernel_reads_no_cos_sin_row_outside_the_table():
    """Positions are not checked on CUDA (a host sync): there the kernel loads nothing for a position outside
    the table, negative ones included, and the rotary channels come out zero instead of rotating by whatever
    memory lies before or after the table."""
    x = torch.randn(1, 4, 2, 8, device=DEVICE)
    cos, sin = _tables(8, positions=8)
    positions = torch.tensor([-3, -1, 8, 5], device=DEVICE)
    out = rot._rotary(x, cos, sin, positions, None, 0, False, False, 2)
    assert torch.equal(out[0, :3], torch.zeros_like(out[0, :3]))
    want = rot.apply_rotary_ref(x[:, 3:], cos, sin, position_ids=torch.tensor([[5]], device=DEVICE))
    assert_close(out[:, 3:], want, torch.float32)
