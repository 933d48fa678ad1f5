"""cross_entropy: Triton kernels (the interpreter on CPU) against the reference and torch's
F.cross_entropy: smoothing, z-loss, logit scale, ignore_index, reductions, in-place backward, lse output."""

import importlib

import pytest
import torch
import torch.nn.functional as F

from flash_kernels import cross_entropy
from flash_kernels._testing import assert_close

ce = importlib.import_module("flash_kernels.cross_entropy")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Logits dtype and the tolerance dtype of the (float32) loss computed from them.
DTYPES = [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16)]
CASES = {
    "plain": dict(),
    "smooth_zloss_scale_sum": dict(label_smoothing=0.1, lse_square_scale=1e-3, logit_scale=0.7, reduction="sum"),
    "none_lse": dict(reduction="none", return_lse=True),
}


def _labels(n, vocab):
    labels = torch.randint(0, vocab, (n,), device=DEVICE)
    labels[::5] = -100
    return labels


@pytest.mark.parametrize("dtype,tol_dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("inplace_backward", [False, True])
def test_fwd_bwd(case, dtype, tol_dtype, inplace_backward):
    kw = CASES[case]
    n, vocab = 37, 3001
    logits = (2 * torch.randn(n, vocab, device=DEVICE, dtype=dtype)).requires_grad_()
    labels = _labels(n, vocab)
    ref = ce.cross_entropy_ref(logits, labels, **kw)
    ref = ref if isinstance(ref, tuple) else (ref,)
    grads = [torch.randn_like(r) for r in ref]
    want = torch.autograd.grad(ref, logits, grads)[0]
    # In-place backward overwrites its input: give it a non-leaf copy.
    inp = logits.detach().clone().requires_grad_()
    x = inp * 1.0 if inplace_backward else inp
    out = cross_entropy(x, labels, inplace_backward=inplace_backward, backend="triton", **kw)
    out = out if isinstance(out, tuple) else (out,)
    for o, r in zip(out, ref):
        assert_close(o, r, tol_dtype, name="loss/lse")
    got = torch.autograd.grad(out, inp, grads)[0]
    assert_close(got, want, tol_dtype, name="grad")


def _slice_rows(monkeypatch, rows):
    """With "small_slices", rows of 1000-2000 logits are cut as the kernels cut 50k-wide ones (statistics of 512
    logits, gradient blocks of 256); with "default" sizes such rows are one program's."""
    if rows == "small_slices":  # tile sizes, not settings: several slices and blocks at a small vocab
        monkeypatch.setattr(ce, "_SLICE", 512)
        monkeypatch.setattr(ce, "_GRAD_BLOCK", 256)


@pytest.mark.parametrize("rows", ["default", "small_slices"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["plain", "smooth_zloss_scale_sum"])
def test_fused_loss_and_gradient_equal_the_two_kernels(case, dtype, rows, monkeypatch):
    """ce_rows_fwd_bwd_ (the fused LM head's: loss gradient known up front, gradient written over the logits)
    against ce_rows_fwd + ce_rows_bwd."""
    _slice_rows(monkeypatch, rows)
    kw = {k: v for k, v in CASES[case].items() if k != "reduction"}
    args = (-100, kw.get("label_smoothing", 0.0), kw.get("lse_square_scale", 0.0), kw.get("logit_scale", 1.0))
    n, vocab = 11, 1999
    logits = 3 * torch.randn(n, vocab, device=DEVICE).to(dtype)
    labels, dlosses = _labels(n, vocab), torch.rand(n, device=DEVICE)
    losses, lse = ce.ce_rows_fwd(logits, labels, *args)
    want = torch.empty_like(logits)
    ce.ce_rows_bwd(logits, want, labels, lse, dlosses, None, *args)
    fused = logits.clone()
    torch.testing.assert_close(ce.ce_rows_fwd_bwd_(fused, labels, dlosses, *args), losses, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused, want, rtol=1e-6, atol=1e-6)


def _labels_in_every_block(n, vocab, block):
    """Labels in the first, a middle and the last block of the row (its first and last column too), and ignored
    rows."""
    picks = [0, vocab // 2, vocab - 1, -100, min(block, vocab - 1), -100, max(0, vocab - 1 - block // 2)]
    return torch.tensor([picks[i % len(picks)] for i in range(n)], device=DEVICE)


ODD_VOCABS = [  # (vocab, dtype, rows): one program a row; a row one logit past a slice; GPT-2's; small slices
    (77, torch.float16, "default"), (1000, torch.float32, "default"), (8193, torch.float32, "default"),
    (50257, torch.bfloat16, "default"), (1000, torch.float16, "small_slices"), (777, torch.bfloat16, "small_slices"),
]


@pytest.mark.parametrize("vocab,dtype,rows", ODD_VOCABS, ids=[f"{v}-{str(d)[6:]}-{r}" for v, d, r in ODD_VOCABS])
def test_odd_vocab_sizes_with_every_option(vocab, dtype, rows, monkeypatch):
    """Vocabularies that are no multiple of any block (the last block is partial, its loads masked), labels in
    every block, ignored rows, smoothing, z-loss and a logit scale: loss, lse and gradient against the reference,
    through the autograd op and through the fused one (gradient written over the logits)."""
    _slice_rows(monkeypatch, rows)
    kw = dict(label_smoothing=0.1, lse_square_scale=1e-3, logit_scale=0.7)
    n = 7
    logits = (3 * torch.randn(n, vocab, device=DEVICE)).to(dtype).requires_grad_()
    labels = _labels_in_every_block(n, vocab, ce._GRAD_BLOCK)
    ref_loss, ref_lse = ce.cross_entropy_ref(logits, labels, reduction="none", return_lse=True, **kw)
    dlosses = torch.rand(n, device=DEVICE)
    want = torch.autograd.grad(ref_loss, logits, dlosses)[0]
    loss, lse = cross_entropy(logits, labels, reduction="none", return_lse=True, backend="triton", **kw)
    assert_close(loss, ref_loss, torch.float32, name="loss")
    assert_close(lse, ref_lse, torch.float32, name="lse")
    assert_close(torch.autograd.grad(loss, logits, dlosses)[0], want, dtype, name="grad")
    fused = logits.detach().clone()
    args = (-100, kw["label_smoothing"], kw["lse_square_scale"], kw["logit_scale"])
    assert_close(ce.ce_rows_fwd_bwd_(fused, labels, dlosses, *args), ref_loss, torch.float32, name="fused loss")
    assert_close(fused, want, dtype, name="fused grad")


@pytest.mark.parametrize("rows", ["default", "small_slices"])
def test_masked_vocabulary_of_minus_inf(rows, monkeypatch):
    """Logits of -inf (a vocabulary masked out), over the row's first slice (where a running max would start
    at -inf) and over part of another: the loss and gradient stay finite and equal torch's, zero there."""
    _slice_rows(monkeypatch, rows)
    n, vocab = 6, 1000
    logits = torch.randn(n, vocab, device=DEVICE)
    logits[:, :600] = -float("inf")
    logits[:, 900:950] = -float("inf")
    labels = torch.tensor([600, 899, 999, -100, 700, 950], device=DEVICE)
    dlosses = torch.rand(n, device=DEVICE)
    x = logits.clone().requires_grad_()
    want_loss = F.cross_entropy(x, labels, reduction="none")
    want = torch.autograd.grad(want_loss, x, dlosses)[0]
    losses, _ = ce.ce_rows_fwd(logits, labels, -100, 0.0, 0.0, 1.0)
    assert_close(losses, want_loss, torch.float32, name="loss")
    fused = logits.clone()
    assert_close(ce.ce_rows_fwd_bwd_(fused, labels, dlosses, -100, 0.0, 0.0, 1.0), want_loss, torch.float32,
                 name="fused loss")
    assert_close(fused, want, torch.float32, name="fused grad")
    assert not fused[:, :600].any()


def test_inplace_backward_reuses_logits_buffer():
    logits = torch.randn(8, 300, device=DEVICE, requires_grad=True)
    x = logits * 1.0
    captured = {}
    x.register_hook(lambda g: captured.update(ptr=g.data_ptr()))
    cross_entropy(x, torch.randint(0, 300, (8,), device=DEVICE), inplace_backward=True, backend="triton").backward()
    assert captured["ptr"] == x.data_ptr(), "the gradient was not written over the logits buffer"


def test_matches_torch_functional():
    logits = torch.randn(21, 1000, device=DEVICE)
    labels = _labels(21, 1000)
    for kw in (dict(), dict(label_smoothing=0.2), dict(reduction="sum"), dict(reduction="none")):
        want = F.cross_entropy(logits, labels, ignore_index=-100, **kw)
        assert_close(cross_entropy(logits, labels, backend="triton", **kw), want, torch.float32)



@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("label_dtype", [torch.int32, torch.int16])
def test_narrow_integer_labels(backend, label_dtype):
    """Labels of any integer dtype give the int64 labels' loss on every backend (torch itself takes int64 only)."""
    logits = torch.randn(9, 37, device=DEVICE)
    labels = _labels(9, 37)
    want = F.cross_entropy(logits, labels, label_smoothing=0.1)
    assert_close(cross_entropy(logits, labels.to(label_dtype), label_smoothing=0.1, backend=backend), want,
                 torch.float32)

@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_all_rows_ignored_gives_nan_as_torch_with_zero_gradients(backend):
    logits = torch.randn(4, 50, device=DEVICE, requires_grad=True)
    labels = torch.full((4,), -100, device=DEVICE)
    want = F.cross_entropy(logits, labels)
    assert want.isnan()  # torch's (and HF's) mean over no labelled row
    loss = cross_entropy(logits, labels, backend=backend)
    assert loss.isnan()
    loss.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))
    assert cross_entropy(logits, labels, backend=backend, reduction="sum").item() == 0.0


def test_compile_fullgraph():
    def lm_loss(h, w, labels):
        return cross_entropy(F.linear(h, w), labels, label_smoothing=0.1, backend="triton")

    h = torch.randn(16, 32, device=DEVICE)
    w = torch.randn(301, 32, device=DEVICE, requires_grad=True)
    labels = _labels(16, 301)
    compiled = torch.compile(lm_loss, fullgraph=True, backend="aot_eager" if DEVICE == "cpu" else "inductor")
    assert_close(compiled(h, w, labels), lm_loss(h, w, labels), torch.float32)
    compiled(h, w, labels).backward()
    assert w.grad is not None and torch.isfinite(w.grad).all()


def test_bad_inputs():
    logits = torch.randn(4, 10)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        cross_entropy(logits, torch.tensor([0, 1, 10, 2]), backend="triton")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        cross_entropy(logits, torch.tensor([0, -1, 3, 2]), backend="triton")
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(logits, torch.zeros(4, dtype=torch.long), reduction="avg", backend="triton")
    with pytest.raises(ValueError, match="expected logits"):
        cross_entropy(logits, torch.zeros(3, dtype=torch.long), backend="triton")
    with pytest.raises(ValueError, match="label_smoothing"):
        cross_entropy(logits, torch.zeros(4, dtype=torch.long), label_smoothing=1.5, backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [50257, 50304, 128256, 262144])
def test_gpu_large_vocab(vocab):
    n = 8192 if vocab < 200000 else 1024
    logits = torch.randn(n, vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = _labels(n, vocab)
    loss, lse = cross_entropy(logits, labels, lse_square_scale=1e-4, return_lse=True)
    ref, ref_lse = ce.cross_entropy_ref(logits, labels, lse_square_scale=1e-4, return_lse=True)
    assert_close(loss, ref, torch.float32, scale=10)
    assert_close(lse, ref_lse, torch.float32, scale=10)
    assert_close(torch.autograd.grad(loss, logits)[0], torch.autograd.grad(ref, logits)[0], torch.bfloat16)


def test_label_range_check_never_syncs_on_cuda(monkeypatch):
    """On CUDA the range check must be an asynchronous device assert, not a host read."""
    import flash_kernels._backend as backend

    calls = []
    monkeypatch.setattr(backend.torch, "_assert_async", lambda cond, msg: calls.append(msg))

    class FakeCuda(torch.Tensor):
        is_cuda = True

    labels = torch.tensor([1, 2, -100]).as_subclass(FakeCuda)
    backend.check_ids_in_range(labels, 5, ignore=-100, message="labels out of range")
    assert calls == ["labels out of range"]
