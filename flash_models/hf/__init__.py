"""flash-models inside HF's stack: our models in transformers.Trainer / TRL, and our attention in HF's models.

- ``SavePretrainedCallback``: Trainer checkpoints of our models written as model folders (config.json and HF's
  layout) that ``flash_models.from_pretrained`` and transformers load, and that resume.
- ``register()``: our attention kernels as ``attn_implementation="fm_attention"`` in HF's own models.
"""

from .attention import ATTN_IMPLEMENTATION, flash_models_attention, register
from .callback import SavePretrainedCallback

__all__ = ["ATTN_IMPLEMENTATION", "SavePretrainedCallback", "flash_models_attention", "register"]
