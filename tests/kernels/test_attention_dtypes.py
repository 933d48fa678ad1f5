"""Integer q/k/v are refused by every attention entry point and backend with one message (the reference used
to return an integer tensor while the Triton path refused)."""

import pytest
import torch

from flash_kernels import flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func, flash_attn_with_kvcache

MESSAGE = r"q, k, v must be floating point \(float16, bfloat16, float32 or float64\), got torch\.int"


@pytest.mark.parametrize("backend", ["reference", "triton", "auto"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int8])
def test_integer_inputs_are_refused(backend, dtype):
    q, k, v = (torch.randint(-4, 5, (2, 7, 4, 32), dtype=dtype) for _ in range(3))
    with pytest.raises(ValueError, match="flash_attn_func: " + MESSAGE):
        flash_attn_func(q, k, v, backend=backend)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    with pytest.raises(ValueError, match=MESSAGE):
        flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4,
                               backend=backend)
    with pytest.raises(ValueError, match=MESSAGE):
        flash_attn_qkvpacked_func(torch.stack([q, k, v], dim=2), backend=backend)
    with pytest.raises(ValueError, match="flash_attn_with_kvcache: " + MESSAGE):
        flash_attn_with_kvcache(q[:, :1], k, v, cache_seqlens=torch.tensor([7, 5], dtype=torch.int32), backend=backend)


def test_float_inputs_still_run_on_the_reference():
    q, k, v = (torch.randn(1, 5, 2, 16, dtype=torch.float64) for _ in range(3))
    out = flash_attn_func(q, k, v, causal=True, backend="reference")
    assert out.dtype == torch.float64 and torch.isfinite(out).all()
