"""Our causal LM in TRL's on-policy trainers, GRPO and distillation: their completions come from our ``generate``,
called with TRL's GenerationConfig (sampling, top_k=0, min_p/repetition_penalty off, pad and several EOS ids) on
left-padded prompts. From HF's weights and the same seed, the first step samples HF's very tokens, so its metrics are
HF's. (Later steps sample from weights that differ from HF's by float rounding, which can flip a token of a
near-uniform tiny model.)"""

import random

import datasets
import pytest
import transformers
from trl import DistillationConfig, DistillationTrainer, GRPOConfig, GRPOTrainer

import flash_models as fm
from flash_models.checkpoint.tokenizer import load_gguf_tokenizer
from flash_models.testing import ours_from_hf, random_hf_model

METRICS = ("loss", "grad_norm", "reward", "reward_std", "completions/mean_length", "num_tokens", "entropy")


def reward_length(completions, **kwargs) -> list[float]:
    return [len(text) / 10 for text in completions]


@pytest.fixture(scope="module")
def tokenizer():
    return load_gguf_tokenizer(fm.smollm2_gguf())  # SmolLM2's tokenizer and chat template, offline


def tiny_llama(tokenizer, *, seed: int):
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return random_hf_model(config, seed=seed)


def test_grpo_first_step_matches_hf(tmp_path, tokenizer):
    rng = random.Random(0)
    # Prompts of different lengths: each batch of 4 completions holds two prompts, left-padded to one length.
    prompts = datasets.Dataset.from_list([{"prompt": "What is " + " plus ".join(str(rng.randrange(1000)) for _ in range(n))}
                                          for n in (2, 5, 3, 7)])

    def first_step(model, name):
        args = GRPOConfig(output_dir=str(tmp_path / name), max_steps=1, per_device_train_batch_size=4, num_generations=2,
                          max_completion_length=6, learning_rate=1e-2, report_to=[], use_cpu=True, logging_steps=1,
                          save_strategy="no", seed=0, data_seed=0, disable_tqdm=True, bf16=False)
        trainer = GRPOTrainer(model=model, reward_funcs=reward_length, args=args, train_dataset=prompts,
                              processing_class=tokenizer)
        trainer.train()
        return next(e for e in trainer.state.log_history if "loss" in e)

    hf = tiny_llama(tokenizer, seed=1)
    ours = ours_from_hf(hf)
    expected, got = first_step(hf, "hf"), first_step(ours, "ours")
    assert got["reward_std"] > 0  # the completions differ in length: a real advantage signal
    for metric in METRICS:
        assert got[metric] == pytest.approx(expected[metric], abs=1e-5), metric


def test_distillation_first_step_matches_hf(tmp_path, tokenizer):
    """The student samples its completions, then the loss compares its and the teacher's next-token distributions
    over them; TRL reads both models' hidden states through ``base_model`` (with HF's ``logits_to_keep``)."""
    rng = random.Random(1)
    rows = [{"prompt": [{"role": "user", "content": f"What is {rng.randrange(100)} plus {rng.randrange(100)}?"}]}
            for _ in range(8)]

    def first_step(student, teacher, name):
        args = DistillationConfig(output_dir=str(tmp_path / name), max_steps=1, per_device_train_batch_size=4,
                                  max_completion_length=6, learning_rate=1e-2, report_to=[], use_cpu=True, logging_steps=1,
                                  save_strategy="no", seed=0, data_seed=0, disable_tqdm=True, bf16=False)
        trainer = DistillationTrainer(model=student, teacher_model=teacher, args=args,
                                      train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer)
        trainer.train()
        return next(e for e in trainer.state.log_history if "loss" in e)

    student, teacher = tiny_llama(tokenizer, seed=2), tiny_llama(tokenizer, seed=3)
    expected = first_step(student, teacher, "hf")
    got = first_step(ours_from_hf(tiny_llama(tokenizer, seed=2)), ours_from_hf(teacher), "ours")
    assert got["loss"] > 0
    for metric in ("loss", "grad_norm"):
        assert got[metric] == pytest.approx(expected[metric], abs=1e-5), metric
