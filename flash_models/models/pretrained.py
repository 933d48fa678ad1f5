"""The HF-style base of the encoder and vision families: backend checks, device and dtype, save_pretrained."""

from __future__ import annotations

import torch
from torch import nn

import flash_kernels

from ..config import ATTN_IMPLS, check_choice
from .hf_config import ModelConfig
from .hf_protocol import HFModelProtocol


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
