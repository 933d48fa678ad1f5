"""A whole model pickles (``torch.save(model)``, ``copy.deepcopy``), as users save transformers models: the
hooks flash-models attaches (vocabulary padding, input gradients for checkpointing) are not closures."""

import copy
import io

import pytest
import torch

import flash_models as fm

MODELS = {
    "gpt2": dict(n_layer=2, n_embd=32, n_head=4, vocab_size=101, bos_token_id=0, eos_token_id=0),  # 128 rows inside
    "llama-1b": dict(num_hidden_layers=2, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=97),
}


@pytest.mark.parametrize("preset", list(MODELS))
def test_torch_save_of_a_whole_model_round_trips(preset):
    model = fm.create_model(preset, **MODELS[preset]).eval()
    model.gradient_checkpointing_enable()  # attaches its forward and the embeddings' hook
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    twin = copy.deepcopy(model)
    ids = torch.randint(0, MODELS[preset]["vocab_size"], (2, 9))
    with torch.no_grad():
        want = model(ids).logits
        assert torch.equal(loaded(ids).logits, want) and torch.equal(twin(ids).logits, want)
    vocab = MODELS[preset]["vocab_size"]
    for copied in (loaded, twin):  # the hooks came along: state dicts keep the real vocabulary
        assert copied.state_dict().keys() == model.state_dict().keys()
        assert copied.state_dict()["embed.tokens.weight"].shape[0] == vocab
        assert copied.is_gradient_checkpointing
