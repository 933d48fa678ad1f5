"""flash-models inside HF's stack: our models in transformers.Trainer / TRL, and our kernels in HF's models.

- ``SavePretrainedCallback``: Trainer checkpoints of our models written as model folders (config.json and HF's
  layout) that ``flash_models.from_pretrained`` and transformers load, and that resume.
- ``register()``: our attention kernels as ``attn_implementation="fm_attention"`` in HF's own models.
- ``use_fused_ops(model)``: our fused norms and cross-entropy in an HF model instance.
- ``load_hf_adapter(model, folder)`` / ``save_hf_adapter(peft_model, folder)``: PEFT LoRA adapters of HF's models on
  ours (merged, or as a PeftModel), and ours in HF's layout.
"""

from .attention import ATTN_IMPLEMENTATION, flash_models_attention, register
from .callback import SavePretrainedCallback
from .fused_ops import SUPPORTED_MODEL_TYPES, FusedNorm, use_fused_ops
from .lora import load_hf_adapter, save_hf_adapter

__all__ = ["ATTN_IMPLEMENTATION", "SUPPORTED_MODEL_TYPES", "FusedNorm", "SavePretrainedCallback",
           "flash_models_attention", "load_hf_adapter", "register", "save_hf_adapter", "use_fused_ops"]
