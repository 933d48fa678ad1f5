"""What the encoder and vision families share: an HF-style model base (backend checks, device and dtype,
save_pretrained) and HF's classification losses."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import flash_kernels

from ..config import ATTN_IMPLS, check_choice
from .hf_config import ModelConfig
from .hf_protocol import HFModelProtocol
from .outputs import EncoderOutput, HeadOutput  # noqa: F401  (the families import them from here)

PROBLEM_TYPES = (None, "regression", "single_label_classification", "multi_label_classification")


class PretrainedModel(HFModelProtocol, nn.Module):
    def _setup(self, config, attn_impl: str, kernel_backend: str) -> None:
        check_choice("attn_impl", attn_impl, ATTN_IMPLS)
        flash_kernels._backend.check_backend_name(kernel_backend)
        self.attn_impl, self.kernel_backend = attn_impl, kernel_backend
        self.config = ModelConfig(config, architecture=type(self).__name__)  # wraps the family's frozen config

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def save_pretrained(self, save_directory, **kwargs) -> None:
        from ..checkpoint import save_pretrained  # a higher layer: imported on use

        save_pretrained(self, save_directory, **kwargs)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position, -100 ignored; logits (..., classes), labels (...)."""
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} must be {tuple(logits.shape[:-1])}")
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100)


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
        return F.mse_loss(logits.squeeze(-1).float(), labels.float().reshape(logits.shape[:-1]))
    if problem_type == "single_label_classification":
        return cross_entropy(logits, labels)
    return F.binary_cross_entropy_with_logits(logits.float(), labels.float())
