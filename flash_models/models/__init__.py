"""Model families. Every module (or package) here that defines ``FAMILY`` is one family: importing this
package imports each of them, collects their records in ``FAMILIES`` and makes the names each one lists in
``__all__`` importable from here (``flash_models.models.LlamaForCausalLM``). Adding a family adds no line here."""

import importlib
import pkgutil

from .decoder import CausalLMOutput, DecoderLM
from .family import Family, Preset

__all__ = ["CausalLMOutput", "DecoderLM", "FAMILIES", "Family", "Preset"]


def _collect() -> tuple[Family, ...]:
    found = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda info: info.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        family = getattr(module, "FAMILY", None)
        if family is None:
            continue
        assert isinstance(family, Family), f"{module.__name__}.FAMILY is a {type(family).__name__}, not a Family"
        for name in module.__all__:
            assert name not in globals(), f"{module.__name__} exports {name!r}, which another module exports too"
            globals()[name] = getattr(module, name)
            __all__.append(name)
        found.append(family)
    return tuple(found)


FAMILIES: tuple[Family, ...] = _collect()
