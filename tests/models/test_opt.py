import pytest
import torch
import transformers

import flash_models as fm
from flash_models.testing import (
    assert_meta_keys_match_hf, assert_padded_rows_equal_alone, assert_round_trip_bit_identical, low_precision_bound_ok,
    max_rel_err, ours_from_hf, random_hf_model,
)

VOCAB = 167


def opt_config(**overrides):
    base = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, ffn_dim=112, num_attention_heads=4,
                max_position_embeddings=48, dropout=0.0, pad_token_id=1, bos_token_id=2, eos_token_id=2)
    return transformers.OPTConfig(**{**base, **overrides})


CONFIGS = {
    "pre_norm": dict(),  # OPT-125m and the large ones
    "post_norm_projected": dict(do_layer_norm_before=False, word_embed_proj_dim=32),  # OPT-350m
    "pre_norm_projected_untied_no_bias": dict(word_embed_proj_dim=48, tie_word_embeddings=False, enable_bias=False),
}


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
@pytest.mark.parametrize("name", CONFIGS)
def test_fp32_logits_and_loss_match_hf(name, attn_impl):
    hf = random_hf_model(opt_config(**CONFIGS[name]), seed=1)
    ours = ours_from_hf(hf, attn_impl=attn_impl)
    ids = torch.randint(0, VOCAB, (3, 22))
    with torch.no_grad():
        ref, out = hf(ids, labels=ids), ours(ids, labels=ids)
    assert max_rel_err(out.logits, ref.logits) < 1e-5
    assert torch.allclose(out.loss, ref.loss, rtol=1e-5)


@pytest.mark.parametrize("name", ["pre_norm", "post_norm_projected"])
def test_left_padded_batch_matches_hf_positions_with_offset(name):
    """HF's OPT derives positions from the mask as we do (then adds its offset of 2)."""
    hf = random_hf_model(opt_config(**CONFIGS[name]), seed=2)
    ours = ours_from_hf(hf)
    ids = torch.randint(3, VOCAB, (3, 19))
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    mask[2, :18] = 0
    with torch.no_grad():
        ref, out = hf(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    assert max_rel_err(out[mask.bool()], ref[mask.bool()]) < 1e-5


@pytest.mark.parametrize("name", ["pre_norm", "post_norm_projected"])
def test_bf16_error_bounded_by_hf_own_bf16_error(name):
    cfg = opt_config(**CONFIGS[name])
    hf32 = random_hf_model(cfg, seed=3)
    hf16 = random_hf_model(cfg, seed=3).to(torch.bfloat16)
    ours16 = ours_from_hf(hf32, dtype=torch.bfloat16)
    ids = torch.randint(0, VOCAB, (2, 27))
    with torch.no_grad():
        ok, ours_err, hf_err = low_precision_bound_ok(ours16(ids).logits.float(), hf16(ids).logits.float(), hf32(ids).logits)
    assert ok, f"ours bf16 error {ours_err:.3g} vs HF's own bf16 error {hf_err:.3g}"


@pytest.mark.parametrize("name", CONFIGS)
def test_to_hf_of_from_hf_is_bit_identical_and_meta_keys_match(name):
    cfg = opt_config(**CONFIGS[name])
    assert_round_trip_bit_identical(random_hf_model(cfg, seed=4))
    assert_meta_keys_match_hf(cfg, auto_class="AutoModelForCausalLM")


def test_opt_model_keys_without_prefix_load(tmp_path):
    """facebook/opt-* files were written from OPTModel: keys start at "decoder.", and carry a tied lm_head."""
    hf = random_hf_model(opt_config(**CONFIGS["post_norm_projected"]), seed=5)
    state = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    hf.config.save_pretrained(tmp_path)
    torch.save(state, tmp_path / "pytorch_model.bin")
    ids = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        assert max_rel_err(fm.from_pretrained(tmp_path)(ids).logits, hf(ids).logits) < 1e-5


@pytest.mark.parametrize("name", ["pre_norm", "post_norm_projected"])
def test_save_pretrained_is_read_by_transformers_with_same_logits(name, tmp_path):
    hf = random_hf_model(opt_config(**CONFIGS[name]), seed=6)
    ours = ours_from_hf(hf)
    ours.save_pretrained(tmp_path)
    reread = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        assert max_rel_err(reread(ids).logits, hf(ids).logits) < 1e-6
    assert fm.from_pretrained(tmp_path).config == ours.config


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", ["pre_norm", "post_norm_projected"])
def test_padded_batch_equals_each_sequence_alone(name, side):
    ours = ours_from_hf(random_hf_model(opt_config(**CONFIGS[name]), seed=7))
    assert_padded_rows_equal_alone(ours, VOCAB, side=side)


@pytest.mark.parametrize("name", ["pre_norm", "post_norm_projected"])
def test_greedy_generation_equals_hf_on_left_padded_batch(name):
    hf = random_hf_model(opt_config(**CONFIGS[name]), seed=8)
    ours = ours_from_hf(hf)
    ids = torch.randint(3, VOCAB, (2, 8))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    ids[0, :2] = 1
    ref = hf.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=1)
    out = ours.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=[])
    assert torch.equal(out, ref)


@pytest.mark.parametrize("field, value", [("layerdrop", 0.1), ("layer_norm_elementwise_affine", False), ("_remove_final_layer_norm", True)])
def test_unsupported_options_raise(field, value):
    with pytest.raises(ValueError, match=field.lstrip("_")):
        fm.checkpoint.build_model(opt_config(**{field: value}))
