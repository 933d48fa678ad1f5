"""Training and fine-tuning: ``flash-models train CONFIG [key=value ...]`` or, from Python,

    from flash_models.train import Trainer, load_config, train
    summary = train("configs/gpt2-small.yaml", ["train.max_steps=100"])

The names are imported on first use, so reading and checking a config (``train.config``,
``train.preflight``) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

_LAZY = {
    "ConfigError": ".config",
    "ExperimentConfig": ".config",
    "NonFiniteLossError": ".trainer",
    "Trainer": ".trainer",
    "backward_on_this_thread": "..backward",
    "load_config": ".config",
    "train": ".trainer",
}

__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)

if TYPE_CHECKING:
    from ..backward import backward_on_this_thread
    from .config import ConfigError, ExperimentConfig, load_config
    from .trainer import NonFiniteLossError, Trainer, train
