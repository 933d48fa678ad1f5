"""``SavePretrainedCallback``: transformers.Trainer checkpoints of our models that load as models.

The Trainer saves a model that is not a ``PreTrainedModel`` as its bare ``state_dict`` (our internal layout,
no config.json), which neither ``flash_models.from_pretrained`` nor transformers can read. With this callback,
every checkpoint folder holds what ``model.save_pretrained`` writes instead (config.json and HF's canonical
weights), and ``resume_from_checkpoint`` still works: our ``load_state_dict`` reads HF's layout."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

log = logging.getLogger(__name__)

_ONE_FILE = 2**62  # bytes: more than any model holds
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


class SavePretrainedCallback(TrainerCallback):
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        _check_model(model)  # before the first step, not at the first save

    def on_save(self, args, state, control, model=None, **kwargs):
        if not state.is_world_process_zero:
            return
        _check_model(model)
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        # Written beside the checkpoint, then moved in file by file: the Trainer's other files (optimizer,
        # scheduler, RNG and trainer state) stay where they are.
        staging = Path(tempfile.mkdtemp(prefix=".tmp-pretrained-", dir=args.output_dir))
        try:
            # One weights file, whatever the model's size: the Trainer reads a sharded checkpoint (resume, best
            # model) shard by shard into load_state_dict, and a shard may hold only part of one of our fused
            # parameters (q_proj without k_proj), which no load can take alone.
            model.save_pretrained(staging, max_shard_size=_ONE_FILE)
            for name in _WEIGHT_FILES:
                if (folder / name).exists() and not (staging / name).exists():
                    (folder / name).unlink()  # the Trainer's state dict in our internal layout
            for item in staging.iterdir():
                os.replace(item, folder / item.name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        log.info("wrote %s as a pretrained model folder", folder)


def _check_model(model) -> None:
    if model is None or not hasattr(model, "save_pretrained") or not hasattr(model.config, "typed"):
        kind = type(model)
        raise ValueError(f"SavePretrainedCallback writes flash-models models; the Trainer's model is "
                         f"{kind.__module__}.{kind.__qualname__}. A transformers model saves its checkpoints as model "
                         "folders itself: leave the callback out")
