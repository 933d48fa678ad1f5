"""Cross-entropy over a large vocabulary, with label smoothing, z-loss and logit scaling.

The Triton forward streams each row of logits once (online max/sum-of-exp in float32 registers), so bf16
logits are never upcast to a float32 copy of the matrix; the backward recomputes the softmax from the saved
per-row log-sum-exp, optionally writing the gradient over the logits buffer (``inplace_backward``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ._backend import check_ids_in_range, use_triton
from ._launch import lean_launch
from ._triton_compat import tl, triton
from ._triton_utils import as_rows, cdiv, eager_function, next_power_of_2, pick, warps_for_block

REDUCTIONS = ("mean", "sum", "none")


def mean_over_labelled(total: torch.Tensor, labelled: torch.Tensor) -> torch.Tensor:
    """``total`` / the number of labelled rows; NaN when no row is labelled, as torch's and HF's mean
    cross-entropy give, with zero gradients (the division never sees a zero, so the backward stays finite)."""
    return torch.where(labelled > 0, total / labelled.clamp(min=1), torch.full_like(total, float("nan")))


def cross_entropy_ref(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    logit_scale: float = 1.0,
    reduction: str = "mean",
    return_lse: bool = False,
):
    """Plain PyTorch reference in float32. logits (N, V), labels (N,). The mean is over non-ignored rows (NaN
    when every row is ignored, with zero gradients, as ``torch.nn.functional.cross_entropy``)."""
    z = logits.float() * logit_scale
    lse = torch.logsumexp(z, dim=-1)
    losses = F.cross_entropy(z, labels, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none")
    valid = labels != ignore_index
    if lse_square_scale:
        losses = losses + lse_square_scale * lse.square() * valid
    if reduction == "mean":
        loss = mean_over_labelled(losses.sum(), valid.sum())
    elif reduction == "sum":
        loss = losses.sum()
    else:
        loss = losses
    return (loss, lse) if return_lse else loss


def check_labels(labels: torch.Tensor, vocab_size: int, ignore_index: int, op: str) -> None:
    """Labels must lie in [0, vocab) or equal ignore_index; a silent out-of-range label corrupts the loss."""
    check_ids_in_range(
        labels, vocab_size, ignore=ignore_index,
        message=f"{op}: a label is outside the vocabulary [0, {vocab_size}); use ignore_index={ignore_index} for "
        "positions that carry no loss",
    )



# ----------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------

_FWD_BLOCK = 8192  # vocab elements per loop step of the forward (one program per row)
_BWD_BLOCK = 4096  # vocab elements per backward program (the grid covers rows x vocab blocks)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _ce_row_loss(
    base, LABELS, row, V, ignore_index, label_smoothing, lse_square_scale, logit_scale,
    HAS_SMOOTHING: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """(lse, loss, label, valid) of the row at ``base``, read once: online log-sum-exp, a running max and a
    sum rescaled whenever the max grows."""
    label = tl.load(LABELS + row).to(tl.int64)
    m = -float("inf")
    s = 0.0
    z_sum = 0.0
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V
        z = tl.load(base + cols, mask=mask, other=-float("inf")).to(tl.float32) * logit_scale
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
        if HAS_SMOOTHING:
            z_sum += tl.sum(tl.where(mask, z, 0.0), axis=0)
    lse = m + tl.log(s)
    valid = label != ignore_index
    z_label = tl.load(base + label, mask=valid, other=0.0).to(tl.float32) * logit_scale
    if HAS_SMOOTHING:
        # torch's definition: (1 - eps) * NLL(label) + eps * mean over classes of NLL(class).
        loss = lse - (1.0 - label_smoothing) * z_label - label_smoothing * z_sum / V
    else:
        loss = lse - z_label
    loss += lse_square_scale * lse * lse
    return lse, loss, label, valid


@lean_launch
@triton.jit
def _ce_fwd_kernel(
    LOGITS, LABELS, LOSS, LSE, stride_row, V, ignore_index, label_smoothing, lse_square_scale, logit_scale,
    HAS_SMOOTHING: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    lse, loss, label, valid = _ce_row_loss(LOGITS + row * stride_row, LABELS, row, V, ignore_index, label_smoothing,
                                           lse_square_scale, logit_scale, HAS_SMOOTHING, BLOCK_V)
    tl.store(LOSS + row, tl.where(valid, loss, 0.0))
    tl.store(LSE + row, lse)


@triton.jit
def _ce_grad(z, cols, label, lse, coef, p_coef, label_smoothing, V, logit_scale):
    """One block of d loss / d logits for scaled logits ``z``. d loss / d z = softmax * p_coef - coef *
    ((1 - eps) * onehot(label) + eps / V), where coef is the row's loss gradient and p_coef adds the z-loss
    and lse terms (d lse / d z = softmax); then the chain rule through z = logit_scale * logits."""
    g = tl.exp(z - lse) * p_coef - coef * label_smoothing / V
    g = tl.where(cols == label, g - coef * (1.0 - label_smoothing), g)
    return g * logit_scale


@lean_launch
@triton.jit
def _ce_bwd_kernel(
    LOGITS, DLOGITS, LABELS, LSE, DLOSS, DLSE, stride_row, stride_drow, V, ignore_index, label_smoothing,
    lse_square_scale, logit_scale, HAS_DLSE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    label = tl.load(LABELS + row).to(tl.int64)
    lse = tl.load(LSE + row)
    coef = tl.where(label != ignore_index, tl.load(DLOSS + row), 0.0)
    p_coef = coef * (1.0 + 2.0 * lse_square_scale * lse)
    if HAS_DLSE:
        p_coef += tl.load(DLSE + row)
    z = tl.load(LOGITS + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32) * logit_scale
    g = _ce_grad(z, cols, label, lse, coef, p_coef, label_smoothing, V, logit_scale)
    tl.store(DLOGITS + row * stride_drow + cols, g.to(DLOGITS.dtype.element_ty), mask=mask)


@lean_launch
@triton.jit
def _ce_fwd_bwd_kernel(
    LOGITS, LABELS, LOSS, DLOSS, stride_row, V, ignore_index, label_smoothing, lse_square_scale, logit_scale,
    HAS_SMOOTHING: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Loss and gradient of one row when its loss gradient DLOSS is known up front (a fused LM head scales it
    later): the forward's online pass, then a second pass that overwrites the row with its gradient. The
    second pass walks the row backwards, so it starts on the blocks the first pass read last, still in L2:
    the row comes from HBM once instead of twice (two kernels: one read each)."""
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_row
    lse, loss, label, valid = _ce_row_loss(base, LABELS, row, V, ignore_index, label_smoothing, lse_square_scale,
                                           logit_scale, HAS_SMOOTHING, BLOCK_V)
    tl.store(LOSS + row, tl.where(valid, loss, 0.0))
    coef = tl.where(valid, tl.load(DLOSS + row), 0.0)
    p_coef = coef * (1.0 + 2.0 * lse_square_scale * lse)
    blocks = tl.cdiv(V, BLOCK_V)
    for i in range(0, blocks):
        cols = (blocks - 1 - i) * BLOCK_V + tl.arange(0, BLOCK_V)
        mask = cols < V
        z = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32) * logit_scale
        g = _ce_grad(z, cols, label, lse, coef, p_coef, label_smoothing, V, logit_scale)
        tl.store(base + cols, g.to(LOGITS.dtype.element_ty), mask=mask)


def ce_rows_fwd(logits, labels, ignore_index, label_smoothing, lse_square_scale, logit_scale):
    N, V = logits.shape
    losses = torch.empty((N,), device=logits.device, dtype=torch.float32)
    lse = torch.empty((N,), device=logits.device, dtype=torch.float32)
    block = min(_FWD_BLOCK, next_power_of_2(V))
    _ce_fwd_kernel[(N,)](
        logits, labels, losses, lse, logits.stride(0), V, ignore_index, label_smoothing, lse_square_scale,
        logit_scale, HAS_SMOOTHING=label_smoothing > 0.0, BLOCK_V=block, num_warps=warps_for_block(block, elems_per_thread=16),
    )
    return losses, lse


def ce_rows_fwd_bwd_(logits, labels, dlosses, ignore_index, label_smoothing, lse_square_scale, logit_scale):
    """Per-row losses (float32), with the logits gradient for the per-row loss gradients ``dlosses`` written
    over ``logits`` in the same launch."""
    N, V = logits.shape
    losses = torch.empty((N,), device=logits.device, dtype=torch.float32)
    block = min(_FWD_BLOCK, next_power_of_2(V))
    _ce_fwd_bwd_kernel[(N,)](
        logits, labels, losses, dlosses, logits.stride(0), V, ignore_index, label_smoothing, lse_square_scale,
        logit_scale, HAS_SMOOTHING=label_smoothing > 0.0, BLOCK_V=block, num_warps=warps_for_block(block, elems_per_thread=16),
    )
    return losses


def ce_rows_bwd(logits, dlogits, labels, lse, dlosses, dlse, ignore_index, label_smoothing, lse_square_scale, logit_scale):
    """Writes the logits gradient into ``dlogits``, which may be ``logits`` itself."""
    N, V = logits.shape
    block = min(_BWD_BLOCK, next_power_of_2(V))
    _ce_bwd_kernel[(N, cdiv(V, block))](
        logits, dlogits, labels, lse, dlosses, dlse, logits.stride(0), dlogits.stride(0), V, ignore_index,
        label_smoothing, lse_square_scale, logit_scale, HAS_DLSE=dlse is not None, BLOCK_V=block,
        num_warps=warps_for_block(block),
    )


# ----------------------------------------------------------------------------------------------------------
# torch.library registration
# ----------------------------------------------------------------------------------------------------------


@torch.library.custom_op("flash_kernels::cross_entropy_fwd", mutates_args=())
def _ce_fwd_op(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, label_smoothing: float, lse_square_scale: float,
    logit_scale: float, inplace_backward: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return ce_rows_fwd(logits, labels, ignore_index, label_smoothing, lse_square_scale, logit_scale)


@_ce_fwd_op.register_fake
def _(logits, labels, ignore_index, label_smoothing, lse_square_scale, logit_scale, inplace_backward):
    n = logits.shape[0]
    return logits.new_empty((n,), dtype=torch.float32), logits.new_empty((n,), dtype=torch.float32)


@torch.library.custom_op("flash_kernels::cross_entropy_bwd", mutates_args=())
def _ce_bwd_op(
    logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, dlosses: torch.Tensor, dlse: Optional[torch.Tensor],
    ignore_index: int, label_smoothing: float, lse_square_scale: float, logit_scale: float,
) -> torch.Tensor:
    return _ce_bwd_new(logits, labels, lse, dlosses, dlse, ignore_index, label_smoothing, lse_square_scale, logit_scale)


@_ce_bwd_op.register_fake
def _(logits, labels, lse, dlosses, dlse, ignore_index, label_smoothing, lse_square_scale, logit_scale):
    return torch.empty_like(logits)


@torch.library.custom_op("flash_kernels::cross_entropy_bwd_", mutates_args=("logits",))
def _ce_bwd_inplace_op(
    logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, dlosses: torch.Tensor, dlse: Optional[torch.Tensor],
    ignore_index: int, label_smoothing: float, lse_square_scale: float, logit_scale: float,
) -> None:
    ce_rows_bwd(logits, logits, labels, lse, dlosses, dlse, ignore_index, label_smoothing, lse_square_scale, logit_scale)


def _ce_setup_context(ctx, inputs, output):
    logits, labels, ignore_index, label_smoothing, lse_square_scale, logit_scale, inplace_backward = inputs
    ctx.save_for_backward(logits, labels, output[1])
    ctx.args = (ignore_index, label_smoothing, lse_square_scale, logit_scale)
    ctx.inplace_backward = inplace_backward


def _ce_bwd_new(logits, labels, lse, dlosses, dlse, *args):
    dlogits = torch.empty_like(logits)
    ce_rows_bwd(logits, dlogits, labels, lse, dlosses, dlse, *args)
    return dlogits


def _ce_backward_with(bwd, bwd_inplace):
    """The backward, calling the custom ops (traced by torch.compile) or their implementations (eager)."""

    def backward(ctx, dlosses, dlse):
        logits, labels, lse = ctx.saved_tensors
        if dlosses is None:
            dlosses = torch.zeros_like(lse)
        if ctx.inplace_backward:
            bwd_inplace(logits, labels, lse, dlosses.contiguous(), dlse, *ctx.args)
            dlogits = logits
        else:
            dlogits = bwd(logits, labels, lse, dlosses.contiguous(), dlse, *ctx.args)
        return dlogits, None, None, None, None, None, None

    return backward


def _ce_bwd_inplace(logits, labels, lse, dlosses, dlse, *args):
    ce_rows_bwd(logits, logits, labels, lse, dlosses, dlse, *args)


_ce_fwd_op.register_autograd(_ce_backward_with(_ce_bwd_op, _ce_bwd_inplace_op), setup_context=_ce_setup_context)
_ce_eager = eager_function(
    "CrossEntropy", lambda logits, labels, *args: ce_rows_fwd(logits, labels, *args[:-1]), _ce_setup_context,
    _ce_backward_with(_ce_bwd_new, _ce_bwd_inplace),
)


# ----------------------------------------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------------------------------------


def _unsupported(logits: torch.Tensor, labels: torch.Tensor) -> str | None:
    if logits.dtype not in _DTYPES:
        return f"logits dtype {logits.dtype} (supported: float32, float16, bfloat16)"
    if labels.dtype not in (torch.int32, torch.int64):
        return f"labels dtype {labels.dtype} (use int64 or int32)"
    if logits.numel() == 0:
        return "an empty input"
    return None


def reduce_losses(losses: torch.Tensor, labels: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    """Per-row losses reduced as the reference does: the mean is over non-ignored rows."""
    if reduction == "mean":
        return mean_over_labelled(losses.sum(), (labels != ignore_index).sum())
    if reduction == "sum":
        return losses.sum()
    return losses


def cross_entropy_triton_rows(
    logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100, label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0, logit_scale: float = 1.0, inplace_backward: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (losses, lse) from the Triton kernels, differentiable; shared with linear_cross_entropy."""
    # Under torch.compile the graph is functional: an in-place backward would be copied anyway.
    inplace = inplace_backward and not torch.compiler.is_compiling()
    return pick(_ce_fwd_op, _ce_eager)(as_rows(logits), labels, int(ignore_index), float(label_smoothing), float(lse_square_scale),
                      float(logit_scale), inplace)


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    logit_scale: float = 1.0,
    reduction: str = "mean",
    inplace_backward: bool = False,
    return_lse: bool = False,
    backend: str | None = None,
):
    """Cross-entropy of logits (N, V) against labels (N,). See ``cross_entropy_ref`` for the exact function.

    The loss is float32. ``inplace_backward=True`` writes the logits gradient over ``logits`` (saving a buffer
    the size of the logits; the logits are garbage afterwards). ``return_lse`` also returns the per-row
    log-sum-exp of the scaled logits, which is differentiable too. Labels are range-checked in eager mode (a
    host sync); under torch.compile the check is skipped and an out-of-range label gives an undefined loss.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"cross_entropy: reduction={reduction!r}; use one of {REDUCTIONS}")
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(f"cross_entropy: expected logits (N, V) and labels (N,), got {tuple(logits.shape)} and {tuple(labels.shape)}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"cross_entropy: label_smoothing={label_smoothing} must be in [0, 1]")
    if not torch.compiler.is_compiling():
        check_labels(labels, logits.shape[-1], ignore_index, "cross_entropy")
    if not use_triton(backend, logits, op="cross_entropy", unsupported=_unsupported(logits, labels)):
        return cross_entropy_ref(
            logits, labels, ignore_index=ignore_index, label_smoothing=label_smoothing,
            lse_square_scale=lse_square_scale, logit_scale=logit_scale, reduction=reduction, return_lse=return_lse,
        )
    losses, lse = cross_entropy_triton_rows(
        logits, labels, ignore_index=ignore_index, label_smoothing=label_smoothing,
        lse_square_scale=lse_square_scale, logit_scale=logit_scale, inplace_backward=inplace_backward,
    )
    loss = reduce_losses(losses, labels, ignore_index, reduction)
    return (loss, lse) if return_lse else loss
