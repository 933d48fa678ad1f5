"""rotary_kv_append: the fused decode-step kernel (the interpreter on CPU) against the two kernels it replaces
(apply_rotary, then kv_append) and against its reference, bit for bit (the reference's float32 results rounded as
the kernels round: see _round_as_kernels): layouts, partial rotary dim, GQA ratios, paged and per-row caches,
strided qkv and positions; qkv left alone; grad-mode fallback; named errors; torch.compile."""

import pytest
import torch

import flash_kernels as fk
from flash_kernels import apply_rotary, kv_append, rotary_kv_append, rotary_kv_append_ref
from flash_kernels._backend import triton_interpreter_enabled
from flash_kernels._testing import assert_close
from flash_kernels.kv_append import kv_append_ref
from flash_kernels.rotary import apply_rotary_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The kernels do the reference's float32 operations elementwise, compiled without contraction into FMAs
# (rotary.ROTATION_COMPILE_OPTIONS), so on a GPU as under the interpreter the reference is matched bit for bit.


def _round_as_kernels(t, dtype):
    """t.to(dtype) as the Triton kernels round: to nearest on a GPU, as torch does; toward zero under the
    interpreter, whose float32 -> bfloat16 cast drops the low 16 bits."""
    if triton_interpreter_enabled() and t.dtype == torch.float32 and dtype == torch.bfloat16:
        return (t.view(torch.int32) & -65536).view(torch.float32).to(dtype)  # exact: the low bits are zero
    return t.to(dtype)


def _oracle(qkv, cos, sin, pos, k_cache, v_cache, slots, table, hq, interleaved):
    """rotary_kv_append_ref, its float32 results rounded as the kernels round (_round_as_kernels): q and k to
    qkv's dtype (apply_rotary_ref's output), k and v then to the caches' (kv_append_ref's cast). Where the
    rounding is torch's this is the reference's own result."""
    hkv = (qkv.shape[2] - hq) // 2
    x32 = qkv.float()
    kw = dict(interleaved=interleaved, position_ids=pos)
    q = _round_as_kernels(apply_rotary_ref(x32[:, :, :hq], cos, sin, **kw), qkv.dtype)
    k = _round_as_kernels(apply_rotary_ref(x32[:, :, hq:hq + hkv], cos, sin, **kw), qkv.dtype)
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    k, v = _round_as_kernels(k.float(), k_cache.dtype), _round_as_kernels(qkv[:, :, hq + hkv:].float(), v_cache.dtype)
    kv_append_ref(k_cache, v_cache, k, v, slots, table)
    return q, k_cache, v_cache


def _inputs(B, S, hq, hkv, D, rotary_dim, dtype, *, paged, cache_dtype=None, positions=64, block_size=4, L=12):
    """A strided qkv (B, S, Hq + 2 * Hkv, D) view, cos/sin tables, non-contiguous positions, random caches (per-row
    (B, L, Hkv, D) or a paged pool with a shuffled block table) and distinct slots per row."""
    H = hq + 2 * hkv
    base = torch.randn(B, H + 3, S, D, device=DEVICE).to(dtype)
    qkv = base.transpose(1, 2)[:, :, 1:H + 1]  # strides on B, S and heads are all not the contiguous ones
    angles = torch.rand(positions, rotary_dim // 2, device=DEVICE) * 6.28
    cos, sin = angles.cos(), angles.sin()
    pos = torch.randint(0, positions, (S, B), device=DEVICE).t()  # arbitrary, and a transposed view
    cache_dtype = cache_dtype or dtype
    if paged:
        per_row = L // block_size
        num_blocks = B * per_row + 3
        shape = (num_blocks, block_size, hkv, D)
        table = torch.randperm(num_blocks, device=DEVICE)[:B * per_row].view(B, per_row).int()
    else:
        shape, table = (B, L, hkv, D), None
    k_cache = torch.randn(shape, device=DEVICE).to(cache_dtype)
    v_cache = torch.randn(shape, device=DEVICE).to(cache_dtype)
    slots = torch.stack([torch.randperm(L, device=DEVICE)[:S] for _ in range(B)]).int()
    return qkv, cos, sin, pos, k_cache, v_cache, slots, table


def _two_kernels(qkv, cos, sin, pos, k_cache, v_cache, slots, table, hq, interleaved):
    """What a decoder layer's decode step did before: rotate q and k of the packed qkv, then append k and v."""
    hkv = (qkv.shape[2] - hq) // 2
    qk = apply_rotary(qkv[:, :, :hq + hkv], cos, sin, interleaved=interleaved, position_ids=pos, backend="triton")
    kv_append(k_cache, v_cache, qk[:, :, hq:], qkv[:, :, hq + hkv:], slots, block_table=table, backend="triton")
    return qk[:, :, :hq]


def _check_against_reference_and_two_kernels(qkv, cos, sin, pos, k_cache, v_cache, slots, table, hq, interleaved):
    """The fused kernel's q and caches: bit for bit those of the two kernels it replaces, and of the reference
    (rounded as the kernels round: on a GPU, the reference itself). qkv is left as it was."""
    before = qkv.clone()
    kw = dict(position_ids=pos, num_q_heads=hq, block_table=table, interleaved=interleaved)
    kc, vc = k_cache.clone(), v_cache.clone()
    q = rotary_kv_append(qkv, cos, sin, k_cache=kc, v_cache=vc, slots=slots, backend="triton", **kw)
    assert torch.equal(qkv, before), "qkv was modified"
    assert q.shape == (*qkv.shape[:2], hq, qkv.shape[3]) and q.dtype == qkv.dtype
    got = {"q": q, "k_cache": kc, "v_cache": vc}

    two_kc, two_vc = k_cache.clone(), v_cache.clone()
    two = {"q": _two_kernels(qkv, cos, sin, pos, two_kc, two_vc, slots, table, hq, interleaved),
           "k_cache": two_kc, "v_cache": two_vc}
    ref_kc, ref_vc = k_cache.clone(), v_cache.clone()
    ref = {"q": rotary_kv_append_ref(qkv, cos, sin, k_cache=ref_kc, v_cache=ref_vc, slots=slots, **kw),
           "k_cache": ref_kc, "v_cache": ref_vc}
    oracle = dict(zip(("q", "k_cache", "v_cache"), _oracle(qkv, cos, sin, pos, k_cache, v_cache, slots, table, hq,
                                                           interleaved)))
    # the caches really changed at the slots (a kernel that wrote nothing could not pass)
    assert not torch.equal(ref_kc, k_cache) and not torch.equal(ref_vc, v_cache)
    for name in got:
        assert torch.equal(got[name], two[name]), f"{name} != the two-kernel path's"
        assert torch.equal(got[name], oracle[name]), f"{name} != the reference's"
        coarser = qkv.dtype if qkv.dtype != torch.float32 else got[name].dtype  # both roundings count
        assert_close(got[name], ref[name], coarser, name=name)
    return got


# (S, Hq, Hkv, D): one decode token and a 3-token chunk; GQA ratios 2, 6 and 1 (MHA)
SHAPES = [(1, 4, 2, 64), (3, 6, 1, 32), (3, 2, 2, 64), (1, 6, 1, 32)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("S,hq,hkv,D", SHAPES)
def test_triton_equals_reference_and_two_kernel_path(S, hq, hkv, D, partial, interleaved, paged, dtype):
    rotary_dim = D // 4 if partial else D
    qkv, cos, sin, pos, k_cache, v_cache, slots, table = _inputs(2, S, hq, hkv, D, rotary_dim, dtype, paged=paged)
    got = _check_against_reference_and_two_kernels(qkv, cos, sin, pos, k_cache, v_cache, slots, table, hq,
                                                   interleaved)
    if partial:  # channels past rotary_dim pass through: q's equal qkv's own
        assert torch.equal(got["q"][..., rotary_dim:], qkv[:, :, :hq, rotary_dim:])


@pytest.mark.parametrize("qkv_dtype,cache_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_cache_of_another_dtype_gets_the_same_roundings(qkv_dtype, cache_dtype):
    """k is rounded to qkv's dtype (apply_rotary's output) and then to the cache's (kv_append's cast); a bf16 qkv
    into a float32 cache shows whether the first rounding is kept."""
    qkv, cos, sin, pos, k_cache, v_cache, slots, table = _inputs(2, 3, 4, 2, 32, 32, qkv_dtype, paged=False,
                                                                 cache_dtype=cache_dtype)
    _check_against_reference_and_two_kernels(qkv, cos, sin, pos, k_cache, v_cache, slots, table, 4, False)


def test_reference_backend_is_the_reference():
    qkv, cos, sin, pos, k_cache, v_cache, slots, table = _inputs(2, 3, 6, 1, 32, 16, torch.float32, paged=True)
    kw = dict(position_ids=pos, num_q_heads=6, slots=slots, block_table=table, interleaved=True)
    k1, v1, k2, v2 = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    got = rotary_kv_append(qkv, cos, sin, k_cache=k1, v_cache=v1, backend="reference", **kw)
    want = rotary_kv_append_ref(qkv, cos, sin, k_cache=k2, v_cache=v2, **kw)
    assert torch.equal(got, want) and torch.equal(k1, k2) and torch.equal(v1, v2)


def test_input_needing_grad_runs_the_reference_or_is_refused():
    """No backward in the kernel: "auto" gives the reference's differentiable q; an explicit "triton" raises;
    under no_grad the kernel runs."""
    qkv, cos, sin, pos, k_cache, v_cache, slots, table = _inputs(1, 1, 4, 2, 32, 32, torch.float32, paged=False)
    qkv = qkv.detach().requires_grad_()
    kw = dict(position_ids=pos, k_cache=k_cache, v_cache=v_cache, slots=slots, num_q_heads=4)
    q = rotary_kv_append(qkv, cos, sin, backend="auto", **kw)
    assert q.requires_grad
    g = torch.randn_like(q)
    want = torch.autograd.grad(apply_rotary(qkv[:, :, :4], cos, sin, position_ids=pos, backend="reference"), qkv, g)
    assert torch.equal(torch.autograd.grad(q, qkv, g)[0], want[0])
    with pytest.raises(ValueError, match="needs gradients"):
        rotary_kv_append(qkv, cos, sin, backend="triton", **kw)
    with torch.no_grad():
        q = rotary_kv_append(qkv, cos, sin, backend="triton", **kw)
    assert not q.requires_grad


def _bad(**change):
    """Arguments for a good call (B=2, S=1, Hq=4, Hkv=2, D=32), with ``change`` applied."""
    qkv, cos, sin, pos, k_cache, v_cache, slots, _ = _inputs(2, 1, 4, 2, 32, 32, torch.float32, paged=False)
    args = dict(qkv=qkv, cos=cos, sin=sin, position_ids=pos, k_cache=k_cache, v_cache=v_cache, slots=slots,
                num_q_heads=4)
    args.update(change)
    return args


BAD = {
    "qkv heads": (lambda: _bad(qkv=torch.randn(2, 1, 9, 32)), r"qkv has 9 heads, expected .* = 8"),
    "D mismatch": (lambda: _bad(qkv=torch.randn(2, 1, 8, 64), cos=torch.randn(64, 32), sin=torch.randn(64, 32)),
                   "head dim 64 != the cache's 32"),
    "cos too wide": (lambda: _bad(cos=torch.randn(64, 17), sin=torch.randn(64, 17)),
                     r"17 columns, more than head_dim / 2 = 16"),
    "cos sin differ": (lambda: _bad(sin=torch.randn(64, 8)), "tables of one shape"),
    "slots shape": (lambda: _bad(slots=torch.zeros(2, 2, dtype=torch.int32)), r"slots must be integer \(B, S\)"),
    "slots dtype": (lambda: _bad(slots=torch.zeros(2, 1)), r"slots must be integer \(B, S\)"),
    "position_ids shape": (lambda: _bad(position_ids=torch.zeros(2, 3, dtype=torch.long)),
                           r"position_ids must be an integer \(B, S\) = \(2, 1\)"),
    "position_ids dtype": (lambda: _bad(position_ids=torch.zeros(2, 1)), "position_ids must be an integer"),
    "num_q_heads not a multiple": (lambda: _bad(qkv=torch.randn(2, 1, 7, 32), num_q_heads=3),
                                   "num_q_heads=3 must be a positive multiple of the cache's 2 kv heads"),
    "qkv not 4-D": (lambda: _bad(qkv=torch.randn(2, 8, 32)), r"qkv must be the packed projection"),
    "D not contiguous": (lambda: _bad(qkv=torch.randn(2, 1, 32, 8).transpose(2, 3)), "head dim must be contiguous"),
    "block_table dtype": (lambda: _bad(block_table=torch.zeros(2, 3)), "block_table must be int32"),
    "cache rows": (lambda: _bad(k_cache=torch.randn(3, 12, 2, 32), v_cache=torch.randn(3, 12, 2, 32)),
                   r"must be \(B, S, Hkv, D\) for a cache"),
}
if DEVICE == "cpu":  # values are checked off CUDA only (a host sync there): positions past the table, bad slots
    BAD.update({
        "position past the table": (lambda: _bad(position_ids=torch.tensor([[3], [64]])), "outside the cos/sin table"),
        "negative position": (lambda: _bad(position_ids=torch.tensor([[-1], [3]])), "outside the cos/sin table"),
        "slot past the row": (lambda: _bad(slots=torch.tensor([[0], [12]], dtype=torch.int32)), "outside the cache"),
        "negative slot": (lambda: _bad(slots=torch.tensor([[-1], [0]], dtype=torch.int32)), "outside the cache"),
    })


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("case", list(BAD))
def test_bad_inputs_are_named(case, backend):
    make, match = BAD[case]
    args = make()
    qkv, cos, sin = args.pop("qkv"), args.pop("cos"), args.pop("sin")
    with pytest.raises(ValueError, match=f"rotary_kv_append: .*{match}"):
        rotary_kv_append(qkv, cos, sin, backend=backend, **args)


def test_compile_fullgraph():
    """The custom op (mutating the caches) traces into one graph and gives the eager results."""
    qkv, cos, sin, pos, k_cache, v_cache, slots, table = _inputs(2, 1, 4, 2, 32, 16, torch.float32, paged=True)

    def step(qkv, k_cache, v_cache):
        q = rotary_kv_append(qkv, cos, sin, position_ids=pos, k_cache=k_cache, v_cache=v_cache, slots=slots,
                             num_q_heads=4, block_table=table, backend="triton")
        return q * 2

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager" if DEVICE == "cpu" else "inductor")
    k1, v1, k2, v2 = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    got, want = compiled(qkv, k1, v1), step(qkv, k2, v2)
    assert torch.equal(got, want) and torch.equal(k1, k2) and torch.equal(v1, v2)
    assert not torch.equal(k1, k_cache)


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("B", [1, 16])
def test_gpu_llama_1b_decode_step_equals_two_kernels(B, paged, pdl):
    """TinyLlama-1.1B's attention: Hq=32, Hkv=4, D=64, one new token per row, bf16; under programmatic launch
    too (the kernels then wait in-kernel for their predecessor)."""
    hq, hkv, D = 32, 4, 64
    qkv, cos, sin, pos, k_cache, v_cache, slots, table = _inputs(
        B, 1, hq, hkv, D, D, torch.bfloat16, paged=paged, positions=2048, block_size=256, L=2048)
    with fk.programmatic_launch(pdl):
        _check_against_reference_and_two_kernels(qkv, cos, sin, pos, k_cache, v_cache, slots, table, hq, False)
