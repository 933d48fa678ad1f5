"""Training and fine-tuning: ``flash-models train CONFIG [key=value ...]`` or, from Python,

    from flash_models.train import Trainer, load_config, train
    summary = train("configs/gpt2-small.yaml", ["train.max_steps=100"])
"""

from ..backward import backward_on_this_thread
from .config import ConfigError, ExperimentConfig, load_config
from .trainer import NonFiniteLossError, Trainer, train

__all__ = ["ConfigError", "ExperimentConfig", "NonFiniteLossError", "Trainer", "backward_on_this_thread", "load_config", "train"]
