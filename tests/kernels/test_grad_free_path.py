"""With grad mode off (inference_mode, no_grad), or on with no input that needs a gradient, the eager ops call
their kernels without an autograd.Function: the outputs must be the very ones the recording path computes, and
carry no graph."""

import contextlib

import pytest
import torch

import flash_kernels as fk

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs():
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(3, 19, 64, generator=gen).to(DEVICE, torch.float16)
    q = torch.randn(2, 17, 4, 32, generator=gen).to(DEVICE, torch.float16)
    w, b = torch.rand(64, generator=gen).to(DEVICE, torch.float16), torch.randn(64, generator=gen).to(DEVICE, torch.float16)
    cu = torch.tensor([0, 5, 5, 17], dtype=torch.int32, device=DEVICE)
    return x, q, w, b, cu


OPS = {
    "layer_norm_prenorm": lambda x, q, w, b, cu: fk.layer_norm(x, w, b, residual=x.flip(0), prenorm=True, backend="triton"),
    # Post-norm (BERT): grad-free, the residual stream is not written, yet y is normalized from the same bits.
    "layer_norm_post_norm": lambda x, q, w, b, cu: fk.layer_norm(x, w, b, residual=x.flip(0), backend="triton"),
    "rms_norm": lambda x, q, w, b, cu: fk.rms_norm(x, w, backend="triton"),
    "gelu": lambda x, q, w, b, cu: fk.gelu(x, approximate="tanh", backend="triton"),
    "swiglu": lambda x, q, w, b, cu: fk.swiglu(x, backend="triton"),
    "flash_attn_func": lambda x, q, w, b, cu: fk.flash_attn_func(q, q, q, causal=True, backend="triton"),
    "flash_attn_varlen_func": lambda x, q, w, b, cu: fk.flash_attn_varlen_func(
        q[0], q[0], q[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=12, max_seqlen_k=12, backend="triton"),
}


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad", "grad_mode_on"])
@pytest.mark.parametrize("name", list(OPS))
def test_grad_free_call_equals_recorded_call(name, mode):
    x, q, w, b, cu = _inputs()
    recorded = OPS[name](x.requires_grad_(), q.requires_grad_(), w, b, cu)
    with contextlib.nullcontext() if mode == "grad_mode_on" else getattr(torch, mode)():
        free = OPS[name](x.detach(), q.detach(), w, b, cu)
    recorded = recorded if isinstance(recorded, tuple) else (recorded,)
    free = free if isinstance(free, tuple) else (free,)
    assert any(t.requires_grad for t in recorded)
    for got, want in zip(free, recorded, strict=True):
        assert not got.requires_grad and got.grad_fn is None
        assert torch.equal(got, want.detach())
