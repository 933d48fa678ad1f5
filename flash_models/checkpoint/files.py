"""Reading and writing weight files: safetensors (single or sharded), PyTorch .bin (single or sharded).

Loading checks what it reads: a truncated or corrupt safetensors file is named in the error, and a .bin
that would run code when unpickled is refused. Saving is atomic per folder (atomic.py).
"""

from __future__ import annotations

import json
import logging
import pickle
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from .atomic import atomic_folder
from .sizes import parse_size

log = logging.getLogger(__name__)

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
WEIGHT_FILES = (SAFETENSORS, SAFETENSORS_INDEX, BIN, BIN_INDEX)
PROGRESS_MIN_BYTES = 256 << 20  # show a progress bar only for checkpoints this large


def weight_files(directory: Path, *, use_safetensors: bool | None = None) -> dict[Path, set[str] | None]:
    """The weight files of an HF model folder, preferring safetensors over .bin (``use_safetensors``, as in
    transformers: True reads safetensors only, False .bin only): each file with the tensor names its index lists
    in it (None for a single-file checkpoint, whose tensors are all read)."""
    names = {None: WEIGHT_FILES, True: WEIGHT_FILES[:2], False: WEIGHT_FILES[2:]}[use_safetensors]
    for name in names:
        path = directory / name
        if path.is_file():
            if name.endswith(".index.json"):
                shards = _shard_contents(path)
                missing = [s for s in shards if not (directory / s).is_file()]
                if missing:
                    raise FileNotFoundError(f"{path} lists shards that are not in {directory}: {missing}")
                return {directory / s: keys for s, keys in shards.items()}
            return {path: None}
    raise FileNotFoundError(f"no weights in {directory}: expected one of {', '.join(names)}"
                            + ("" if use_safetensors is None else f" (use_safetensors={use_safetensors})"))


def _shard_contents(index: Path) -> dict[str, set[str]]:
    """Shard file -> the tensor names a sharded checkpoint's index puts in it. Shards are plain file names in the
    index's own folder (as HF writes them); a name with a folder in it (``../``, an absolute path) is refused: a
    crafted index must not make the loader read files outside the checkpoint folder."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"{index} is not a checkpoint index (a JSON object with a weight_map): {err!r}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index}: weight_map must map tensor names to shard file names")
    shards: dict[str, set[str]] = {}
    for key, shard in weight_map.items():
        shards.setdefault(shard, set()).add(key)
    outside = [s for s in sorted(shards) if s in ("", ".", "..") or Path(s).name != s or "\\" in s]
    if outside:
        raise ValueError(f"{index} names shards outside its folder: {outside[:5]}; shards must be file names in "
                         f"{index.parent}")
    return dict(sorted(shards.items()))


def _check_shard(path: Path, held: set[str], listed: set[str] | None) -> None:
    """A shard must hold exactly the tensors its index lists in it: a tensor it lacks, or one the index places in
    another shard (which of two copies is the checkpoint's?), means the index and the shards disagree."""
    if listed is None or held == listed:
        return
    absent, unlisted = sorted(listed - held), sorted(held - listed)
    problems = [f"the index lists {len(absent)} tensor(s) in it that it does not hold: {', '.join(absent[:10])}"] if absent else []
    if unlisted:
        problems.append(f"it holds {len(unlisted)} tensor(s) the index does not place in it: {', '.join(unlisted[:10])}")
    index = path.parent / (SAFETENSORS_INDEX if path.suffix == ".safetensors" else BIN_INDEX)
    raise ValueError(f"{index} and its shard {path.name} disagree: {'; '.join(problems)}. The checkpoint is damaged "
                     "or its files come from different saves: download it again")


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return {key: f.get_tensor(key) for key in f.keys()}
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(
            f"cannot read {path}: the safetensors file is truncated or corrupt ({err or type(err).__name__}); "
            "download it again"
        ) from err


class UnsafeCheckpointError(ValueError):
    """A pickled file holding objects other than tensors and plain containers: unpickling it could run code."""


def read_json_object(path: Path, *, what: str) -> dict:
    """A JSON file that must hold one object (a config's fields): a damaged file or another JSON value is a
    ValueError naming the file and ``what`` it should hold."""
    try:
        fields = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}); the file is damaged or not {what}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{path} must hold a JSON object of {what}, got a {type(fields).__name__}")
    return fields


def safe_torch_load(path: Path, *, what: str = "PyTorch checkpoint"):
    """``torch.load`` restricted to tensors and plain containers (``weights_only=True``). A file that needs
    more is refused as unsafe; a damaged one is named as truncated or corrupt."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        # Bytes that are no pickle at all fail on an opcode the restricted unpickler lacks: damaged, not unsafe.
        if "Weights only load failed" not in str(err) or "Unsupported operand" in str(err):
            raise ValueError(f"cannot read {path}: the {what} is truncated or corrupt ({err or type(err).__name__})") from None
        found = _UNSAFE_GLOBAL.search(str(err))
        culprit = f" (it calls {found.group(1)})" if found else ""
        # torch's own message suggests weights_only=False, i.e. running the file's code: not repeated here.
        raise UnsafeCheckpointError(
            f"refused to load {path}: the {what} holds pickled objects other than tensors{culprit}, and "
            "unpickling them could run arbitrary code. flash-models only loads tensors and plain values from "
            "pickles; use a safetensors file"
        ) from None
    except Exception as err:  # torch raises several types for a damaged pickle/zip
        raise ValueError(f"cannot read {path}: the {what} is truncated or corrupt ({err or type(err).__name__})") from err


_UNSAFE_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def _read_bin(path: Path) -> dict[str, torch.Tensor]:
    return safe_torch_load(path)


def load_state_dict(directory: str | Path, *, use_safetensors: bool | None = None) -> dict[str, torch.Tensor]:
    directory = Path(directory)
    files = weight_files(directory, use_safetensors=use_safetensors)
    total = sum(f.stat().st_size for f in files)
    state: dict[str, torch.Tensor] = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", disable=total < PROGRESS_MIN_BYTES) as bar:
        for path, listed in files.items():
            tensors = _read_safetensors(path) if path.suffix == ".safetensors" else _read_bin(path)
            _check_shard(path, set(tensors), listed)
            state.update(tensors)
            bar.update(path.stat().st_size)
    return state


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


def owned_by_model_save(name: str) -> bool:
    """Whether a file of a model folder belongs to the saved model (weights in any layout, config.json), so
    that a new save replaces it; anything else in the folder (tokenizer, README) is the user's and kept."""
    return name == "config.json" or _MODEL_FILE.fullmatch(name) is not None


_MODEL_FILE = re.compile(r"(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?")


def write_model_dir(directory: str | Path, state: dict[str, torch.Tensor], extra_files: dict[str, str], *, max_shard_size: int | str = "5GB") -> None:
    """Write safetensors (sharded past ``max_shard_size``, with an index) and the given text files, atomically
    per folder (``atomic.atomic_folder``): a reader sees the old checkpoint or the new one, whole, and no
    weight file of the old one is left behind."""
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    shards = _shards(state, parse_size(max_shard_size))
    with atomic_folder(directory, owned=owned_by_model_save) as tmp:
        if len(shards) == 1:
            save_file(shards[0], str(tmp / SAFETENSORS), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards, start=1):
                name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / name), metadata={"format": "pt"})
                weight_map.update({key: name for key in shard})
            total = sum(t.numel() * t.element_size() for t in state.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2))
        for name, text in extra_files.items():
            (tmp / name).write_text(text)
