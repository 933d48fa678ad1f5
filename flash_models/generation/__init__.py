"""Text generation: prefill, graph-replayed decode steps, sampling, streaming, speculative decoding."""

from .generate import GenerateOutput, Generation, generate
from .sampling import filter_logits
from .settings import GenerationSettings, resolve_settings
from .streaming import TextStream, stream

__all__ = [
    "GenerateOutput", "Generation", "GenerationSettings", "TextStream", "filter_logits", "generate",
    "resolve_settings", "stream",
]
