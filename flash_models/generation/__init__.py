"""Text generation: KV-cached decoding, sampling, streaming."""

from .generate import generate
from .sampling import filter_logits, next_token
from .streaming import TextStream

__all__ = ["TextStream", "filter_logits", "generate", "next_token"]
