"""The Hopper attention backward (Gluon, ``attention_hopper_bwd``): equal to the reference where it runs, taken
only where ``backward_unsupported`` allows, never where a deterministic backward was asked for, and handing over
to the Triton backward where this Triton cannot build it. Its kernel runs on a Hopper GPU only; the CPU checks the
dispatch, the PTX rewrite that gives Triton 3.6 its TMA reduce-add, and an offline sm_90 compile."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flash_kernels import attention_hopper, attention_hopper_bwd as bwd
from flash_kernels import flash_attn_func, flash_attn_qkvpacked_func
from flash_kernels._testing import assert_close
from tests.kernels.test_attention import GRAD_SCALE, _qkv
# (the autouse fixture lifts the eager size limit here too)
from tests.kernels.test_attention_hopper import HOPPER, eager_calls_of_any_size, needs_gluon, needs_hopper  # noqa: F401

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PLAIN = dict(varlen=False, causal=False, local=False, softcap=0.0, alibi=None, dropout_p=0.0, scale=0.125,
             deterministic=False)


@pytest.fixture
def backward_calls(monkeypatch):
    """The q shapes the Hopper backward ran for."""
    calls, real = [], bwd.attention_backward

    def spy(q, *args, **kwargs):
        done = real(q, *args, **kwargs)
        if done:
            calls.append(tuple(q.shape))
        return done

    monkeypatch.setattr(bwd, "attention_backward", spy)
    return calls


def _reason(q, k=None, **kw):
    k = q if k is None else k
    return bwd.backward_unsupported(q, k, k, q, k, k, **{**PLAIN, **kw})


def test_reasons_name_what_keeps_the_triton_backward():
    q = torch.randn(1, 1024, 2, 128, dtype=torch.bfloat16)
    assert "varlen" in _reason(q, varlen=True)
    assert "deterministic" in _reason(q, deterministic=True)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert "deterministic" in _reason(q)
    finally:
        torch.use_deterministic_algorithms(was)
    assert "head dim 96 (this kernel has head dims 64 and 128)" in _reason(q[..., :96])
    assert "fewer than 512 keys" in _reason(q, q[:, :500])
    assert "fewer than 1024 keys causal" in _reason(q[:, :1000], causal=True)
    assert "fewer than 1024 keys" in _reason(q[..., :64], q[:, :1000, :, :64])
    assert "fewer than 2048 keys causal" in _reason(q[..., :64], causal=True)
    assert "Hopper" in _reason(q) or "Gluon" in _reason(q)  # the CPU (or another GPU)
    previous = bwd.use_hopper_backward(False)
    try:
        assert "switched off" in _reason(q)
    finally:
        assert bwd.use_hopper_backward(previous) is False
    if HOPPER:
        g = q.cuda()
        assert _reason(g) is None
        assert _reason(g, causal=True) is None
        g64 = g[..., :64].contiguous()
        assert _reason(g64) is None
        assert _reason(g64, torch.cat([g64, g64], 1), causal=True) is None
        assert "window" in _reason(g, local=True)
        assert "last dim" in bwd.backward_unsupported(g, g, g, g, g.transpose(2, 3), g, **PLAIN)


def test_the_ptx_rewrite_makes_the_dq_store_a_reduce_add():
    store = "\t@%p63 cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%rd1, {%r961, %r962}], [%r963];\n"
    text = "ld.shared.f32 %f1, [%r2];\n" + store + "cp.async.bulk.commit_group;\n"
    rewritten = bwd.rewrite_ptx(text)
    assert "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%rd1, {%r961, %r962}]" in rewritten
    assert "cp.async.bulk.tensor" not in rewritten and rewritten.count("\n") == text.count("\n")
    with pytest.raises(bwd.PtxRewriteError, match="no 'cp.async.bulk.tensor"):
        bwd.rewrite_ptx("ld.shared.f32 %f1, [%r2];\n")


@needs_gluon
def test_the_hook_rewrites_this_kernel_only_and_keeps_an_earlier_hook(monkeypatch):
    """On Triton 3.6 the hook wraps the PTX stage for the backward kernel only, after running any hook that was
    installed before it; installing it twice wraps once."""
    seen = []

    def earlier(backend, stages, options, language, capability):
        seen.append(capability)

    monkeypatch.setattr(bwd.triton.knobs.runtime, "add_stages_inspection_hook", earlier)
    bwd._install_reduce_hook()
    hook = bwd.triton.knobs.runtime.add_stages_inspection_hook
    bwd._install_reduce_hook()
    assert bwd.triton.knobs.runtime.add_stages_inspection_hook is hook
    store = "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%rd1, {%r1, %r2}], [%r3];"
    stages = {"ptx": lambda src, metadata: store}
    hook(None, stages, None, None, 90)
    assert seen == [90]
    assert "cp.reduce.async.bulk" in stages["ptx"](None, {"name": "_attn_bwd_hopper_kernel"})
    assert stages["ptx"](None, {"name": "_attn_fwd_hopper_kernel"}) == store


def test_a_compiled_kernel_without_the_reduce_add_is_refused(monkeypatch, caplog):
    """The check after a first launch: PTX with the TMA store still in it means a wrong dQ, so the kernel is
    switched off (with a warning) and the caller's Triton backward writes the gradients."""
    monkeypatch.setattr(bwd, "_checked", bwd.weakref.WeakSet())

    class Compiled:
        def __init__(self, ptx):
            self.asm = {"ptx": ptx}

    # _reduces and _give_up are the check a first launch on a Hopper GPU runs: here without one.
    assert bwd._reduces(Compiled("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%rd1];"))
    assert not bwd._reduces(Compiled("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%rd1];"))
    previous = bwd.use_hopper_backward(True)
    try:
        with caplog.at_level("WARNING", logger=bwd.logger.name):
            assert bwd._give_up("the Hopper attention backward compiled without its dQ reduce-add", "why") is False
        assert "without its dQ reduce-add" in caplog.text
        assert "switched off" in _reason(torch.randn(1, 1024, 2, 128, dtype=torch.bfloat16))
    finally:
        bwd.use_hopper_backward(previous)


def _spy_dispatch(monkeypatch):
    """Records the ``deterministic`` each backward asks ``backward_unsupported`` with; the Triton backward runs."""
    asked = []

    def unsupported(*args, deterministic, **kwargs):
        asked.append(deterministic)
        return "recorded"

    monkeypatch.setattr(bwd, "backward_unsupported", unsupported)
    return asked


@pytest.mark.parametrize("packed", [False, True], ids=["qkv", "packed"])
def test_deterministic_reaches_the_backward(monkeypatch, packed):
    """``deterministic=True`` travels with the forward's inputs to the backward's dispatch (FA2's flag: it keeps
    the atomics-free Triton backward), eagerly and through the custom ops."""
    asked = _spy_dispatch(monkeypatch)
    torch.manual_seed(30)
    for deterministic in (False, True):
        if packed:
            qkv = torch.randn(1, 19, 3, 2, 32, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
            out = flash_attn_qkvpacked_func(qkv, deterministic=deterministic, backend="triton")
            out.sum().backward()
        else:
            q, k, v = (t.requires_grad_() for t in _qkv(1, 19, 23, 2, 1, 32, torch.bfloat16))
            out = flash_attn_func(q, k, v, deterministic=deterministic, backend="triton")
            out.sum().backward()
    q, k, v = (t.requires_grad_() for t in _qkv(1, 19, 23, 2, 1, 32, torch.bfloat16))
    # cu_q, cu_k, max_q, max_k, causal, scale, window left, right, softcap, alibi, dropout_p, deterministic
    op_args = (None, None, 19, 23, False, 32**-0.5, -1, -1, 0.0, None, 0.0, True)
    out, _, _ = torch.ops.flash_kernels.attn_fwd(q, k, v, *op_args)
    out.sum().backward()
    assert asked == [False, True, True]


def test_a_backward_it_cannot_build_hands_over_to_the_triton_backward(monkeypatch):
    """Where the Hopper backward returns False (this Triton cannot compile it), the Triton backward writes the
    gradients, equal to the reference."""
    tried = []

    def cannot_build(q, *args):
        tried.append(tuple(q.shape))
        return False

    monkeypatch.setattr(bwd, "backward_unsupported", lambda *args, **kwargs: None)
    monkeypatch.setattr(bwd, "leave_to_triton", lambda *args: False)
    monkeypatch.setattr(bwd, "attention_backward", cannot_build)
    torch.manual_seed(31)
    q, k, v = (t.requires_grad_() for t in _qkv(2, 21, 30, 4, 2, 64, torch.float16))
    out = flash_attn_func(q, k, v, backend="triton")
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = flash_attn_func(q, k, v, backend="reference")
    for name, g, r in zip(("dq", "dk", "dv"), grads, torch.autograd.grad(ref, (q, k, v), dout)):
        assert_close(g, r, torch.float16, scale=GRAD_SCALE, name=name)
    assert tried == [(2, 21, 4, 64)]


def test_small_eager_calls_go_to_the_triton_backward_once_this_kernel_is_loaded(monkeypatch):
    monkeypatch.setattr(attention_hopper, "EAGER_MIN_FLOP", 2**35)
    monkeypatch.setattr(bwd, "_launched", set())
    q = torch.randn(1, 1024, 2, 128, dtype=torch.bfloat16)  # 2^30 FLOPs
    lse = torch.empty(1, 2, 1024)
    args = (q, q, lse, q, q)
    assert not bwd.leave_to_triton(*args, False)  # never launched: this kernel first
    bwd._launched.add(bwd._specialization(q, lse, q, q, False, bwd._launch_scalars(*args, 64)))  # a GPU launch's record
    assert bwd.leave_to_triton(*args, False)
    unaligned = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)  # a 2-byte offset: not 16-aligned
    assert not bwd.leave_to_triton(q, q, lse, q, unaligned, False)  # another specialization, not loaded
    monkeypatch.setattr(attention_hopper, "EAGER_MIN_FLOP", 2**29)
    assert not bwd.leave_to_triton(*args, False)


@needs_gluon
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_the_kernel_compiles_for_hopper_with_this_triton(head_dim, causal):
    """The backward builds for sm_90 with the installed Triton (Triton 3.6 through the PTX rewrite, 3.7+ with
    Gluon's TMA reduce-add), sums dQ with a TMA reduce-add, and fits a Hopper SM's 227 KB of shared memory, at
    each head dim with its own tiles; the causal variant too (its own code: query tiles walked
    last-first, heads launched in groups)."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "tests.kernels.hopper_offline_compile", str(head_dim), str(int(causal)), "bwd"]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("reduce-add True"), done.stdout
    shared = int(done.stdout.split("shared")[-1].split()[0])
    assert 0 < shared <= 227 * 1024


# ---- on a Hopper GPU ---------------------------------------------------------------------------------------


def _direct_grads(q, k, v, dout, causal):
    """The kernel called directly (any head dim, mask or length it supports), from this library's forward."""
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True, backend="triton")
    delta = (out.float() * dout.float()).sum(-1).transpose(1, 2).contiguous()
    grads = tuple(torch.empty_like(t) for t in (q, k, v))
    assert bwd.attention_backward(q, k, v, dout, lse, delta, *grads, q.shape[-1] ** -0.5, causal)
    return grads


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize(
    "b,sq,sk,hq,hkv,d,dtype",
    [(2, 300, 513, 4, 2, 128, torch.bfloat16), (3, 77, 700, 4, 1, 64, torch.float16),
     (2, 1000, 1000, 4, 4, 128, torch.float16), (1, 1, 129, 2, 2, 128, torch.bfloat16),
     (2, 448, 512, 8, 2, 128, torch.bfloat16)],
    ids=str,
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_the_kernel_matches_the_reference(b, sq, sk, hq, hkv, d, dtype, causal):
    """Odd lengths (partial key blocks and query tiles, a single query row), Sq != Sk, GQA and MQA, both head
    dims, causal aligned bottom-right: dQ, dK and dV against the reference's autograd."""
    torch.manual_seed(32)
    q, k, v = (t.requires_grad_() for t in _qkv(b, sq, sk, hq, hkv, d, dtype))
    dout = torch.randn_like(q)
    grads = _direct_grads(q.detach(), k.detach(), v.detach(), dout, causal)
    ref = flash_attn_func(q, k, v, causal=causal, backend="reference")
    for name, g, r in zip(("dq", "dk", "dv"), grads, torch.autograd.grad(ref, (q, k, v), dout)):
        assert_close(g, r, dtype, scale=GRAD_SCALE, name=name)


@pytest.mark.gpu
@needs_hopper
def test_gpu_attention_takes_it_where_it_should(backward_calls):
    """flash_attn_func's backward runs here from ``MIN_KEYS`` keys: head dim 128 (a GQA call with a partial last
    key block, a packed qkv's strided slices, a causal call with Sq < Sk) and head dim 64, matching the
    reference; deterministic calls, and causal or head dim 64 calls with fewer keys, keep the Triton backward."""
    torch.manual_seed(33)
    dtype = torch.bfloat16

    def check(q, k, v, **kwargs):
        out = flash_attn_func(q, k, v, backend="triton", **kwargs)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        ref = flash_attn_func(q, k, v, backend="reference", **kwargs)
        for name, g, r in zip(("dq", "dk", "dv"), grads, torch.autograd.grad(ref, (q, k, v), dout)):
            assert_close(g, r, dtype, scale=GRAD_SCALE, name=name)

    q, k, v = (t.requires_grad_() for t in _qkv(2, 333, 1100, 8, 2, 128, dtype))
    check(q, k, v)
    assert backward_calls == [(2, 333, 8, 128)]
    qkv = torch.randn(1, 1024, 3, 4, 128, dtype=dtype, device="cuda", requires_grad=True)
    out = flash_attn_qkvpacked_func(qkv, backend="triton")
    (dqkv, ) = torch.autograd.grad(out, qkv, torch.ones_like(out))
    ref = flash_attn_qkvpacked_func(qkv, backend="reference")
    assert_close(dqkv, torch.autograd.grad(ref, qkv, torch.ones_like(ref))[0], dtype, scale=GRAD_SCALE, name="dqkv")
    assert len(backward_calls) == 2
    check(*(t[..., :64].detach().contiguous().requires_grad_() for t in (q, k, v)))  # head dim 64, 1100 keys
    assert backward_calls[2:] == [(2, 333, 8, 64)]
    check(*(t.requires_grad_() for t in _qkv(1, 200, 2100, 4, 2, 128, dtype)), causal=True)
    assert backward_calls[3:] == [(1, 200, 4, 128)]
    # Kept by the Triton backward: deterministic, causal under 1024 keys, head dim 64 causal under 2048.
    torch.autograd.grad(flash_attn_func(q, k, v, backend="triton", deterministic=True).sum(), (q, k, v))
    short = [t.requires_grad_() for t in _qkv(1, 200, 1000, 4, 2, 128, dtype)]
    torch.autograd.grad(flash_attn_func(*short, backend="triton", causal=True).sum(), short)
    small = [t[..., :64].detach().contiguous().requires_grad_() for t in (q, k, v)]
    torch.autograd.grad(flash_attn_func(*small, backend="triton", causal=True).sum(), small)
    assert len(backward_calls) == 4


@pytest.mark.gpu
@needs_hopper
def test_gpu_a_capture_after_an_eager_call_replays_right(backward_calls):
    """A CUDA graph of the forward and backward, captured after an eager call loaded the kernel, replays the
    gradients of new inputs."""
    torch.manual_seed(34)
    q, k, v = (t.requires_grad_() for t in _qkv(1, 1024, 1024, 4, 4, 128, torch.bfloat16))
    dout = torch.randn(1, 1024, 4, 128, dtype=torch.bfloat16, device="cuda")
    step = lambda: torch.autograd.grad(flash_attn_func(q, k, v, backend="triton"), (q, k, v), dout)  # noqa: E731
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads = step()
    with torch.no_grad():
        for t in (q, k, v, dout):
            t.copy_(torch.randn_like(t))
    graph.replay()
    ref = flash_attn_func(q, k, v, backend="reference")
    for name, g, r in zip(("dq", "dk", "dv"), grads, torch.autograd.grad(ref, (q, k, v), dout)):
        assert_close(g, r, torch.bfloat16, scale=GRAD_SCALE, name=name)
    assert len(backward_calls) == 2
