"""flash_models.hf.use_fused_ops(model) on HF's own models: the same logits, loss and gradients as the model it
swapped, HF's state-dict keys and save_pretrained untouched, our attention on top, the Triton path."""

import functools

import pytest
import torch
import transformers

import flash_models.hf
from flash_models.hf import FusedNorm, use_fused_ops
from flash_models.hf.fused_ops import causal_lm_loss
from flash_models.testing import random_hf_model

VOCAB = 101
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, max_position_embeddings=64)
GQA = dict(intermediate_size=40, num_attention_heads=4, num_key_value_heads=2)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, **GQA),
    "mistral": lambda: transformers.MistralConfig(**COMMON, **GQA, sliding_window=5),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, **GQA),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, **GQA, head_dim=8),  # q_norm / k_norm per head too
    "phi3": lambda: transformers.Phi3Config(**COMMON, **GQA, pad_token_id=0),  # fused qkv_proj and gate_up_proj
    "gemma": lambda: transformers.GemmaConfig(**COMMON, **GQA, head_dim=8),  # (1 + weight) norms
    "gemma2": lambda: transformers.Gemma2Config(**COMMON, **GQA, head_dim=8, query_pre_attn_scalar=8,
                                                final_logit_softcapping=5.0),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
}


def pair(name: str, seed: int, *, backend: str = "reference", attn_implementation: str = "sdpa"):
    """(HF's model, the same weights with use_fused_ops)."""
    attention = "eager" if name == "gemma2" else attn_implementation  # Gemma2's softcap has no sdpa path
    plain = random_hf_model(CONFIGS[name](), seed=seed, attn_implementation=attention)
    fused = random_hf_model(CONFIGS[name](), seed=seed, attn_implementation=attention)
    assert use_fused_ops(fused, backend=backend) is fused
    return plain, fused


def batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (3, 11), generator=gen)
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt that is not trained on
    return ids, labels


def loss_logits_grads(model, **inputs):
    model.zero_grad()
    out = model(**inputs)
    (out.loss + (out.logits * torch.linspace(-1, 1, out.logits.shape[-1])).mean()).backward()
    return out.loss.detach(), out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_same(a, b, atol=1e-5):
    (loss_a, logits_a, grads_a), (loss_b, logits_b, grads_b) = a, b
    torch.testing.assert_close(loss_a, loss_b, atol=atol, rtol=1e-5)
    torch.testing.assert_close(logits_a, logits_b, atol=atol, rtol=1e-5)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], atol=atol, rtol=1e-4, msg=name)


def norm_count(model) -> int:
    return sum(isinstance(m, FusedNorm) for m in model.modules())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_equals_the_unswapped_model(name):
    plain, fused = pair(name, seed=1)
    # Every norm is swapped: per layer two (GPT-2: ln_1, ln_2), Gemma2 four, Qwen3 two more per head; one final.
    per_layer = {"gemma2": 4, "qwen3": 4}.get(name, 2)
    assert norm_count(fused) == 2 * per_layer + 1
    assert fused.loss_function.func is causal_lm_loss
    ids, labels = batch(2)
    assert_same(loss_logits_grads(fused, input_ids=ids, labels=labels), loss_logits_grads(plain, input_ids=ids, labels=labels))
    # transformers.Trainer's gradient accumulation: the sum over the batch / the items of all micro-batches.
    items = torch.tensor(47)
    assert_same(loss_logits_grads(fused, input_ids=ids, labels=labels, num_items_in_batch=items),
                loss_logits_grads(plain, input_ids=ids, labels=labels, num_items_in_batch=items))


@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt2"])
def test_keys_parameters_and_save_pretrained_unchanged(name, tmp_path):
    plain, fused = pair(name, seed=3)
    before = dict(fused.named_parameters())
    assert list(fused.state_dict()) == list(plain.state_dict())
    assert all(before[n] is p for n, p in fused.named_parameters())  # an optimizer built before the swap still steps them
    # The swapped model loads an HF state dict strictly, and its own round-trips.
    fresh = use_fused_ops(random_hf_model(CONFIGS[name](), seed=4, attn_implementation=plain.config._attn_implementation),
                          backend="reference")
    fresh.load_state_dict(plain.state_dict(), strict=True)
    plain.load_state_dict(fresh.state_dict(), strict=True)
    fused.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=plain.config._attn_implementation)
    assert not any(isinstance(m, FusedNorm) for m in reloaded.modules())  # HF's own classes, from HF's files
    ids = torch.randint(0, VOCAB, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, fused(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["qwen2", "gpt2"])
def test_with_our_attention(name):
    """use_fused_ops and attn_implementation="fm_attention" together: a padded batch, against sdpa + HF's norms."""
    flash_models.hf.register(backend="reference")
    plain, fused = pair(name, seed=5, attn_implementation=flash_models.hf.ATTN_IMPLEMENTATION)
    plain.set_attn_implementation("sdpa")
    ids, labels = batch(6)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    labels[1, :4] = -100
    fused_out, plain_out = (loss_logits_grads(m, input_ids=ids, attention_mask=mask, labels=labels) for m in (fused, plain))
    real = mask.bool()  # padding rows differ between attention implementations and carry no loss
    assert_same((fused_out[0], fused_out[1][real], fused_out[2]), (plain_out[0], plain_out[1][real], plain_out[2]), atol=2e-5)


def test_gradient_checkpointing_and_a_training_step():
    plain, fused = pair("llama", seed=7)
    for model in (plain, fused):
        model.train()
        model.activation_checkpointing_enable()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(2):
            ids, labels = batch(10 + step)
            model(input_ids=ids, labels=labels).loss.backward()
            opt.step()
            opt.zero_grad()
    for (name, a), b in zip(fused.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_triton_path_through_the_interpreter(name):
    """Our Triton norm and cross-entropy kernels (the interpreter on the CPU), forward and backward."""
    plain, fused = pair(name, seed=8, backend="triton")
    ids, labels = batch(9)
    assert_same(loss_logits_grads(fused, input_ids=ids, labels=labels), loss_logits_grads(plain, input_ids=ids, labels=labels),
                atol=2e-5)
    use_fused_ops(fused, backend="reference")  # again, with another backend: the same modules re-made
    assert {m.backend for m in fused.modules() if isinstance(m, FusedNorm)} == {"reference"}


def test_other_heads_get_the_norms():
    def config():
        return transformers.LlamaConfig(**COMMON, **GQA, num_labels=3, pad_token_id=0)

    plain = random_hf_model(config(), seed=11, auto_class="AutoModelForSequenceClassification")
    fused = use_fused_ops(random_hf_model(config(), seed=11, auto_class="AutoModelForSequenceClassification"),
                          backend="reference")
    assert norm_count(fused) == 5
    ids = torch.randint(1, VOCAB, (2, 6))
    labels = torch.tensor([0, 2])
    torch.testing.assert_close(fused(input_ids=ids, labels=labels).loss, plain(input_ids=ids, labels=labels).loss)


def test_refuses_what_it_cannot_do():
    neox = random_hf_model(transformers.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                                                      num_attention_heads=4, intermediate_size=40), seed=12)
    with pytest.raises(ValueError, match="model_type 'gpt_neox'.*fm.from_pretrained"):
        use_fused_ops(neox)
    with pytest.raises(ValueError, match="PreTrainedModel"):
        use_fused_ops(torch.nn.Sequential(torch.nn.LayerNorm(4)))
    with pytest.raises(ValueError, match="backend"):
        use_fused_ops(random_hf_model(CONFIGS["llama"](), seed=13), backend="cuda")


def test_a_peft_model_gets_the_fused_ops_under_its_adapters():
    """use_fused_ops(get_peft_model(hf, ...)): the base model is swapped, the wrapper returned, and the adapted
    model computes what it computed before (loss, logits, the adapters' gradients)."""
    import peft

    plain, fused = (peft.get_peft_model(random_hf_model(CONFIGS["llama"](), seed=14),
                                        peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
                    for _ in range(2))
    fused.load_state_dict(plain.state_dict())  # the same adapter weights
    assert use_fused_ops(fused, backend="reference") is fused
    assert norm_count(fused) == 2 * 2 + 1
    assert isinstance(fused.get_base_model().loss_function, functools.partial)
    ids, labels = batch(15)
    want, got = loss_logits_grads(plain, input_ids=ids, labels=labels), loss_logits_grads(fused, input_ids=ids, labels=labels)
    assert_same(got, want)
