"""linear_cross_entropy: the token-chunked LM head + CE (Triton CE through the interpreter, and the plain
PyTorch chunk path) against the unfused reference: loss and the gradients of hidden, weight and bias."""

import importlib
import weakref

import pytest
import torch

from flash_kernels import linear_cross_entropy
from flash_kernels._testing import assert_close
from flash_kernels.linear_cross_entropy import default_chunk_size, linear_cross_entropy_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [(torch.float32, 1.0), (torch.bfloat16, 2.0)]
CASES = {
    "mean": dict(),
    "sum_smooth_scale": dict(reduction="sum", label_smoothing=0.1, logit_scale=0.5),
    "none": dict(reduction="none"),
}


def _inputs(dtype, bias, h=24, vocab=301):
    hidden = torch.randn(3, 15, h, dtype=dtype, device=DEVICE, requires_grad=True)
    weight = (torch.randn(vocab, h, dtype=dtype, device=DEVICE) / 4).requires_grad_()
    b = torch.randn(vocab, dtype=dtype, device=DEVICE, requires_grad=True) if bias else None
    labels = torch.randint(0, vocab, (3, 15), device=DEVICE)
    labels[0, ::3] = -100
    return hidden, weight, b, labels


@pytest.mark.parametrize("dtype,scale", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", ["triton", "auto"])
@pytest.mark.parametrize("bias", [False, True])
def test_fwd_bwd(case, dtype, scale, backend, bias):
    kw = CASES[case]
    hidden, weight, b, labels = _inputs(dtype, bias)
    out = linear_cross_entropy(hidden, weight, labels, bias=b, chunk_size=16, backend=backend, **kw)
    # The oracle in float32: the bf16 kernel path is judged against exact math, not against bf16 rounding.
    ref = linear_cross_entropy_ref(hidden.float(), weight.float(), labels, bias=None if b is None else b.float(), **kw)
    assert_close(out, ref, dtype, scale=scale, name="loss")
    g = torch.randn_like(ref)
    params = [p for p in (hidden, weight, b) if p is not None]
    for name, got, want in zip(["hidden", "weight", "bias"], torch.autograd.grad(out, params, g),
                               torch.autograd.grad(ref, params, g)):
        assert_close(got, want.to(got.dtype), dtype, scale=scale, name=f"grad {name}")


def test_vocab_wider_than_one_program():
    """A vocabulary one logit past a Triton CE statistics slice (8193: two slices, three gradient blocks, the
    last of one logit), which the op pads to aligned rows (the kernels see the classes through a wider row):
    loss and gradients against the reference, with labels in the first, middle and last block, ignored rows,
    smoothing and a logit scale."""
    kw = dict(reduction="sum", label_smoothing=0.1, logit_scale=0.5)
    dtype, scale = DTYPES[1]
    hidden, weight, b, labels = _inputs(dtype, True, h=16, vocab=8193)
    labels[1, :4] = torch.tensor([0, 4096, 8191, 8192])
    out = linear_cross_entropy(hidden, weight, labels, bias=b, chunk_size=32, backend="triton", **kw)
    ref = linear_cross_entropy_ref(hidden.float(), weight.float(), labels, bias=b.float(), **kw)
    assert_close(out, ref, dtype, scale=scale, name="loss")
    for name, got, want in zip(["hidden", "weight", "bias"], torch.autograd.grad(out, (hidden, weight, b)),
                               torch.autograd.grad(ref, (hidden, weight, b))):
        assert_close(got, want.to(got.dtype), dtype, scale=scale, name=f"grad {name}")


@pytest.mark.parametrize("chunk_size", [45, 64, 15, 7])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_last_chunk_weight_grad_in_backward(chunk_size, reduction):
    """The last chunk's weight-gradient GEMM runs in the backward with the upstream gradient: one chunk (45 and
    64 rows for 45 tokens), chunks that divide the tokens (15) and a short last chunk (7). Two backward passes of
    one graph give the same gradients: the stored ones are not scaled in place."""
    hidden, weight, b, labels = _inputs(torch.float32, True)
    out = linear_cross_entropy(hidden, weight, labels, bias=b, chunk_size=chunk_size, reduction=reduction,
                               backend="auto")
    ref = linear_cross_entropy_ref(hidden, weight, labels, bias=b, reduction=reduction)
    params = (hidden, weight, b)
    want = torch.autograd.grad(ref, params, torch.tensor(-2.5))
    first = torch.autograd.grad(out, params, torch.tensor(-2.5), retain_graph=True)
    second = torch.autograd.grad(out, params, torch.tensor(-2.5))
    for name, got, again, w in zip(["hidden", "weight", "bias"], first, second, want):
        assert_close(got, w, torch.float32, name=f"grad {name}")
        assert torch.equal(got, again), name


def test_failed_extension_build_falls_back_with_one_warning(monkeypatch):
    """A toolchain that cannot build fused_dense costs the weight gradient a scaling pass, not the run."""
    fused_dense_module = importlib.import_module("flash_kernels.fused_dense")  # the package exports the function

    lce_module = importlib.import_module("flash_kernels.linear_cross_entropy")  # the package exports the function

    def broken_build():
        raise fused_dense_module.ExtensionBuildError("fused_dense: building the CUDA extension failed: nvcc exploded")

    monkeypatch.setattr(fused_dense_module, "load_extension", broken_build)
    fused_dense_module.optional_extension.cache_clear()
    try:  # the op asks for the extension on CUDA only: on the CPU, its lookup is called directly
        with pytest.warns(RuntimeWarning, match="linear_cross_entropy: .*separate pass.*nvcc exploded"):
            assert lce_module._scaling_extension() is None
        assert lce_module._scaling_extension() is None  # cached: no second build, no second warning
    finally:
        fused_dense_module.optional_extension.cache_clear()


def test_no_grad_path_and_default_chunk():
    hidden, weight, _, labels = _inputs(torch.float32, False)
    with torch.no_grad():
        out = linear_cross_entropy(hidden, weight, labels, backend="auto")
    assert_close(out, linear_cross_entropy_ref(hidden, weight, labels), torch.float32)
    assert default_chunk_size(16384, 4096) == 8192  # LLaMA-3-8B's head: twice the hidden size
    assert default_chunk_size(16384, 2048) == 4096
    assert default_chunk_size(16384, 3000) == 4096  # a power of two, not above twice the hidden size
    assert default_chunk_size(16384, 768) == 2048  # GPT-2: the row floor, not 1536 rows
    assert default_chunk_size(65536, 8192) == 8192  # the ceiling
    assert default_chunk_size(10, 64) == 10



@pytest.mark.parametrize("backend", ["triton", "auto", "reference"])
@pytest.mark.parametrize("label_dtype", [torch.int32, torch.int16, torch.uint8])
def test_narrow_integer_labels(backend, label_dtype):
    """Labels of any integer dtype give the int64 labels' loss on every path (uint8's ignore_index is 255)."""
    hidden, weight, _, labels = _inputs(torch.float32, False, vocab=201)
    ignore = 255 if label_dtype == torch.uint8 else -100
    labels = labels.masked_fill(labels < 0, ignore)
    want = linear_cross_entropy_ref(hidden, weight, labels, ignore_index=ignore)
    got = linear_cross_entropy(hidden, weight, labels.to(label_dtype), ignore_index=ignore, backend=backend)
    assert_close(got, want, torch.float32)

@pytest.mark.parametrize("bias", [False, True])
def test_empty_batch_gives_zero_gradients(bias):
    """No token, no chunk: the gradients the first chunk would have written are zeros, not an empty buffer."""
    hidden, weight, b, labels = _inputs(torch.float32, bias)
    hidden = hidden[:0].detach().requires_grad_()
    loss = linear_cross_entropy(hidden, weight, labels[:0], bias=b, reduction="sum", backend="auto")
    params = [p for p in (hidden, weight, b) if p is not None]
    grads = torch.autograd.grad(loss, params)
    assert loss.item() == 0.0
    assert grads[0].shape == hidden.shape
    for g in grads[1:]:
        assert torch.equal(g, torch.zeros_like(g))


def test_compile_fullgraph():
    hidden, weight, _, labels = _inputs(torch.float32, False)

    def head_loss(h, w, y):
        return linear_cross_entropy(h, w, y, chunk_size=16, backend="triton")

    compiled = torch.compile(head_loss, fullgraph=True, backend="aot_eager" if DEVICE == "cpu" else "inductor")
    assert_close(compiled(hidden, weight, labels), head_loss(hidden, weight, labels), torch.float32)
    compiled(hidden, weight, labels).backward()
    assert weight.grad is not None and hidden.grad is not None


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", ["triton", "auto", "reference"])
def test_padded_weight_rows_past_vocab_size_are_ignored(case, backend):
    """A head padded past the vocabulary (as models pad theirs): with ``vocab_size`` the pad rows, even random
    ones, never enter the softmax, get a zero gradient, and the rest equals the unpadded op."""
    kw = CASES[case]
    hidden, weight, b, labels = _inputs(torch.float32, True, vocab=301)
    pad_w = torch.randn(83, weight.shape[1], device=DEVICE)
    padded_w = torch.cat([weight.detach(), pad_w]).requires_grad_()
    padded_b = torch.cat([b.detach(), torch.randn(83, device=DEVICE)]).requires_grad_()
    out = linear_cross_entropy(hidden, padded_w, labels, bias=padded_b, vocab_size=301, chunk_size=16,
                               backend=backend, **kw)
    ref = linear_cross_entropy_ref(hidden, weight, labels, bias=b, **kw)
    assert_close(out, ref, torch.float32, name="loss")
    g = torch.randn_like(ref)
    got = torch.autograd.grad(out, (hidden, padded_w, padded_b), g)
    want = torch.autograd.grad(ref, (hidden, weight, b), g)
    for name, gg, w in zip(["hidden", "weight", "bias"], got, want):
        assert_close(gg[:301] if name != "hidden" else gg, w, torch.float32, name=f"grad {name}")
    assert torch.equal(got[1][301:], torch.zeros_like(pad_w)) and not got[2][301:].any()


def test_unaligned_weight_is_padded_for_the_gemms(monkeypatch):
    """An odd row count (GPT-2's 50257) reaches the chunk loop padded to aligned rows, with ``vocab_size`` the
    real one; an aligned one reaches it as it is."""
    lce_module = importlib.import_module("flash_kernels.linear_cross_entropy")
    seen = []
    real = lce_module._chunked  # the padding changes no result: seen where the chunk loop receives the weight

    def spy(hidden, weight, *args, vocab_size, **kwargs):
        seen.append((weight.shape[0], vocab_size))
        return real(hidden, weight, *args, vocab_size=vocab_size, **kwargs)

    monkeypatch.setattr(lce_module, "_chunked", spy)
    for vocab, dtype, rows in ((301, torch.float32, 384), (300, torch.float32, 300), (299, torch.bfloat16, 384),
                               (304, torch.bfloat16, 304)):
        hidden, weight, _, labels = _inputs(dtype, False, vocab=vocab)
        linear_cross_entropy(hidden, weight, labels, backend="auto").backward()
        assert seen[-1] == (rows, vocab) and weight.grad.shape == weight.shape


def test_bad_inputs():
    hidden, weight, _, labels = _inputs(torch.float32, False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        linear_cross_entropy(hidden, weight, torch.full_like(labels, 301))
    with pytest.raises(ValueError, match="do not match"):
        linear_cross_entropy(hidden, weight[:, :10], labels)
    with pytest.raises(ValueError, match="labels"):
        linear_cross_entropy(hidden, weight, labels[:, :3])
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(hidden, weight, labels, reduction="mean_tokens")
    with pytest.raises(ValueError, match="vocab_size=302"):
        linear_cross_entropy(hidden, weight, labels, vocab_size=302)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        linear_cross_entropy(hidden, weight, torch.full_like(labels, 300), vocab_size=300)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_weight_grad_scaled_in_epilogue(dtype):
    """The last chunk's weight gradient from the extension's GEMM (upstream scalar read on the device, as alpha
    and beta) at an odd token count: three chunks, the last of 904 rows; and one chunk (no partial sum)."""
    from flash_kernels.linear_cross_entropy import _epilogue_scaling

    n, h, vocab = 5000, 1024, 32000
    hidden = torch.randn(n, h, device="cuda", dtype=dtype, requires_grad=True)
    weight = (torch.randn(vocab, h, device="cuda", dtype=dtype) / 32).requires_grad_()
    labels = torch.randint(0, vocab, (n,), device="cuda")
    assert _epilogue_scaling(torch.empty(1, vocab, device="cuda", dtype=dtype), hidden)  # the path under test is taken
    ref = linear_cross_entropy_ref(hidden.float(), weight.float(), labels, reduction="sum")
    want = torch.autograd.grad(ref, (hidden, weight), torch.tensor(0.37, device="cuda"))
    for chunk_size in (2048, 8192):
        loss = linear_cross_entropy(hidden, weight, labels, reduction="sum", chunk_size=chunk_size)
        assert_close(loss, ref, dtype)
        got = torch.autograd.grad(loss, (hidden, weight), torch.tensor(0.37, device="cuda"))
        for name, g, w in zip(["hidden", "weight"], got, want):
            assert_close(g, w.to(dtype), dtype, scale=2, name=f"grad {name}, chunk {chunk_size}")


@pytest.mark.gpu
def test_gpu_compile_fullgraph_takes_the_scaled_gemm(monkeypatch):
    """Under torch.compile (inductor) the backward's last weight-gradient GEMM is the custom op around the
    extension's epilogue-scaled GEMM: same gradients as the eager path."""
    n, h, vocab = 300, 64, 512
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(vocab, h, device="cuda", dtype=torch.bfloat16) / 8).requires_grad_()
    labels = torch.randint(0, vocab, (n,), device="cuda")

    def head_loss(x, w):
        return linear_cross_entropy(x, w, labels, chunk_size=128) * 3.0  # an upstream gradient of 3

    lce_module = importlib.import_module("flash_kernels.linear_cross_entropy")
    compiled = torch.compile(head_loss, fullgraph=True)
    extensions = []  # what each call of the scaled GEMM's op got
    find_extension = lce_module._scaling_extension

    def counted():
        extensions.append(find_extension())
        return extensions[-1]

    monkeypatch.setattr(lce_module, "_scaling_extension", counted)
    got = torch.autograd.grad(compiled(hidden, weight), (hidden, weight))
    assert len(extensions) == 1 and extensions[0] is not None
    want = torch.autograd.grad(head_loss(hidden, weight), (hidden, weight))
    for name, g, w in zip(["hidden", "weight"], got, want):
        assert_close(g, w, torch.bfloat16, name=f"grad {name}")


class _LogitsWatch:
    """torch.nn.functional for linear_cross_entropy's module, whose ``linear`` (one chunk's logits) checks that
    no earlier chunk's logits buffer is still alive when it makes the next."""

    def __init__(self):
        self.chunks = []

    def __getattr__(self, name):
        return getattr(torch.nn.functional, name)

    def linear(self, *args, **kwargs):
        alive = sum(ref() is not None for ref in self.chunks)
        assert alive == 0, f"{alive} earlier chunk(s) of logits alive while the next is made"
        out = torch.nn.functional.linear(*args, **kwargs)
        self.chunks.append(weakref.ref(out))
        return out


@pytest.mark.parametrize("padded", [False, True])
def test_one_chunk_of_logits_alive_at_a_time(monkeypatch, padded):
    """The chunk loop drops each chunk's logits (and every view of them) before it makes the next: the forward's
    memory is one chunk of logits, not two. Padded: the classes are a view of the first vocab_size columns."""
    lce = importlib.import_module("flash_kernels.linear_cross_entropy")
    watch = _LogitsWatch()
    monkeypatch.setattr(lce, "F", watch)
    hidden, weight, _, labels = _inputs(torch.float32, False, vocab=256)
    vocab_size = 251 if padded else None
    if padded:
        labels = torch.where(labels >= vocab_size, vocab_size - 1, labels)
    loss = linear_cross_entropy(hidden, weight, labels, chunk_size=8, vocab_size=vocab_size, backend="triton")
    loss.backward()
    assert len(watch.chunks) >= 5  # 45 rows in chunks of 8: the check ran between chunks


@pytest.mark.gpu
def test_gpu_forward_holds_one_chunk_of_logits():
    """The forward's memory: the gradients it returns (hidden's and weight's) plus one chunk of logits at a time,
    not two (a chunk's buffer is dropped before the next chunk's logits are allocated)."""
    n, h, vocab, chunk = 4096, 1024, 128256, 1024
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(vocab, h, device="cuda", dtype=torch.bfloat16) / 32).requires_grad_()
    labels = torch.randint(0, vocab, (n,), device="cuda")
    linear_cross_entropy(hidden, weight, labels, chunk_size=chunk)  # warm-up: kernels and CE workspace
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = linear_cross_entropy(hidden, weight, labels, chunk_size=chunk)
    peak = torch.cuda.max_memory_allocated() - base
    chunk_bytes = chunk * vocab * 2
    assert peak < 2 * (weight.numel() + hidden.numel()) + 1.5 * chunk_bytes, peak / 2**20
    del loss


@pytest.mark.gpu
def test_gpu_llama_head():
    n, h, vocab = 4096, 4096, 128256
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(vocab, h, device="cuda", dtype=torch.bfloat16) / 64).requires_grad_()
    labels = torch.randint(0, vocab, (n,), device="cuda")
    loss = linear_cross_entropy(hidden, weight, labels)
    ref = linear_cross_entropy_ref(hidden, weight, labels)
    assert_close(loss, ref, torch.bfloat16)
    got = torch.autograd.grad(loss, (hidden, weight))
    want = torch.autograd.grad(ref, (hidden, weight))
    for g, w in zip(got, want):
        assert_close(g, w, torch.bfloat16, scale=2)


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [50257, 151936])
def test_gpu_real_vocabularies_with_smoothing(vocab):
    """GPT-2's vocabulary (no multiple of 16: the weight padded to aligned rows, each row's last block loaded
    masked) and Qwen2's (19 statistics slices a row), with ignored rows and label smoothing."""
    n, h = 4096, 768
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(vocab, h, device="cuda", dtype=torch.bfloat16) / 32).requires_grad_()
    labels = torch.randint(0, vocab, (n,), device="cuda")
    labels[::7] = -100
    loss = linear_cross_entropy(hidden, weight, labels, label_smoothing=0.1)
    ref = linear_cross_entropy_ref(hidden.float(), weight.float(), labels, label_smoothing=0.1)
    assert_close(loss, ref, torch.bfloat16)
    got = torch.autograd.grad(loss, (hidden, weight))
    want = torch.autograd.grad(ref, (hidden, weight))
    for name, g, w in zip(["hidden", "weight"], got, want):
        assert_close(g, w.to(g.dtype), torch.bfloat16, scale=2, name=f"grad {name}")


@pytest.mark.parametrize("backend", ["reference", "triton", "auto"])
def test_all_labels_ignored_gives_nan_as_torch_with_zero_gradients(backend):
    hidden, weight, b, labels = _inputs(torch.float32, bias=True)
    labels = torch.full_like(labels, -100)
    loss = linear_cross_entropy(hidden, weight, labels, bias=b, chunk_size=16, backend=backend)
    assert loss.isnan()
    loss.backward()
    for grad in (hidden.grad, weight.grad, b.grad):
        assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("backend", ["triton", "auto", "reference"])
def test_one_token_without_a_batch_dim(backend):
    """hidden (H,) and a 0-d label: one token's loss, as F.cross_entropy gives it (reduction="none": 0-d too)."""
    hidden, weight = torch.randn(24, device=DEVICE), torch.randn(301, 24, device=DEVICE)
    label = torch.tensor(7, device=DEVICE)
    want = torch.nn.functional.cross_entropy((weight @ hidden)[None], label[None])
    for reduction in ("mean", "none"):
        got = linear_cross_entropy(hidden, weight, label, reduction=reduction, backend=backend)
        assert got.shape == () and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
