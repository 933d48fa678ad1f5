"""The Hopper attention forward (Gluon, ``attention_hopper``): taken where it can run, equal to the reference
there (output, log-sum-exp, and the gradients of the backward it feeds), and passed over where it cannot. Its
kernel runs on a Hopper GPU only (Gluon has no interpreter); the CPU checks the reasons it gives."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flash_kernels import attention_hopper, flash_attn_func, flash_attn_varlen_func
from flash_kernels._testing import assert_close
from tests.kernels.test_attention import _check_fwd_bwd, _qkv

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(
    not HOPPER, reason="needs a Hopper GPU (compute capability 9.0): run on the device machine")
needs_gluon = pytest.mark.skipif(not attention_hopper.GLUON_AVAILABLE, reason="this Triton has no Gluon Hopper ops")
PLAIN = dict(cu_q=None, cu_k=None, max_k=0, causal=False, local=False, softcap=0.0, alibi=None, dropout_p=0.0,
             scale=0.125)


@pytest.fixture(autouse=True)
def eager_calls_of_any_size(monkeypatch):
    """The kernel tests run small, odd shapes eagerly: no eager size limit (``EAGER_MIN_FLOP``) for them."""
    monkeypatch.setattr(attention_hopper, "EAGER_MIN_FLOP", 0)


@pytest.fixture
def hopper_calls(monkeypatch):
    """The q shapes the Hopper forward was called with."""
    calls, real = [], attention_hopper.attention_forward

    def spy(q, *args, **kwargs):
        calls.append(tuple(q.shape))
        return real(q, *args, **kwargs)

    monkeypatch.setattr(attention_hopper, "attention_forward", spy)
    return calls


def test_reasons_on_the_cpu_and_for_unsupported_inputs():
    q = torch.randn(1, 512, 2, 128, dtype=torch.bfloat16)
    reason = attention_hopper.forward_unsupported(q, q, q, q, **PLAIN)
    assert "Hopper" in reason or "Gluon" in reason
    if HOPPER:
        g = q.cuda()
        assert attention_hopper.forward_unsupported(g, g, g, g, **PLAIN) is None
        short = g[:, :100, :, :64].contiguous()
        assert "fewer than 128 keys" in attention_hopper.forward_unsupported(short, short, short, short, **PLAIN)
        assert attention_hopper.forward_unsupported(g, g, g, g, **{**PLAIN, "causal": True}) is None
        assert "more queries than keys" in attention_hopper.forward_unsupported(
            torch.cat([g, g], 1), g, g, torch.cat([g, g], 1), **{**PLAIN, "causal": True})
        assert "window" in attention_hopper.forward_unsupported(g, g, g, g, **{**PLAIN, "causal": True, "local": True})
        assert "head dim" in attention_hopper.forward_unsupported(g[..., :32], g[..., :32], g[..., :32],
                                                                 g[..., :32].contiguous(), **PLAIN)
        heads_apart = torch.randn(1, 2, 512, 128, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
        assert "layout" in attention_hopper.forward_unsupported(heads_apart, g, g, g, **PLAIN)
        cu = torch.tensor([0, 200, 512], dtype=torch.int32, device="cuda")
        varlen = {**PLAIN, "cu_q": cu, "cu_k": cu}
        assert attention_hopper.forward_unsupported(g, g, g, g, **{**varlen, "max_k": 312}) is None  # 82% full
        assert "filling less than 80%" in attention_hopper.forward_unsupported(g, g, g, g, **{**varlen, "max_k": 512})
        assert "fewer than 128 keys" in attention_hopper.forward_unsupported(g, g, g, g, **{**varlen, "max_k": 100})
        assert "self-attention" in attention_hopper.forward_unsupported(g, g, g, g, **{**varlen, "cu_k": cu.clone(),
                                                                                       "max_k": 312})


def test_small_eager_calls_go_to_the_triton_forward_once_this_kernel_is_loaded(monkeypatch):
    """Eagerly, a call of under ``EAGER_MIN_FLOP`` goes to the Triton forward (its launch costs less host time),
    but only once this kernel has launched with the same specialization: the first such call loads it, so that
    a CUDA graph's capture of the call (which forbids loading a kernel) can take it. Captures and larger eager
    calls always take it. Causal halves the work; varlen counts every token against ``max_seqlen``."""
    monkeypatch.setattr(attention_hopper, "EAGER_MIN_FLOP", 2**35)
    monkeypatch.setattr(attention_hopper, "_launched", set())
    q = torch.randn(2, 600, 4, 128, dtype=torch.bfloat16)
    lse = torch.empty(2, 4, 600)
    args = (q, q, q, lse)
    assert not attention_hopper.leave_to_triton(*args, False, None, 600)  # never launched: this kernel first
    # What a launch on a Hopper GPU records, which the CPU cannot do:
    attention_hopper._launched.add(attention_hopper._specialization(
        q, q, lse, None, False, attention_hopper._launch_scalars(q, q, q, lse, False, None, 600)))
    assert attention_hopper.leave_to_triton(*args, False, None, 600)
    assert not attention_hopper.leave_to_triton(*args, True, None, 600)  # causal: another specialization
    # 592 rows, a multiple of 16 (600 is not): another specialization
    assert not attention_hopper.leave_to_triton(q[:, :592], q, q[:, :592], lse, False, None, 592)
    monkeypatch.setattr(attention_hopper, "EAGER_MIN_FLOP", 4 * 2 * 600 * 600 * 4 * 128)
    assert not attention_hopper.leave_to_triton(*args, False, None, 600)  # enough work
    monkeypatch.setattr(attention_hopper, "EAGER_MIN_FLOP", 2**35)
    monkeypatch.setattr(attention_hopper, "capturing_cuda_graph", lambda: True)
    assert not attention_hopper.leave_to_triton(*args, False, None, 600)
    big = torch.empty(1, 1, 1, 128).expand(32, 512, 16, 128)
    assert attention_hopper._matmul_flop(big, 512, causal=False) == 2**36
    assert attention_hopper._matmul_flop(big, 512, causal=True) == 2**35
    assert attention_hopper._matmul_flop(q[:1, :, :1], 700, causal=False) == 4 * 600 * 700 * 128


@pytest.mark.gpu
@needs_hopper
def test_gpu_a_capture_after_eager_calls_takes_this_kernel(hopper_calls, monkeypatch):
    """A small call: eagerly, the first launch is this kernel's (loading it), the second the Triton kernel's;
    captured into a CUDA graph after them, this kernel's, and the replay computes the graph's new inputs."""
    monkeypatch.setattr(attention_hopper, "EAGER_MIN_FLOP", 2**35)
    monkeypatch.setattr(attention_hopper, "_launched", set())
    torch.manual_seed(25)
    q, k, v = (torch.randn(3, 333, 4, 64, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    eager = [flash_attn_func(q, k, v) for _ in range(2)]
    assert hopper_calls == [(3, 333, 4, 64)]
    assert_close(eager[0], eager[1], torch.bfloat16, name="out")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        flash_attn_func(q, k, v)  # the warm-up a capture wants, on its side stream
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = flash_attn_func(q, k, v)
    assert hopper_calls == [(3, 333, 4, 64)] * 2
    for t in (q, k, v):
        t.copy_(torch.randn_like(t))
    graph.replay()
    previous = attention_hopper.use_hopper_forward(False)
    try:
        ref = flash_attn_func(q, k, v)
    finally:
        attention_hopper.use_hopper_forward(previous)
    assert_close(captured, ref, torch.bfloat16, name="out")


@needs_gluon
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_descriptors_view_the_rows_matrix_and_share_one_layout_per_box(dtype):
    """A packed qkv slice's descriptor: the (B * S, H * D) matrix with qkv's row stride, (rows, D) boxes, and the
    layout Gluon picks for them, one object for every launch (making it anew costs 15-18 us of host time)."""
    from triton.experimental.gluon import language as gl

    q = torch.zeros(1, 100, 3, 4, 64, dtype=dtype)[:, :, 0]
    desc = attention_hopper._descriptor(q, 64)
    assert (list(desc.shape), list(desc.strides), list(desc.block_shape)) == ([100, 256], [768, 1], [64, 64])
    assert desc.base.data_ptr() == q.data_ptr()
    gl_dtype = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    assert desc.layout == gl.NVMMASharedLayout.get_default_for([64, 64], gl_dtype)
    assert attention_hopper._descriptor(q[:, :50], 64).layout is desc.layout


def test_the_switch_returns_the_previous_setting():
    assert attention_hopper.use_hopper_forward(False) is True
    assert attention_hopper.enabled() is False
    assert attention_hopper.use_hopper_forward(True) is False
    assert attention_hopper.enabled() is True


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize(
    "b,sq,sk,hq,hkv,d,dtype",
    [(2, 1, 600, 4, 4, 128, torch.bfloat16), (3, 17, 4100, 4, 2, 64, torch.float16),
     (2, 113, 700, 8, 2, 128, torch.bfloat16), (2, 300, 513, 4, 1, 128, torch.float16),
     (1, 4096, 4096, 2, 2, 64, torch.bfloat16), (2, 2048, 2048, 16, 16, 128, torch.bfloat16),
     (2, 448, 512, 4, 2, 128, torch.bfloat16), (3, 150, 150, 4, 2, 64, torch.bfloat16)],
    ids=str,
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_forward_and_its_gradients_match_the_reference(hopper_calls, b, sq, sk, hq, hkv, d, dtype, causal):
    """Odd lengths (a partial last key tile, query rows past the end of a 128-row tile), Sq != Sk, GQA and MQA;
    the backward (the Triton kernels) reads this forward's log-sum-exp. Causal: the mask aligned bottom-right,
    an odd count of query blocks (300 rows: the middle block is a unit alone), and Sk - Sq = 64, where the last
    key tile lies wholly past the first warpgroup's rows."""
    torch.manual_seed(20)
    q, k, v = _qkv(b, sq, sk, hq, hkv, d, dtype)
    _check_fwd_bwd(q, k, v, dtype, causal=causal)
    assert hopper_calls == [(b, sq, hq, d)]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("d,dtype", [(128, torch.bfloat16), (64, torch.float16)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_varlen_self_attention_matches_the_reference(hopper_calls, monkeypatch, d, dtype, causal):
    """Packed sequences (BERT's path): empty ones (inside the batch and trailing), lengths that end inside a
    warpgroup's 64 rows (those rows are stored with ``gl.store``, not TMA), one shorter than a query tile, and
    max_seqlen above the longest. So uneven a batch is left to the Triton kernel by ``MIN_VARLEN_FILL``, set
    aside here: the kernel itself must be right on any lengths."""
    monkeypatch.setattr(attention_hopper, "MIN_VARLEN_FILL", 0.0)
    torch.manual_seed(23)
    lengths = [700, 0, 77, 1000, 128, 513, 0, 0]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device="cuda")
    total = int(cu[-1])
    q, k, v = (torch.randn(total, 4, d, dtype=dtype, device="cuda", requires_grad=True) for _ in range(3))
    varlen_kwargs = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1100, max_seqlen_k=1100)
    _check_fwd_bwd(q, k, v, dtype, varlen_kwargs=varlen_kwargs, causal=causal)
    assert hopper_calls == [(1, total, 4, d)]


@pytest.mark.gpu
@needs_hopper
def test_gpu_packed_qkv_slices_take_it_and_match_the_triton_forward(hopper_calls):
    """q, k, v as slices of one packed (B, S, 3, H, D) tensor (rows 3 * H * D apart), as a fused qkv projection
    gives them; the Triton forward of the same call agrees."""
    torch.manual_seed(21)
    qkv = torch.randn(4, 777, 3, 8, 128, dtype=torch.bfloat16, device="cuda")
    q, k, v = qkv.unbind(2)
    out, lse = flash_attn_func(q, k, v, return_lse=True)
    assert hopper_calls == [(4, 777, 8, 128)]
    previous = attention_hopper.use_hopper_forward(False)
    try:
        ref, ref_lse = flash_attn_func(q, k, v, return_lse=True)
    finally:
        attention_hopper.use_hopper_forward(previous)
    assert len(hopper_calls) == 1
    assert_close(out, ref, torch.bfloat16, name="out")
    assert_close(lse, ref_lse, torch.float32, scale=10, name="lse")


@pytest.mark.gpu
@needs_hopper
def test_gpu_a_repeated_call_launches_the_compiled_kernel_itself(monkeypatch):
    """The second call of a shape skips Triton's launch path (``_launch.lean_launch``, keyed on the descriptors'
    dtype, box and layout) and still reads its own tensors: new inputs at new addresses give their own output."""
    kernel = attention_hopper._attn_fwd_hopper_kernel
    torch.manual_seed(24)
    first, second = (torch.randn(2, 300, 3, 4, 64, dtype=torch.float16, device="cuda") for _ in range(2))
    flash_attn_func(*first.unbind(2))

    def refuse(*args, **kwargs):
        raise AssertionError("Triton's own launch path ran for a known launch")

    monkeypatch.setattr(kernel.jit, "run", refuse)
    out = flash_attn_func(*second.unbind(2))
    monkeypatch.undo()
    previous = attention_hopper.use_hopper_forward(False)
    try:
        ref = flash_attn_func(*second.unbind(2))
    finally:
        attention_hopper.use_hopper_forward(previous)
    assert_close(out, ref, torch.float16, name="out")


@pytest.mark.gpu
@needs_hopper
def test_gpu_other_inputs_keep_the_triton_forward(hopper_calls):
    """At a size the plain call takes this kernel for, every excluded feature keeps the Triton forward (varlen:
    separate query and key cu_seqlens); causal takes it where no row is left without keys."""
    torch.manual_seed(22)
    q, k, v = _qkv(2, 600, 600, 4, 4, 128, torch.bfloat16)
    flash_attn_func(q, k, v)
    flash_attn_func(q, k, v, causal=True)
    assert hopper_calls == [(2, 600, 4, 128)] * 2
    flash_attn_func(q, k, v, window_size=(64, 64))
    flash_attn_func(q, k, v, causal=True, window_size=(64, 0))
    flash_attn_func(torch.cat([q, q], 1), k, v, causal=True)
    flash_attn_func(q, k, v, dropout_p=0.1)
    flash_attn_func(q, k, v, softcap=30.0)
    flash_attn_func(q[..., :96].contiguous(), k[..., :96].contiguous(), v[..., :96].contiguous())
    cu = torch.tensor([0, 100, 1200], dtype=torch.int32, device="cuda")
    flat = [t.detach().reshape(1200, 4, 128) for t in (q, k, v)]
    flash_attn_varlen_func(*flat, cu_seqlens_q=cu, cu_seqlens_k=cu.clone(), max_seqlen_q=1100, max_seqlen_k=1100)
    assert len(hopper_calls) == 2


def test_the_forward_hands_over_when_the_kernel_can_run(monkeypatch):
    """The dispatch in ``attention``'s forward, on any device: where ``forward_unsupported`` says yes, the Hopper
    forward writes the output and the log-sum-exp that the call returns (and the backward reads), and no
    Triton launch happens; switched off, the Triton forward runs."""
    written = []

    def fake_forward(q, k, v, out, lse, scale, causal, cu_seqlens, max_seqlen):
        written.append(scale)
        out.fill_(0.5)
        lse.fill_(-3.0)
        return True

    monkeypatch.setattr(attention_hopper, "forward_unsupported", lambda *args, **kwargs: None)
    monkeypatch.setattr(attention_hopper, "attention_forward", fake_forward)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = (torch.randn(2, 9, 2, 64, dtype=torch.bfloat16, device=device) for _ in range(3))
    out, lse = flash_attn_func(q, k, v, softmax_scale=0.25, return_lse=True, backend="triton")
    assert written == [0.25]
    assert (out == 0.5).all() and (lse == -3.0).all() and lse.shape == (2, 2, 9)
    previous = attention_hopper.use_hopper_forward(False)
    try:
        out = flash_attn_func(q, k, v, softmax_scale=0.25, backend="triton")
    finally:
        attention_hopper.use_hopper_forward(previous)
    assert written == [0.25] and not (out == 0.5).all()


@needs_gluon
def test_a_triton_that_cannot_compile_the_kernel_leaves_attention_to_the_triton_forward(monkeypatch, caplog):
    """Gluon's API moves between Triton releases (3.7 renamed ``thread_barrier``): where this kernel does not
    compile, the call runs the Triton forward instead, and the kernel is off for the process, with a warning
    naming the Triton version and the compiler's message."""
    from triton.compiler.errors import CompilationError

    class Uncompilable:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise CompilationError(None, None, "module 'gluon.language' has no attribute 'thread_barrier'")
            return launch

    monkeypatch.setattr(attention_hopper, "forward_unsupported", lambda *args, **kwargs: None)
    monkeypatch.setattr(attention_hopper, "leave_to_triton", lambda *args, **kwargs: False)
    monkeypatch.setattr(attention_hopper, "_attn_fwd_hopper_kernel", Uncompilable())
    monkeypatch.setattr(attention_hopper, "sm_count", lambda device_index: 4)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(26)
    q, k, v = (torch.randn(2, 37, 2, 64, dtype=torch.bfloat16, device=device) for _ in range(3))
    previous = attention_hopper.use_hopper_forward(True)
    try:
        with caplog.at_level("WARNING", logger=attention_hopper.logger.name):
            out = flash_attn_func(q, k, v, backend="triton")
        assert not attention_hopper.enabled()
    finally:
        attention_hopper.use_hopper_forward(previous)
    assert "cannot compile the Hopper attention forward" in caplog.text and "thread_barrier" in caplog.text
    assert_close(out, flash_attn_func(q, k, v, backend="reference"), torch.bfloat16, name="out")


@needs_gluon
@pytest.mark.parametrize("d,causal,varlen", [(128, False, False), (64, True, True)], ids=str)
def test_the_kernel_compiles_for_hopper_with_this_triton(d, causal, varlen):
    """The kernel builds for sm_90 with the installed Triton (its Gluon API moves between releases), every flag
    covered by the two cases, and fits a Hopper SM's 227 KB of shared memory. Compiled without a GPU, in a fresh
    process without Triton's interpreter (``hopper_offline_compile``)."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "tests.kernels.hopper_offline_compile", str(d), str(int(causal)),
                           str(int(varlen))], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    shared = int(done.stdout.split("shared")[-1])
    assert 0 < shared <= 227 * 1024
