import pytest
import torch
import transformers

import flash_models as fm
from flash_models.testing import (
    assert_bf16_error_bounded, assert_fp32_parity, assert_greedy_generation_equals_hf,
    assert_kv_cache_decode_equals_full_forward, assert_meta_keys_match_hf, assert_padded_rows_equal_alone,
    assert_round_trip_bit_identical, max_rel_err, ours_from_hf, random_hf_model, random_input_ids,
)

VOCAB = 197
WINDOW = 6  # shorter than the sequences below: the window acts
ORIGINAL = 24  # LongRoPE's original length: the long-context tests cross it


def phi3_config(**overrides):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, original_max_position_embeddings=64,
                sliding_window=WINDOW, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    return transformers.Phi3Config(**{**base, **overrides})


def longrope_config(**overrides):
    """Phi-3-128k's rotary: LongRoPE past ORIGINAL tokens, here over the first 3/4 of each head (Phi-4-mini's
    partial rotary), no window."""
    rotated = 12  # 16 channels a head, 3/4 of them
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + i / 8 for i in range(rotated // 2)], "long_factor": [2.0 + i for i in range(rotated // 2)]}
    return phi3_config(sliding_window=None, max_position_embeddings=96, original_max_position_embeddings=ORIGINAL,
                       rope_parameters=rope, **overrides)


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
def test_fp32_logits_and_loss_match_hf_across_the_window(attn_impl):
    hf = random_hf_model(phi3_config(), seed=1)
    ours = ours_from_hf(hf, attn_impl=attn_impl)
    assert type(ours).__name__ == "Phi3ForCausalLM" and ours.decoder_config.attention.sliding_window == WINDOW
    ids = torch.randint(0, VOCAB, (2, 23))
    out = assert_fp32_parity(hf, ours, ids, labels=ids, tol=1e-5)
    with torch.no_grad():
        no_window = ours_from_hf(random_hf_model(phi3_config(sliding_window=None), seed=1))(ids).logits
    assert max_rel_err(no_window[:, WINDOW:], out.logits[:, WINDOW:]) > 1e-3, "the window must change the output"


def test_fused_checkpoint_projections_load_row_for_row():
    """HF's qkv_proj and gate_up_proj are our qkv and gate_up as they are: the round trip is bit-identical, and
    the meta model has HF's keys and shapes."""
    cfg = phi3_config(num_key_value_heads=1)
    hf = random_hf_model(cfg, seed=2)
    assert_round_trip_bit_identical(hf)
    assert_meta_keys_match_hf(cfg, auto_class="AutoModelForCausalLM")
    ours = ours_from_hf(hf)
    torch.testing.assert_close(ours.blocks[1].attn.qkv.weight, hf.model.layers[1].self_attn.qkv_proj.weight, rtol=0, atol=0)
    torch.testing.assert_close(ours.blocks[1].mlp.gate_up.weight, hf.model.layers[1].mlp.gate_up_proj.weight, rtol=0, atol=0)


@pytest.mark.parametrize("length", [ORIGINAL - 3, ORIGINAL + 17])
def test_longrope_and_partial_rotary_match_hf_on_both_sides_of_the_original_length(length):
    hf = random_hf_model(longrope_config(), seed=3)
    ours = ours_from_hf(hf)
    rope = ours.decoder_config.rope
    assert (rope.rope_type, rope.rotary_dim, rope.original_length) == ("longrope", 12, ORIGINAL)
    ids = torch.randint(0, VOCAB, (2, length))
    assert_fp32_parity(hf, ours, ids, labels=ids, tol=1e-5)


def test_generation_across_the_longrope_switch_equals_hf():
    """HF's generate recomputes the whole cache with the long factors once the sequence passes the original
    length; ours too, so the tokens after the switch are HF's (a cache kept on would differ from there)."""
    hf = random_hf_model(longrope_config(), seed=4)
    ours = ours_from_hf(hf)
    assert_greedy_generation_equals_hf(hf, ours, vocab_size=VOCAB, shape=(2, ORIGINAL - 5), left_pad=(1, 3),
                                       max_new_tokens=16)


@pytest.mark.parametrize("left_pad", [None, (1, 2)])
def test_greedy_generation_with_partial_rotary_equals_hf(left_pad):
    """Half of each head rotates; unpadded prompts take the CPU's lean prefill and decode step, a padded batch
    the plain forward."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    hf = random_hf_model(phi3_config(rope_parameters=rope), seed=12)
    assert_greedy_generation_equals_hf(hf, ours_from_hf(hf), vocab_size=VOCAB, shape=(2, 9), left_pad=left_pad,
                                       max_new_tokens=20)


def test_speculative_decoding_refuses_to_cross_the_longrope_switch():
    ours = ours_from_hf(random_hf_model(longrope_config(), seed=5))
    ids = torch.randint(2, VOCAB, (1, ORIGINAL - 2))
    with pytest.raises(ValueError, match="LongRoPE.*generate without draft_model"):
        ours.generate(ids, max_new_tokens=8, draft_model=ours)
    assert ours.generate(ids[:, :8], max_new_tokens=4, draft_model=ours).shape == (1, 12)  # short of it: runs


def test_config_round_trip_keeps_longrope_and_the_partial_rotary():
    ours = ours_from_hf(random_hf_model(longrope_config(resid_pdrop=0.1), seed=6))
    hf_again = ours.config.typed.to_hf()
    assert hf_again.rope_parameters["partial_rotary_factor"] == 0.75
    assert hf_again.rope_parameters["rope_type"] == "longrope" and hf_again.resid_pdrop == 0.1
    assert type(ours.config.typed).from_hf(hf_again) == ours.config.typed


def test_residual_dropout_acts_in_training_only():
    """resid_pdrop drops each branch's output before its residual add, as HF's Phi-3 does."""
    ours = ours_from_hf(random_hf_model(phi3_config(resid_pdrop=0.5), seed=7))
    assert ours.decoder_config.residual_dropout_p == 0.5 and ours.decoder_config.embed_dropout_p == 0.0
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        assert torch.equal(ours.eval()(ids).logits, ours(ids).logits)
        ours.train()
        first, second = ours(ids, return_logits=True).logits, ours(ids, return_logits=True).logits
    assert max_rel_err(first, second) > 1e-2


def test_bf16_error_bounded_by_hf_own_bf16_error():
    assert_bf16_error_bounded(phi3_config(), random_input_ids(VOCAB, (2, 30)), seed=8)


def test_kv_cache_decode_keeps_the_window():
    ours = ours_from_hf(random_hf_model(phi3_config(), seed=9))
    assert_kv_cache_decode_equals_full_forward(ours, torch.randint(0, VOCAB, (2, 21)), prefill=4, cache_len=32, tol=1e-5)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_equals_each_sequence_alone(side):
    assert_padded_rows_equal_alone(ours_from_hf(random_hf_model(phi3_config(), seed=10)), VOCAB, side=side)


def test_our_kernels_stay_within_hf_bf16_error():
    """attn_impl='flash' and kernel_backend='triton' (on a CPU through Triton's interpreter), the partial rotary
    and a padded row included."""
    ids = torch.randint(0, VOCAB, (2, 13))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    assert_bf16_error_bounded(phi3_config(num_hidden_layers=2, rope_parameters=rope),
                              {"input_ids": ids, "attention_mask": mask}, seed=11, attn_impl="flash",
                              kernel_backend="triton")


def test_the_preset_builds_phi3_mini():
    model = fm.create_model("phi3-mini", device="meta")
    dc = model.decoder_config
    assert (dc.num_layers, dc.hidden_size, dc.vocab_size, dc.attention.sliding_window) == (32, 3072, 32064, 2047)
    assert "phi3-mini" in fm.list_models()
