"""A token table whose lookups are scaled by a constant (Gemma's sqrt(hidden_size))."""

from __future__ import annotations

import torch
from torch import nn


class ScaledEmbedding(nn.Embedding):
    """``nn.Embedding`` whose output is multiplied by ``scale`` rounded to the table's dtype first, as HF's
    ``GemmaTextScaledWordEmbedding`` does (in bf16, sqrt(2048) = 45.25...: 45.25). The scaling is inside the
    module ``get_input_embeddings()`` returns, so that NEFTune's noise and a caller's ``inputs_embeds`` see the
    scaled vectors, as on HF's model."""

    def __init__(self, *args, scale: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.scale = float(scale)
        self._rounded = {}  # dtype -> the scale rounded to it

    def scale_in(self, dtype: torch.dtype) -> float:
        """The scale as the table's ``dtype`` holds it (a Python float: one rounding, no tensor per call)."""
        rounded = self._rounded.get(dtype)
        if rounded is None:
            rounded = self._rounded[dtype] = torch.tensor(self.scale, dtype=dtype).item()
        return rounded

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.scale_in(self.weight.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale={self.scale:g}"
