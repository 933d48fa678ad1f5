"""HF's classification losses for the encoder heads: which loss a ``problem_type`` (or the labels) asks for."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flash_kernels._backend import check_ids_in_range

PROBLEM_TYPES = (None, "regression", "single_label_classification", "multi_label_classification")


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position, -100 ignored; logits (..., classes), labels (...)."""
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} must be {tuple(logits.shape[:-1])}")
    classes = logits.shape[-1]
    # Else torch's IndexError (a device assert on CUDA) names neither the labels nor the fix.
    check_ids_in_range(labels, classes, ignore=-100,
                       message=f"labels must be class ids in [0, {classes}) (the logits' classes) or -100 (ignored)")
    return F.cross_entropy(logits.reshape(-1, classes).float(), labels.reshape(-1).long(), ignore_index=-100)


def classification_loss(logits: torch.Tensor, labels: torch.Tensor, *, problem_type: str | None) -> torch.Tensor:
    """HF's rule for (B, num_labels) logits: regression for one label, else single-label (integer labels) or
    multi-label (float labels), unless the config names the problem type."""
    if problem_type is None:
        if logits.shape[-1] == 1:
            problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            problem_type = "single_label_classification"
        else:
            problem_type = "multi_label_classification"
    if problem_type == "regression":
        if logits.shape[-1] == 1:  # one target per example: labels (B,) or (B, 1)
            return F.mse_loss(logits.squeeze(-1).float(), labels.float().reshape(logits.shape[:-1]))
        if labels.shape != logits.shape:  # several targets per example (HF: num_labels > 1)
            raise ValueError(f"regression labels shape {tuple(labels.shape)} must be the logits' {tuple(logits.shape)}")
        return F.mse_loss(logits.float(), labels.float())
    if problem_type == "single_label_classification":
        if labels.dim() == logits.dim() and labels.shape[-1] == 1:  # (B, 1) class ids: HF flattens them too
            labels = labels.squeeze(-1)
        return cross_entropy(logits, labels)
    return F.binary_cross_entropy_with_logits(logits.float(), labels.float())
