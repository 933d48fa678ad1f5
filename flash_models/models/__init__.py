"""Model families. Importing this package registers every family and preset."""

from .decoder import CausalLMOutput, DecoderLM
from .gpt2 import GPT2Config, GPT2LMHeadModel
from .llama import LlamaConfig, LlamaForCausalLM

__all__ = ["CausalLMOutput", "DecoderLM", "GPT2Config", "GPT2LMHeadModel", "LlamaConfig", "LlamaForCausalLM"]
