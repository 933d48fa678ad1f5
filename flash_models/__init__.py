"""flash-models: a transformer model zoo on its own kernels.

    import flash_models as fm
    model = fm.from_pretrained("gpt2")
    ids = model.generate(input_ids, max_new_tokens=64)

The names below are imported on first use (PEP 562), so ``import flash_models`` (and the ``flash-models``
command's help and argument errors) costs next to nothing; the first ``fm.from_pretrained`` pays for torch,
transformers and the model code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY = {
    "CheckpointKeyError": ".checkpoint.remap",
    "backward_on_this_thread": ".backward",
    "create_model": ".checkpoint.loader",
    "families": ".registry",
    "from_pretrained": ".checkpoint.loader",
    "from_timm": ".checkpoint.timm",
    "list_models": ".registry",
    "minilm_dir": ".embedded",
    "save_pretrained": ".checkpoint.loader",
    "smollm2_gguf": ".embedded",
}
_SUBMODULES = ("generation",)

__all__ = sorted([*_LAZY, *_SUBMODULES])


def __getattr__(name: str):
    if name in _LAZY:
        if _LAZY[name] == ".registry":
            importlib.import_module(".models", __name__)  # importing the family files registers them
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:
    from . import generation
    from .backward import backward_on_this_thread
    from .checkpoint.loader import create_model, from_pretrained, save_pretrained
    from .checkpoint.remap import CheckpointKeyError
    from .checkpoint.timm import from_timm
    from .embedded import minilm_dir, smollm2_gguf
    from .registry import families, list_models
