"""The vocabulary padded inside the model (modules/vocab_padding.py) is invisible: a padded model and an unpadded
one with the same weights give the same logits, losses (plain and fused), gradients, generations and
checkpoints, for tied and untied heads at odd vocabularies; the pad rows stay zero through AdamW."""

import pytest
import torch
import transformers

from flash_models.checkpoint.loader import build_model, from_pretrained
from flash_models.modules.vocab_padding import padded_vocab_size
from flash_models.testing import randomize_

CONFIGS = {
    "gpt2_tied_257": lambda: transformers.GPT2Config(
        vocab_size=257, n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=1),
    "llama_untied_130": lambda: transformers.LlamaConfig(
        vocab_size=130, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1),
    "llama_tied_257": lambda: transformers.LlamaConfig(
        vocab_size=257, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, bos_token_id=0, eos_token_id=1),
    "opt_untied_bias_130": lambda: transformers.OPTConfig(
        vocab_size=130, hidden_size=32, ffn_dim=48, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
        word_embed_proj_dim=32, tie_word_embeddings=False, dropout=0.0, bos_token_id=0, eos_token_id=1, pad_token_id=2),
}
TOL = dict(rtol=1e-5, atol=1e-6)


def pair(name: str, seed: int = 0):
    """(padded, unpadded) models of config ``name``: the same random weights, the padded one's pad rows random
    too, so nothing below can pass by the pad rows being zero."""
    hf_config = CONFIGS[name]()
    padded = build_model(hf_config, kernel_backend="reference", device="cpu")
    randomize_(padded, seed=seed)
    plain = type(padded)(padded.config.typed, kernel_backend="reference", vocab_multiple=1)
    plain.load_state_dict(padded.state_dict(), strict=True)
    return padded, plain


def head_params(model):
    return [model.embed.tokens.weight] + list(model.lm_head.parameters())  # a tied head has none of its own


@pytest.mark.parametrize("name", CONFIGS)
def test_state_dict_shows_the_real_vocabulary(name):
    padded, plain = pair(name)
    vocab = padded.decoder_config.vocab_size
    assert padded.embed.tokens.weight.shape[0] == padded_vocab_size(vocab) > vocab  # the padding is real
    assert {k: v.shape for k, v in padded.state_dict().items()} == {k: v.shape for k, v in plain.state_dict().items()}
    meta = build_model(CONFIGS[name](), device="meta")
    assert {k: v.shape for k, v in meta.state_dict().items()} == {k: v.shape for k, v in plain.state_dict().items()}
    fresh = build_model(CONFIGS[name](), device="cpu")  # construction zeroes the pad rows after the random init
    assert all(not p[vocab:].any() for p in head_params(fresh))


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_losses_and_gradients_equal_the_unpadded_model(name):
    padded, plain = pair(name, seed=1)
    vocab = padded.decoder_config.vocab_size
    ids = torch.randint(0, vocab, (3, 19))
    labels = ids.clone()
    labels[1, :4] = -100
    with torch.no_grad():
        got, want = padded.eval()(ids).logits, plain.eval()(ids).logits
    assert got.shape == (3, 19, vocab) and got.is_contiguous()
    torch.testing.assert_close(got, want, **TOL)
    # On the CPU the head's real rows compute the logits whole: no view of a padded output for the forward to copy.
    assert padded._logits(torch.randn(5, padded.output_embeddings().shape[1])).is_contiguous()
    padded.train(), plain.train()
    for return_logits in (True, False):  # the loss from the logits, and the fused LM head + loss
        out_p = padded(ids, labels=labels, return_logits=return_logits)
        out_u = plain(ids, labels=labels, return_logits=return_logits)
        torch.testing.assert_close(out_p.loss, out_u.loss, **TOL)
        grads_p = torch.autograd.grad(out_p.loss, list(padded.parameters()))
        grads_u = torch.autograd.grad(out_u.loss, list(plain.parameters()))
        for (key, param), g_p, g_u in zip(padded.named_parameters(), grads_p, grads_u):
            torch.testing.assert_close(g_p[:g_u.shape[0]], g_u, **TOL, msg=lambda m: f"{key}: {m}")
            assert not g_p[g_u.shape[0]:].any(), f"{key}: a pad row got a gradient"


@pytest.mark.parametrize("name", ["gpt2_tied_257", "llama_untied_130"])
def test_generate_equals_the_unpadded_model(name):
    padded, plain = pair(name, seed=2)
    padded.eval(), plain.eval()
    vocab = padded.decoder_config.vocab_size
    ids = torch.randint(0, vocab, (2, 7))
    greedy = padded.generate(ids, max_new_tokens=9, do_sample=False)
    assert torch.equal(greedy, plain.generate(ids, max_new_tokens=9, do_sample=False))
    sample = dict(max_new_tokens=9, do_sample=True, temperature=1.3, top_k=50, top_p=0.95)
    got = padded.generate(ids, generator=torch.Generator().manual_seed(5), **sample)
    want = plain.generate(ids, generator=torch.Generator().manual_seed(5), **sample)
    assert torch.equal(got, want)
    assert int(got.max()) < vocab


@pytest.mark.parametrize("name", ["gpt2_tied_257", "llama_untied_130"])
def test_save_load_round_trip_keeps_real_shapes(name, tmp_path):
    padded, _ = pair(name, seed=3)
    padded.eval()
    padded.save_pretrained(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # HF's real vocabulary
    assert hf.get_output_embeddings().weight.shape[0] == padded.decoder_config.vocab_size
    back = from_pretrained(tmp_path, kernel_backend="reference")
    assert back.embed.tokens.weight.shape == padded.embed.tokens.weight.shape
    assert all(not p[padded.decoder_config.vocab_size:].any() for p in head_params(back))  # loaded pads are zeros
    ids = torch.randint(0, padded.decoder_config.vocab_size, (2, 11))
    with torch.no_grad():
        want = padded(ids).logits
        torch.testing.assert_close(back(ids).logits, want, **TOL)
        torch.testing.assert_close(hf(ids).logits, want, rtol=1e-4, atol=1e-5)


def test_ids_past_the_real_vocabulary_are_refused():
    padded, _ = pair("gpt2_tied_257")
    ids = torch.randint(0, 257, (1, 5))
    ids[0, 2] = 257  # a row of the padded table, but not a token
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, 257\)"):
        padded(ids)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        padded.train()(torch.randint(0, 257, (1, 5)), labels=ids)


@pytest.mark.parametrize("name", ["gpt2_tied_257", "llama_untied_130"])
def test_pad_rows_stay_zero_under_adamw_with_weight_decay(name):
    model = build_model(CONFIGS[name](), kernel_backend="reference", device="cpu").train()
    vocab = model.decoder_config.vocab_size
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        ids = torch.randint(0, vocab, (2, 9))
        for return_logits in (True, None):
            model(ids, labels=ids, return_logits=return_logits).loss.backward()
            opt.step()
            opt.zero_grad()
    assert all(not p[vocab:].any() for p in head_params(model))
    assert model.embed.tokens.weight[:vocab].abs().sum() > 0
