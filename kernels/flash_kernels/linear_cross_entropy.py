"""Fused LM-head projection + cross-entropy, chunked over tokens so the (N, V) logits never exist at once.

For each chunk of tokens: logits = hidden_chunk @ weight.T (+ bias), then one cross-entropy launch writes the
loss and, over the same logits buffer, the logits gradient (each row read from HBM once); two GEMMs turn that into the chunk's hidden
gradient and its contribution to the weight gradient. Peak memory is one chunk of logits plus the gradients,
instead of the full logits, their float32 upcast and their gradient.

Why the gradients are computed in the forward (as Liger does) rather than recomputed in the backward: a
recompute would repeat the logits GEMM, 4 GEMMs instead of 3 (~33% more matmul work for the largest GEMMs of
a small model), while storing costs only buffers the size of hidden and weight, which the backward must
produce anyway. With reduction "mean"/"sum" the upstream gradient is one scalar, so the stored gradients are
scaled by it in the backward. With reduction "none" every row has its own upstream gradient, unknown in the
forward, so the backward recomputes chunk by chunk instead.

The chunk loop runs the Triton cross-entropy kernels on CUDA (or the interpreter) and a plain PyTorch
cross-entropy otherwise, so the memory-lean path also works on the CPU.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from ._backend import check_backend_name, records_grad, use_triton
from ._triton_utils import eager_function, next_power_of_2, pick, placeholder
from .cross_entropy import REDUCTIONS, ce_rows_fwd, ce_rows_fwd_bwd_, check_labels, cross_entropy_ref


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
):
    """Plain PyTorch reference: the full logits in the input dtype, then ``cross_entropy_ref`` (float32)."""
    logits = F.linear(hidden.reshape(-1, hidden.shape[-1]), weight, bias)
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


def _chunked(hidden, weight, bias, labels, row_grad, *, chunk_size, ignore_index, label_smoothing, logit_scale,
             triton_ce):
    """Per-row losses and, when ``row_grad`` (N,) is given, the gradients scaled per row by it."""
    n, v = hidden.shape[0], weight.shape[0]
    need_grads = row_grad is not None
    losses = torch.empty((n,), device=hidden.device, dtype=torch.float32)
    dhidden = torch.empty_like(hidden) if need_grads else None
    # Accumulated in the weight's dtype by addmm (float32 inside each GEMM), as an unfused backward would: a
    # float32 accumulator would cost a (V, H) float32 buffer, the largest tensor of the whole op. The first
    # chunk writes it (no zero fill, no read of zeros): each pass over the (V, H) gradient is HBM traffic
    # that the GEMMs do not hide.
    alloc = torch.empty if n > 0 else torch.zeros  # no chunk at all: the gradients are zero
    dweight = alloc(weight.shape, device=weight.device, dtype=weight.dtype) if need_grads else None
    dbias = alloc((v,), device=hidden.device, dtype=torch.float32) if need_grads and bias is not None else None
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        h = hidden[start:end]
        logits = F.linear(h, weight, bias)  # (chunk, V)
        chunk_grad = row_grad[start:end] if need_grads else None
        losses[start:end], dlogits = _chunk_ce(logits, labels[start:end], chunk_grad, ignore_index, label_smoothing,
                                               logit_scale, triton_ce)
        if need_grads:
            torch.mm(dlogits, weight, out=dhidden[start:end])
            if start == 0:
                torch.mm(dlogits.t(), h, out=dweight)
            else:
                dweight.addmm_(dlogits.t(), h)
            if dbias is not None:
                if start == 0:
                    torch.sum(dlogits, 0, dtype=torch.float32, out=dbias)
                else:
                    dbias += dlogits.sum(0, dtype=torch.float32)
    return losses, dhidden, dweight, dbias


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
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor, ignore_index: int,
    label_smoothing: float, logit_scale: float, reduction: str, chunk_size: int, triton_ce: bool, compute_grads: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    grads_now = compute_grads and reduction != "none"
    row_grad = _row_grad(labels, ignore_index, reduction) if grads_now else None
    losses, dh, dw, db = _chunked(hidden, weight, bias, labels, row_grad, chunk_size=chunk_size,
                                  ignore_index=ignore_index, label_smoothing=label_smoothing,
                                  logit_scale=logit_scale, triton_ce=triton_ce)
    dev = hidden.device
    if reduction == "mean":
        loss = losses.sum() / (labels != ignore_index).sum().clamp(min=1)
    elif reduction == "sum":
        loss = losses.sum()
    else:
        loss = losses
    return (loss, dh if dh is not None else placeholder(dev, hidden.dtype),
            dw if dw is not None else placeholder(dev, weight.dtype),
            db.to(bias.dtype) if db is not None else placeholder(dev))


_lce_fwd_op = torch.library.custom_op("flash_kernels::linear_cross_entropy_fwd", mutates_args=())(_lce_fwd)


@_lce_fwd_op.register_fake
def _(hidden, weight, bias, labels, ignore_index, label_smoothing, logit_scale, reduction, chunk_size, triton_ce,
      compute_grads):
    grads_now = compute_grads and reduction != "none"
    loss = hidden.new_empty((hidden.shape[0],) if reduction == "none" else (), dtype=torch.float32)
    dh = torch.empty_like(hidden) if grads_now else hidden.new_empty((0,))
    dw = torch.empty_like(weight) if grads_now else weight.new_empty((0,))
    db = torch.empty_like(bias) if grads_now and bias is not None else hidden.new_empty((0,), dtype=torch.float32)
    return loss, dh, dw, db


def _lce_bwd(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
    dlosses: torch.Tensor, ignore_index: int, label_smoothing: float, logit_scale: float, chunk_size: int,
    triton_ce: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _, dh, dw, db = _chunked(hidden, weight, bias, labels, dlosses.float().contiguous(), chunk_size=chunk_size,
                             ignore_index=ignore_index, label_smoothing=label_smoothing, logit_scale=logit_scale,
                             triton_ce=triton_ce)
    return dh, dw, db.to(bias.dtype) if db is not None else placeholder(hidden.device)


_lce_bwd_op = torch.library.custom_op("flash_kernels::linear_cross_entropy_bwd", mutates_args=())(_lce_bwd)


@_lce_bwd_op.register_fake
def _(hidden, weight, bias, labels, dlosses, ignore_index, label_smoothing, logit_scale, chunk_size, triton_ce):
    db = torch.empty_like(bias) if bias is not None else hidden.new_empty((0,), dtype=torch.float32)
    return torch.empty_like(hidden), torch.empty_like(weight), db


def _lce_setup_context(ctx, inputs, output):
    hidden, weight, bias, labels, ignore_index, label_smoothing, logit_scale, reduction, chunk_size, triton_ce, _ = inputs
    ctx.reduction = reduction
    ctx.has_bias = bias is not None
    if reduction == "none":
        ctx.save_for_backward(hidden, weight, bias, labels)
        ctx.args = (ignore_index, label_smoothing, logit_scale, chunk_size, triton_ce)
    else:
        ctx.save_for_backward(*output[1:])


def _lce_backward_with(bwd):
    def backward(ctx, dloss, _ddh, _ddw, _ddb):
        if ctx.reduction == "none":
            hidden, weight, bias, labels = ctx.saved_tensors
            dh, dw, db = bwd(hidden, weight, bias, labels, dloss, *ctx.args)
        else:
            dh, dw, db = (g * dloss.to(g.dtype) for g in ctx.saved_tensors)
        return dh, dw, db if ctx.has_bias else None, None, None, None, None, None, None, None, None

    return backward


_lce_fwd_op.register_autograd(_lce_backward_with(_lce_bwd_op), setup_context=_lce_setup_context)
_lce_eager = eager_function("LinearCrossEntropy", _lce_fwd, _lce_setup_context, _lce_backward_with(_lce_bwd))


# ----------------------------------------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------------------------------------


MIN_CHUNK_ROWS = 2048


def default_chunk_size(n_tokens: int, hidden_size: int, vocab_size: int) -> int:
    """Tokens per chunk: a chunk of logits two to four times the size of the hidden states, a power of two, and
    at least MIN_CHUNK_ROWS rows. Bigger chunks make the weight-gradient GEMM (whose reduction dim is the chunk)
    more efficient, and every chunk costs five launches: GPT-2's head over 16k tokens in 512-row chunks was 160
    launches a step, more host time than GPU time on an H200. A 2048-row chunk of a 128k vocabulary is 0.5 GB
    of bf16 logits, still small next to the unfused op's (N, V) logits and their float32 copies."""
    target = next_power_of_2(math.ceil(2 * n_tokens * hidden_size / max(vocab_size, 1)))
    return max(1, min(n_tokens, max(MIN_CHUNK_ROWS, target)))


def _check(hidden, weight, labels, bias, reduction, label_smoothing, chunk_size):
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
    backend: str | None = None,
):
    """cross_entropy(logit_scale * (hidden @ weight.T + bias), labels) without materialising the logits.

    hidden (..., H), weight (V, H), labels (...). Gradients flow to hidden, weight and bias. backend "reference"
    is the unfused oracle; otherwise the chunked path runs, with the Triton cross-entropy where it can run
    (CUDA, or the interpreter when asked for "triton") and PyTorch's elsewhere.
    """
    _check(hidden, weight, labels, bias, reduction, label_smoothing, chunk_size)
    if not torch.compiler.is_compiling():
        check_labels(labels, weight.shape[0], ignore_index, "linear_cross_entropy")
    if check_backend_name(backend) == "reference":
        return linear_cross_entropy_ref(hidden, weight, labels, bias=bias, ignore_index=ignore_index,
                                        label_smoothing=label_smoothing, logit_scale=logit_scale, reduction=reduction)
    unsupported = None if hidden.dtype in (torch.float32, torch.float16, torch.bfloat16) else f"dtype {hidden.dtype}"
    triton_ce = use_triton(backend, hidden, op="linear_cross_entropy", unsupported=unsupported)
    h2 = hidden.reshape(-1, hidden.shape[-1])
    n = h2.shape[0]
    chunk = chunk_size or default_chunk_size(n, weight.shape[1], weight.shape[0])
    needs_grad = records_grad(hidden, weight, bias)
    loss, _, _, _ = pick(_lce_fwd_op, _lce_eager)(h2.contiguous(), weight.contiguous(), bias, labels.reshape(-1), int(ignore_index),
                                float(label_smoothing), float(logit_scale), reduction, int(chunk), triton_ce,
                                needs_grad)
    return loss.view(labels.shape) if reduction == "none" else loss
