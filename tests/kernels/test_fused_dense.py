"""fused_dense / fused_dense_gelu_dense. The cuBLASLt extension runs only on a GPU (tests marked gpu build it
there, JIT); on the CPU the backend choice and the torch path are checked. No CPU test compiles CUDA code."""

import pytest
import torch
import torch.nn.functional as F

from flash_kernels import fused_dense, fused_dense_gelu_dense
from flash_kernels._testing import assert_close
from flash_kernels.fused_dense import bias_grad_by_ones_column, fused_dense_gelu_dense_ref, load_extension


def _mlp_params(d, hidden, dtype, device):
    make = lambda *s: (torch.randn(*s, dtype=dtype, device=device) / s[-1] ** 0.5).requires_grad_()  # noqa: E731
    return make(hidden, d), make(hidden), make(d, hidden), make(d)


def test_cpu_auto_uses_torch():
    x = torch.randn(3, 7, 16)
    w1, b1, w2, b2 = _mlp_params(16, 64, torch.float32, "cpu")
    assert_close(fused_dense(x, w1, b1), F.linear(x, w1, b1), torch.float32)
    assert_close(fused_dense_gelu_dense(x, w1, b1, w2, b2, approximate="none"),
                 F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2), torch.float32)


def test_explicit_backend_that_cannot_run_raises():
    x = torch.randn(4, 16)
    w1, b1, w2, b2 = _mlp_params(16, 64, torch.float32, "cpu")
    with pytest.raises(ValueError, match="backend='triton' cannot run this input: device 'cpu'"):
        fused_dense(x, w1, b1, backend="triton")
    with pytest.raises(ValueError, match="backend"):
        fused_dense(x, w1, b1, backend="cublas")
    with pytest.raises(ValueError, match="do not chain"):
        fused_dense_gelu_dense(x, w1, b1, w1, b2)


def test_the_old_cuda_spelling_still_means_our_kernels_with_a_warning():
    """fused_dense shares every op's backend vocabulary; its former "cuda" still works, warning, as "triton"
    (which on the CPU is the error an explicit "triton" gets)."""
    x = torch.randn(5, 24)
    w, b = torch.randn(40, 24), torch.randn(40)
    with pytest.warns(FutureWarning, match="spelled 'triton'"), pytest.raises(ValueError, match="backend='triton'"):
        fused_dense(x, w, b, backend="cuda")


def test_bias_grad_by_ones_column_rule():
    """The ones column is taken where the layer widens its input over many rows (its copies then move fewer bytes
    than a pass over dy): GPT-2's fc1 over 16k tokens, not its fc2, and not over 2k tokens (dW's copy dominates)."""
    assert bias_grad_by_ones_column(16384, 768, 3072)
    assert not bias_grad_by_ones_column(16384, 3072, 768)
    assert not bias_grad_by_ones_column(2048, 768, 3072)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch", [4, 32])
def test_gpu_extension_matches_torch(dtype, batch):
    """GPT-2 MLP sizes: built here (JIT), forward and every gradient against torch in float32. At 4 x 512 tokens
    every bias gradient comes from BGRADB; at 32 x 512, fc1's comes from the ones column."""
    tokens = batch * 512
    assert bias_grad_by_ones_column(tokens, 768, 3072) == (batch == 32)
    x = torch.randn(batch, 512, 768, dtype=dtype, device="cuda", requires_grad=True)
    params = _mlp_params(768, 3072, dtype, "cuda")
    out = fused_dense_gelu_dense(x, *params, backend="triton")
    ref = fused_dense_gelu_dense_ref(x.float(), *(p.float() for p in params), approximate="tanh")
    assert_close(out, ref, dtype, name="mlp out")
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, *params], g)
    want = torch.autograd.grad(ref, [x, *params], g.float())
    for name, a, b in zip(["x", "w1", "b1", "w2", "b2"], got, want):
        assert_close(a, b.to(dtype), dtype, scale=2, name=f"grad {name}")

    # Both dense layers of the MLP alone: fc2's shape (BGRADB), fc1's (the ones column at 32 x 512 tokens).
    for (w, b), width in (((params[2], params[3]), 3072), ((params[0], params[1]), 768)):
        h = torch.randn(batch, 512, width, dtype=dtype, device="cuda", requires_grad=True)
        _check_dense(h, w, b, f"dense {width}")


def _check_dense(x, w, b, label):
    """fused_dense on the extension against float32 torch: output and the gradients of x, w and b."""
    dtype = x.dtype
    out = fused_dense(x, w, b, backend="triton")
    ref = F.linear(x.float(), w.float(), b.float())
    assert_close(out, ref, dtype, name=f"{label} out")
    g = torch.randn_like(out)
    for name, got, want in zip(["x", "w", "b"], torch.autograd.grad(out, [x, w, b], g),
                               torch.autograd.grad(ref, [x, w, b], g.float())):
        assert_close(got, want.to(dtype), dtype, scale=2, name=f"{label} grad {name}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_ones_column_odd_shape(dtype):
    """The ones-column bias gradient at a row count and widths that match no tile (12345 rows, 136 -> 520)."""
    rows, width, out_features = 12345, 136, 520
    assert bias_grad_by_ones_column(rows, width, out_features)
    x = torch.randn(rows, width, dtype=dtype, device="cuda", requires_grad=True)
    w = (torch.randn(out_features, width, dtype=dtype, device="cuda") / width**0.5).requires_grad_()
    b = torch.randn(out_features, dtype=dtype, device="cuda", requires_grad=True)
    _check_dense(x, w, b, "12345 x 136 -> 520")


@pytest.mark.gpu
def test_gpu_compile_fullgraph():
    x = torch.randn(256, 768, dtype=torch.bfloat16, device="cuda")
    params = _mlp_params(768, 3072, torch.bfloat16, "cuda")
    fn = torch.compile(lambda x, *p: fused_dense_gelu_dense(x, *p, backend="triton"), fullgraph=True)
    assert_close(fn(x, *params), fused_dense_gelu_dense(x, *params, backend="triton"), torch.bfloat16)


@pytest.mark.gpu
def test_gpu_first_call_inside_a_cuda_graph_capture():
    """The first call of a shape times cuBLASLt's candidate algorithms, which cannot happen inside a CUDA-graph
    capture: a shape first met there runs the heuristic's first answer, the replay matches torch, and the next
    eager call (which times the candidates, on scratch outputs) matches too, forward and backward."""
    dtype = torch.bfloat16
    x = torch.randn(200, 136, dtype=dtype, device="cuda")  # a shape no other test uses
    w, b = (torch.randn(264, 136, dtype=dtype, device="cuda") / 12), torch.randn(264, dtype=dtype, device="cuda")
    want = F.linear(x.float(), w.float(), b.float())
    load_extension()  # built outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_dense(x, w, b, backend="triton")
    graph.replay()
    assert_close(captured, want, dtype, name="replayed")
    assert_close(fused_dense(x, w, b, backend="triton"), want, dtype, name="eager after capture")

    xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
    dy = torch.randn(200, 264, dtype=dtype, device="cuda")
    got = torch.autograd.grad(fused_dense(xg, wg, bg, backend="triton"), (xg, wg, bg), dy)
    ref = torch.autograd.grad(F.linear(*(t.float() for t in (xg, wg, bg))), (xg, wg, bg), dy.float())
    for name, a, r in zip(("x", "w", "b"), got, ref):
        assert_close(a, r.to(dtype), dtype, scale=2, name=f"grad {name}")
