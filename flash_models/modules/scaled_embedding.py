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
        # The scale rounded to each floating dtype, worked out here (on the CPU, whatever device a model is built
        # on): a Python float per dtype, no tensor or host read in the forward (torch.compile traces a constant).
        self._rounded = {dtype: torch.tensor(self.scale, dtype=dtype, device="cpu").item()
                         for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}

    def scale_in(self, dtype: torch.dtype) -> float:
        """The scale as a table of ``dtype`` holds it (a floating dtype: an embedding table's)."""
        return self._rounded[dtype]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.scale_in(self.weight.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale={self.scale:g}"
