import pytest
import torch
import transformers

from flash_models.testing import (
    assert_bf16_error_bounded, assert_fp32_parity, assert_greedy_generation_equals_hf,
    assert_left_padded_logits_match_hf, max_rel_err, ours_from_hf, random_hf_model, random_input_ids,
)


def gpt2_config(**overrides):
    base = dict(vocab_size=211, n_positions=64, n_embd=48, n_layer=3, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                attn_pdrop=0.0, bos_token_id=0, eos_token_id=1)
    return transformers.GPT2Config(**{**base, **overrides})


CONFIGS = {
    "default": {},
    "untied_relu_inner": dict(tie_word_embeddings=False, activation_function="relu", n_inner=80),
    "gelu_erf_unscaled": dict(activation_function="gelu", scale_attn_weights=False, layer_norm_epsilon=1e-3),
}


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
@pytest.mark.parametrize("name", CONFIGS)
def test_fp32_logits_match_hf(name, attn_impl):
    hf = random_hf_model(gpt2_config(**CONFIGS[name]), seed=1)
    ours = ours_from_hf(hf, attn_impl=attn_impl)
    ids = torch.randint(0, 211, (3, 29))
    labels = ids.clone()
    labels[0, :5] = -100
    assert_fp32_parity(hf, ours, ids, labels=labels, tol=1e-5)


def test_left_padded_batch_matches_hf_with_same_positions():
    hf = random_hf_model(gpt2_config(), seed=2)
    ours = ours_from_hf(hf)
    ids = torch.randint(0, 211, (3, 17))
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    mask[1, :1] = 0
    assert_left_padded_logits_match_hf(hf, ours, ids, mask, tol=1e-5)


def test_padded_rows_equal_unpadded_sequences():
    ours = ours_from_hf(random_hf_model(gpt2_config(), seed=3))
    a, b = torch.randint(0, 211, (1, 13)), torch.randint(0, 211, (1, 7))
    batch = torch.zeros(2, 13, dtype=torch.long)
    batch[0], batch[1, 6:] = a[0], b[0]
    mask = torch.zeros_like(batch)
    mask[0], mask[1, 6:] = 1, 1
    with torch.no_grad():
        padded = ours(batch, attention_mask=mask, mask_positions=True).logits
        alone_b = ours(b).logits
    assert max_rel_err(padded[1, 6:], alone_b[0]) < 1e-5


def test_bf16_error_bounded_by_hf_own_bf16_error():
    assert_bf16_error_bounded(gpt2_config(), random_input_ids(211, (2, 31)), seed=4)


def test_backward_matches_hf_gradients():
    hf = random_hf_model(gpt2_config(), seed=5)
    ours = ours_from_hf(hf)
    ids = torch.randint(0, 211, (2, 19))
    hf(ids, labels=ids).loss.backward()
    ours(ids, labels=ids).loss.backward()
    hf_grad = hf.transformer.h[1].attn.c_attn.weight.grad.t()  # Conv1D stores (in, out)
    assert max_rel_err(ours.blocks[1].attn.qkv.weight.grad, hf_grad) < 1e-4
    assert max_rel_err(ours.embed.tokens.weight.grad[:211], hf.transformer.wte.weight.grad) < 1e-4
    assert not ours.embed.tokens.weight.grad[211:].any()  # the vocabulary padding gets no gradient


def test_greedy_generation_equals_hf():
    hf = random_hf_model(gpt2_config(), seed=6)
    ours = ours_from_hf(hf)
    assert_greedy_generation_equals_hf(hf, ours, vocab_size=211, shape=(1, 9), max_new_tokens=24)


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
@pytest.mark.parametrize("reorder_and_upcast_attn", [False, True])
def test_inverse_layer_idx_scaling_and_upcast_attention_match_hf(attn_impl, reorder_and_upcast_attn):
    """Checkpoints of the Mistral/Stanford-CRFM lineage set both options; HF's eager attention takes the
    reordered, upcast path, its SDPA ignores that flag."""
    cfg = gpt2_config(scale_attn_by_inverse_layer_idx=True, reorder_and_upcast_attn=reorder_and_upcast_attn)
    hf = random_hf_model(cfg, seed=11, attn_implementation=attn_impl)
    ours = ours_from_hf(hf, attn_impl=attn_impl)
    assert [b.attn.softmax_scale for b in ours.blocks] == pytest.approx([12 ** -0.5 / (i + 1) for i in range(3)])
    ids = torch.randint(0, 211, (2, 23))
    assert_fp32_parity(hf, ours, ids, labels=ids, tol=1e-5)
    assert ours.config.to_hf().scale_attn_by_inverse_layer_idx and ours.config.to_hf().reorder_and_upcast_attn == reorder_and_upcast_attn


def test_upcast_attention_bf16_error_bounded_by_hf_eager():
    cfg = gpt2_config(scale_attn_by_inverse_layer_idx=True, reorder_and_upcast_attn=True)
    assert_bf16_error_bounded(cfg, random_input_ids(211, (2, 29)), seed=12, attn_implementation="eager")
