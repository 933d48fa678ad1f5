"""The backend rule shared by every op (``flash_kernels._backend.use_triton``), tried through the ops: an empty
input has nothing to launch, so every backend, "triton" included, returns the reference's empty result and
gradients instead of refusing it."""

import pytest
import torch

import flash_kernels as fk

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _ones(n=8):
    return torch.ones(n, device=DEVICE)


def _tables():
    angles = torch.rand(16, 4, device=DEVICE)
    return angles.cos(), angles.sin()


# op -> (empty input shape, call taking that input and backend=)
EMPTY_CALLS = {
    "layer_norm": ((0, 3, 8), lambda x, **kw: fk.layer_norm(x, _ones(), _ones(), **kw)),
    "rms_norm": ((2, 0, 8), lambda x, **kw: fk.rms_norm(x, _ones(), residual=torch.zeros_like(x), **kw)),
    "layer_norm_dual": ((0, 8), lambda x, **kw: fk.layer_norm_dual(x, _ones(), None, _ones(), **kw)[1]),
    "swiglu": ((0, 3, 8), lambda x, **kw: fk.swiglu(x, **kw)),
    "gelu": ((4, 0), lambda x, **kw: fk.gelu(x, **kw)),
    "apply_rotary": ((2, 0, 3, 8), lambda x, **kw: fk.apply_rotary(x, *_tables(), **kw)),
    "cross_entropy": ((0, 11), lambda x, **kw: fk.cross_entropy(
        x, torch.zeros(0, dtype=torch.long, device=DEVICE), reduction="sum", **kw)),
    "flash_attn_func": ((0, 5, 4, 8), lambda q, **kw: fk.flash_attn_func(q, q[:, :, :2], q[:, :, :2], causal=True, **kw)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("op", list(EMPTY_CALLS))
def test_empty_input_gives_the_empty_result_on_every_backend(op, dtype):
    shape, call = EMPTY_CALLS[op]
    x = torch.randn(shape, dtype=dtype, device=DEVICE, requires_grad=True)
    results = {}
    for backend in ("reference", "triton", "auto"):
        out = call(x, backend=backend)
        (grad,) = torch.autograd.grad(out.float().sum(), x)
        results[backend] = (out, grad)
    ref_out, ref_grad = results["reference"]
    for backend, (out, grad) in results.items():
        assert out.shape == ref_out.shape and out.dtype == ref_out.dtype, backend
        assert torch.equal(out, ref_out), backend
        assert grad.shape == x.shape, backend


@pytest.mark.parametrize("shape", [(0, 2, 4, 8), (2, 0, 4, 8)])
def test_decode_attention_of_an_empty_batch_or_no_query(shape):
    """flash_attn_with_kvcache over no row or no new token: empty outputs and log-sum-exps on every backend."""
    q = torch.randn(shape, dtype=torch.float16, device=DEVICE)
    cache = torch.randn(shape[0], 5, 2, 8, dtype=torch.float16, device=DEVICE)
    for backend in ("reference", "triton", "auto"):
        out, lse = fk.flash_attn_with_kvcache(q, cache, cache, return_softmax_lse=True, backend=backend)
        assert out.shape == q.shape and lse.shape == (shape[0], 4, shape[1]), backend
