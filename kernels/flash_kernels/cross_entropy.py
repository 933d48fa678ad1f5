"""Cross-entropy over a large vocabulary, with label smoothing, z-loss and logit scaling."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._backend import use_triton

REDUCTIONS = ("mean", "sum", "none")


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
    """Plain PyTorch reference in float32. logits (N, V), labels (N,). The mean is over non-ignored rows."""
    z = logits.float() * logit_scale
    lse = torch.logsumexp(z, dim=-1)
    losses = F.cross_entropy(z, labels, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none")
    valid = labels != ignore_index
    if lse_square_scale:
        losses = losses + lse_square_scale * lse.square() * valid
    if reduction == "mean":
        loss = losses.sum() / valid.sum().clamp(min=1)
    elif reduction == "sum":
        loss = losses.sum()
    else:
        loss = losses
    return (loss, lse) if return_lse else loss


def check_labels(labels: torch.Tensor, vocab_size: int, ignore_index: int, op: str) -> None:
    """Labels must lie in [0, vocab) or equal ignore_index; a silent out-of-range label corrupts the loss."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))
    if bad.any():
        first = labels[bad][0].item()
        raise ValueError(
            f"{op}: label {first} is outside the vocabulary [0, {vocab_size}); use ignore_index={ignore_index} "
            "for positions that carry no loss"
        )


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
    """Cross-entropy of logits (N, V) against labels (N,). See ``cross_entropy_ref`` for the exact function."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"cross_entropy: reduction={reduction!r}; use one of {REDUCTIONS}")
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(f"cross_entropy: expected logits (N, V) and labels (N,), got {tuple(logits.shape)} and {tuple(labels.shape)}")
    check_labels(labels, logits.shape[-1], ignore_index, "cross_entropy")
    use_triton(backend, logits, op="cross_entropy", unsupported="no Triton cross_entropy kernel is built yet")
    return cross_entropy_ref(
        logits, labels, ignore_index=ignore_index, label_smoothing=label_smoothing,
        lse_square_scale=lse_square_scale, logit_scale=logit_scale, reduction=reduction, return_lse=return_lse,
    )
