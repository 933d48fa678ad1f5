"""``from_timm``: our VisionTransformer with the weights of a timm ``VisionTransformer``."""

from __future__ import annotations

import torch

from ..models.vit import ViTConfig, VisionTransformer
from .loader import _dtype
from .remap import hf_to_ours
from .rules import timm_vit_rules


def from_timm(name_or_model, *, pretrained: bool = False, dtype=None, device=None, attn_impl: str = "auto",
              kernel_backend: str = "auto", **timm_kwargs) -> VisionTransformer:
    """A timm model name (built with ``timm.create_model(name, pretrained=pretrained, **timm_kwargs)``; with
    ``pretrained=True`` timm downloads the weights) or a timm VisionTransformer instance -> ours, in eval mode."""
    if isinstance(name_or_model, str):
        import timm

        source = timm.create_model(name_or_model, pretrained=pretrained, **timm_kwargs)
    else:
        if timm_kwargs:
            raise ValueError(f"timm keyword arguments {sorted(timm_kwargs)} apply only when a model name is given")
        source = name_or_model
    if type(source).__name__ != "VisionTransformer":
        raise ValueError(f"from_timm reads timm VisionTransformer models, got {type(source).__name__}")
    config = ViTConfig.from_timm(source)
    with torch.device("meta"):
        model = VisionTransformer(config, attn_impl=attn_impl, kernel_backend=kernel_backend)
    state = hf_to_ours(source.state_dict(), timm_vit_rules(config))
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device=torch.device(device or "cpu"), dtype=_dtype(dtype)).eval()
