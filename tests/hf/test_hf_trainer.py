"""Our models in transformers.Trainer: the same losses as HF's model, checkpoints that load as models, resume."""

import json

import pytest
import torch
import transformers
from transformers import Trainer, TrainingArguments

import flash_models as fm
from flash_models.hf import SavePretrainedCallback
from flash_models.testing import ours_from_hf, random_hf_model

VOCAB, SEQ = 97, 13


def tiny_llama_config():
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    tie_word_embeddings=False)


def tiny_gemma_config():
    """Gemma's norms (1 + weight), scaled embeddings and tied head, through the Trainer and its checkpoints."""
    return transformers.GemmaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                                    pad_token_id=0)


CONFIGS = {"llama": tiny_llama_config, "gemma": tiny_gemma_config}


def lm_dataset(n: int, *, seed: int) -> list[dict]:
    """Right-padded rows of random lengths; labels -100 on padding and on a random prompt part."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(4, SEQ + 1, (), generator=g))
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        mask = (torch.arange(SEQ) < length).long()
        labels = torch.where(mask.bool(), ids, -100)
        labels[: int(torch.randint(0, 3, (), generator=g))] = -100
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return rows


def args(out, **kw) -> TrainingArguments:
    base = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
                learning_rate=3e-3, lr_scheduler_type="constant", logging_steps=1, save_strategy="steps", save_steps=2,
                report_to=[], use_cpu=True, seed=0, data_seed=0, disable_tqdm=True)
    return TrainingArguments(**{**base, **kw})


def losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_trainer_matches_hf_and_checkpoints_load(tmp_path, family):
    config = CONFIGS[family]
    hf = random_hf_model(config(), seed=1)
    ours = ours_from_hf(hf)  # before HF's model trains: the same starting weights
    data = lm_dataset(16, seed=2)

    hf_trainer = Trainer(model=hf, args=args(tmp_path / "hf"), train_dataset=data)
    hf_trainer.train()
    ours_trainer = Trainer(model=ours, args=args(tmp_path / "ours"), train_dataset=data,
                           callbacks=[SavePretrainedCallback()])
    ours_trainer.train()
    assert ours.config.use_cache is False  # the Trainer's setting, on our config
    expected, got = losses(hf_trainer), losses(ours_trainer)
    assert len(got) == 4
    assert got == pytest.approx(expected, abs=1e-5, rel=0)
    assert ours_trainer.state.total_flos == hf_trainer.state.total_flos > 0  # num_parameters: the real vocabulary's

    # Each checkpoint is a model folder that both libraries read, with the trained weights.
    ids = torch.randint(0, VOCAB, (2, 9))
    final = tmp_path / "ours" / "checkpoint-4"
    ours.eval()
    with torch.no_grad():
        reference = ours(ids).logits
        again = fm.from_pretrained(final).eval()
        torch.testing.assert_close(again(ids).logits, reference, atol=1e-5, rtol=0)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(final).eval()
        torch.testing.assert_close(theirs(ids).logits, reference, atol=1e-5, rtol=0)
    assert json.loads((final / "config.json").read_text())["architectures"] == [type(hf).__name__]

    # Resume from the middle: the last two steps again, with the same losses as the uninterrupted run.
    resumed = Trainer(model=ours_from_hf(random_hf_model(config(), seed=5)), args=args(tmp_path / "ours"),
                      train_dataset=data)
    resumed.train(resume_from_checkpoint=str(tmp_path / "ours" / "checkpoint-2"))
    assert losses(resumed)[-2:] == pytest.approx(got[2:], abs=1e-5, rel=0)
    with torch.no_grad():
        torch.testing.assert_close(resumed.model.eval()(ids).logits, reference, atol=1e-5, rtol=0)


def test_a_checkpoint_of_a_model_past_the_shard_size_resumes(tmp_path, monkeypatch):
    """The Trainer loads a sharded checkpoint shard by shard; the callback writes one file, so that no shard holds
    part of a fused parameter. A tiny default shard size stands for a model past save_pretrained's 5GB."""
    import flash_models.checkpoint as checkpoint

    save = checkpoint.save_pretrained
    monkeypatch.setattr(checkpoint, "save_pretrained",
                        lambda model, folder, **kw: save(model, folder, **{"max_shard_size": 4096, **kw}))
    data = lm_dataset(8, seed=17)
    ours = ours_from_hf(random_hf_model(tiny_llama_config(), seed=18))
    trainer = Trainer(model=ours, args=args(tmp_path, gradient_accumulation_steps=1), train_dataset=data,
                      callbacks=[SavePretrainedCallback()])
    trainer.train()
    assert not list((tmp_path / "checkpoint-2").glob("*.index.json"))
    resumed = Trainer(model=ours_from_hf(random_hf_model(tiny_llama_config(), seed=19)),
                      args=args(tmp_path, gradient_accumulation_steps=1), train_dataset=data)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert losses(resumed)[-2:] == pytest.approx(losses(trainer)[2:], abs=1e-5, rel=0)


def test_gradient_accumulation_normalizes_by_tokens():
    """With num_items_in_batch the loss is the token sum over the whole accumulated batch, for both loss paths."""
    ours = ours_from_hf(random_hf_model(tiny_llama_config(), seed=3))
    batch = {k: torch.stack([row[k] for row in lm_dataset(3, seed=4)]) for k in ("input_ids", "attention_mask", "labels")}
    items = int((batch["labels"][:, 1:] != -100).sum())
    mean = ours(**batch).loss
    for return_logits in (True, False):
        total = ours(**batch, num_items_in_batch=torch.tensor(items * 3), return_logits=return_logits).loss
        torch.testing.assert_close(total * 3, mean, atol=1e-6, rtol=1e-6)


def test_gradient_checkpointing_switches_and_same_gradients():
    ours = ours_from_hf(random_hf_model(tiny_llama_config(), seed=6)).train()  # HF's rule: checkpointed while training
    batch = {k: torch.stack([row[k] for row in lm_dataset(2, seed=7)]) for k in ("input_ids", "attention_mask", "labels")}
    keys, names = set(ours.state_dict()), [name for name, _ in ours.named_modules()]

    def grads():
        ours.zero_grad()
        ours(**batch).loss.backward()
        return [p.grad.clone() for p in ours.parameters()]

    plain = grads()
    ours.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert ours.is_gradient_checkpointing and set(ours.state_dict()) == keys
    assert [name for name, _ in ours.named_modules()] == names  # no wrapper module: PEFT's adapter keys stay
    for a, b in zip(grads(), plain):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    ours.gradient_checkpointing_disable()
    assert not ours.is_gradient_checkpointing
    ours.activation_checkpointing_enable(every_n_layers=2)
    assert ["forward" in vars(b) for b in ours.blocks] == [True, False]  # the first block only
    with pytest.raises(ValueError, match="offload"):
        ours.gradient_checkpointing_enable(offload=True)


def test_trainer_with_gradient_checkpointing_trains(tmp_path):
    ours = ours_from_hf(random_hf_model(tiny_llama_config(), seed=8))
    trainer = Trainer(model=ours, args=args(tmp_path, max_steps=2, activation_checkpointing=True, save_strategy="no"),
                      train_dataset=lm_dataset(8, seed=9))
    trainer.train()
    assert ours.is_gradient_checkpointing and len(losses(trainer)) == 2


def test_evaluation_gathers_logits_only(tmp_path):
    ours = ours_from_hf(random_hf_model(tiny_llama_config(), seed=10))
    data = lm_dataset(4, seed=11)
    trainer = Trainer(model=ours, args=args(tmp_path, per_device_eval_batch_size=2), eval_dataset=data)
    out = trainer.predict(data)
    assert out.predictions.shape == (4, SEQ, VOCAB)  # the hidden states are not predictions
    assert out.metrics["test_loss"] > 0


def test_a_checkpoint_saved_without_the_callback_says_how_to_load_it(tmp_path):
    """The Trainer's own save of our model is its bare state dict: from_pretrained says so, and the way it names
    (the same model, load_state_dict) gives the trained weights back."""
    from safetensors.torch import load_file

    ours = ours_from_hf(random_hf_model(tiny_llama_config(), seed=12))
    trainer = Trainer(model=ours, args=args(tmp_path, max_steps=2, save_steps=2), train_dataset=lm_dataset(8, seed=13))
    trainer.train()
    checkpoint = tmp_path / "checkpoint-2"
    with pytest.raises(FileNotFoundError, match=r"Trainer checkpoint saved without .*SavePretrainedCallback.*load_state_dict"):
        fm.from_pretrained(checkpoint)
    trainer.save_model(tmp_path / "final")  # the Trainer's export: the same bare state dict, no callback involved
    with pytest.raises(FileNotFoundError, match=r"Trainer\.save_model\(\) writes .*model\.save_pretrained\(folder\)"):
        fm.from_pretrained(tmp_path / "final")
    again = ours_from_hf(random_hf_model(tiny_llama_config(), seed=14))
    again.load_state_dict(load_file(checkpoint / "model.safetensors"))
    for (name, trained), (_, loaded) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert torch.equal(trained, loaded), name


def test_callback_refuses_a_transformers_model_before_training(tmp_path):
    """The callback is for our models; given HF's, it says so before the first step (not at the first save),
    naming the class by its module, since ours carry HF's class names."""
    trainer = Trainer(model=random_hf_model(tiny_llama_config(), seed=15), args=args(tmp_path, save_steps=1),
                      train_dataset=lm_dataset(8, seed=16), callbacks=[SavePretrainedCallback()])
    with pytest.raises(ValueError, match=r"is transformers\.models\.llama\.modeling_llama\.LlamaForCausalLM.*leave the callback out"):
        trainer.train()
    assert trainer.state.global_step == 0


@pytest.mark.gpu
def test_gpu_the_trainers_backward_runs_on_the_calling_thread(tmp_path):
    """transformers.Trainer calls loss.backward() itself: on CUDA our model's forward has made it run on the
    Trainer's thread (flash_models.backward), not on autograd's worker, where each of our autograd nodes would
    take the GIL from another thread."""
    import threading

    model = ours_from_hf(random_hf_model(tiny_llama_config(), seed=5))
    threads = []
    model.embed.tokens.weight.register_hook(lambda grad: threads.append(threading.get_ident()))
    trainer = Trainer(model=model, args=args(tmp_path, use_cpu=False, max_steps=2, save_strategy="no"),
                      train_dataset=lm_dataset(8, seed=5))
    trainer.train()
    assert threads and set(threads) == {threading.get_ident()}
    assert next(model.parameters()).is_cuda
