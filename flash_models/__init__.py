"""flash-models: a transformer model zoo on its own kernels.

    import flash_models as fm
    model = fm.from_pretrained("gpt2")
    ids = model.generate(input_ids, max_new_tokens=64)
"""

from .backward import backward_on_this_thread
from .checkpoint import CheckpointKeyError, create_model, from_pretrained, from_timm, save_pretrained
from . import generation
from .embedded import minilm_dir, smollm2_gguf
from .registry import families, list_models

__version__ = "0.1.0"

__all__ = [
    "CheckpointKeyError", "backward_on_this_thread", "create_model", "families", "from_pretrained", "from_timm", "generation", "list_models",
    "minilm_dir", "save_pretrained", "smollm2_gguf",
]
