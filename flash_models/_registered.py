"""The registry's listings with every family in them: importing the family files registers them."""

from . import models as _families  # noqa: F401
from .registry import families, list_models

__all__ = ["families", "list_models"]
