"""The command line, in process, on the embedded SmolLM2 (the main job) and tiny saved models."""

import json

import pytest
import transformers

from flash_models.cli import main
from flash_models.testing import random_hf_model

pytestmark = pytest.mark.slow


def test_chat_answers_the_capital_question_offline(capsys):
    main(["chat", "What is the capital of France?", "--max-new-tokens", "24", "--stats"])
    captured = capsys.readouterr()
    assert "Paris" in captured.out
    assert "first token" in captured.err and "tokens/s" in captured.err


def test_generate_from_a_folder_without_tokenizer_is_a_clear_error(tmp_path, capsys):
    hf = random_hf_model(transformers.GPT2Config(vocab_size=300, n_positions=64, n_embd=32, n_layer=1, n_head=4))
    hf.save_pretrained(tmp_path)
    with pytest.raises(SystemExit):
        main(["generate", str(tmp_path), "hello", "--raw"])
    assert "no tokenizer in" in capsys.readouterr().err


def test_convert_gguf_to_an_hf_folder_that_transformers_reads(tmp_path, capsys):
    from flash_models import smollm2_gguf

    main(["convert", str(smollm2_gguf()), str(tmp_path / "smollm2")])
    assert "llama" in capsys.readouterr().out
    config = json.loads((tmp_path / "smollm2" / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["tie_word_embeddings"]
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "smollm2")
    assert model.config.num_key_value_heads == 3


def test_compare_reports_parity(capsys):
    main(["compare", "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    assert "identical: yes" in out
    diff = float(out.split("max |logits ours - HF|:")[1].split()[0])
    assert diff < 1e-3


def test_unknown_bench_area_is_refused():
    with pytest.raises(SystemExit):
        main(["bench", "nonsense"])
