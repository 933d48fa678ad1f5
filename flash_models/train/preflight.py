"""Checks of an experiment that need no torch and no model: a config's keys, values and the paths it names
(data, tokenizer), so ``flash-models train`` refuses a missing dataset in a second, before any load."""

from __future__ import annotations

import glob
from pathlib import Path

from .config import ExperimentConfig, load_config


def _data_exists(spec: str) -> bool:
    if Path(spec).exists():
        return True
    folder, _, split = spec.rpartition(":")  # a split of a saved HF dataset (hf_disk, sft, classification)
    if folder and split and Path(folder).is_dir():
        return True
    return bool(glob.glob(spec, recursive=True))


def check_experiment(config: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    """The config, loaded and validated; FileNotFoundError names the first data or tokenizer path that does not
    exist (and the override that fixes it)."""
    cfg = load_config(config, overrides)
    check_paths(cfg, origin=f" (from {config})")
    return cfg


def experiment_or_usage_error(parser, config: str | Path, overrides: list[str], *,
                              flags: dict[str, str] | None = None) -> ExperimentConfig:
    """``check_experiment`` for a script's own argparse ``parser``: a mistyped value or a missing data path ends
    the script as a usage error naming it (``parser.error``), before anything loads, not as a traceback.
    ``flags`` maps the config keys the script sets to its own options (``{"data.train": "--train"}``): an error
    naming such a key names the option too, which is what the script's user types."""
    try:
        return check_experiment(config, overrides)
    except (ValueError, FileNotFoundError) as err:
        message = str(err)
        named = [f"{flag} sets {key}" for key, flag in (flags or {}).items() if key in message]
        parser.error(message + (f" (in this script, {'; '.join(named)})" if named else ""))


def check_paths(cfg: ExperimentConfig, *, origin: str = "") -> None:
    """FileNotFoundError naming the first data or tokenizer path of ``cfg`` that does not exist, and the key."""
    from ..embedded import ALIASES

    data = cfg.data
    if data.format != "synthetic":
        for key, spec, other in (("train", data.train, "data.format=synthetic"), ("eval", data.eval, "data.eval=null")):
            if spec is not None and not _data_exists(spec):
                raise FileNotFoundError(f"data.{key}: no data at {spec!r}{origin}; point it at your data "
                                        f"with data.{key}=PATH (or try {other})")
    tokenizer = data.tokenizer
    if tokenizer is not None and tokenizer != "bytes" and tokenizer not in ALIASES and not Path(tokenizer).exists():
        raise FileNotFoundError(f"data.tokenizer: no tokenizer at {tokenizer!r}{origin}; give a tokenizer "
                                f"folder, a .gguf file, an alias ({', '.join(ALIASES)}) or 'bytes' with data.tokenizer=...")
