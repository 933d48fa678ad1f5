"""flash_kernels: functional ops, each a plain PyTorch reference plus Triton (or CUDA C++) kernels.

No nn.Module lives here; ``flash_models.modules`` wraps these functions. See ``_backend`` for how a
backend is chosen.
"""

from ._backend import BACKENDS
from ._pdl import programmatic_launch
from .activations import gelu, geglu, swiglu
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

__all__ = [
    "BACKENDS",
    "apply_rotary",
    "cross_entropy",
    "embedding_layer_norm",
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "fused_dense",
    "fused_dense_gelu_dense",
    "geglu",
    "gelu",
    "gemv",
    "kv_append",
    "layer_norm",
    "layer_norm_dual",
    "linear_act",
    "linear_cross_entropy",
    "programmatic_launch",
    "rms_norm",
    "rms_norm_dual",
    "rotary_kv_append",
    "rotary_kv_append_ref",
    "swiglu",
]
