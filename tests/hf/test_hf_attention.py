"""attn_implementation="fm_attention" (flash_models.hf.register()) in HF's own models: logits and gradients equal sdpa's."""

import pytest
import torch
import transformers

import flash_models.hf
from flash_models.testing import random_hf_model

VOCAB = 101
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, max_position_embeddings=64)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
                                              head_dim=8),
    # A window shorter than the sequences, so it masks keys.
    "mistral": lambda: transformers.MistralConfig(**COMMON, intermediate_size=40, num_attention_heads=4,
                                                  num_key_value_heads=2, sliding_window=5),
    # Fused qkv_proj, partial rotary and a window.
    "phi3": lambda: transformers.Phi3Config(**COMMON, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
                                            sliding_window=5, pad_token_id=0,
                                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                             "partial_rotary_factor": 0.5}),
    "gemma2": lambda: transformers.Gemma2Config(**COMMON, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
                                                head_dim=8, sliding_window=5, attn_logit_softcapping=3.0,
                                                query_pre_attn_scalar=8),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
}


@pytest.fixture(autouse=True, scope="module")
def registered():
    flash_models.hf.register(backend="reference")


def pair(name: str, seed: int):
    """(HF's model with sdpa, or eager where HF has no sdpa path (softcap), the same with ours)."""
    sdpa = random_hf_model(CONFIGS[name](), seed=seed, attn_implementation="eager" if name == "gemma2" else "sdpa")
    ours = random_hf_model(CONFIGS[name](), seed=seed, attn_implementation=flash_models.hf.ATTN_IMPLEMENTATION)
    assert ours.config._attn_implementation == "fm_attention"
    return sdpa, ours


def logits_and_grads(model, labels_mask=None, **inputs):
    """Logits at the real positions (``labels_mask``, else the attention mask) and the gradients they give."""
    model.zero_grad()
    logits = model(**inputs).logits
    mask = inputs.get("attention_mask") if labels_mask is None else labels_mask
    real = logits if mask is None else logits[mask.bool()]  # padding rows differ between implementations
    (real * torch.linspace(-1, 1, real.shape[-1])).sum().backward()
    return real.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(a, b, atol=2e-5):
    (la, ga), (lb, gb) = a, b
    torch.testing.assert_close(la, lb, atol=atol, rtol=1e-4)
    assert ga.keys() == gb.keys()
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], atol=atol, rtol=1e-4, msg=name)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_padded_batch_equals_sdpa(name):
    sdpa, ours = pair(name, seed=1)
    ids = torch.randint(0, VOCAB, (3, 11))
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    mask[2, 8:] = 0  # right padding
    assert_same(logits_and_grads(ours, input_ids=ids, attention_mask=mask),
                logits_and_grads(sdpa, input_ids=ids, attention_mask=mask))
    full = torch.randint(0, VOCAB, (2, 9))  # no padding: the dense kernel
    assert_same(logits_and_grads(ours, input_ids=full), logits_and_grads(sdpa, input_ids=full))


@pytest.mark.parametrize("name", ["llama", "mistral", "gpt2"])
def test_packed_row_equals_documents_alone(name):
    """A padding-free row: position_ids restart at each document; each document's logits are its own."""
    _, ours = pair(name, seed=2)
    lengths = [4, 7, 3]
    docs = [torch.randint(0, VOCAB, (1, n)) for n in lengths]
    ids = torch.cat(docs, dim=1)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    with torch.no_grad():
        packed = ours(input_ids=ids, position_ids=positions).logits[0]
        alone = torch.cat([ours(input_ids=doc).logits[0] for doc in docs])
        torch.testing.assert_close(packed, alone, atol=2e-5, rtol=1e-4)
        offsets = torch.tensor([0, 4, 11, 14], dtype=torch.int32)
        given = ours(input_ids=ids, position_ids=positions, cu_seq_lens_q=offsets, cu_seq_lens_k=offsets,
                     max_length_q=7, max_length_k=7).logits[0]
        torch.testing.assert_close(given, alone, atol=2e-5, rtol=1e-4)


def test_generation_with_cache_equals_sdpa():
    sdpa, ours = pair("mistral", seed=3)
    ids = torch.randint(0, VOCAB, (2, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **kw), sdpa.generate(ids, **kw))


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_static_cache_generation_equals_sdpa(name):
    """A static cache's keys are all its slots, unwritten ones included; the mask covers the written ones (each
    step's scores equal the reference's, in a left-padded batch and a full row)."""
    sdpa, ours = pair(name, seed=8)
    ids = torch.randint(1, VOCAB, (2, 6))
    kw = dict(attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6]), max_new_tokens=5, do_sample=False,
              pad_token_id=0, cache_implementation="static", output_scores=True, return_dict_in_generate=True)
    want, got = sdpa.generate(ids, **kw), ours.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_autocast_casts_inputs_as_for_sdpa(name):
    """Under bf16 autocast HF's rotary leaves q and k in float32 and v in bf16: our attention casts them as autocast
    casts sdpa's inputs (a Trainer with bf16=True runs every step so), and computes what sdpa does there."""
    sdpa, ours = pair(name, seed=9)
    ids = torch.randint(0, VOCAB, (2, 7))
    mask = torch.tensor([[1] * 7, [0, 0] + [1] * 5])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = sdpa(input_ids=ids, attention_mask=mask).logits[mask.bool()].float()
        got = ours(input_ids=ids, attention_mask=mask).logits[mask.bool()].float()
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


def test_triton_path_through_the_interpreter():
    """The Triton kernels (the interpreter on the CPU) in HF's Llama, bf16, against sdpa in fp32."""
    flash_models.hf.register(backend="triton")
    try:
        config = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=32)  # head dim 32: one the kernels take
        reference = random_hf_model(transformers.LlamaConfig(**config), seed=4)
        ours = random_hf_model(transformers.LlamaConfig(**config), seed=4, attn_implementation="fm_attention")
        ours.to(torch.bfloat16)
        ids = torch.randint(0, VOCAB, (2, 7))
        mask = torch.tensor([[1] * 7, [0, 0] + [1] * 5])
        want = reference(input_ids=ids, attention_mask=mask).logits[mask.bool()]
        got = ours(input_ids=ids, attention_mask=mask).logits[mask.bool()]
        got.float().sum().backward()  # the backward kernels run too
        err = (got.float() - want).abs().max() / want.abs().max()
        assert err < 3e-2, err
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in ours.parameters() if p.requires_grad)
    finally:
        flash_models.hf.register(backend="reference")


def test_refuses_what_it_cannot_do():
    _, ours = pair("llama", seed=5)
    with pytest.raises(ValueError, match="attention weights"):
        ours(input_ids=torch.randint(0, VOCAB, (1, 4)), output_attentions=True)
    with pytest.raises(ValueError, match="backend"):
        flash_models.hf.register(backend="cuda")
    causal = torch.tril(torch.ones(4, 4, dtype=torch.bool)).expand(1, 1, 4, 4)
    with pytest.raises(ValueError, match="4D \\(custom\\) attention mask"):
        ours(input_ids=torch.randint(0, VOCAB, (1, 4)), attention_mask=causal)


def test_refuses_a_model_whose_attention_takes_a_bias():
    """T5 adds a relative position bias to the scores through the interface: refused, never dropped."""
    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=40, num_layers=1, num_heads=4,
                                   dropout_rate=0.0)
    t5 = random_hf_model(config, seed=6, auto_class="AutoModelForSeq2SeqLM", attn_implementation="fm_attention")
    ids = torch.randint(0, VOCAB, (2, 5))
    with pytest.raises(ValueError, match="position_bias=, passed by T5Attention"):
        t5(input_ids=ids, decoder_input_ids=ids)


@pytest.mark.parametrize("decoder_len", [5, 9], ids=["shorter", "same-length"])
def test_cross_attention_equals_eager(decoder_len):
    """BART: the encoder's padding mask covers the cross-attention's keys, not its queries (the decoder's tokens),
    whatever the two lengths."""
    config = lambda: transformers.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,  # noqa: E731
                                             encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=40,
                                             decoder_ffn_dim=40, dropout=0.0, attention_dropout=0.0,
                                             activation_dropout=0.0, max_position_embeddings=32)
    eager = random_hf_model(config(), seed=7, auto_class="AutoModelForSeq2SeqLM", attn_implementation="eager")
    ours = random_hf_model(config(), seed=7, auto_class="AutoModelForSeq2SeqLM", attn_implementation="fm_attention")
    inputs = dict(input_ids=torch.randint(3, VOCAB, (2, 9)), attention_mask=torch.tensor([[1] * 9, [1] * 4 + [0] * 5]),
                  decoder_input_ids=torch.randint(3, VOCAB, (2, decoder_len)))
    inputs["decoder_attention_mask"] = torch.ones(2, decoder_len, dtype=torch.long)
    inputs["decoder_attention_mask"][1, -2:] = 0
    real = inputs["decoder_attention_mask"].bool()
    assert_same(logits_and_grads(ours, **inputs, labels_mask=real), logits_and_grads(eager, **inputs, labels_mask=real))


@pytest.mark.parametrize("fused_ops", [False, True], ids=["attention", "attention+fused_ops"])
def test_a_cuda_training_forward_moves_later_backwards_to_this_thread(monkeypatch, fused_ops):
    """HF's model with our attention (and our fused norms) switches the calling thread's backward as our own
    models' forwards do (flash_models.backward; the device is faked here, tests/test_backward_thread.py runs a
    real one); HF's own attention leaves torch's default."""
    from flash_models import backward

    monkeypatch.setattr(backward, "_on_cuda", lambda module: True)
    sdpa, ours = pair("llama", seed=7)
    ids = torch.randint(0, VOCAB, (2, 6))
    sdpa(input_ids=ids).logits.sum().backward()
    assert torch._C._is_multithreading_enabled()
    if fused_ops:
        ours.set_attn_implementation("sdpa")
        flash_models.hf.use_fused_ops(ours, backend="reference")
    with torch.no_grad():
        ours(input_ids=ids)
    assert torch._C._is_multithreading_enabled()
    ours(input_ids=ids).logits.sum().backward()
    assert not torch._C._is_multithreading_enabled()
