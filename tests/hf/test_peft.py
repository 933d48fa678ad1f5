"""PEFT LoRA on our causal LM (our fused projections are the targets: qkv, out_proj, gate_up, down), in the Trainer."""

import copy

import peft
import pytest
import torch
import transformers
from transformers import Trainer, TrainingArguments

import flash_models as fm
from flash_models.testing import ours_from_hf, random_hf_model
from test_hf_trainer import lm_dataset, tiny_llama_config


def test_lora_adapters_train_and_only_they_change(tmp_path):
    ours = ours_from_hf(random_hf_model(tiny_llama_config(), seed=1))
    base = {k: v.clone() for k, v in ours.state_dict().items()}
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        before = ours(ids).logits
    model = peft.get_peft_model(ours, peft.LoraConfig(r=4, target_modules=["qkv", "out_proj", "gate_up", "down"]))
    with torch.no_grad():  # LoRA's B starts at zero: the adapted model computes the base model
        torch.testing.assert_close(model(input_ids=ids).logits, before)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, learning_rate=1e-2,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, activation_checkpointing=True)
    Trainer(model=model, args=args, train_dataset=lm_dataset(8, seed=0)).train()
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert len(lora) == 2 * 4 * 2  # A and B of four projections in two blocks
    assert all(p.requires_grad for p in lora.values())
    merged = model.merge_and_unload()
    with torch.no_grad():
        after = merged(ids).logits
    assert not torch.allclose(after, before)  # the adapters learned something, and the forward used them
    changed = [k for k, v in merged.state_dict().items() if not torch.equal(v, base[k])]
    assert changed and all(any(t in k for t in ("qkv", "out_proj", "gate_up", "down")) for k in changed)


@pytest.mark.parametrize("targets", [["qkv", "out_proj", "gate_up", "down"], ["lm_head"]], ids=["blocks", "lm_head"])
def test_adapters_run_in_forward_loss_and_generate(targets):
    """What the adapted model computes equals the merged model, in every path that reads the weights: the
    forward, the fused training loss (the LM head), generate's prefill and decode steps (the CPU's lean step)."""
    config = tiny_llama_config()
    adapted = peft.get_peft_model(ours_from_hf(random_hf_model(config, seed=2)),
                                  peft.LoraConfig(r=4, target_modules=targets, init_lora_weights=False))
    merged = copy.deepcopy(adapted).merge_and_unload()
    base = ours_from_hf(random_hf_model(config, seed=2))
    ids = torch.randint(0, 97, (2, 7))
    with torch.no_grad():
        logits = adapted(input_ids=ids).logits
        torch.testing.assert_close(logits, merged(ids).logits, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(logits, base(ids).logits, atol=1e-3)  # the adapters change the numbers
        adapted.train(), merged.train()
        torch.testing.assert_close(adapted(input_ids=ids, labels=ids).loss, merged(ids, labels=ids).loss,
                                   atol=1e-5, rtol=1e-5)
        adapted.eval(), merged.eval()
    kw = dict(max_new_tokens=5, do_sample=False)
    assert torch.equal(adapted.generate(ids, **kw), merged.generate(ids, **kw))


def tiny_bert(architecture: str, auto_class: str):
    config = transformers.BertConfig(vocab_size=89, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                     intermediate_size=48, max_position_embeddings=32, num_labels=3,
                                     architectures=[architecture], hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return ours_from_hf(random_hf_model(config, seed=3, auto_class=auto_class))


TASKS = {  # PEFT task_type -> (our model, its inputs with labels, PEFT's wrapper class)
    "CAUSAL_LM": lambda ids, mask: (ours_from_hf(random_hf_model(tiny_llama_config(), seed=3)),
                                    dict(input_ids=ids, attention_mask=mask, labels=ids), peft.PeftModelForCausalLM),
    "SEQ_CLS": lambda ids, mask: (tiny_bert("BertForSequenceClassification", "AutoModelForSequenceClassification"),
                                  dict(input_ids=ids, attention_mask=mask, labels=torch.tensor([2, 0])),
                                  peft.PeftModelForSequenceClassification),
    "TOKEN_CLS": lambda ids, mask: (tiny_bert("BertForTokenClassification", "AutoModelForTokenClassification"),
                                    dict(input_ids=ids, attention_mask=mask, labels=torch.randint(0, 3, ids.shape)),
                                    peft.PeftModelForTokenClassification),
}


@pytest.mark.parametrize("task", sorted(TASKS))
def test_peft_task_wrappers(task):
    """LoraConfig(task_type=...) as the tutorials write it: PEFT's wrapper calls our forward with HF's flags
    (inputs_embeds=None, output_attentions=None, ...) and the adapted model computes the merged model."""
    ids, mask = torch.randint(0, 89, (2, 6)), torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    model, inputs, wrapper = TASKS[task](ids, mask)
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["qkv"], task_type=task,
                                                         init_lora_weights=False))
    assert type(adapted) is wrapper
    merged = copy.deepcopy(adapted).merge_and_unload()
    torch.testing.assert_close(adapted(**inputs).loss, merged(**inputs).loss, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="inputs_embeds is not supported"):
        adapted(inputs_embeds=torch.randn(2, 6, 32), **{k: v for k, v in inputs.items() if k != "input_ids"})
    if task == "CAUSAL_LM":
        kw = dict(max_new_tokens=4, do_sample=False)
        assert torch.equal(adapted.generate(input_ids=ids[:1], **kw), merged.generate(ids[:1], **kw))


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointing_gives_adapters_gradients(reentrant):
    """gradient_checkpointing_enable() makes the (frozen) embeddings' output require grad, as HF's models do: with
    reentrant checkpointing the adapters inside the blocks would otherwise get no gradient (an error here)."""
    ours = ours_from_hf(random_hf_model(tiny_llama_config(), seed=4))
    adapted = peft.get_peft_model(ours, peft.LoraConfig(r=4, target_modules=["qkv", "down"]))
    adapted.train()
    adapted.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ids = torch.randint(0, 97, (2, 6))
    adapted(input_ids=ids, labels=ids).loss.backward()
    lora = [p for n, p in adapted.named_parameters() if "lora_" in n]
    assert len(lora) == 8 and all(p.grad is not None for p in lora)
    adapted.gradient_checkpointing_disable()
    assert not ours.get_input_embeddings()._forward_hooks  # the hook goes with the checkpointing


def test_adapter_of_a_loaded_checkpoint_saves_and_reloads(tmp_path):
    """An adapter on a model from fm.from_pretrained(folder): PEFT's save_pretrained reads the base checkpoint's
    config through type(model.config).from_pretrained (to see whether the vocabulary was resized), and the adapter
    it writes loads back onto the same checkpoint with PeftModel.from_pretrained."""
    ours_from_hf(random_hf_model(tiny_llama_config(), seed=6)).save_pretrained(tmp_path / "base")
    adapted = peft.get_peft_model(fm.from_pretrained(tmp_path / "base"),
                                  peft.LoraConfig(r=4, target_modules=["qkv", "down"], init_lora_weights=False))
    assert type(adapted.base_model.model.config).from_pretrained(tmp_path / "base").vocab_size == 97
    ids = torch.randint(0, 97, (2, 7))
    with torch.no_grad():
        expected = adapted.eval()(input_ids=ids).logits
    adapted.save_pretrained(tmp_path / "adapter")
    again = peft.PeftModel.from_pretrained(fm.from_pretrained(tmp_path / "base"), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, expected, atol=0, rtol=0)


def test_checkpointed_model_saves_and_loads_its_adapters(tmp_path):
    """gradient_checkpointing=True (the Trainer's, before or after PEFT wraps the model) keeps the module names:
    PEFT saves every adapter weight, loads them back, and a resumed Trainer run continues the same losses."""
    base = lambda: ours_from_hf(random_hf_model(tiny_llama_config(), seed=7))  # noqa: E731
    adapted = peft.get_peft_model(base(), peft.LoraConfig(r=4, target_modules=["qkv", "down"], init_lora_weights=False))
    adapted.gradient_checkpointing_enable()
    assert len(peft.get_peft_model_state_dict(adapted)) == 8  # A and B of two projections in two blocks
    adapted.save_pretrained(tmp_path / "adapter")
    ids = torch.randint(0, 97, (2, 7))
    checkpointed = base()
    checkpointed.gradient_checkpointing_enable()
    again = peft.PeftModel.from_pretrained(checkpointed, tmp_path / "adapter", is_trainable=True)
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=0, rtol=0)

    def run(resume: bool) -> list[float]:
        torch.manual_seed(0)  # the same LoRA init in both runs
        model = peft.get_peft_model(base(), peft.LoraConfig(r=4, target_modules=["qkv"]))
        args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, max_steps=4,
                                 learning_rate=1e-2, logging_steps=1, save_strategy="steps", save_steps=2, report_to=[],
                                 use_cpu=True, seed=0, disable_tqdm=True, gradient_checkpointing=True)
        trainer = Trainer(model=model, args=args, train_dataset=lm_dataset(8, seed=8))
        trainer.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2") if resume else None)
        return [e["loss"] for e in trainer.state.log_history if "loss" in e]

    whole = run(resume=False)
    assert run(resume=True)[2:] == pytest.approx(whole[2:], abs=1e-6, rel=0)


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_vit_adapters_get_the_gradients_of_the_plain_model(reentrant):
    """A ViT has no token table to hook: checkpointing turned on before PEFT wraps the model (PEFT then calls
    enable_input_require_grads) works, and with reentrant checkpointing the adapters inside the frozen blocks get
    their gradients all the same (no input of the first block requires grad otherwise)."""
    from test_hf_trainer_heads import vit

    hf = vit()
    pixels, labels = torch.randn(3, 3, 16, 16), torch.tensor([0, 2, 1])

    def lora_grads(checkpointed: bool) -> dict:
        torch.manual_seed(0)  # the same adapter init
        ours = ours_from_hf(hf).train()
        if checkpointed:
            ours.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        adapted = peft.get_peft_model(ours, peft.LoraConfig(r=4, target_modules=["qkv", "fc2"], modules_to_save=["head"],
                                                            init_lora_weights=False))
        adapted(pixel_values=pixels, labels=labels).loss.backward()
        return {n: p.grad for n, p in adapted.named_parameters() if "lora_" in n}

    plain, checkpointed = lora_grads(False), lora_grads(True)
    assert len(plain) == 8
    for name, grad in checkpointed.items():
        assert grad is not None, name
        torch.testing.assert_close(grad, plain[name], atol=1e-6, rtol=1e-5)
