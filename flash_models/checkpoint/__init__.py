"""Loading and saving checkpoints: HF folders, the hub, GGUF; declarative key remapping.

The names are imported on first use: ``flash_models.checkpoint.hub`` and ``.tokenizer`` (what the command
line needs before a model loads) do not pull in the model code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

_LAZY = {
    "CheckpointKeyError": ".remap",
    "build_model": ".loader",
    "create_model": ".loader",
    "from_pretrained": ".loader",
    "from_timm": ".timm",
    "save_pretrained": ".loader",
    "UnsafeCheckpointError": ".files",
}

__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)

if TYPE_CHECKING:
    from .files import UnsafeCheckpointError
    from .loader import build_model, create_model, from_pretrained, save_pretrained
    from .remap import CheckpointKeyError
    from .timm import from_timm
