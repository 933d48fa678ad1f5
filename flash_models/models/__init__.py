"""Model families. Importing this package registers every family and preset."""

from .bert import BertConfig, BertForMaskedLM, BertForPreTraining, BertForSequenceClassification, BertForTokenClassification, BertModel
from .decoder import CausalLMOutput, DecoderLM
from .gpt2 import GPT2Config, GPT2LMHeadModel
from .gpt_neox import GPTNeoXConfig, GPTNeoXForCausalLM
from .gptj import GPTJConfig, GPTJForCausalLM
from .llama import LlamaConfig, LlamaForCausalLM
from .mistral import MistralConfig, MistralForCausalLM
from .opt import OPTConfig, OPTForCausalLM
from .qwen2 import Qwen2Config, Qwen2ForCausalLM
from .vit import ViTConfig, VisionTransformer

__all__ = [
    "BertConfig", "BertForMaskedLM", "BertForPreTraining", "BertForSequenceClassification", "BertForTokenClassification",
    "BertModel", "ViTConfig", "VisionTransformer",
    "CausalLMOutput", "DecoderLM", "GPT2Config", "GPT2LMHeadModel", "GPTJConfig", "GPTJForCausalLM", "GPTNeoXConfig",
    "GPTNeoXForCausalLM", "LlamaConfig", "LlamaForCausalLM", "MistralConfig", "MistralForCausalLM", "OPTConfig",
    "OPTForCausalLM", "Qwen2Config", "Qwen2ForCausalLM",
]
