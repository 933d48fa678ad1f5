"""BERT sequence / token classification and ViT image classification in transformers.Trainer: the same
losses as HF's models, evaluation predictions, checkpoints that load as models."""

import pytest
import torch
import transformers
from transformers import Trainer, TrainingArguments

import flash_models as fm
from flash_models.hf import SavePretrainedCallback
from flash_models.testing import ours_from_hf, random_hf_model

VOCAB, SEQ, LABELS = 89, 11, 3
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def bert(architecture: str, auto_class: str):
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=48, max_position_embeddings=32, num_labels=LABELS,
                                     architectures=[architecture], **NO_DROPOUT)
    return random_hf_model(config, seed=0, auto_class=auto_class)


def text_rows(n: int, *, token_labels: bool, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(3, SEQ + 1, (), generator=g))
        mask = (torch.arange(SEQ) < length).long()
        ids = torch.randint(1, VOCAB, (SEQ,), generator=g) * mask
        if token_labels:
            labels = torch.where(mask.bool(), torch.randint(0, LABELS, (SEQ,), generator=g), -100)
        else:
            labels = torch.randint(0, LABELS, (), generator=g)
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return rows


def image_rows(n: int, *, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"pixel_values": torch.randn(3, 16, 16, generator=g), "labels": torch.randint(0, LABELS, (), generator=g)}
            for _ in range(n)]


def train(model, data, out, **kw):
    # Gradient accumulation is off by default: HF's heads take **kwargs, so the Trainer believes they normalize by
    # num_items_in_batch and stops averaging over micro-batches, but they return per-micro-batch means (their loss
    # and gradients grow with the accumulation steps). Ours say accepts_loss_kwargs = False and are averaged.
    settings = dict(output_dir=str(out), per_device_train_batch_size=4, max_steps=2, learning_rate=1e-2,
                    lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                    seed=0, data_seed=0, disable_tqdm=True)
    args = TrainingArguments(**{**settings, **kw})
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data)
    trainer.train()
    return trainer, [e["loss"] for e in trainer.state.log_history if "loss" in e]


CASES = {
    "sequence": lambda: (bert("BertForSequenceClassification", "AutoModelForSequenceClassification"),
                         text_rows(8, token_labels=False, seed=1), (8, LABELS)),
    "token": lambda: (bert("BertForTokenClassification", "AutoModelForTokenClassification"),
                      text_rows(8, token_labels=True, seed=2), (8, SEQ, LABELS)),
    "image": lambda: (random_hf_model(transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                             intermediate_size=48, image_size=16, patch_size=4,
                                                             num_labels=LABELS, architectures=["ViTForImageClassification"],
                                                             **NO_DROPOUT),
                                      seed=0, auto_class="AutoModelForImageClassification"),
                      image_rows(8, seed=3), (8, LABELS)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_head_in_trainer_matches_hf(case, tmp_path):
    hf, data, prediction_shape = CASES[case]()
    ours = ours_from_hf(hf)
    _, expected = train(hf, data, tmp_path / "hf")
    trainer, got = train(ours, data, tmp_path / "ours")
    assert len(got) == 2 and got == pytest.approx(expected, abs=1e-5, rel=0)
    predictions = trainer.predict(data)
    assert predictions.predictions.shape == prediction_shape  # logits only, no hidden states
    assert predictions.label_ids.shape[0] == 8


def test_bert_checkpoint_loads_as_a_model(tmp_path):
    hf, data, _ = CASES["sequence"]()
    ours = ours_from_hf(hf)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, save_strategy="steps",
                             save_steps=1, report_to=[], use_cpu=True, disable_tqdm=True)
    Trainer(model=ours, args=args, train_dataset=data, callbacks=[SavePretrainedCallback()]).train()
    ids, mask = torch.randint(1, VOCAB, (2, 7)), torch.ones(2, 7, dtype=torch.long)
    with torch.no_grad():
        reference = ours.eval()(ids, attention_mask=mask).logits
        again = fm.from_pretrained(tmp_path / "checkpoint-1").eval()
        assert type(again).__name__ == "BertForSequenceClassification"
        torch.testing.assert_close(again(ids, attention_mask=mask).logits, reference, atol=1e-5, rtol=0)
        theirs = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "checkpoint-1").eval()
        torch.testing.assert_close(theirs(ids, attention_mask=mask).logits, reference, atol=1e-5, rtol=0)


def test_gradient_accumulation_averages_per_example_losses(tmp_path):
    """Two micro-batches of 2 give the loss of one batch of 4 (the mean over examples), not twice it."""
    hf, data, _ = CASES["sequence"]()
    _, whole = train(ours_from_hf(hf), data, tmp_path / "whole")
    _, accumulated = train(ours_from_hf(hf), data, tmp_path / "accumulated", per_device_train_batch_size=2,
                           gradient_accumulation_steps=2)
    assert accumulated == pytest.approx(whole, abs=1e-5, rel=0)
