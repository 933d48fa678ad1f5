"""Gemma 2: what is particular to it beyond the registry's parity tests. Four norms a block, soft-capped scores
and logits (small caps here, so that they act), a window on every other layer (shorter than the sequences),
``query_pre_attn_scalar``: HF's outputs in fp32 and bf16, training, generation, padding, and our kernels'
path (through Triton's interpreter on a CPU)."""

import pytest
import torch
import transformers

from flash_models.modules import SandwichBlock
from flash_models.testing import (
    assert_bf16_error_bounded, assert_fp32_parity, assert_greedy_generation_equals_hf,
    assert_kv_cache_decode_equals_full_forward, assert_padded_rows_equal_alone, max_rel_err, ours_from_hf,
    random_hf_model, random_input_ids,
)

VOCAB = 131
WINDOW = 5


def gemma2_config(**overrides):
    base = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=WINDOW,
                query_pre_attn_scalar=20, final_logit_softcapping=3.0, attn_logit_softcapping=2.0, pad_token_id=0,
                bos_token_id=2, eos_token_id=1)
    return transformers.Gemma2Config(**{**base, **overrides})


def hf_gemma2(seed, **overrides):
    return random_hf_model(gemma2_config(**overrides), seed=seed, attn_implementation="eager")  # HF: no sdpa here


@pytest.mark.parametrize("attn_impl", ["eager", "auto"])
def test_fp32_logits_and_loss_match_hf(attn_impl):
    hf = hf_gemma2(1)
    ours = ours_from_hf(hf, attn_impl=attn_impl)
    assert type(ours).__name__ == "Gemma2ForCausalLM" and all(isinstance(b, SandwichBlock) for b in ours.blocks)
    assert ours.decoder_config.full_attention_layers == (1,)  # HF's default: a window on layers 0 and 2
    ids = torch.randint(0, VOCAB, (2, 19))
    out = assert_fp32_parity(hf, ours, ids, labels=ids, tol=1e-5)
    assert out.logits.abs().max() <= 3.0  # the final soft-cap holds
    for name, value in (("attn_logit_softcapping", None), ("final_logit_softcapping", None), ("sliding_window", 64)):
        other = ours_from_hf(hf_gemma2(1, **{name: value}), attn_impl=attn_impl)
        with torch.no_grad():
            assert max_rel_err(other(ids).logits, out.logits) > 1e-3, f"{name} must change the output"


def test_training_loss_and_gradients_match_hf():
    """A training forward with labels: the soft-capped logits are computed (the fused loss cannot cap them), and
    the loss and gradients are HF's."""
    hf = hf_gemma2(2).train()
    ours = ours_from_hf(hf).train()
    ids = torch.randint(0, VOCAB, (2, 15))
    ref, out = hf(ids, labels=ids), ours(ids, labels=ids)
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=0)
    ref.loss.backward()
    out.loss.backward()
    layer, block = hf.model.layers[2], ours.blocks[2]
    pairs = {"embed": (ours.embed.tokens.weight.grad[:VOCAB], hf.model.embed_tokens.weight.grad),
             "post_attn_norm": (block.post_attn_norm.weight.grad, layer.post_attention_layernorm.weight.grad),
             "norm2": (block.norm2.weight.grad, layer.pre_feedforward_layernorm.weight.grad),
             "post_mlp_norm": (block.post_mlp_norm.weight.grad, layer.post_feedforward_layernorm.weight.grad),
             "qkv (q rows)": (block.attn.qkv.weight.grad[:64], layer.self_attn.q_proj.weight.grad)}
    for name, (mine, theirs) in pairs.items():
        assert max_rel_err(mine, theirs) < 1e-4, name


def test_padded_rows_and_kv_cache_decode_across_the_window():
    ours = ours_from_hf(hf_gemma2(3))
    assert_padded_rows_equal_alone(ours, VOCAB, side="left")
    assert_padded_rows_equal_alone(ours, VOCAB, side="right")
    assert_kv_cache_decode_equals_full_forward(ours, torch.randint(0, VOCAB, (2, 14)), prefill=4, cache_len=20)


def test_greedy_generation_equals_hf():
    hf = hf_gemma2(4)
    assert_greedy_generation_equals_hf(hf, ours_from_hf(hf), vocab_size=VOCAB, shape=(2, 6), max_new_tokens=12,
                                       left_pad=(1, 2))


def test_bf16_error_bounded_by_hfs_on_our_kernels():
    """bf16 through the reference ops, and through our attention kernels (soft-cap and window in the kernel;
    Triton's interpreter on a CPU)."""
    inputs = random_input_ids(VOCAB, (2, 16))
    assert_bf16_error_bounded(gemma2_config(), inputs, seed=5, attn_implementation="eager")
    assert_bf16_error_bounded(gemma2_config(head_dim=32), inputs, seed=5, attn_implementation="eager",
                              attn_impl="flash")


def test_custom_layer_types_round_trip_and_bad_ones_are_refused():
    from flash_models.models.gemma2 import Gemma2Config

    types = ["full_attention", "sliding_attention", "sliding_attention"]
    ours = ours_from_hf(hf_gemma2(6, layer_types=types))
    assert ours.decoder_config.full_attention_layers == (0,)
    assert ours.config.to_hf().layer_types == types
    with pytest.raises(ValueError, match="layer_types names 2 layers, the model has 3"):
        Gemma2Config(num_hidden_layers=3, layer_types=("full_attention", "full_attention"))
    with pytest.raises(ValueError, match=r"layer_types \['chunked_attention'\] are not supported"):
        Gemma2Config(num_hidden_layers=1, layer_types=("chunked_attention",))


def test_sdpa_is_refused_naming_the_soft_cap():
    with pytest.raises(ValueError, match="attn_impl='sdpa' has no soft-capping"):
        ours_from_hf(hf_gemma2(7), attn_impl="sdpa")


@pytest.mark.gpu
def test_gpu_kernels_follow_hf():
    """On CUDA our attention kernels soft-cap and window the scores: a bf16-autocast training step's loss within
    bf16's rounding of HF's float32 loss; in a bf16 model, the logits of a forward near HF's float32 ones, and a
    prefill then decode steps (the split-KV decode kernel) giving the full forward's logits."""
    hf = hf_gemma2(8, head_dim=32).cuda()
    ours = ours_from_hf(hf).cuda().train()
    ids = torch.randint(3, VOCAB, (2, 21), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = ours(ids, labels=ids).loss
    loss.backward()
    with torch.no_grad():
        reference = hf(ids, labels=ids)
    torch.testing.assert_close(loss.float(), reference.loss, rtol=2e-2, atol=0)
    ours = ours.eval().to(torch.bfloat16)
    with torch.no_grad():
        assert max_rel_err(ours(ids).logits.float(), reference.logits) < 3e-2
    assert_kv_cache_decode_equals_full_forward(ours, ids, prefill=6, cache_len=24, tol=3e-2)
