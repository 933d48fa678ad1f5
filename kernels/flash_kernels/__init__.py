"""flash_kernels: functional ops, each a plain PyTorch reference plus Triton (or CUDA C++) kernels.

No nn.Module lives here; ``flash_models.modules`` wraps these functions. See ``_backend`` for how a
backend is chosen.
"""

from ._backend import BACKENDS, default_backend
from .activations import gelu, geglu, swiglu
from .cross_entropy import cross_entropy
from .layer_norm import layer_norm, rms_norm
from .rotary import apply_rotary

__all__ = [
    "BACKENDS",
    "apply_rotary",
    "cross_entropy",
    "default_backend",
    "geglu",
    "gelu",
    "layer_norm",
    "rms_norm",
    "swiglu",
]
