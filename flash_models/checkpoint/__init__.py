"""Loading and saving checkpoints: HF folders, the hub, GGUF; declarative key remapping.

The names are imported on first use: ``flash_models.checkpoint.hub`` and ``.tokenizer`` (what the command
line needs before a model loads) do not pull in the model code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

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


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from .loader import build_model, create_model, from_pretrained, save_pretrained
    from .remap import CheckpointKeyError
    from .files import UnsafeCheckpointError
    from .timm import from_timm
