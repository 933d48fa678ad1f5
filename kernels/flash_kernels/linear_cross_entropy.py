"""Fused LM-head projection + cross-entropy, chunked over tokens so the (N, V) logits never exist at once.

For each chunk of tokens: logits = hidden_chunk @ weight.T (+ bias), then one cross-entropy launch writes the
loss and, over the same logits buffer, the logits gradient (each row read from HBM once); two GEMMs turn that into the chunk's hidden
gradient and its contribution to the weight gradient. Peak memory is one chunk of logits plus the gradients,
instead of the full logits, their float32 upcast and their gradient.

Why the gradients are computed in the forward (as Liger does) rather than recomputed in the backward: a
recompute would repeat the logits GEMM, 4 GEMMs instead of 3 (~33% more matmul work for the largest GEMMs of
a small model), while storing costs only buffers the size of hidden and weight, which the backward must
produce anyway. With reduction "mean"/"sum" the upstream gradient is one scalar, so the stored gradients are
scaled by it in the backward. Scaling the weight gradient would be a pass of its own over the largest tensor
of the op, so the last chunk's weight-gradient GEMM waits for the backward and takes the scalar, read on the
device, into its epilogue (``fused_dense``'s cuBLASLt extension, where it runs); the price is that chunk's
logits gradient, kept from the forward to the backward. With reduction "none" every row has its own upstream
gradient, unknown in the forward, so the backward recomputes chunk by chunk instead.

The chunk loop runs the Triton cross-entropy kernels on CUDA (or the interpreter) and a plain PyTorch
cross-entropy otherwise, so the memory-lean path also works on the CPU.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ._backend import check_backend_name, records_grad, use_triton
from ._triton_utils import eager_function, pick, placeholder
from .cross_entropy import (
    REDUCTIONS, ce_rows_fwd, ce_rows_fwd_bwd_, check_labels, cross_entropy_ref, index_labels, mean_over_labelled,
)


def linear_cross_entropy_ref(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    logit_scale: float = 1.0,
    reduction: str = "mean",
    vocab_size: int | None = None,
):
    """Plain PyTorch reference: the full logits in the input dtype, then ``cross_entropy_ref`` (float32)."""
    logits = F.linear(hidden.reshape(-1, hidden.shape[-1]), weight, bias)[:, :vocab_size]
    loss = cross_entropy_ref(logits, labels.reshape(-1), ignore_index=ignore_index, label_smoothing=label_smoothing,
                             logit_scale=logit_scale, reduction=reduction)
    return loss.view(labels.shape) if reduction == "none" else loss


# ----------------------------------------------------------------------------------------------------------
# One chunk: loss per row and the logits gradient, by Triton kernels or by PyTorch
# ----------------------------------------------------------------------------------------------------------


def _chunk_ce_torch(logits, labels, row_grad, ignore_index, label_smoothing, logit_scale):
    z = logits.float() * logit_scale
    logp = torch.log_softmax(z, dim=-1)
    valid = labels != ignore_index
    safe = torch.where(valid, labels, 0).unsqueeze(-1)
    nll = -logp.gather(-1, safe).squeeze(-1)
    losses = (1.0 - label_smoothing) * nll - label_smoothing * logp.mean(-1) if label_smoothing else nll
    losses = losses * valid
    if row_grad is None:
        return losses, None
    grad = logp.exp_()
    grad.scatter_add_(-1, safe, torch.full_like(safe, -(1.0 - label_smoothing), dtype=grad.dtype))
    if label_smoothing:
        grad -= label_smoothing / z.shape[-1]
    grad *= (row_grad * valid * logit_scale).unsqueeze(-1)
    return losses, grad.to(logits.dtype)


def _chunk_ce(logits, labels, row_grad, ignore_index, label_smoothing, logit_scale, triton_ce):
    """(losses (n,), dlogits (n, V) written over ``logits`` on the Triton path, or None without row_grad)."""
    if not triton_ce:
        return _chunk_ce_torch(logits, labels, row_grad, ignore_index, label_smoothing, logit_scale)
    if row_grad is None:
        return ce_rows_fwd(logits, labels, ignore_index, label_smoothing, 0.0, logit_scale)[0], None
    return ce_rows_fwd_bwd_(logits, labels, row_grad, ignore_index, label_smoothing, 0.0, logit_scale), logits


def _class_grad_full_width(logits, dclasses, vocab_size):
    """The chunk's (n, V) logits gradient, written over its logits buffer: ``dclasses`` (n, vocab_size) in the
    classes' columns (the Triton kernel wrote it there already), zero in the pad columns past them."""
    if dclasses.data_ptr() != logits.data_ptr():
        logits[:, :vocab_size].copy_(dclasses)
    logits[:, vocab_size:].zero_()
    return logits


def _chunked(hidden, weight, bias, labels, row_grad, *, vocab_size, chunk_size, ignore_index, label_smoothing,
             logit_scale, triton_ce, defer_last=False):
    """(losses, dhidden, dweight, dbias, last_dlogits): per-row losses and, when ``row_grad`` (N,) is given, the
    gradients scaled per row by it. The classes are the first ``vocab_size`` rows of weight; the logits of the
    rows past them (a vocabulary padded for aligned GEMMs) are cut off and get a zero gradient. With ``defer_last`` the last chunk's weight-gradient GEMM is the caller's:
    dweight holds the other chunks' sum (empty when there is exactly one chunk) and last_dlogits is the last
    chunk's logits gradient ((0, V) when there is no chunk); without it last_dlogits is None."""
    n, v = hidden.shape[0], weight.shape[0]
    need_grads = row_grad is not None
    defer_last = defer_last and need_grads
    losses = torch.empty((n,), device=hidden.device, dtype=torch.float32)
    dhidden = torch.empty_like(hidden) if need_grads else None
    # Accumulated in the weight's dtype by addmm (float32 inside each GEMM), as an unfused backward would: a
    # float32 accumulator would cost a (V, H) float32 buffer, the largest tensor of the whole op. The first
    # chunk writes it (no zero fill, no read of zeros): each pass over the (V, H) gradient is HBM traffic
    # that the GEMMs do not hide.
    dweight = dbias = None
    if need_grads:
        if defer_last and 0 < n <= chunk_size:
            dweight = weight.new_empty((0,))  # the one chunk's GEMM is the caller's
        else:
            dweight = (torch.empty if n > 0 else torch.zeros)(weight.shape, device=weight.device, dtype=weight.dtype)
        if bias is not None:
            dbias = (torch.empty if n > 0 else torch.zeros)((v,), device=hidden.device, dtype=torch.float32)
    last_dlogits = hidden.new_empty((0, v)) if defer_last else None
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        h = hidden[start:end]
        logits = F.linear(h, weight, bias)  # (chunk, V)
        chunk_grad = row_grad[start:end] if need_grads else None
        classes = logits[:, :vocab_size] if vocab_size < v else logits  # a view: the kernels take a row stride
        losses[start:end], dlogits = _chunk_ce(classes, labels[start:end], chunk_grad, ignore_index, label_smoothing,
                                               logit_scale, triton_ce)
        if need_grads and vocab_size < v:
            dlogits = _class_grad_full_width(logits, dlogits, vocab_size)
        if need_grads:
            torch.mm(dlogits, weight, out=dhidden[start:end])
            if defer_last and end == n:
                last_dlogits = dlogits
            elif start == 0:
                torch.mm(dlogits.t(), h, out=dweight)
            else:
                dweight.addmm_(dlogits.t(), h)
            if dbias is not None:
                if start == 0:
                    torch.sum(dlogits, 0, dtype=torch.float32, out=dbias)
                else:
                    dbias += dlogits.sum(0, dtype=torch.float32)
        logits = classes = dlogits = None  # freed before the next chunk's logits exist: one chunk at a time, not two
    return losses, dhidden, dweight, dbias, last_dlogits


def _scaled_weight_grad(partial: torch.Tensor, dlogits: torch.Tensor, h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """scale * (partial + dlogits.T @ h), partial empty for none: one GEMM whose epilogue reads the scalar on the
    device (``fused_dense``'s extension) where that runs, else the GEMM and then a multiply."""
    if dlogits.shape[0] == 0:  # no token at all: partial holds the zeros
        return partial * scale
    ext = _scaling_extension() if _epilogue_scaling(dlogits, h) else None
    if ext is not None:
        return ext.linear_wgrad_scaled(h, dlogits, partial, scale.float().reshape(1).contiguous())
    dw = torch.mm(dlogits.t(), h) if partial.numel() == 0 else torch.addmm(partial, dlogits.t(), h)
    return dw.mul_(scale)


def _epilogue_scaling(dlogits: torch.Tensor, h: torch.Tensor) -> bool:
    """Whether ``_scaled_weight_grad`` takes the cuBLASLt GEMM (else torch, with a pass for the scale)."""
    if not h.is_cuda:  # the extension is CUDA's; its module imports torch._dynamo, seconds of a CPU program's start
        return False
    from .fused_dense import gemm_unsupported

    return gemm_unsupported(h, (dlogits.shape[1], h.shape[1])) is None


def _scaling_extension():
    """The fused_dense extension, or None (one warning) when its build fails: for this op it only saves a pass
    over the weight gradient, so a broken toolchain should cost that pass and not stop a training run."""
    from .fused_dense import optional_extension

    return optional_extension("linear_cross_entropy", "the weight gradient is scaled in a separate pass (slower, "
                              "and rounded twice rather than once)")


_scaled_weight_grad_op = torch.library.custom_op("flash_kernels::linear_ce_scaled_weight_grad",
                                                 mutates_args=())(_scaled_weight_grad)


@_scaled_weight_grad_op.register_fake
def _(partial, dlogits, h, scale):
    return h.new_empty((dlogits.shape[1], h.shape[1]))


def _row_grad(labels, ignore_index, reduction):
    """Per-row upstream gradient for a unit upstream gradient of the reduced loss."""
    n = labels.shape[0]
    ones = torch.ones((n,), device=labels.device, dtype=torch.float32)
    if reduction == "mean":
        return ones / (labels != ignore_index).sum().clamp(min=1)
    return ones


# ----------------------------------------------------------------------------------------------------------
# torch.library registration
# ----------------------------------------------------------------------------------------------------------


def _lce_fwd(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor, vocab_size: int,
    ignore_index: int, label_smoothing: float, logit_scale: float, reduction: str, chunk_size: int, triton_ce: bool,
    compute_grads: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, dhidden, dweight without the last chunk's GEMM, dbias, the last chunk's logits gradient), the
    gradients for a unit upstream gradient; placeholders for those not computed."""
    grads_now = compute_grads and reduction != "none"
    row_grad = _row_grad(labels, ignore_index, reduction) if grads_now else None
    losses, dh, dw, db, last = _chunked(hidden, weight, bias, labels, row_grad, vocab_size=vocab_size, chunk_size=chunk_size,
                                        ignore_index=ignore_index, label_smoothing=label_smoothing,
                                        logit_scale=logit_scale, triton_ce=triton_ce, defer_last=True)
    dev = hidden.device
    if reduction == "mean":
        loss = mean_over_labelled(losses.sum(), (labels != ignore_index).sum())
    elif reduction == "sum":
        loss = losses.sum()
    else:
        loss = losses
    return (loss, dh if dh is not None else placeholder(dev, hidden.dtype),
            dw if dw is not None else placeholder(dev, weight.dtype),
            db.to(bias.dtype) if db is not None else placeholder(dev),
            last if last is not None else placeholder(dev, hidden.dtype))


_lce_fwd_op = torch.library.custom_op("flash_kernels::linear_cross_entropy_fwd", mutates_args=())(_lce_fwd)


@_lce_fwd_op.register_fake
def _(hidden, weight, bias, labels, vocab_size, ignore_index, label_smoothing, logit_scale, reduction, chunk_size,
      triton_ce, compute_grads):
    grads_now = compute_grads and reduction != "none"
    loss = hidden.new_empty((hidden.shape[0],) if reduction == "none" else (), dtype=torch.float32)
    dh = torch.empty_like(hidden) if grads_now else hidden.new_empty((0,))
    n, v = hidden.shape[0], weight.shape[0]
    one_chunk = grads_now and 0 < n <= chunk_size  # then the only dW GEMM is the backward's
    dw = torch.empty_like(weight) if grads_now and not one_chunk else weight.new_empty((0,))
    db = torch.empty_like(bias) if grads_now and bias is not None else hidden.new_empty((0,), dtype=torch.float32)
    last_rows = n - (n - 1) // chunk_size * chunk_size if n > 0 else 0
    last = hidden.new_empty((last_rows, v)) if grads_now else hidden.new_empty((0,))
    return loss, dh, dw, db, last


def _lce_bwd(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
    dlosses: torch.Tensor, vocab_size: int, ignore_index: int, label_smoothing: float, logit_scale: float,
    chunk_size: int, triton_ce: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _, dh, dw, db, _ = _chunked(hidden, weight, bias, labels, dlosses.float().contiguous(), vocab_size=vocab_size,
                                chunk_size=chunk_size,
                                ignore_index=ignore_index, label_smoothing=label_smoothing, logit_scale=logit_scale,
                                triton_ce=triton_ce)
    return dh, dw, db.to(bias.dtype) if db is not None else placeholder(hidden.device)


_lce_bwd_op = torch.library.custom_op("flash_kernels::linear_cross_entropy_bwd", mutates_args=())(_lce_bwd)


@_lce_bwd_op.register_fake
def _(hidden, weight, bias, labels, dlosses, vocab_size, ignore_index, label_smoothing, logit_scale, chunk_size,
      triton_ce):
    db = torch.empty_like(bias) if bias is not None else hidden.new_empty((0,), dtype=torch.float32)
    return torch.empty_like(hidden), torch.empty_like(weight), db


def _lce_setup_context(ctx, inputs, output):
    hidden, weight, bias, labels, vocab_size, ignore_index, label_smoothing, logit_scale, reduction, chunk_size, triton_ce, _ = inputs
    ctx.reduction = reduction
    ctx.has_bias = bias is not None
    if reduction == "none":
        ctx.save_for_backward(hidden, weight, bias, labels)
        ctx.args = (vocab_size, ignore_index, label_smoothing, logit_scale, chunk_size, triton_ce)
    else:
        ctx.save_for_backward(hidden, *output[1:])


def _lce_backward_with(bwd, scaled_weight_grad):
    def backward(ctx, dloss, _ddh, _ddw, _ddb, _dlast):
        if ctx.reduction == "none":
            hidden, weight, bias, labels = ctx.saved_tensors
            dh, dw, db = bwd(hidden, weight, bias, labels, dloss, *ctx.args)
        else:
            hidden, dh, dw_partial, db, last = ctx.saved_tensors
            dw = scaled_weight_grad(dw_partial, last, hidden[hidden.shape[0] - last.shape[0]:], dloss)
            dh, db = (g * dloss.to(g.dtype) for g in (dh, db))
        return dh, dw, db if ctx.has_bias else None, None, None, None, None, None, None, None, None, None

    return backward


_lce_fwd_op.register_autograd(_lce_backward_with(_lce_bwd_op, _scaled_weight_grad_op), setup_context=_lce_setup_context)
_lce_eager = eager_function("LinearCrossEntropy", _lce_fwd, _lce_setup_context,
                            _lce_backward_with(_lce_bwd, _scaled_weight_grad))


# ----------------------------------------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------------------------------------


MIN_CHUNK_ROWS = 2048
MAX_CHUNK_ROWS = 8192


def default_chunk_size(n_tokens: int, hidden_size: int) -> int:
    """Tokens per chunk: the largest power of two up to twice the hidden size, within [MIN_CHUNK_ROWS,
    MAX_CHUNK_ROWS] and at most the token count.

    Twice the hidden size keeps a chunk of logits (rows x V) within twice the elements of the weight gradient,
    which the op holds anyway. Bigger chunks are faster: each chunk's weight-gradient GEMM reads and writes the
    whole (V, H) gradient in its epilogue, a cost per GEMM FLOP that falls as 1 / chunk and that the GEMM does
    not hide, and its reduction dim is the chunk. H100, 16k tokens, H 4096, V 128k, bf16 (docs/benchmarks.md,
    Fused ops, session 22): the three GEMMs took 72.2 ms of kernels in 2048-row chunks, 69.2 in 8192-row ones,
    68.5 unchunked (torch.compile). At 8192 rows the accumulating GEMM took 12.8 ms against the first one's
    12.4. By the 1 / chunk rule that difference halves with each doubling (not measured past 8192): not worth
    the memory. The floor keeps launches few: every chunk costs five, and GPT-2's head over 16k
    tokens in 512-row chunks was 160 launches a step, more host time than GPU time on an H200."""
    target = 1 << max(0, (2 * hidden_size).bit_length() - 1)
    return max(1, min(n_tokens, max(MIN_CHUNK_ROWS, min(MAX_CHUNK_ROWS, target))))


def _check(hidden, weight, labels, bias, reduction, label_smoothing, chunk_size, vocab_size):
    if reduction not in REDUCTIONS:
        raise ValueError(f"linear_cross_entropy: reduction={reduction!r}; use one of {REDUCTIONS}")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} "
                         "do not match: expected hidden (..., H) and weight (V, H)")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"linear_cross_entropy: labels {tuple(labels.shape)} != hidden.shape[:-1] {tuple(hidden.shape[:-1])}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"linear_cross_entropy: bias {tuple(bias.shape)} != ({weight.shape[0]},)")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"linear_cross_entropy: label_smoothing={label_smoothing} must be in [0, 1]")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"linear_cross_entropy: chunk_size={chunk_size} must be >= 1")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"linear_cross_entropy: hidden dtype {hidden.dtype} != weight dtype {weight.dtype}")
    if vocab_size is not None and not 1 <= vocab_size <= weight.shape[0]:
        raise ValueError(f"linear_cross_entropy: vocab_size={vocab_size} must be in [1, {weight.shape[0]}] (weight's rows)")


# Pad an unaligned weight to this many rows: see _aligned_rows.
ALIGNED_ROWS = 128


def _aligned_rows(weight, bias):
    """(weight, bias) with rows added up to a multiple of ALIGNED_ROWS when the row count is not 16-byte aligned.

    The logits' width is the row count: an odd one (GPT-2's 50257) makes each chunk's three GEMMs unaligned, and
    cuBLAS then falls back to kernels several times slower, which made this op slower than the unfused path at
    GPT-2's vocabulary. Padding costs one copy of the weight per call (and a slice of its gradient), far less
    than the GEMMs it speeds up; the pad rows lie past ``vocab_size`` and are ignored. A model pads its head
    once, at construction (flash_models.modules.vocab_padding), and never pays this."""
    rows = weight.shape[0]
    if rows * weight.element_size() % 16 == 0:
        return weight, bias
    extra = -(-rows // ALIGNED_ROWS) * ALIGNED_ROWS - rows
    return F.pad(weight, (0, 0, 0, extra)), (F.pad(bias, (0, extra)) if bias is not None else None)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    logit_scale: float = 1.0,
    reduction: str = "mean",
    chunk_size: int | None = None,
    vocab_size: int | None = None,
    backend: str | None = None,
):
    """cross_entropy(logit_scale * (hidden @ weight.T + bias), labels) without materialising the logits.

    hidden (..., H), weight (V, H), labels (...). Gradients flow to hidden, weight and bias. ``vocab_size``: the
    classes are weight's first ``vocab_size`` rows (default: all of them); the rows past it, a vocabulary padded
    for aligned GEMMs, are ignored (their logits never enter the softmax, their gradient is zero). backend
    "reference" is the unfused oracle; otherwise the chunked path runs, with the Triton cross-entropy where it
    can run (CUDA, or the interpreter when asked for "triton") and PyTorch's elsewhere.
    """
    _check(hidden, weight, labels, bias, reduction, label_smoothing, chunk_size, vocab_size)
    vocab_size = vocab_size or weight.shape[0]
    if not torch.compiler.is_compiling():
        check_labels(labels, vocab_size, ignore_index, "linear_cross_entropy")
    labels = index_labels(labels)
    if check_backend_name(backend) == "reference":
        return linear_cross_entropy_ref(hidden, weight, labels, bias=bias, ignore_index=ignore_index,
                                        label_smoothing=label_smoothing, logit_scale=logit_scale, reduction=reduction,
                                        vocab_size=vocab_size)
    unsupported = None if hidden.dtype in (torch.float32, torch.float16, torch.bfloat16) else f"dtype {hidden.dtype}"
    triton_ce = use_triton(backend, hidden, op="linear_cross_entropy", unsupported=unsupported)
    h2 = hidden.reshape(-1, hidden.shape[-1])
    n = h2.shape[0]
    chunk = chunk_size or default_chunk_size(n, weight.shape[1])
    needs_grad = records_grad(hidden, weight, bias)
    weight, bias = _aligned_rows(weight, bias)
    loss, _, _, _, _ = pick(_lce_fwd_op, _lce_eager)(h2.contiguous(), weight.contiguous(), bias, labels.reshape(-1),
                                int(vocab_size), int(ignore_index), float(label_smoothing), float(logit_scale),
                                reduction, int(chunk), triton_ce, needs_grad)
    return loss.view(labels.shape) if reduction == "none" else loss
