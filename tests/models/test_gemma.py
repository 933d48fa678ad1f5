"""Gemma: what is particular to it beyond the registry's parity tests. Its norms scale by 1 + weight and its token
embeddings by sqrt(hidden) rounded to the table's dtype; both must follow HF in fp32 and bf16, in training,
generation, the lean CPU step and a resized vocabulary."""

import pytest
import torch
import transformers

from flash_models.modules import Norm
from flash_models.modules.scaled_embedding import ScaledEmbedding
from flash_models.runtime.cpu_decode import lean_step_unsupported
from flash_models.testing import (
    assert_bf16_error_bounded, assert_fp32_parity, assert_greedy_generation_equals_hf,
    assert_kv_cache_decode_equals_full_forward, assert_padded_rows_equal_alone, max_rel_err, ours_from_hf,
    random_hf_model, random_input_ids,
)

VOCAB = 203
HIDDEN = 48  # sqrt(48) = 6.928..., which bf16 rounds (to 6.9375): the scale's rounding shows


def gemma_config(**overrides):
    base = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=1, head_dim=16, max_position_embeddings=64, pad_token_id=0, bos_token_id=2,
                eos_token_id=1)
    return transformers.GemmaConfig(**{**base, **overrides})


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
def test_fp32_logits_and_loss_match_hf(attn_impl):
    hf = random_hf_model(gemma_config(), seed=1)  # norm weights drawn around 0: 1 + weight differs from weight
    ours = ours_from_hf(hf, attn_impl=attn_impl)
    assert type(ours).__name__ == "GemmaForCausalLM" and ours.head_is_tied()
    assert all(isinstance(m, Norm) and m.zero_centered for m in (ours.norm_f, ours.blocks[0].norm1, ours.blocks[2].norm2))
    ids = torch.randint(0, VOCAB, (2, 19))
    assert_fp32_parity(hf, ours, ids, labels=ids, tol=1e-5)


def test_training_step_gradients_match_hf():
    """The fused LM head + loss of a training forward, through the tied, scaled table: HF's loss and gradients."""
    hf = random_hf_model(gemma_config(), seed=2).train()
    ours = ours_from_hf(hf).train()
    ids = torch.randint(0, VOCAB, (2, 15))
    ref, out = hf(ids, labels=ids), ours(ids, labels=ids)
    assert out.logits is None  # the fused loss
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=0)
    ref.loss.backward()
    out.loss.backward()
    pairs = {"embed": (ours.embed.tokens.weight.grad[:VOCAB], hf.model.embed_tokens.weight.grad),  # (ours: 256 rows)
             "norm_f": (ours.norm_f.weight.grad, hf.model.norm.weight.grad),
             "norm1": (ours.blocks[1].norm1.weight.grad, hf.model.layers[1].input_layernorm.weight.grad),
             "down": (ours.blocks[2].mlp.down.weight.grad, hf.model.layers[2].mlp.down_proj.weight.grad)}
    for name, (mine, theirs) in pairs.items():
        assert max_rel_err(mine, theirs) < 1e-4, name


def test_padded_rows_and_kv_cache_decode():
    ours = ours_from_hf(random_hf_model(gemma_config(), seed=3))
    assert_padded_rows_equal_alone(ours, VOCAB, side="left")
    assert_padded_rows_equal_alone(ours, VOCAB, side="right")
    assert_kv_cache_decode_equals_full_forward(ours, torch.randint(0, VOCAB, (2, 12)), prefill=5, cache_len=16)


def test_greedy_generation_equals_hf_through_the_lean_cpu_step():
    hf = random_hf_model(gemma_config(), seed=4)
    ours = ours_from_hf(hf)
    with torch.no_grad():  # the float32 CPU decode step takes Gemma
        assert lean_step_unsupported(ours, ours.new_kv_cache(2, 8)) is None
    assert_greedy_generation_equals_hf(hf, ours, vocab_size=VOCAB, shape=(2, 7), max_new_tokens=9, left_pad=(1, 3))


def test_bf16_error_bounded_by_hfs():
    assert_bf16_error_bounded(gemma_config(), random_input_ids(VOCAB, (2, 16)), seed=5)


def test_embeddings_are_scaled_as_hfs_in_each_dtype():
    """get_input_embeddings() is the scaled table, as HF's (NEFTune's hook and inputs_embeds see scaled vectors),
    and its scale is rounded to the table's dtype as HF rounds it: bit for bit in bf16 and fp32."""
    hf = random_hf_model(gemma_config(), seed=6)
    ours = ours_from_hf(hf)
    table = ours.get_input_embeddings()
    assert isinstance(table, ScaledEmbedding) and table.scale == HIDDEN**0.5
    ids = torch.randint(0, VOCAB, (3, 5))
    for dtype in (torch.float32, torch.bfloat16):
        hf_table, our_table = hf.get_input_embeddings().to(dtype), table.to(dtype)
        with torch.no_grad():
            torch.testing.assert_close(our_table(ids), hf_table(ids), rtol=0, atol=0)
    assert table.scale_in(torch.bfloat16) == 6.9375 != HIDDEN**0.5


def test_resized_vocabulary_keeps_the_scale_and_hfs_logits():
    hf = random_hf_model(gemma_config(), seed=7)
    ours = ours_from_hf(hf)
    hf.resize_token_embeddings(VOCAB + 9)
    ours.resize_token_embeddings(VOCAB + 9)
    assert isinstance(ours.get_input_embeddings(), ScaledEmbedding)
    # HF draws the new rows around the old rows' mean, which ours take (5e-6 apart here): the old tokens'
    # logits, the new columns included, are HF's
    ids = torch.randint(0, VOCAB, (2, 11))
    with torch.no_grad():
        out, ref = ours(ids).logits, hf(ids).logits
    assert out.shape[-1] == VOCAB + 9
    torch.testing.assert_close(out[..., :VOCAB], ref[..., :VOCAB], atol=1e-5, rtol=0)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


def test_fresh_norms_start_at_zero_weight_and_unit_scale():
    """A model built from a config (not loaded) has Gemma's fresh norm weights, zeros, so each scales by one."""
    from flash_models.checkpoint.loader import create_model

    model = create_model("gemma-2b", **{"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
                                        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
                                        "vocab_size": 128})
    assert all(torch.equal(n.weight, torch.zeros_like(n.weight)) for n in model.modules() if isinstance(n, Norm))
    x = torch.randn(2, 64)
    torch.testing.assert_close(model.norm_f(x), x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6))


def test_bidirectional_attention_is_refused():
    from flash_models.models.gemma import GemmaConfig

    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        GemmaConfig.from_hf(gemma_config(use_bidirectional_attention=True))


@pytest.mark.gpu
def test_gpu_kernels_follow_hf():
    """On CUDA our kernels take Gemma's norms (1 + weight) and scaled table: float32 logits and greedy tokens
    (the decode steps leave the chained GEMVs to LLaMA-style norms) are HF's, and a bf16-autocast training
    step (flash attention, fused norms, the fused loss) gives HF's float32 loss within bf16's rounding."""
    hf = random_hf_model(gemma_config(), seed=8)
    ours = ours_from_hf(hf).cuda()
    hf = hf.cuda()
    ids = torch.randint(3, VOCAB, (2, 21), device="cuda")
    with torch.no_grad():
        assert max_rel_err(ours(ids).logits, hf(ids).logits) < 1e-4
        mine = ours.generate(ids[:, :9], max_new_tokens=8, do_sample=False, eos_token_id=[])
        theirs = hf.generate(ids[:, :9], max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(mine, theirs)
    ours.train()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = ours(ids, labels=ids).loss
    loss.backward()
    with torch.no_grad():
        reference = hf(ids, labels=ids).loss
    torch.testing.assert_close(loss.float(), reference, rtol=2e-2, atol=0)
    assert all(p.grad is not None and p.grad.isfinite().all() for p in ours.parameters() if p.requires_grad)
