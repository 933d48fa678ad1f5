"""Our causal LM in TRL's DPOTrainer, which patches the model's forward with its fused LM head (it reads
``base_model`` and ``get_output_embeddings``): the same losses and rewards as HF's model from the same weights, and
a PEFT adapter as the policy with the adapter-less model as its reference (``ref_model=None``)."""

import random

import datasets
import peft
import pytest
import torch
import transformers
from trl import DPOConfig, DPOTrainer

import flash_models as fm
from flash_models.checkpoint.tokenizer import load_gguf_tokenizer
from flash_models.testing import ours_from_hf, random_hf_model

METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


@pytest.fixture(scope="module")
def tokenizer():
    return load_gguf_tokenizer(fm.smollm2_gguf())  # SmolLM2's tokenizer, offline


def preferences(seed: int) -> datasets.Dataset:
    rng = random.Random(seed)
    rows = []
    for _ in range(8):
        a, b = rng.randrange(100), rng.randrange(100)
        rows.append({"prompt": f"What is {a} plus {b}?", "chosen": f" {a + b}.",
                     "rejected": f" {a + b + rng.randrange(1, 9)}, I think."})
    return datasets.Dataset.from_list(rows)


def config(vocab: int) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def dpo_args(out) -> DPOConfig:
    return DPOConfig(output_dir=str(out), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2, report_to=[],
                     use_cpu=True, logging_steps=1, save_strategy="no", seed=0, data_seed=0, disable_tqdm=True,
                     max_length=64, bf16=False)  # fp32 for a tight comparison


def test_dpo_matches_hf(tmp_path, tokenizer):
    data = preferences(seed=0)

    def run(policy, reference, name):
        trainer = DPOTrainer(model=policy, ref_model=reference, args=dpo_args(tmp_path / name), train_dataset=data,
                             processing_class=tokenizer)
        trainer.train()
        return [e for e in trainer.state.log_history if "loss" in e]

    hf, hf_ref = random_hf_model(config(len(tokenizer)), seed=1), random_hf_model(config(len(tokenizer)), seed=1)
    ours, ours_ref = ours_from_hf(hf), ours_from_hf(hf_ref)
    expected, got = run(hf, hf_ref, "hf"), run(ours, ours_ref, "ours")
    assert len(got) == 2 and got[1]["rewards/margins"] != 0  # the second step sees a trained policy
    for theirs, mine in zip(expected, got):
        for metric in METRICS:
            assert mine[metric] == pytest.approx(theirs[metric], abs=1e-4), metric


def test_dpo_with_an_adapter_and_no_reference_model(tmp_path, tokenizer):
    """ref_model=None with a PEFT config: the reference is the policy with its adapter switched off. At the first
    step the two agree (LoRA's B starts at zero), so the loss is log 2; only the adapter trains."""
    ours = ours_from_hf(random_hf_model(config(len(tokenizer)), seed=2))
    base = {k: v.clone() for k, v in ours.state_dict().items()}
    trainer = DPOTrainer(model=ours, args=dpo_args(tmp_path), train_dataset=preferences(seed=1), processing_class=tokenizer,
                         peft_config=peft.LoraConfig(r=4, target_modules=["qkv", "gate_up"], task_type="CAUSAL_LM"))
    assert trainer.ref_model is None
    trainer.train()
    first = next(e for e in trainer.state.log_history if "loss" in e)
    assert first["loss"] == pytest.approx(torch.log(torch.tensor(2.0)).item(), abs=1e-6)
    merged = trainer.model.merge_and_unload()
    changed = {k for k, v in merged.state_dict().items() if not torch.equal(v, base[k])}
    assert changed and all(".qkv." in k or ".gate_up." in k for k in changed)
