"""flash_kernels: functional ops, each a plain PyTorch reference plus Triton (or CUDA C++) kernels.

No nn.Module lives here; ``flash_models.modules`` wraps these functions. See ``_backend`` for how a
backend is chosen.

Every name is imported on first use (PEP 562): most op modules import Triton (and some torch._dynamo) at
import time, which costs seconds and is not needed by a program that only touches a few ops, or none.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING

# public name -> the op module that defines it
_LAZY = {
    "BACKENDS": "._backend",
    "activation_backward": ".activations",
    "apply_rotary": ".rotary",
    "cross_entropy": ".cross_entropy",
    "embedding_layer_norm": ".embedding_norm",
    "flash_attn_func": ".attention",
    "flash_attn_qkvpacked_func": ".attention_packed",
    "flash_attn_varlen_func": ".attention",
    "flash_attn_varlen_qkvpacked_func": ".attention_packed",
    "flash_attn_with_kvcache": ".attention_decode",
    "fused_dense": ".fused_dense",
    "fused_dense_gelu_dense": ".fused_dense",
    "geglu": ".activations",
    "gelu": ".activations",
    "gemv": ".gemv",
    "kv_append": ".kv_append",
    "layer_norm": ".layer_norm",
    "layer_norm_dual": ".layer_norm",
    "linear_act": ".linear_act",
    "linear_cross_entropy": ".linear_cross_entropy",
    "programmatic_launch": "._pdl",
    "rms_norm": ".layer_norm",
    "rms_norm_dual": ".layer_norm",
    "rotary_kv_append": ".rotary_append",
    "rotary_kv_append_ref": ".rotary_append",
    "swiglu": ".activations",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    """Importing a submodule sets the package attribute of its name to that module. Six ops share their
    module's name (``kv_append``, ``gemv``, ``cross_entropy``, ...): ``flash_kernels.kv_append`` stays the
    function, whichever is imported first."""

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, types.ModuleType) and _LAZY.get(name) == f".{name}" and value.__name__ == f"{__name__}.{name}":
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


if TYPE_CHECKING:
    from ._backend import BACKENDS
    from ._pdl import programmatic_launch
    from .activations import activation_backward, gelu, geglu, swiglu
    from .attention import flash_attn_func, flash_attn_varlen_func
    from .attention_decode import flash_attn_with_kvcache
    from .attention_packed import flash_attn_qkvpacked_func, flash_attn_varlen_qkvpacked_func
    from .cross_entropy import cross_entropy
    from .embedding_norm import embedding_layer_norm
    from .kv_append import kv_append
    from .fused_dense import fused_dense, fused_dense_gelu_dense
    from .gemv import gemv
    from .layer_norm import layer_norm, layer_norm_dual, rms_norm, rms_norm_dual
    from .linear_act import linear_act
    from .linear_cross_entropy import linear_cross_entropy
    from .rotary import apply_rotary
    from .rotary_append import rotary_kv_append, rotary_kv_append_ref
