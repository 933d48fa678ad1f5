"""Contract tests every registered preset gets automatically, at a tiny size that keeps the preset's options
(tied head, GQA ratio, activation): forward+backward with no NaN and a gradient for every parameter,
KV-cache decoding equal to a full forward (decoders), and a save -> load round trip."""

import pytest
import torch

import flash_models as fm
from flash_models.registry import get_family, get_preset
from flash_models.testing import max_rel_err, randomize_


def tiny_overrides(preset):
    hf = preset.hf_config
    if preset.model_type == "gpt2":
        return dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    if preset.model_type in ("llama", "mistral", "qwen2"):
        ratio = hf.get("num_attention_heads", 32) // hf.get("num_key_value_heads", hf.get("num_attention_heads", 32))
        tiny = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=max(1, 4 // ratio), vocab_size=128, max_position_embeddings=64)
        if preset.model_type == "mistral":
            tiny["sliding_window"] = 6  # shorter than the test sequences, so the window is exercised
        return tiny
    if preset.model_type == "gpt_neox":
        return dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, vocab_size=128,
                    max_position_embeddings=64, hidden_dropout=0.1, attention_dropout=0.1)
    if preset.model_type == "gptj":
        return dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, vocab_size=128, n_positions=64, resid_pdrop=0.1,
                    embd_pdrop=0.1, attn_pdrop=0.1)
    if preset.model_type == "opt":
        projected = hf.get("word_embed_proj_dim", hf.get("hidden_size")) != hf.get("hidden_size")
        return dict(hidden_size=64, num_hidden_layers=2, ffn_dim=96, num_attention_heads=4, vocab_size=128,
                    max_position_embeddings=64, word_embed_proj_dim=32 if projected else 64, dropout=0.1)
    if preset.model_type == "bert":
        return dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, vocab_size=128,
                    max_position_embeddings=64, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    if preset.model_type == "vit":
        return dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, image_size=32,
                    patch_size=8, num_labels=10, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    raise AssertionError(f"add tiny sizes for model_type {preset.model_type!r}")


def is_decoder(name):
    return get_family(get_preset(name).model_type).hf_auto_class == "AutoModelForCausalLM"


DECODERS = [name for name in fm.list_models() if is_decoder(name)]


def training_loss(model, name):
    """A loss that reaches every parameter: the LM loss, the ViT classification loss, or for a bare encoder a
    function of both of its outputs."""
    model_type = get_preset(name).model_type
    if model_type == "vit":
        c = model.config
        out = model(torch.randn(2, c.num_channels, c.image_size, c.image_size), labels=torch.randint(0, c.num_classes, (2,)))
        return out.logits, out.loss
    ids = torch.randint(0, 128, (2, 17))
    if model_type == "bert":
        mask = torch.ones_like(ids)
        mask[1, 12:] = 0
        out = model(ids, attention_mask=mask, token_type_ids=torch.randint(0, 2, ids.shape))
        return out.last_hidden_state, out.last_hidden_state[mask.bool()].square().mean() + out.pooler_output.square().mean()
    out = model(ids, labels=ids)
    assert out.logits is None  # training with labels: the fused LM head + loss, no (B, S, vocab) logits
    return out.last_hidden_state, out.loss


def tiny_model(name):
    model = fm.create_model(name, **tiny_overrides(get_preset(name)))
    return randomize_(model, seed=1)


@pytest.mark.parametrize("name", fm.list_models())
def test_forward_backward_reaches_every_parameter(name):
    model = tiny_model(name).train()
    output, loss = training_loss(model, name)
    assert torch.isfinite(output).all() and torch.isfinite(loss)
    loss.backward()
    for pname, param in model.named_parameters():
        assert param.grad is not None, f"{pname} got no gradient"
        assert torch.isfinite(param.grad).all(), f"{pname} has a non-finite gradient"
        assert param.grad.abs().sum() > 0, f"{pname} has an all-zero gradient"


@pytest.mark.parametrize("name", DECODERS)
def test_kv_cache_decode_equals_full_forward(name):
    model = tiny_model(name).eval()
    ids = torch.randint(0, 128, (2, 15))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        full = model(ids, attention_mask=mask, mask_positions=True).logits
        cache = model.new_kv_cache(2, 15)
        pieces = [model(ids[:, :9], attention_mask=mask[:, :9], kv_cache=cache).logits]
        for t in range(9, 15):
            pieces.append(model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], kv_cache=cache).logits)
    decoded = torch.cat(pieces, dim=1)
    real = mask.bool()
    assert max_rel_err(decoded[real], full[real]) < 1e-5


@pytest.mark.parametrize("name", fm.list_models())
def test_save_load_round_trip(name, tmp_path):
    model = tiny_model(name).eval()
    model.save_pretrained(tmp_path)
    again = fm.from_pretrained(tmp_path)
    assert type(again) is type(model) and again.config == model.config
    for (key, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), key
