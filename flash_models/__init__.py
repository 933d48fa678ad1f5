"""flash-models: a transformer model zoo on its own kernels.

    import flash_models as fm
    model = fm.from_pretrained("gpt2")
    ids = model.generate(input_ids, max_new_tokens=64)

The names below are imported on first use, so ``import flash_models`` (and the ``flash-models`` command's
help and argument errors) costs next to nothing; the first ``fm.from_pretrained`` pays for torch,
transformers and the model code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_attributes

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY = {
    "CheckpointKeyError": ".checkpoint.remap",
    "backward_on_this_thread": ".backward",
    "create_model": ".checkpoint.loader",
    "families": ".registry",
    "from_pretrained": ".checkpoint.loader",
    "from_timm": ".checkpoint.timm",
    "generate": ".generation",
    "generation": ".generation",
    "list_models": ".registry",
    "minilm_dir": ".embedded",
    "save_pretrained": ".checkpoint.loader",
    "smollm2_gguf": ".embedded",
}

__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)

if TYPE_CHECKING:
    from . import generation
    from .generation import generate
    from .backward import backward_on_this_thread
    from .checkpoint.loader import create_model, from_pretrained, save_pretrained
    from .checkpoint.remap import CheckpointKeyError
    from .checkpoint.timm import from_timm
    from .embedded import minilm_dir, smollm2_gguf
    from .registry import families, list_models
