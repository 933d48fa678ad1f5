"""BERT sequence / token classification and ViT image classification in transformers.Trainer: the same
losses as HF's models, evaluation predictions, checkpoints that load as models."""

import math

import pytest
import torch
import transformers
from transformers import Trainer, TrainingArguments

import flash_models as fm
from flash_models.hf import SavePretrainedCallback
from flash_models.testing import ours_from_hf, random_hf_model

VOCAB, SEQ, LABELS = 89, 11, 3
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def bert(architecture: str, auto_class: str, **head):
    head = {"num_labels": LABELS, **head}
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=48, max_position_embeddings=32, architectures=[architecture],
                                     **head, **NO_DROPOUT)
    return random_hf_model(config, seed=0, auto_class=auto_class)


def vit(**head):
    head = {"num_labels": LABELS, **head}
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                                    image_size=16, patch_size=4, architectures=["ViTForImageClassification"], **head,
                                    **NO_DROPOUT)
    return random_hf_model(config, seed=0, auto_class="AutoModelForImageClassification")


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
    "image": lambda: (vit(), image_rows(8, seed=3), (8, LABELS)),
}


# Heads and labels for each problem_type (HF's rule: one output is regression, float labels are multi-label).
PROBLEMS = {
    "regression-one-output": dict(num_labels=1),
    "regression-several-outputs": dict(num_labels=LABELS, problem_type="regression"),
    "multi-label-by-dtype": dict(num_labels=LABELS),
    "multi-label-named": dict(num_labels=LABELS, problem_type="multi_label_classification"),
}


def problem_labels(problem: str, batch: int) -> torch.Tensor:
    if problem == "regression-one-output":
        return torch.randn(batch)
    if problem == "regression-several-outputs":
        return torch.randn(batch, LABELS)
    return torch.randint(0, 2, (batch, LABELS)).float()


@pytest.mark.parametrize("problem", sorted(PROBLEMS))
@pytest.mark.parametrize("family", ["bert", "vit"])
def test_problem_types_give_hf_losses_and_gradients(family, problem):
    hf = (bert("BertForSequenceClassification", "AutoModelForSequenceClassification", **PROBLEMS[problem])
          if family == "bert" else vit(**PROBLEMS[problem]))
    ours = ours_from_hf(hf)
    if family == "bert":
        inputs = {"input_ids": torch.randint(1, VOCAB, (3, 7)), "attention_mask": torch.tensor([[1] * 7] * 2 + [[1] * 4 + [0] * 3])}
    else:
        inputs = {"pixel_values": torch.randn(3, 3, 16, 16)}
    labels = problem_labels(problem, 3)
    want, got = hf(**inputs, labels=labels).loss, ours(**inputs, labels=labels).loss
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    want.backward()
    got.backward()
    ours_head = ours.classifier if family == "bert" else ours.head
    torch.testing.assert_close(ours_head.weight.grad, hf.classifier.weight.grad, atol=1e-6, rtol=1e-5)


def test_regression_refuses_labels_of_another_shape():
    ours = ours_from_hf(vit(**PROBLEMS["regression-several-outputs"]))
    with pytest.raises(ValueError, match="regression labels shape \\(2,\\) must be the logits' \\(2, 3\\)"):
        ours(pixel_values=torch.randn(2, 3, 16, 16), labels=torch.randn(2))


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


def test_neftune_on_vit_noises_the_patch_tokens(tmp_path):
    """transformers.Trainer's NEFTune (``neftune_noise_alpha``) hooks the model's input embeddings: on a ViT, the
    patch tokens (HF's ViTPatchEmbeddings), where ours hand theirs on through a module too. Its hook adds uniform
    noise of alpha / sqrt(patches * width) to them in training, none in eval (HF's patch tokens are a transposed
    view, so the same draws land on other elements there: the same noise, not the same sample). The Trainer's
    run differs from one without it, and takes its hook off after."""
    from transformers.integrations.neftune import neftune_post_forward_hook

    hf, data, _ = CASES["image"]()
    ours = ours_from_hf(hf)
    tokens = ours.get_input_embeddings()
    assert tokens is ours.patch_tokens and not list(tokens.parameters())
    pixels = torch.stack([row["pixel_values"] for row in data[:4]])
    tokens.neftune_noise_alpha = 5.0
    hook = tokens.register_forward_hook(neftune_post_forward_hook)
    with torch.no_grad():
        clean = ours.eval()(pixel_values=pixels).logits
        assert torch.equal(ours(pixel_values=pixels).logits, clean)  # eval: no noise
        torch.manual_seed(3)
        noisy = ours.train()(pixel_values=pixels).logits
    hook.remove()
    patches = (16 // 4) ** 2
    torch.manual_seed(3)
    bound = 5.0 / math.sqrt(patches * 32)
    noise = torch.zeros(4, patches, 32).uniform_(-bound, bound)
    tokens.register_forward_hook(lambda module, args, out: out + noise)
    with torch.no_grad():
        torch.testing.assert_close(ours(pixel_values=pixels).logits, noisy, rtol=0, atol=1e-6)
    assert (noisy - clean).abs().max() > 1e-4
    _, plain = train(ours_from_hf(hf), data, tmp_path / "plain")
    model = ours_from_hf(hf)
    _, noised = train(model, data, tmp_path / "neftune", neftune_noise_alpha=50.0)
    assert abs(plain[0] - noised[0]) > 1e-4 and not model.patch_tokens._forward_hooks


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


@pytest.mark.parametrize("head", ["BertForSequenceClassification", "BertForTokenClassification"])
def test_a_base_checkpoint_loads_under_a_fresh_head(head, tmp_path):
    """HF's AutoModelFor<Task>.from_pretrained(base_dir, num_labels=N): the encoder's weights, a new head."""
    from flash_models.models import bert as bert_models

    base = ours_from_hf(bert("BertModel", "AutoModel"))
    base.save_pretrained(tmp_path / "base")
    cls = getattr(bert_models, head)
    model = cls.from_pretrained(tmp_path / "base", num_labels=5)
    assert type(model) is cls and model.config.num_labels == 5 and not model.training
    ids, mask = torch.randint(1, VOCAB, (2, 7)), torch.tensor([[1] * 7, [1] * 5 + [0] * 2])
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=mask).last_hidden_state,
                                   base(ids, attention_mask=mask).last_hidden_state, atol=1e-6, rtol=0)
        model.save_pretrained(tmp_path / "head")
        again = cls.from_pretrained(tmp_path / "head")  # a checkpoint of this head loads as it is
        torch.testing.assert_close(again(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits)
    assert cls.from_pretrained(tmp_path / "head", num_labels=2).config.num_labels == 2
    llama = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                     num_attention_heads=2, max_position_embeddings=16)
    ours_from_hf(random_hf_model(llama)).save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="holds a LlamaForCausalLM, not a BertPreTrainedModel"):
        cls.from_pretrained(tmp_path / "llama")


@pytest.mark.parametrize("family", ["llama", "gptj", "bert", "vit"])
@pytest.mark.parametrize("fsdp_version", [1, 2])
def test_fsdp_wraps_each_block_by_the_models_no_split_modules(family, fsdp_version):
    """transformers.Trainer with fsdp_config (transformer-based wrap) shards by accelerate's policy, which finds the
    block classes from ``_no_split_modules``: each block is its own unit, and nothing else (a CPU Trainer does not
    run FSDP, so the policy is checked on the model)."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    model = {
        "llama": lambda: fm.create_model("llama-1b", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, device="meta"),
        "gptj": lambda: fm.create_model("gptj-6b", vocab_size=VOCAB, n_layer=2, n_embd=32, n_head=2, rotary_dim=8,
                                        n_positions=32, device="meta"),
        "bert": lambda: ours_from_hf(bert("BertForSequenceClassification", "AutoModelForSequenceClassification")),
        "vit": lambda: ours_from_hf(vit()),
    }[family]()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=fsdp_version, auto_wrap_policy="transformer_based_wrap")
    if fsdp_version == 2:
        policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    else:
        plugin.set_auto_wrap_policy(model)
        classes = plugin.auto_wrap_policy.keywords["transformer_layer_cls"]
        policy = lambda module: isinstance(module, tuple(classes))  # noqa: E731
    blocks = [name for name, _ in model.named_modules() if name.rsplit(".", 2)[-2:-1] == ["blocks"]]
    assert len(blocks) == 2 and [name for name, module in model.named_modules() if policy(module)] == blocks
