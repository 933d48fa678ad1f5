"""Reading and writing weight files: safetensors (single or sharded), PyTorch .bin (single or sharded).

Loading checks what it reads: a truncated or corrupt safetensors file is named in the error. Saving is
atomic: files go to a temporary folder beside the target and are renamed into place only when complete.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

log = logging.getLogger(__name__)

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
WEIGHT_FILES = (SAFETENSORS, SAFETENSORS_INDEX, BIN, BIN_INDEX)
PROGRESS_MIN_BYTES = 256 << 20  # show a progress bar only for checkpoints this large


def weight_files(directory: Path) -> list[Path]:
    """The weight files of an HF model folder, preferring safetensors over .bin."""
    for name in WEIGHT_FILES:
        path = directory / name
        if path.is_file():
            if name.endswith(".index.json"):
                shards = sorted(set(json.loads(path.read_text())["weight_map"].values()))
                missing = [s for s in shards if not (directory / s).is_file()]
                if missing:
                    raise FileNotFoundError(f"{path} lists shards that are not in {directory}: {missing}")
                return [directory / s for s in shards]
            return [path]
    raise FileNotFoundError(f"no weights in {directory}: expected one of {', '.join(WEIGHT_FILES)}")


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return {key: f.get_tensor(key) for key in f.keys()}
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(
            f"cannot read {path}: the safetensors file is truncated or corrupt ({err}); download it again"
        ) from err


def _read_bin(path: Path) -> dict[str, torch.Tensor]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several types for a damaged pickle/zip
        raise ValueError(f"cannot read {path}: the PyTorch checkpoint is truncated or corrupt ({err})") from err


def load_state_dict(directory: str | Path) -> dict[str, torch.Tensor]:
    directory = Path(directory)
    files = weight_files(directory)
    total = sum(f.stat().st_size for f in files)
    state: dict[str, torch.Tensor] = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", disable=total < PROGRESS_MIN_BYTES) as bar:
        for path in files:
            state.update(_read_safetensors(path) if path.suffix == ".safetensors" else _read_bin(path))
            bar.update(path.stat().st_size)
    return state


def parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    text = size.strip().upper()
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def _shards(state: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards, current, current_bytes = [], {}, 0
    for key, tensor in state.items():
        size = tensor.numel() * tensor.element_size()
        if current and current_bytes + size > max_bytes:
            shards.append(current)
            current, current_bytes = {}, 0
        current[key] = tensor
        current_bytes += size
    shards.append(current)
    return shards


def write_model_dir(directory: str | Path, state: dict[str, torch.Tensor], extra_files: dict[str, str], *, max_shard_size: int | str = "5GB") -> None:
    """Write safetensors (sharded past ``max_shard_size``, with an index) and the given text files, atomically:
    everything lands in a temporary folder first, then each file is renamed into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    shards = _shards(state, parse_size(max_shard_size))
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-save-", dir=directory))
    try:
        if len(shards) == 1:
            save_file(shards[0], str(tmp / SAFETENSORS), metadata={"format": "pt"})
            written = [SAFETENSORS]
        else:
            weight_map, written = {}, []
            for i, shard in enumerate(shards, start=1):
                name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / name), metadata={"format": "pt"})
                weight_map.update({key: name for key in shard})
                written.append(name)
            total = sum(t.numel() * t.element_size() for t in state.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2))
            written.append(SAFETENSORS_INDEX)
        for name, text in extra_files.items():
            (tmp / name).write_text(text)
            written.append(name)
        stale = [n for n in (SAFETENSORS, SAFETENSORS_INDEX, BIN, BIN_INDEX) if n not in written and (directory / n).exists()]
        for name in written:
            os.replace(tmp / name, directory / name)
        for name in stale:  # an older save's other layout would shadow or confuse the new weights
            (directory / name).unlink()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
