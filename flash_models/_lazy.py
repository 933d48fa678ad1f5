"""Package attributes imported on first use (PEP 562): ``import flash_models`` (and its subpackages) then
costs nothing until a name is used, which keeps scripts and the command line's help and errors instant."""

from __future__ import annotations

import importlib
import sys
from typing import Callable


def lazy_attributes(package: str, names: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``names`` maps each public name to the module (relative
    to the package) that defines it; a name mapped to its own submodule (".name") is that submodule."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(names[name], package)
        value = module if names[name] == f".{name}" else getattr(module, name)
        namespace[name] = value  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *names})

    return __getattr__, __dir__
