"""modules.linear: nn.Linear's forward with a leaner backward (the autocast weight copy recomputed on request, the
bias gradient a GEMV on CUDA). Same outputs and gradients as nn.Linear, in float32 and under bf16 autocast, on
the CPU and (marked gpu) on CUDA; hooked layers and no-grad calls run the layer itself."""

import pytest
import torch
from torch import nn

from flash_models.modules import linear as linear_module
from flash_models.modules.linear import linear


def run(layer, x, *, ours: bool, autocast: bool = False, recompute_weight_cast=False):
    for p in [x, *layer.parameters()]:
        p.grad = None
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        out = linear(x, layer, backend="auto", recompute_weight_cast=recompute_weight_cast) if ours else layer(x)
    out.float().square().sum().backward()
    return [out.detach()] + [t.grad for t in [x, *layer.parameters()]]


@pytest.mark.parametrize("bias", [True, False])
def test_same_as_nn_linear_in_float32(bias):
    torch.manual_seed(0)
    layer, x = nn.Linear(24, 37, bias=bias), torch.randn(3, 19, 24, requires_grad=True)
    for got, want in zip(run(layer, x, ours=True), run(layer, x, ours=False), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recompute_weight_cast", [False, True])
def test_same_as_nn_linear_under_bf16_autocast(recompute_weight_cast):
    torch.manual_seed(0)
    layer, x = nn.Linear(24, 37), torch.randn(3, 19, 24, requires_grad=True)
    got = run(layer, x, ours=True, autocast=True, recompute_weight_cast=recompute_weight_cast)
    want = run(layer, x, ours=False, autocast=True)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
    torch.testing.assert_close(got[:3], want[:3], rtol=0, atol=0)  # output, input and weight grads: same ops
    # the bias gradient is summed in float32 rather than rounded to bf16 first: within bf16 rounding
    torch.testing.assert_close(got[3], want[3], rtol=1e-2, atol=1e-2)


def test_input_without_grad():
    layer, x = nn.Linear(8, 5), torch.randn(4, 8)
    out, dx, dw, db = run(layer, x, ours=True)
    assert dx is None and dw is not None and db is not None


def saved_weight_copies(layer, x, recompute_weight_cast=True) -> list[torch.dtype]:
    """The dtypes of the weight-shaped tensors the forward saves for the backward, under bf16 autocast."""
    saved = []

    def pack(t):
        if t.numel() == layer.weight.numel():  # the weight or its transpose
            saved.append(t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        linear(x, layer, backend="auto", recompute_weight_cast=recompute_weight_cast)
    return saved


def test_autocast_weight_copy_is_recomputed_when_asked():
    layer, x = nn.Linear(16, 12), torch.randn(5, 16, requires_grad=True)
    assert saved_weight_copies(layer, x) == [torch.float32]  # the parameter itself, cast again in the backward
    assert saved_weight_copies(layer, x, recompute_weight_cast=False) == [torch.float32, torch.bfloat16]  # both
    hooked = nn.Linear(16, 12)
    hooked.register_forward_hook(lambda *args: None)  # its own forward: autograd keeps the bf16 copy
    assert saved_weight_copies(hooked, x) == [torch.bfloat16]


def test_hooked_subclassed_and_no_grad_calls_run_the_layer():
    class Doubling(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    x = torch.randn(5, 8, requires_grad=True)
    plain = nn.Linear(8, 3)
    doubling = Doubling(8, 3)
    doubling.load_state_dict(plain.state_dict())
    torch.testing.assert_close(linear(x, doubling, backend="auto"), 2 * plain(x))
    plain.register_forward_hook(lambda module, args, out: out + 1)
    torch.testing.assert_close(linear(x, plain, backend="auto"), nn.functional.linear(x, plain.weight, plain.bias) + 1)
    with torch.no_grad():
        assert linear(x, plain, backend="auto").grad_fn is None


def test_ones_for_the_bias_gemv_are_cached_and_grown():
    linear_module._ONES.clear()
    dy = torch.randn(7, 5)
    assert torch.equal(linear_module._ones(7, dy), torch.ones(7))
    first = linear_module._ONES[(dy.device, dy.dtype)]
    assert linear_module._ones(3, dy).data_ptr() == first.data_ptr()  # a slice of the cached vector
    assert linear_module._ones(9, dy).numel() == 9 and linear_module._ONES[(dy.device, dy.dtype)].numel() == 9


@pytest.mark.gpu
@pytest.mark.parametrize("autocast", [False, True])
def test_same_as_nn_linear_on_cuda(autocast):
    """The GEMV bias gradient (and the rest) on CUDA against autograd's own Linear, at a real GPT-2 width."""
    torch.manual_seed(0)
    layer, x = nn.Linear(768, 2304).cuda(), torch.randn(4, 333, 768, device="cuda", requires_grad=True)
    got, want = run(layer, x, ours=True, autocast=autocast), run(layer, x, ours=False, autocast=autocast)
    tol = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-4, atol=1e-4)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, **tol)
