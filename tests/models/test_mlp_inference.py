"""The plain MLP's inference path: with nothing recording gradients, fc1 and its activation run as one
``flash_kernels.linear_act`` call (the Triton kernel under the interpreter here) and give the unfused MLP's
output; anything that needs the unfused path (grad mode, autocast, a hooked layer) keeps it."""

import pytest
import torch

import flash_kernels
from flash_kernels._testing import assert_close, record_calls
from flash_models.config import MLPConfig
from flash_models.modules.mlp import MLP

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _mlp(activation, kernel_backend, dtype=torch.float16):
    torch.manual_seed(0)
    return MLP(MLPConfig(hidden_size=48, intermediate_size=80, activation=activation),
               kernel_backend=kernel_backend).to(DEVICE, dtype)


@pytest.fixture
def fused_calls(monkeypatch):
    """The activation of each linear_act call made by the MLP (it looks the function up on flash_kernels)."""
    return record_calls(monkeypatch, flash_kernels, "linear_act", "activation")


@pytest.mark.parametrize("activation, fused", [("gelu", "gelu"), ("gelu_new", "gelu_tanh"), ("relu", "relu")])
def test_fused_inference_equals_the_unfused_mlp(activation, fused, fused_calls):
    x = torch.randn(3, 29, 48, device=DEVICE).half()
    with torch.no_grad():
        out = _mlp(activation, "triton")(x)
        assert fused_calls == [fused]
        ref = _mlp(activation, "reference")(x)
    assert_close(out, ref, torch.float16, name=activation)


def test_unfused_when_gradients_autocast_hooks_or_float32_need_it(fused_calls):
    x = torch.randn(2, 7, 48, device=DEVICE)
    mlp = _mlp("gelu", "triton", torch.float32)
    with torch.no_grad():
        mlp(x)  # float32: torch's GEMM (the kernel would run its dot in TF32)
    with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16):
        mlp(x)  # fp32 weights cast by autocast: fc1 is not a plain call in x's dtype
    mlp, x = mlp.half(), x.half()
    mlp(x)  # grad mode: the backward needs the pre-activation
    hook = mlp.fc1.register_forward_hook(lambda *args: None)
    with torch.no_grad():
        mlp(x)  # the hook must see fc1 run
    hook.remove()
    assert fused_calls == []
    with torch.no_grad():
        mlp(x)
    assert fused_calls == ["gelu"]


def test_triton_backend_keeps_the_unfused_path_where_the_kernel_cannot_run(fused_calls):
    """hidden 44 (not a multiple of 8: TMA cannot move its rows): kernel_backend="triton" runs unfused, no error."""
    torch.manual_seed(0)
    mlp = MLP(MLPConfig(hidden_size=44, intermediate_size=80, activation="gelu"), kernel_backend="triton")
    mlp = mlp.to(DEVICE, torch.float16)
    x = torch.randn(2, 5, 44, device=DEVICE).half()
    with torch.no_grad():
        out = mlp(x)
    assert fused_calls == []
    assert_close(out, mlp.fc2(torch.nn.functional.gelu(mlp.fc1(x))), torch.float16)
