"""The attention forward's TMA load path (``TMA`` configs: Q, K, V tiles through device-side tensor descriptors).

TMA is an autotune choice, so ordinary calls may never reach it (under the interpreter, which never benchmarks,
only a forced launch takes its TMA tile); every test here forces it with ``attention._set_tma_loads("force")``
and checks, through the autotuner's recorded choice, that the launch did (or, for inputs TMA cannot address,
did not) take a TMA config. On the CPU the kernels run under Triton's interpreter, which implements descriptors
(zero fill outside the shape included); there a TMA launch and a plain one do the same arithmetic on the same
tile, so their outputs must be identical.
"""

import contextvars
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.utils.checkpoint
import triton

from flash_kernels import attention, attention_hopper, flash_attn_func, flash_attn_varlen_func
from flash_kernels._testing import assert_close
from flash_kernels.attention import dropout_keep_mask, flash_attn_func_ref, flash_attn_varlen_func_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float16, torch.bfloat16]

pytestmark = pytest.mark.skipif(
    not attention.TMA_AVAILABLE,
    reason=f"triton {triton.__version__} has no device-side tensor descriptors (tl.make_tensor_descriptor)",
)


def _on_tma_device():
    return DEVICE == "cpu" or torch.cuda.get_device_capability() >= (9, 0)


@pytest.fixture(autouse=True)
def _forced_tma():
    """TMA configs only, on the Triton forward: the Hopper (Gluon) forward switched off, since whether it takes
    a call can depend on the calls before it (``attention_hopper.leave_to_triton``: the first eager call of a
    specialization runs there), and a call it took would record no Triton config at all."""
    previous = attention._set_tma_loads("force")
    hopper_before = attention_hopper.use_hopper_forward(False)
    yield
    attention_hopper.use_hopper_forward(hopper_before)
    attention._set_tma_loads(previous)


def _launch(call, *, tma: bool):
    """call() with the forward's chosen configs forgotten first, so that what it records is this call's choice
    (the autotuner keeps its own, so nothing is tuned again); asserts each of its launches took TMA or not
    (never on a GPU without TMA, where these tests still check the answers)."""
    kernel = attention._attn_fwd_kernel
    kernel.chosen.clear()
    attention._FWD_PLANS.clear()
    result = call()
    used = {meta["TMA"] for meta, _ in kernel.chosen.values()}
    expected = tma and _on_tma_device()
    assert used == {expected}, f"forward launches took TMA = {used}, expected {expected}"
    return result


def _plain(call):
    """call() with plain loads only."""
    previous = attention._set_tma_loads("off")
    try:
        return _launch(call, tma=False)
    finally:
        attention._set_tma_loads(previous)


def _check(out, lse, ref, ref_lse, dtype):
    assert_close(out, ref, dtype, name="out")
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "lse: -inf rows differ from the reference"
    assert_close(lse[finite], ref_lse[finite], torch.float32, scale=10, name="lse")


def _same_as_plain(got, call):
    """Under the interpreter both paths compute on the same 16 x 16 tiles: the same bits, -inf rows included."""
    if DEVICE != "cpu":
        return
    for g, p in zip(got, _plain(call), strict=True):
        torch.testing.assert_close(g, p, rtol=0, atol=0)


def _qkv(b, sq, sk, hq, hkv, d, dtype):
    q = torch.randn(b, sq, hq, d, dtype=dtype, device=DEVICE)
    k, v = (torch.randn(b, sk, hkv, d, dtype=dtype, device=DEVICE) for _ in range(2))
    return q, k, v


def _on_a_new_thread(fn):
    """fn() on a thread of its own, which starts with an empty contextvars context; its exception is raised here."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn).result()


# ---- which launches may take TMA ------------------------------------------------------------------------------


def test_tma_flag_follows_the_mode_the_device_and_the_alignment():
    q, k, v = _qkv(2, 17, 17, 4, 2, 64, torch.float16)
    expected = attention._TMA_MUST if _on_tma_device() else attention._TMA_NO
    assert attention._tma_flag(q, k, v) == expected
    assert attention._tma_flag(q[:, 1:], k[:, 1:], v[:, 1:]) == expected  # whole rows off: still aligned
    storage = torch.randn(q.numel() + 1, dtype=q.dtype, device=DEVICE)
    assert attention._tma_flag(storage[1:].view_as(q), k, v) == attention._TMA_NO  # base 2 bytes off
    wide = torch.randn(2, 17, 4, 68, dtype=q.dtype, device=DEVICE)[..., :64]  # head stride 136 bytes
    assert attention._tma_flag(q, k, wide[:, :, :2]) == attention._TMA_NO
    packed = torch.randn(2, 17, 3, 4, 64, dtype=q.dtype, device=DEVICE)  # row stride 3 * 4 * 64 elements
    assert attention._tma_flag(*packed.unbind(2)) == expected
    attention._set_tma_loads("auto")
    assert attention._tma_flag(q, k, v) == (attention._TMA_MAY if _on_tma_device() else attention._TMA_NO)
    attention._set_tma_loads("off")
    assert attention._tma_flag(q, k, v) == attention._TMA_NO
    with pytest.raises(ValueError, match="mode must be one of"):
        attention._set_tma_loads("always")


def _config(m, n, tma, warps=4, stages=3):
    return triton.Config({"BLOCK_M": m, "BLOCK_N": n, "TMA": tma}, num_warps=warps, num_stages=stages)


@pytest.mark.parametrize("autotuned", [True, False])
def test_the_prune_picks_tma_configs_only_where_they_may_run(monkeypatch, autotuned):
    monkeypatch.setattr(attention, "_TMA_AUTOTUNED", autotuned)
    plain = [_config(128, 64, False), _config(64, 64, False), _config(64, 32, False, stages=2)]
    tma = [_config(128, 64, True, stages=2), _config(128, 128, True, warps=8)]

    def prune(flag, bd=128):
        return attention._prune_fwd(plain + tma, {"tma_ok": flag}, BLOCK_D=bd)

    big = [c for c in plain if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] > 64 * 32]
    assert prune(attention._TMA_NO) == big  # TMA cannot run: never a candidate
    assert prune(attention._TMA_MAY) == (big + tma if autotuned else big)
    assert prune(attention._TMA_MUST) == (tma if autotuned else tma[:1])
    for flag in (attention._TMA_NO, attention._TMA_MAY, attention._TMA_MUST):  # head dim 192 / 256: no TMA
        assert prune(flag, bd=256) == [plain[2]]


def test_the_scratch_allocator_is_installed_per_context_and_never_over_a_users():
    """Triton's allocator is a ContextVar (3.6 and 3.8): a new thread starts without one."""
    allocation = triton.runtime._allocation

    def current():
        return allocation._allocator.get() if hasattr(allocation._allocator, "get") else allocation._allocator

    def in_fresh_context(fn):
        return _on_a_new_thread(lambda: contextvars.Context().run(fn))

    def install():
        attention._ensure_scratch_allocator()
        return current()

    assert in_fresh_context(install) is attention._scratch_alloc

    def users_allocator(size, alignment, stream):
        raise AssertionError("never called here")

    def user_first():
        triton.set_allocator(users_allocator)
        return install()

    assert in_fresh_context(user_first) is users_allocator


# ---- forced TMA against the reference -------------------------------------------------------------------------


# (B, Sq, Sk, Hq, Hkv, D, causal, window, softcap, alibi)
CASES = [
    (2, 1, 1, 2, 2, 32, False, (-1, -1), 0.0, False),  # length 1
    (2, 17, 17, 4, 2, 64, True, (-1, -1), 0.0, False),  # GQA 2
    (1, 113, 113, 2, 1, 64, False, (-1, -1), 0.0, False),  # MQA
    (1, 17, 113, 4, 2, 64, True, (-1, -1), 0.0, False),  # Sq < Sk, bottom-right causal
    (1, 113, 17, 2, 2, 32, True, (-1, -1), 0.0, False),  # Sq > Sk: leading rows see no key
    (1, 113, 113, 2, 1, 64, False, (16, 7), 0.0, False),  # local window
    (1, 33, 33, 2, 2, 32, False, (-1, -1), 4.0, False),  # softcap
    (2, 33, 49, 4, 2, 32, True, (-1, -1), 0.0, True),  # ALiBi
    (1, 47, 61, 2, 2, 80, True, (-1, -1), 0.0, False),  # head dim 80 in a 128-wide tile: zero-filled columns
    (1, 49, 49, 2, 2, 64, True, (9, -1), 10.0, True),  # everything at once
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:7])) + f"-w{c[7]}-sc{c[8]}-al{c[9]}")
def test_forward_matches_reference(case, dtype):
    b, sq, sk, hq, hkv, d, causal, window, softcap, alibi = case
    q, k, v = _qkv(b, sq, sk, hq, hkv, d, dtype)
    kw = dict(causal=causal, window_size=window, softcap=softcap,
              alibi_slopes=torch.rand(b, hq, device=DEVICE) if alibi else None)

    def call():
        return flash_attn_func(q, k, v, **kw, return_lse=True, backend="triton")

    out, lse = _launch(call, tma=True)
    _check(out, lse, *flash_attn_func_ref(q, k, v, **kw, return_lse=True), dtype)
    _same_as_plain((out, lse), call)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_with_empty_sequences(causal, dtype):
    """Empty q and k sequences (a k extent of 0 gets a descriptor of one row, never read), GQA, Sq != Sk per
    sequence: each program's descriptor must stop at its own sequence's end, not read into the next one."""
    lens_q = [17, 0, 1, 40, 5]
    lens_k = [17, 3, 0, 40, 33]
    cu_q = torch.tensor([0] + lens_q, device=DEVICE).cumsum(0).int()
    cu_k = torch.tensor([0] + lens_k, device=DEVICE).cumsum(0).int()
    q = torch.randn(sum(lens_q), 4, 64, dtype=dtype, device=DEVICE)
    k, v = (torch.randn(sum(lens_k), 2, 64, dtype=dtype, device=DEVICE) for _ in range(2))
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=causal, return_lse=True)

    def call():
        return flash_attn_varlen_func(q, k, v, **kw, max_seqlen_q=40, max_seqlen_k=40, backend="triton")

    out, lse = _launch(call, tma=True)
    _check(out, lse, *flash_attn_varlen_func_ref(q, k, v, **kw), dtype)
    _same_as_plain((out, lse), call)


def test_views_of_packed_qkv_and_nan_beyond_the_sequences():
    """q, k, v as views of one (B, S, 3, H, D) buffer (row stride 3 * H * D), and varlen views of a buffer whose
    rows past the last sequence hold NaN: a row read past a sequence's end would bring NaN in (0 * NaN in P @ V)."""
    qkv = torch.randn(2, 113, 3, 4, 64, dtype=torch.float16, device=DEVICE)
    q, k, v = qkv.unbind(2)
    out, lse = _launch(lambda: flash_attn_func(q, k, v, causal=True, return_lse=True, backend="triton"), tma=True)
    _check(out, lse, *flash_attn_func_ref(q, k, v, causal=True, return_lse=True), torch.float16)
    lens = [17, 0, 113, 1]
    cu = torch.tensor([0] + lens, device=DEVICE).cumsum(0).int()
    total = sum(lens)
    padded = torch.full((total + 40, 3, 4, 64), float("nan"), dtype=torch.float16, device=DEVICE)
    padded[:total] = torch.randn(total, 3, 4, 64, dtype=torch.float16, device=DEVICE)
    q, k, v = padded[:total].unbind(1)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, return_lse=True)
    out, lse = _launch(lambda: flash_attn_varlen_func(q, k, v, **kw, max_seqlen_q=113, max_seqlen_k=113,
                                                      backend="triton"), tma=True)
    _check(out, lse, *flash_attn_varlen_func_ref(q, k, v, **kw), torch.float16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dropout_matches_reference_with_same_mask(dtype):
    p = 0.3
    q, k, v = _qkv(1, 37, 45, 4, 2, 32, dtype)
    # max_q, max_k, causal, scale, window left, right, softcap, alibi, dropout_p
    args = (None, None, 37, 45, True, 32**-0.5, -1, -1, 0.0, None, p)
    out, _, rng_state = _launch(lambda: torch.ops.flash_kernels.attn_fwd(q, k, v, *args), tma=True)
    mask = dropout_keep_mask(rng_state, 1, 4, 37, 45, p, device=DEVICE)
    assert_close(out, flash_attn_func_ref(q, k, v, causal=True, dropout_p=p, dropout_mask=mask), dtype, name="out")


def test_backward_after_a_tma_forward():
    """The backward (pointer loads) takes the TMA forward's output and lse."""
    q, k, v = (t.requires_grad_() for t in _qkv(1, 41, 41, 4, 2, 64, torch.bfloat16))
    out = _launch(lambda: flash_attn_func(q, k, v, causal=True, backend="triton"), tma=True)
    ref = flash_attn_func_ref(q, k, v, causal=True)
    assert_close(out, ref, torch.bfloat16, name="out")
    dout = torch.randn_like(out)
    for name, g, rg in zip("qkv", torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        assert_close(g, rg, torch.bfloat16, scale=2.0, name="d" + name)


def test_misaligned_inputs_take_the_plain_loads():
    """A q that starts 2 bytes into its buffer, and a k whose head stride is no multiple of 16 bytes: no TMA
    config may be chosen (a descriptor there would be invalid), and the answer is still right."""
    q, k, v = _qkv(2, 33, 33, 4, 2, 64, torch.float16)
    shifted = torch.randn(q.numel() + 1, dtype=q.dtype, device=DEVICE)[1:].view_as(q).copy_(q)
    wide = torch.randn(2, 33, 2, 68, dtype=k.dtype, device=DEVICE)
    wide[..., :64] = k
    ref = flash_attn_func_ref(q, k, v, causal=True, return_lse=True)
    for q_, k_ in ((shifted, k), (q, wide[..., :64])):

        def call(q_=q_, k_=k_):
            return flash_attn_func(q_, k_, v, causal=True, return_lse=True, backend="triton")

        out, lse = _launch(call, tma=False)
        _check(out, lse, *ref, torch.float16)


# ---- GPU, real sizes ------------------------------------------------------------------------------------------


def _needs_tma_gpu():
    if not _on_tma_device():
        pytest.skip("TMA needs compute capability 9.0 or newer")


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_dense_real_sizes(d, causal):
    _needs_tma_gpu()
    q, k, v = _qkv(2, 1000, 1000, 16, 4, d, torch.bfloat16)
    out, lse = _launch(lambda: flash_attn_func(q, k, v, causal=causal, return_lse=True, backend="triton"), tma=True)
    _check(out, lse, *flash_attn_func_ref(q, k, v, causal=causal, return_lse=True), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_varlen_real_sizes(d):
    _needs_tma_gpu()
    lens = [1000, 0, 1, 513, 2048, 128]
    cu = torch.tensor([0] + lens, device=DEVICE).cumsum(0).int()
    q, k, v = (torch.randn(sum(lens), h, d, dtype=torch.float16, device=DEVICE) for h in (8, 2, 2))
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, return_lse=True)
    out, lse = _launch(lambda: flash_attn_varlen_func(q, k, v, **kw, max_seqlen_q=2048, max_seqlen_k=2048,
                                                      backend="triton"), tma=True)
    _check(out, lse, *flash_attn_varlen_func_ref(q, k, v, **kw), torch.float16)


@pytest.mark.gpu
def test_gpu_misaligned_q_takes_the_plain_loads():
    q, k, v = _qkv(2, 1000, 1000, 8, 8, 128, torch.bfloat16)
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype, device=DEVICE)[1:].view_as(q).copy_(q)
    out = _launch(lambda: flash_attn_func(shifted, k, v, causal=True, backend="triton"), tma=False)
    assert_close(out, flash_attn_func_ref(q, k, v, causal=True), torch.bfloat16, name="out")


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_and_replay():
    """The descriptors' scratch is allocated at capture from the graph's pool; replays on new data are right."""
    _needs_tma_gpu()
    q, k, v = _qkv(2, 777, 777, 8, 2, 128, torch.bfloat16)
    _launch(lambda: flash_attn_func(q, k, v, causal=True, backend="triton"), tma=True)  # tune and compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_func(q, k, v, causal=True, backend="triton")
    for _ in range(2):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, flash_attn_func_ref(q, k, v, causal=True), torch.bfloat16, name="replayed out")


@pytest.mark.gpu
def test_gpu_forward_on_other_threads():
    """Triton's allocator is per thread (a ContextVar): a forward on a fresh thread, and one that autograd's
    worker re-runs for activation checkpointing, must install it there."""
    _needs_tma_gpu()
    q, k, v = (t.requires_grad_() for t in _qkv(2, 300, 300, 8, 2, 64, torch.bfloat16))
    out = _on_a_new_thread(lambda: flash_attn_func(q.detach(), k.detach(), v.detach(), causal=True, backend="triton"))
    ref = flash_attn_func_ref(q, k, v, causal=True)
    assert_close(out, ref, torch.bfloat16, name="out on a thread")
    out = torch.utils.checkpoint.checkpoint(lambda *t: flash_attn_func(*t, causal=True, backend="triton"), q, k, v,
                                            use_reentrant=False)
    dout = torch.randn_like(out)
    for name, g, rg in zip("qkv", torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        assert_close(g, rg, torch.bfloat16, scale=2.0, name="d" + name)
