"""Ours vs HF transformers under the same trainer: same initial weights, same batches, same AdamW, 30 steps in
fp32 with dropout 0. The per-step losses must agree within 1e-4 relative."""

import copy

import pytest
import transformers

from flash_models.testing import ours_from_hf, random_hf_model
from flash_models.train import Trainer

CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(vocab_size=257, n_positions=64, n_embd=48, n_layer=2, n_head=4,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=256,
                                            eos_token_id=256),
    "llama": lambda: transformers.LlamaConfig(vocab_size=257, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                              bos_token_id=256, eos_token_id=256, pad_token_id=None),
}


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_30_steps_match_hf(family, tiny_config, tmp_path):
    hf = random_hf_model(CONFIGS[family](), seed=7, )
    ours = ours_from_hf(hf, attn_impl="sdpa")
    hf = copy.deepcopy(hf)
    histories = {}
    for name, model in (("ours", ours), ("hf", hf)):
        cfg = tiny_config(data={"packing": "stream"},
                          train={"max_steps": 30, "output_dir": str(tmp_path / name), "global_batch_size": 4,
                                 "micro_batch_size": 2},
                          optim={"lr": 2e-3, "warmup_steps": 3, "weight_decay": 0.1, "grad_clip": 1.0})
        trainer = Trainer(cfg, model=model)
        trainer.fit()
        histories[name] = [h["loss"] for h in trainer.history]
    assert len(histories["ours"]) == 30
    assert histories["ours"][-1] < histories["ours"][0] - 0.5  # it actually trains
    for step, (a, b) in enumerate(zip(histories["ours"], histories["hf"]), 1):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {step}: ours {a} vs HF {b}"
