"""Our BERT sequence classifier (one output) as the reward model of TRL's RewardTrainer, which calls every model
with ``use_cache=False``: HF's losses, accuracies and margins from the same weights."""

import random

import datasets
import pytest
import transformers
from trl import RewardConfig, RewardTrainer

import flash_models as fm
from flash_models.testing import ours_from_hf, random_hf_model


def test_reward_model_matches_hf(tmp_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(fm.minilm_dir())
    tokenizer.eos_token = "[SEP]"  # RewardTrainer appends the EOS token to every text
    rng = random.Random(0)
    rows = []
    for _ in range(8):
        a, b = rng.randrange(100), rng.randrange(100)
        rows.append({"chosen": f"{a} plus {b} is {a + b}.", "rejected": f"{a} plus {b} is {a * b + 1}, surely."})
    config = transformers.BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=48, max_position_embeddings=64, num_labels=1,
                                     architectures=["BertForSequenceClassification"], hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)

    def run(model, name):
        args = RewardConfig(output_dir=str(tmp_path / name), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2,
                            report_to=[], use_cpu=True, logging_steps=1, save_strategy="no", seed=0, data_seed=0,
                            disable_tqdm=True, bf16=False, max_length=32)
        trainer = RewardTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                                processing_class=tokenizer)
        trainer.train()
        return [e for e in trainer.state.log_history if "loss" in e]

    hf = random_hf_model(config, seed=1, auto_class="AutoModelForSequenceClassification")
    ours = ours_from_hf(hf)
    expected, got = run(hf, "hf"), run(ours, "ours")
    assert len(got) == 2 and got[1]["margin"] != 0
    for theirs, mine in zip(expected, got):
        for metric in ("loss", "accuracy", "margin"):
            assert mine[metric] == pytest.approx(theirs[metric], abs=1e-5), metric
