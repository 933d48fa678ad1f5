"""Loading and saving checkpoints: HF folders, the hub, GGUF; declarative key remapping."""

from .files import UnsafeCheckpointError
from .loader import build_model, create_model, from_pretrained, save_pretrained
from .remap import CheckpointKeyError
from .timm import from_timm

__all__ = ["CheckpointKeyError", "build_model", "create_model", "from_pretrained", "from_timm", "save_pretrained",
           "UnsafeCheckpointError"]
