"""Our causal LM in TRL's SFTTrainer: chat template, completion-only loss, packing without padding; the same
losses as HF's model from the same weights."""

import datasets
import pytest
import transformers
from trl import SFTConfig, SFTTrainer

import flash_models as fm
from flash_models.checkpoint.tokenizer import load_gguf_tokenizer
from flash_models.testing import ours_from_hf, random_hf_model


@pytest.fixture(scope="module")
def tokenizer():
    return load_gguf_tokenizer(fm.smollm2_gguf())  # SmolLM2's tokenizer and chat template, offline


def chat_dataset(seed: int) -> datasets.Dataset:
    """Conversational prompt/completion pairs: the loss covers the assistant's completion only."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(8):
        a, b = rng.randrange(100), rng.randrange(100)
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} plus {b}?"}],
                     "completion": [{"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]})
    return datasets.Dataset.from_list(rows)


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_sft_matches_hf(tmp_path, tokenizer, packing):
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=True)
    data = chat_dataset(seed=0)

    def run(model, name):
        args = SFTConfig(output_dir=str(tmp_path / name), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2,
                         report_to=[], use_cpu=True, logging_steps=1, save_strategy="no", max_length=64, seed=0, data_seed=0,
                         packing=packing, padding_free=packing, disable_tqdm=True,
                         bf16=False)  # SFTConfig defaults to bf16 autocast; fp32 for a tight comparison
        trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
        trainer.train()
        return [e for e in trainer.state.log_history if "loss" in e]

    hf = random_hf_model(config, seed=1)
    ours = ours_from_hf(hf)
    expected, got = run(hf, "hf"), run(ours, "ours")
    assert len(got) == 2
    for theirs, mine in zip(expected, got):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-5)
        assert mine["num_tokens"] == theirs["num_tokens"]
        assert mine["mean_token_accuracy"] == pytest.approx(theirs["mean_token_accuracy"], abs=1e-6)
    assert ours.config.eos_token_id == tokenizer.eos_token_id  # TRL aligned the config with its tokenizer
    assert "sft" in ours.model_tags


def test_sft_with_a_peft_config_saves_the_trained_adapter(tmp_path, tokenizer):
    """SFTTrainer(peft_config=...) on a model loaded from a folder, with SFTConfig's default gradient
    checkpointing: save_model writes every adapter weight, and they load back onto the base model."""
    import peft
    import torch
    from safetensors.torch import load_file

    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    ours_from_hf(random_hf_model(config, seed=2)).save_pretrained(tmp_path / "base")
    args = SFTConfig(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=4, learning_rate=1e-2,
                     report_to=[], use_cpu=True, save_strategy="no", max_length=64, seed=0, disable_tqdm=True, bf16=False)
    assert args.gradient_checkpointing
    trainer = SFTTrainer(model=fm.from_pretrained(tmp_path / "base"), args=args, train_dataset=chat_dataset(seed=1),
                         processing_class=tokenizer,
                         peft_config=peft.LoraConfig(r=4, target_modules=["qkv", "gate_up"], task_type="CAUSAL_LM"))
    trainer.train()
    trainer.save_model(tmp_path / "adapter")
    assert len(load_file(tmp_path / "adapter" / "adapter_model.safetensors")) == 8  # A and B, two projections, two blocks
    again = peft.PeftModel.from_pretrained(fm.from_pretrained(tmp_path / "base"), tmp_path / "adapter").eval()
    ids = torch.randint(0, len(tokenizer), (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, trainer.model.eval()(input_ids=ids).logits, atol=0, rtol=0)


def test_sft_padded_batches_run_their_real_tokens_on_our_kernels(tmp_path, tokenizer):
    """SFTTrainer's default collator pads (labels -100 there) and its fused LM head calls the backbone: on our
    attention kernels (Triton's interpreter here) the layers run the batch's real tokens alone, with the losses
    of the padded path (sdpa)."""
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                                      tie_word_embeddings=True)
    hf = random_hf_model(config, seed=3)
    losses, shapes = {}, {}
    for attn_impl in ("sdpa", "flash"):
        ours = ours_from_hf(hf, attn_impl=attn_impl)
        seen = []
        ours.blocks[0].register_forward_hook(lambda module, args, output: seen.append(tuple(args[0].shape)))
        args = SFTConfig(output_dir=str(tmp_path / attn_impl), max_steps=2, per_device_train_batch_size=4,
                         learning_rate=1e-2, report_to=[], use_cpu=True, logging_steps=1, save_strategy="no",
                         max_length=64, seed=0, data_seed=0, disable_tqdm=True, bf16=True, gradient_checkpointing=False)
        trainer = SFTTrainer(model=ours, args=args, train_dataset=chat_dataset(seed=0), processing_class=tokenizer)
        trainer.train()
        losses[attn_impl] = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        shapes[attn_impl] = seen[:2]
    assert all(rows == 4 for rows, _, _ in shapes["sdpa"])
    assert all(rows == 1 and tokens < 4 * padded for (rows, tokens, _), (_, padded, _) in zip(shapes["flash"], shapes["sdpa"]))
    assert losses["flash"] == pytest.approx(losses["sdpa"], rel=1e-3)
