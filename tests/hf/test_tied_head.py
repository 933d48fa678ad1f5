"""A tied causal LM has an ``lm_head`` module, as HF's models do, whose weight is the token table: tools that hook
the output layer by that name work (TRL's activation offloading), copies stay tied, and PEFT's
``modules_to_save=["lm_head"]``, which would train a hidden copy of the table, is refused."""

import copy

import peft
import pytest
import torch
import transformers
from trl.models.activation_offloading import get_act_offloading_ctx_manager

from flash_models.testing import ours_from_hf, random_hf_model


def causal_lm(tied: bool):
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=tied)
    return ours_from_hf(random_hf_model(config, seed=1))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_trl_activation_offloading_finds_the_head(tied):
    """TRL hooks ``model.lm_head`` (it failed on None); the loss and gradients inside its context are the plain
    step's. CPU: without pinned memory and streams, which need CUDA."""
    model = causal_lm(tied)
    ids = torch.randint(0, 97, (2, 11))
    loss = model(ids, labels=ids).loss
    loss.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with get_act_offloading_ctx_manager(model, use_pin_memory=False, use_streams=False):
        offloaded = model(ids, labels=ids).loss
    offloaded.backward()
    assert offloaded.item() == pytest.approx(loss.item(), abs=1e-6)
    for want, p in zip(expected, model.parameters()):
        torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-6)


def test_tied_head_is_the_table_and_has_no_parameters():
    model = causal_lm(tied=True)
    assert model.head_is_tied() and model.lm_head.weight is model.embed.tokens.weight
    assert not list(model.lm_head.parameters()) and "lm_head.weight" not in model.state_dict()
    head = model.get_output_embeddings().weight  # the real vocabulary's rows of the (padded) table
    assert head.shape[0] == 97 and head.data_ptr() == model.embed.tokens.weight.data_ptr()
    twin = copy.deepcopy(model)
    assert twin.lm_head.weight is twin.embed.tokens.weight and twin.lm_head.weight is not model.lm_head.weight
    twin.resize_token_embeddings(101)
    assert twin.lm_head.weight is twin.embed.tokens.weight and twin.lm_head.weight.shape[0] >= 101


def test_peft_modules_to_save_on_a_tied_head():
    """modules_to_save=["lm_head"] is refused naming why; ["embed.tokens"] trains the table, which the head reads."""
    model = causal_lm(tied=True)
    with pytest.raises(TypeError, match="token embedding table.*modules_to_save=\\['embed.tokens'\\]"):
        peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=4, target_modules=["qkv"], modules_to_save=["lm_head"]))
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["qkv"], modules_to_save=["embed.tokens"]))
    ids = torch.randint(0, 97, (2, 9))
    wrapped(input_ids=ids, labels=ids).loss.backward()
    table = dict(wrapped.named_parameters())["base_model.model.embed.tokens.modules_to_save.default.weight"]
    assert model.lm_head.weight is table and table.grad is not None
