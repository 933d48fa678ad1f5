"""attn_impl='flash' takes any head dim up to 256, as FlashAttention-2 does: a model whose head dim is not one of
the kernels' tile widths (here 24) runs on our kernels (through Triton's interpreter on a CPU) within HF's own
bf16 error."""

import pytest
import torch
import transformers

from flash_models.modules.attention import Attention
from flash_models.config import AttentionConfig
from flash_models.testing import low_precision_bound_ok, ours_from_hf, random_hf_model


def test_flash_takes_head_dim_24_and_refuses_past_256():
    cfg = transformers.GPTNeoXConfig(vocab_size=97, hidden_size=48, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=80, max_position_embeddings=32, rotary_pct=0.5)
    hf32 = random_hf_model(cfg, seed=3)
    hf16 = random_hf_model(cfg, seed=3).to(torch.bfloat16)
    ours = ours_from_hf(hf32, attn_impl="flash", kernel_backend="triton", dtype=torch.bfloat16)
    ids = torch.randint(0, 97, (2, 11))
    with torch.no_grad():
        out = ours(ids).logits.float()
        ok, ours_err, hf_err = low_precision_bound_ok(out, hf16(ids).logits.float(), hf32(ids).logits)
    assert ok, f"ours bf16 error {ours_err:.3g} vs HF's own bf16 error {hf_err:.3g}"
    with pytest.raises(ValueError, match="head dims up to 256"):
        Attention(AttentionConfig(hidden_size=576, num_heads=2, num_kv_heads=2, head_dim=288), layer_idx=0,
                  attn_impl="flash")
