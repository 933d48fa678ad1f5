"""The plain MLP's training path on CUDA: with the tanh GELU (GPT-2, GPT-J), fc1 + bias + GELU and fc2 + bias run
on fused_dense's cuBLASLt epilogues (``flash_kernels.fused_dense_gelu_dense``), forward and backward, in half
precision and under autocast; everything else keeps the unfused path. The extension is built on the GPU only, so
these tests are marked gpu; the CPU tests of the unfused path are in the model families' tests."""

import pytest
import torch
import torch.nn.functional as F

import flash_kernels
from flash_kernels._testing import assert_close, record_calls
from flash_models.config import MLPConfig
from flash_models.modules.mlp import MLP

pytestmark = pytest.mark.gpu


def _mlp(activation="gelu_new", hidden=768, intermediate=3072, dtype=torch.bfloat16, **kwargs):
    torch.manual_seed(0)
    return MLP(MLPConfig(hidden_size=hidden, intermediate_size=intermediate, activation=activation),
               **kwargs).to("cuda", dtype)


@pytest.fixture
def cublaslt_calls(monkeypatch):
    """The GELU approximation of each fused_dense_gelu_dense call made by the MLP."""
    return record_calls(monkeypatch, flash_kernels, "fused_dense_gelu_dense", "approximate")


def _float32_reference(mlp, x, approximate="tanh"):
    w1, b1, w2, b2 = (p.detach().float().requires_grad_() for p in (mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight,
                                                                      mlp.fc2.bias))
    xf = x.detach().float().requires_grad_()
    return F.linear(F.gelu(F.linear(xf, w1, b1), approximate=approximate), w2, b2), [xf, w1, b1, w2, b2]


@pytest.mark.parametrize("autocast", [False, True])
def test_tanh_gelu_mlp_trains_on_cublaslt(autocast, cublaslt_calls):
    """Output and every gradient against float32 torch: pure bf16, and float32 parameters under bf16 autocast
    (their gradients come back in float32, through autocast-like casts)."""
    dtype = torch.float32 if autocast else torch.bfloat16
    mlp = _mlp(dtype=dtype)
    x = torch.randn(4, 333, 768, device="cuda", dtype=dtype, requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = mlp(x)
    assert cublaslt_calls == ["tanh"] and out.dtype == torch.bfloat16
    ref, ref_inputs = _float32_reference(mlp, x)
    assert_close(out, ref, torch.bfloat16, name="out")
    dy = torch.randn_like(out)
    params = [x, mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias]
    got = torch.autograd.grad(out, params, dy)
    want = torch.autograd.grad(ref, ref_inputs, dy.float())
    for name, g, w, p in zip(["x", "w1", "b1", "w2", "b2"], got, want, params, strict=True):
        assert g.dtype == p.dtype, name
        assert_close(g, w.to(g.dtype), torch.bfloat16, scale=2, name=f"grad {name}")


@pytest.mark.parametrize("case", ["exact gelu", "recomputed activation", "reference backend", "odd width",
                                  "float32 without autocast", "no grad"])
def test_other_mlps_keep_the_unfused_path(case, cublaslt_calls):
    """The exact GELU (cuBLASLt has the tanh form only), a recomputed activation, kernel_backend="reference",
    a width that is not a multiple of 8, float32 without autocast, and inference: no cuBLASLt MLP, same result."""
    kwargs = {"exact gelu": dict(activation="gelu"), "reference backend": dict(kernel_backend="reference"),
              "odd width": dict(hidden=100, intermediate=300), "float32 without autocast": dict(dtype=torch.float32)}
    mlp = _mlp(**kwargs.get(case, {}))
    if case == "recomputed activation":
        mlp.recompute_activation = True
    x = torch.randn(2, 77, mlp.cfg.hidden_size, device="cuda", dtype=mlp.fc1.weight.dtype, requires_grad=True)
    with torch.set_grad_enabled(case != "no grad"):
        out = mlp(x)
    assert cublaslt_calls == []
    ref, _ = _float32_reference(mlp, x, approximate="none" if case == "exact gelu" else "tanh")
    assert_close(out, ref, out.dtype, name=case)
